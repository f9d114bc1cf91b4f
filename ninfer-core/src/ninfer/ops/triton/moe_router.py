"""Triton ``moe_router``: softmax over all E experts, top-k, renormalised -- one kernel, one program per token.

Same contract as :func:`ninfer.ops.reference.moe.moe_router`: p = softmax(fp32 logits), ids = the k largest p in
descending order, weights = p[ids] / sum(p[ids]) (fp32). The reference takes four torch kernels (cast, softmax,
topk, the renormalisation); at decode, inside a CUDA graph, each of them costs a launch gap per MoE layer.

Top-k is k rounds of (max, first index holding it, mask it out): exact, and k = 8 rounds over E = 256 values in
registers are cheaper than one sort. Ties pick the lowest index (torch.topk leaves tie order unspecified).
``logits`` may be a row-strided view (the model slices it out of a fused [router | shared expert] GEMM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.reference import moe as _reference
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import pdl, pdl_wait

# Above this many experts the one-program-per-row layout would hold too many registers: use the reference.
MAX_EXPERTS = 4096


@triton.jit
def _router_kernel(l_ptr, w_ptr, i_ptr, E, sl_t, TOPK: tl.constexpr, BE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    e = tl.arange(0, BE)
    em = e < E
    logit = tl.load(l_ptr + t * sl_t + e, mask=em, other=float("-inf")).to(tl.float32)
    m = tl.max(logit, 0)
    p = tl.exp(logit - m)            # masked lanes: exp(-inf) = 0
    p = p / tl.sum(p, 0)
    # NaN logits (a broken row) must still give ids in [0, E): an id out of range would make the expert kernels read
    # out of bounds and fail the whole engine, not just this row. NaN probabilities rank below every real one.
    p = tl.where(p == p, p, -1.0)
    total = 0.0
    for j in tl.static_range(TOPK):
        best = tl.max(p, 0)
        idx = tl.minimum(tl.min(tl.where(p == best, e, BE), 0), E - 1)
        tl.store(w_ptr + t * TOPK + j, best)
        tl.store(i_ptr + t * TOPK + j, idx.to(tl.int64))
        total += best
        # Taken lanes drop below every probability (p >= 0) so the next round cannot pick them again.
        p = tl.where(e == idx, -1.0, p)
    scale = 1.0 / total
    for j in tl.static_range(TOPK):
        w = tl.load(w_ptr + t * TOPK + j)
        tl.store(w_ptr + t * TOPK + j, w * scale)


def moe_router(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits[T, E] -> (weights[T, k] fp32, ids[T, k] int64)``."""
    t_len, n_exp = logits.shape
    if n_exp > MAX_EXPERTS or top_k > n_exp or logits.stride(1) != 1:
        return _reference.moe_router(logits, top_k)
    weights = torch.empty((t_len, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t_len, top_k), dtype=torch.int64, device=logits.device)
    if t_len:
        # One warp up to 512 experts: every reduction of the k rounds is then a warp shuffle, with no shared-memory
        # barrier between warps (the kernel is a chain of 2k + 2 reductions: latency, not bandwidth).
        kw = {} if logits.device.type != "cuda" else {"num_warps": 1 if n_exp <= 512 else 4 if n_exp <= 1024 else 8}
        _router_kernel[(t_len,)](logits, weights, ids, n_exp, logits.stride(0), TOPK=top_k,
                                 BE=triton.next_power_of_2(n_exp), **kw, **pdl(logits))
    return weights, ids


_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

OPS = [
    OpImpl(op="moe_router", name="triton", fn=moe_router, devices=frozenset({"cuda"}), dtypes=_DTYPES,
           priority=10),
]
