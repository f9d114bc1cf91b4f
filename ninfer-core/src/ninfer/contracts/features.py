"""Startup features: what an engine binds and prepares, fixed at start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Purpose = Literal["generation", "causal_scoring"]


@dataclass(frozen=True)
class StartupFeatures:
    """Invariant: Text is always on; at most one speculative backend; purpose never changes after start.
    ``host_experts``: a MoE model's routed expert banks are placed in host memory and computed there
    (``EngineOptions.host_experts``, resolved), except in the last ``device_expert_layers`` MoE layers, whose banks
    stay whole on the device (0 without host experts); ``expert_cache_slots`` per host layer are also cached on the
    device (0 without host experts); ``expert_copy_min_tokens``: the copy path's threshold (None: the
    architecture's start-up cost model); ``host_expert_threads``: the host's compute threads (None: the
    architecture's default); ``host_expert_kernel``: "auto", "torch", "compiled" or "native" (``EngineOptions.host_expert_kernel``)."""

    vision: bool = False
    speculative: str | None = None  # None, "mtp", "dflash" or "dflash2"
    purpose: Purpose = "generation"
    host_experts: bool = False
    device_expert_layers: int = 0
    expert_cache_slots: int = 0
    expert_copy_min_tokens: int | None = None
    host_expert_threads: int | None = None
    host_expert_kernel: str = "torch"

    def components(self) -> tuple[str, ...]:
        """Artifact components these features read (Text first)."""
        out = ["text"]
        if self.vision:
            out.append("vision")
        if self.speculative is not None:
            out.append(self.speculative)
        return tuple(out)
