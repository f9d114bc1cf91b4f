"""The host's share of a MoE layer: the routed experts' fp32 weighted sum, computed by the CPU.

The arithmetic is the reference ``routed_experts_fp32`` (``ninfer.ops.reference.moe``): the (token, expert) pairs
sorted by expert, each expert's two GEMMs in the wider of the activation and weight dtypes, the SwiGLU in fp32
rounded to that dtype before the down projection, the pairs' weighted outputs summed in fp32 in that order. Only
the number of CPU operations differs: the reference runs nine small ops an expert; here every expert costs its two
GEMMs (written into one buffer for all pairs) and the rest runs once over all pairs. On a many-core host each op
wakes the whole intra-op thread team, which at a decode step's one token an expert costs more than the
elementwise work itself.

Invariant: on the CPU the result is bitwise the reference's (same operations on the same rows, the same summation
order), checked by ``tests/engine/test_host_experts.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def routed_sum(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up, down,
               skip: torch.Tensor | None = None) -> torch.Tensor:
    """``routed_experts_fp32(x, weights, ids, gate_up, down, skip)``: the fp32 ``[T, H]`` sum on x's device, for
    banks that are tensors ``[E, ...]`` or anything indexable by expert with ``shape`` and ``dtype`` (a quantized
    bank decoded per expert); ``skip`` (bool ``[T, k]``): pairs left out (computed elsewhere)."""
    t_len, k = ids.shape
    inter, hidden, experts = down.shape[-1], x.shape[-1], gate_up.shape[0]
    flat = ids.reshape(-1)
    if skip is not None:   # a skipped pair goes to bucket E, after every expert's group
        flat = torch.where(skip.reshape(-1), experts, flat)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)[:experts]
    out = torch.zeros((t_len, hidden), dtype=torch.float32, device=x.device)
    pairs = int(counts.sum())
    if pairs == 0:
        return out
    active = torch.nonzero(counts).flatten()
    groups = list(zip(active.tolist(), counts[active].tolist(), strict=True))
    order = order[:pairs]
    tokens = order // k
    wide = torch.promote_types(x.dtype, gate_up.dtype)
    xs = x.index_select(0, tokens).to(wide)
    h = torch.empty((pairs, 2 * inter), dtype=wide, device=x.device)
    start = 0
    for expert, count in groups:
        torch.matmul(xs[start:start + count], gate_up[expert].to(wide).t(), out=h[start:start + count])
        start += count
    hf = h.float()
    act = (F.silu(hf[:, :inter]) * hf[:, inter:]).to(wide)
    y = torch.empty((pairs, hidden), dtype=wide, device=x.device)
    start = 0
    for expert, count in groups:
        torch.matmul(act[start:start + count], down[expert].to(wide).t(), out=y[start:start + count])
        start += count
    out.index_add_(0, tokens, y.float() * weights.reshape(-1)[order].float()[:, None])
    return out
