"""Torch reference MoE ops: the softmax top-k router and the routed SwiGLU experts (+ an optional shared expert).

Invariants:
- ``moe_router``: p = softmax(fp32(logits)) over all E experts; ids = the top_k largest p (descending);
  weights = p[ids] / sum(p[ids]) in fp32 (unconditional renormalisation, no norm_topk_prob flag).
- ``moe_experts``: out[t] = sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j], with
  ``gate_up[e] = [gate rows (I); up rows (I)]``. Tokens are grouped by expert (one GEMM pair per active
  expert, never a per-token loop). The expert GEMMs run in the wider of x's and the weights' dtypes (torch
  accumulates bf16 in fp32), the SwiGLU activation in fp32 rounded to that dtype before the down projection
  (as the model's module does in bf16), and the weighted sum over the k experts accumulates in fp32, rounded once to x.dtype.
- ``shared`` (optional, :class:`~ninfer.ops.contracts.SharedExpert`): an always-on SwiGLU expert whose gate/up
  projection the caller already computed (``shared.projected[T, 2Is]``, in x.dtype, typically fused with the
  router's GEMM); its activation is rounded to x.dtype like the routed ones, its down projection joins the same
  fp32 sum scaled by ``sigmoid(shared.gate_logit[t])``, and the total is rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops.contracts import SharedExpert
from ninfer.ops.registry import OpImpl


def moe_router(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits[T, E] -> (weights[T, k] fp32, ids[T, k] int64)``."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int64)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, *, shared: SharedExpert | None = None) -> torch.Tensor:
    """Weighted sum of the routed experts' SwiGLU MLPs for ``x[T, H]``; returns [T, H] in x.dtype."""
    out = routed_experts_fp32(x, weights, ids, gate_up, down)
    if shared is not None:
        out += shared_expert_fp32(shared, x.dtype)
    return out.to(x.dtype)


def routed_experts_fp32(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up, down,
                        skip: torch.Tensor | None = None) -> torch.Tensor:
    """The routed part of :func:`moe_experts` before its one rounding: the fp32 ``[T, H]`` sum on x's device. A
    bank is a tensor ``[E, ...]`` or anything indexable by expert with ``shape`` and ``dtype`` (a quantized bank
    decoded per expert, ``ninfer.ops.reference.quantized.DecodedBank``). ``skip`` (bool ``[T, k]``): pairs left
    out of the sum (computed elsewhere)."""
    t_len, k = ids.shape
    inter = down.shape[-1]
    experts = gate_up.shape[0]
    flat_ids = ids.reshape(-1)
    if skip is not None:   # a skipped pair goes to bucket E, after every expert's group, and is never read
        flat_ids = torch.where(skip.reshape(-1), experts, flat_ids)
    # Sort the T*k (token, expert) pairs by expert so each expert sees one contiguous group of tokens.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=experts)[:experts].tolist()
    token_of_pair = (order // k)
    pair_weight = weights.reshape(-1)[order].float()
    wide = torch.promote_types(x.dtype, gate_up.dtype)
    out = torch.zeros((t_len, x.shape[-1]), dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of_pair[start:start + count]
        xs = x.index_select(0, tokens).to(wide)
        h = (xs @ gate_up[expert].to(wide).t()).float()              # [n, 2I]
        act = (F.silu(h[:, :inter]) * h[:, inter:]).to(wide)
        y = (act @ down[expert].to(wide).t()).float()                # [n, H]
        out.index_add_(0, tokens, y * pair_weight[start:start + count, None])
        start += count
    return out


def shared_expert_fp32(shared: SharedExpert, dtype: torch.dtype) -> torch.Tensor:
    """``sigmoid(gate_logit) * down_s(round(silu(g) * u))`` per token, in fp32 ([T, H])."""
    inter = shared.down.shape[-1]
    p = shared.projected.float()
    act = (F.silu(p[:, :inter]) * p[:, inter:]).to(dtype)
    wide = torch.promote_types(dtype, shared.down.dtype)
    y = (act.to(wide) @ shared.down.to(wide).t()).float()
    return torch.sigmoid(shared.gate_logit.float())[:, None] * y


OPS = [
    OpImpl(op="moe_router", name="torch_reference", fn=moe_router, priority=0),
    OpImpl(op="moe_experts", name="torch_reference", fn=moe_experts, priority=0),
]
