"""Dense SwiGLU MLP: ``down(silu(gate x) * up x)`` with gate and up stored as one ``[2I, H]`` parent."""

from __future__ import annotations

import torch

from ninfer_qwen3_5.layers.fused import NormInput, norm_project, row_groups


class DenseMLP:
    def __init__(self, w: dict[str, torch.Tensor], ops) -> None:
        self.ops = ops
        self.w_gate_up, self.w_down = w["gate_up"], w["down"]
        self.in_groups = row_groups([self.w_gate_up])

    def __call__(self, inp: NormInput) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.ops
        if inp.x is not None:
            # Pre-norm, gate/up and SwiGLU as one op: at decode one GEMV that stores the activation.
            act, _, residual = ops.add_rms_norm_unit_offset_swiglu(inp.x, inp.residual, inp.weight, inp.eps,
                                                                   self.w_gate_up)
            return ops.linear(act, self.w_down), residual
        (gate_up,), _, residual = norm_project(ops, inp, self.in_groups)
        return ops.linear(ops.silu_and_mul(gate_up), self.w_down), residual
