"""Qwen3.5 sparse MoE block (reference doc section 8).

Router logits ``x W_r^T``; ``moe_router`` takes the fp32 softmax over all E, the top-k, renormalised
(unconditionally, as in Qwen3.5-MoE). The routed experts and an always-on shared SwiGLU expert scaled
by ``sigmoid(shared_gate x)`` are summed.
"""

from __future__ import annotations

import torch

from ninfer_qwen3_5.config import Qwen35Config


class SparseMoE:
    def __init__(self, cfg: Qwen35Config, w: dict[str, torch.Tensor], ops) -> None:
        self.ops = ops
        self.top_k = cfg.num_experts_per_tok
        self.w_router = w["router"]
        self.bank_gate_up, self.bank_down = w["experts/gate_up"], w["experts/down"]
        self.w_shared_gate_up, self.w_shared_down = w["shared/gate_up"], w["shared/down"]
        self.w_shared_gate = w["shared/gate"]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        weights, ids = ops.moe_router(ops.linear(h, self.w_router), self.top_k)
        routed = ops.moe_experts(h, weights, ids, self.bank_gate_up, self.bank_down)
        shared = ops.linear(ops.silu_and_mul(ops.linear(h, self.w_shared_gate_up)), self.w_shared_down)
        return routed + torch.sigmoid(ops.linear(h, self.w_shared_gate)) * shared
