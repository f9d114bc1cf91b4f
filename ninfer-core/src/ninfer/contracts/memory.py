"""MemorySummary: where an engine's device memory goes, computed once at start (docs/design.md section 7).

Invariants:
- ``kv_bytes``, ``state_bytes`` and ``weights_bytes`` are exact: the nbytes of the tensors the
  Program holds (the architecture's ModelProfile is tested against them). ``runtime_reservation_bytes``
  is their explicit Program backing only: ``kv_bytes + state_bytes``.
- ``workspace_bytes`` is the planner's estimate of one step's transient tensors; it is reserved in the
  plan, never allocated up front.
- ``startup_peak_bytes`` bounds the bytes live during construction (the stored weights as loaded,
  the converted copies, KV and State); ``planned_bytes + headroom_bytes <= budget_bytes``.
- Graph fields (decode CUDA graphs, CUDA only; all 0 when nothing was captured):
  ``graph_rebuild_estimate_bytes`` is what the plan reserved for the graphs' private pool before
  fixing the KV capacity (0 when no graphs are planned). Capture measures the growth of the
  allocator's reserved bytes: ``graph_calibration_growth_bytes`` for the first capture,
  ``graph_final_growth_bytes`` for the graphs the engine serves with. They are equal unless graph
  calibration found less than ``headroom_bytes`` free and made the one corrective rebuild (smaller
  automatic KV pool, graphs captured again); then ``kv_pages_before_rebuild`` is the pool the plan
  had fixed (``num_pages`` is the final one, ``kv_bytes`` its size) and
  ``graph_retained_after_release_bytes`` is what stayed reserved after dropping the first graphs. A rebuild
  takes from an automatic expert cache before the KV pool: then ``cache_slots_before_rebuild`` and
  ``cache_slots_after_rebuild`` are its slots per layer as planned and as built (``weights_bytes`` counts the
  latter), and ``kv_pages_before_rebuild`` stays 0 when the cache alone gave enough. Without a rebuild all are 0.
- ``host_weights_bytes``: the parameters placed in host memory (``ParameterSpec.placement``), exact; on a CPU run
  they are part of ``weights_bytes`` too (one memory), on another device they are not, and
  ``host_budget_bytes`` is the host budget they were checked against (0 when none was).
- ``measured`` is True for an engine's summary (``startup_retained_bytes`` then is what start left
  held: on CUDA the growth of the allocator's reserved bytes, on the CPU the unique storage bytes of
  the Program's tensors); False for a plan made without loading weights (``ninfer info --memory``),
  where it is the planned ``weights + KV + State``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MemorySummary:
    device: str
    dtype: str
    budget_bytes: int                 # the cap the plan had to fit (see budget_source)
    budget_source: str
    headroom_bytes: int               # kept free on top of the plan
    weights_bytes: int
    kv_bytes: int
    state_bytes: int
    workspace_bytes: int
    startup_peak_bytes: int
    startup_retained_bytes: int
    runtime_reservation_bytes: int
    num_pages: int
    page_size: int
    state_slots: int
    max_context: int
    kv_candidate: str                 # which KV sizing rule won (see ninfer.planning.planner)
    measured: bool
    graph_calibration_growth_bytes: int = 0
    graph_retained_after_release_bytes: int = 0
    graph_rebuild_estimate_bytes: int = 0
    graph_final_growth_bytes: int = 0
    kv_pages_before_rebuild: int = 0  # 0: no corrective rebuild shrank the KV; else the planned pool, now num_pages
    cache_slots_before_rebuild: int = 0   # 0: no corrective rebuild took expert cache slots; else the planned ones
    cache_slots_after_rebuild: int = 0    # the expert cache slots per layer the rebuild left (with the field above)
    host_weights_bytes: int = 0
    host_budget_bytes: int = 0

    @property
    def kv_state_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes

    @property
    def kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def planned_bytes(self) -> int:
        """What the plan reserves at runtime: weights, KV/State, workspace and the graphs (the larger of
        the planned estimate and the measured growth)."""
        return (self.weights_bytes + self.kv_state_bytes + self.workspace_bytes
                + max(self.graph_final_growth_bytes, self.graph_rebuild_estimate_bytes))

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(kv_state_bytes=self.kv_state_bytes, kv_tokens=self.kv_tokens, planned_bytes=self.planned_bytes)
        return out


def _graphs_line(s: MemorySummary) -> str:
    if s.graph_final_growth_bytes == 0 and s.graph_rebuild_estimate_bytes == 0:
        return f"  graphs            {_mib(0)}  (no CUDA graphs)"
    if s.graph_final_growth_bytes == 0:
        return f"  graphs            {_mib(s.graph_rebuild_estimate_bytes)}  (estimate, decode graphs planned)"
    text = (f"  graphs            {_mib(s.graph_final_growth_bytes)}  (captured; planned "
            f"{_mib(s.graph_rebuild_estimate_bytes)}")
    if s.kv_pages_before_rebuild or s.cache_slots_before_rebuild:
        text += (f"; first capture {_mib(s.graph_calibration_growth_bytes)}, "
                 f"{_mib(s.graph_retained_after_release_bytes)} retained after release")
        if s.cache_slots_before_rebuild:
            text += (f"; expert cache shrunk from {s.cache_slots_before_rebuild} to {s.cache_slots_after_rebuild} "
                     f"slots per layer")
        if s.kv_pages_before_rebuild:
            text += f"; KV shrunk from {s.kv_pages_before_rebuild} to {s.num_pages} pages"
        text += " after calibration"
    return text + ")"


def _host_line(s: MemorySummary) -> str:
    where = ("in the weights above: host memory is the device's" if s.device == "cpu"
             else f"host memory, checked against a host budget of {_mib(s.host_budget_bytes)}")
    return f"  host weights      {_mib(s.host_weights_bytes)}  ({where})"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def format_memory_summary(summary: MemorySummary) -> str:
    """A few aligned lines for ``ninfer info --memory`` and the server's start banner."""
    s = summary
    kind = "measured at start" if s.measured else "planned, no weights loaded"
    lines = [
        f"memory ({s.device}, {s.dtype}; {kind}):",
        f"  budget            {_mib(s.budget_bytes)}  [{s.budget_source}]",
        f"  weights           {_mib(s.weights_bytes)}",
        *([_host_line(s)] if s.host_weights_bytes else []),
        f"  KV                {_mib(s.kv_bytes)}  ({s.num_pages} pages x {s.page_size} tokens = "
        f"{s.kv_tokens:,} tokens; {s.kv_candidate})",
        f"  State             {_mib(s.state_bytes)}  ({s.state_slots} slots)",
        f"  workspace         {_mib(s.workspace_bytes)}  (estimate)",
        _graphs_line(s),
        f"  headroom          {_mib(s.headroom_bytes)}",
        f"  planned total     {_mib(s.planned_bytes)} of {_mib(s.budget_bytes)}",
        f"  startup peak      {_mib(s.startup_peak_bytes)}",
        f"  startup retained  {_mib(s.startup_retained_bytes)}",
        f"  runtime reserved  {_mib(s.runtime_reservation_bytes)}  (KV + State backing)",
        f"  max_context       {s.max_context:,} tokens",
    ]
    return "\n".join(lines)
