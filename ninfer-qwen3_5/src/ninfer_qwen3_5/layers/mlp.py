"""Dense SwiGLU MLP: ``down(silu(gate x) * up x)`` with gate and up stored as one ``[2I, H]`` parent."""

from __future__ import annotations

import torch


class DenseMLP:
    def __init__(self, w: dict[str, torch.Tensor], ops) -> None:
        self.ops = ops
        self.w_gate_up, self.w_down = w["gate_up"], w["down"]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        return ops.linear(ops.silu_and_mul(ops.linear(h, self.w_gate_up)), self.w_down)
