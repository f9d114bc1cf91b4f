"""Qwen3.5 sparse MoE block (reference doc section 8).

Router logits ``x W_r^T``; ``moe_router`` takes the fp32 softmax over all E, the top-k, renormalised
(unconditionally, as in Qwen3.5-MoE). The routed experts and an always-on shared SwiGLU expert scaled
by ``sigmoid(shared_gate x)`` are summed.

Every projection that reads the block's input is one GEMM: ``[router (E); shared gate_up (2Is);
shared gate (1); zero rows up to a multiple of 8]`` rows are concatenated once at construction (a few MB
per layer), and ``moe_experts`` takes the shared expert's projected half as a
:class:`~ninfer.ops.contracts.SharedExpert`, so at decode the block is four kernels (GEMM, router, two
expert GEMVs) instead of a dozen small launches. When one of those weights is quantized (a
:class:`~ninfer.quant.PackedWeight`) they stay separate projections whose outputs are concatenated.
"""

from __future__ import annotations

import torch
from ninfer.ops.contracts import SharedExpert
from ninfer.quant import PackedWeight

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.layers.fused import NormInput, norm_project, row_groups
from ninfer_qwen3_5.layers.host_experts import HostExperts

# The fused input GEMM's rows are padded with zero rows to a multiple of this: its [T, rows] output's row stride
# must be 16-byte aligned for cuBLAS's vectorised kernels. Unpadded (E + 2Is + 1 = 1281 at 35B-A3B), cuBLAS
# falls back to a slow unaligned kernel that was a visible share of a prefill (docs/dev/perf-log.md).
ROW_ALIGN = 8


def fused_input_rows(cfg: Qwen35Config) -> int:
    """Rows of the MoE block's fused input weight: router (E), shared gate/up (2Is), shared gate (1), zero padding."""
    rows = cfg.num_experts + 2 * cfg.shared_expert_intermediate_size + 1
    return rows + (-rows) % ROW_ALIGN


class SparseMoE:
    """``host_experts``: the routed banks are in host memory and computed there
    (:class:`~ninfer_qwen3_5.layers.host_experts.HostExperts`, ``cache_slots`` of them per layer also cached on
    ``device`` in ``dtype``; ``host_options``: the rest of its keyword arguments, from
    :func:`~ninfer_qwen3_5.layers.host_options.host_expert_options`); the rest of the block stays on the device."""

    def __init__(self, cfg: Qwen35Config, w: dict[str, torch.Tensor], ops, *, host_experts: bool = False,
                 **host_options) -> None:
        self.ops = ops
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_experts
        self.shared_width = 2 * cfg.shared_expert_intermediate_size
        parts = (w["router"], w["shared/gate_up"], w["shared/gate"])
        if any(isinstance(p, PackedWeight) for p in parts):
            self.in_groups = row_groups(parts)
        else:
            pad = fused_input_rows(cfg) - sum(p.shape[0] for p in parts)
            self.w_in = torch.cat((*parts, parts[0].new_zeros((pad, parts[0].shape[1]))))
            self.in_groups = row_groups([self.w_in])
        self.bank_gate_up, self.bank_down = w["experts/gate_up"], w["experts/down"]
        self.w_shared_down = w["shared/down"]
        self.host = (HostExperts(self.bank_gate_up, self.bank_down, ops=ops, top_k=self.top_k, **host_options)
                     if host_experts else None)

    def __call__(self, inp: NormInput) -> tuple[torch.Tensor, torch.Tensor]:
        ops, e, s = self.ops, self.num_experts, self.shared_width
        outs, h, residual = norm_project(ops, inp, self.in_groups)
        proj = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)   # [T, E + 2Is + 1 (+ padding)]
        weights, ids = ops.moe_router(proj[:, :e], self.top_k)
        shared = SharedExpert(projected=proj[:, e:e + s], down=self.w_shared_down, gate_logit=proj[:, e + s])
        if self.host is not None:
            return self.host(h, weights, ids, shared), residual
        return ops.moe_experts(h, weights, ids, self.bank_gate_up, self.bank_down, shared=shared), residual
