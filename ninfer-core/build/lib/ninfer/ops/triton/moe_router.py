"""Triton ``moe_router``: softmax over all E experts, top-k, renormalised -- one kernel, one program per token.

Same contract as :func:`ninfer.ops.reference.moe.moe_router`: p = softmax(fp32 logits), ids = the k largest p in
descending order, weights = p[ids] / sum(p[ids]) (fp32). The reference takes four torch kernels (cast, softmax,
topk, the renormalisation); at decode, inside a CUDA graph, each of them costs a launch gap per MoE layer.

Top-k is k rounds of one max over integer keys (the logit's float order, then the complemented expert index): exact,
and k = 8 rounds over E = 256 values in registers are cheaper than one sort. Ties pick the lowest index
(torch.topk leaves tie order unspecified). Selection is on the logits (the softmax is monotonic); the weights are
exp(l - l_max) over the k chosen, renormalised: the softmax's denominator cancels, so it is not formed. At decode
the kernel is a chain of dependent reductions on one warp (latency, not bandwidth): k of them here, against
2k + 2 for (max, first index holding it) rounds after a softmax, and the weights are stored once, from registers.
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
def _router_kernel(l_ptr, w_ptr, i_ptr, E, sl_t, TOPK: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    e = tl.arange(0, BE)
    logit = tl.load(l_ptr + t * sl_t + e, mask=e < E, other=float("-inf")).to(tl.float32)
    # NaN logits (a broken row) rank with -inf, below every real logit: ids stay in [0, E) whatever the row holds
    # (an id out of range would make the expert kernels read out of bounds and fail the whole engine).
    logit = tl.where(logit == logit, logit, float("-inf"))
    logit = tl.where(logit == 0.0, 0.0, logit)            # -0.0 -> +0.0: equal logits get equal keys
    bits = logit.to(tl.int32, bitcast=True)
    order = bits ^ ((bits >> 31) & 0x7FFFFFFF)            # sign-magnitude -> two's complement order
    # The index part is complemented so that among equal logits the max picks the lowest index; lanes past E
    # (masked, -inf) have the lowest index parts, below every real -inf lane.
    key = (order.to(tl.int64) << 16) | (BE - 1 - e).to(tl.int64)       # BE <= 2**16
    j = tl.arange(0, KP)
    w = tl.zeros((KP,), dtype=tl.float32)
    ids = tl.zeros((KP,), dtype=tl.int64)
    total = 0.0
    for r in tl.static_range(TOPK):
        kmax = tl.max(key, 0)
        idx = tl.minimum((BE - 1) - (kmax & 0xFFFF), E - 1)
        ob = (kmax >> 16).to(tl.int32)
        best = (ob ^ ((ob >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        if r == 0:
            top = best
        p = tl.exp(best - top)                            # round 0: exp(0) = 1
        w = tl.where(j == r, p, w)
        ids = tl.where(j == r, idx, ids)
        total += p
        # Taken lanes drop below every key (the lowest, -inf's, is about -2**47) so no later round picks them.
        key = tl.where(key == kmax, -4611686018427387904, key)   # -2**62
    tl.store(w_ptr + t * TOPK + j, w * (1.0 / total), mask=j < TOPK)
    tl.store(i_ptr + t * TOPK + j, ids, mask=j < TOPK)


def moe_router(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits[T, E] -> (weights[T, k] fp32, ids[T, k] int64)``."""
    t_len, n_exp = logits.shape
    if n_exp > MAX_EXPERTS or top_k > n_exp or logits.stride(1) != 1:
        return _reference.moe_router(logits, top_k)
    weights = torch.empty((t_len, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t_len, top_k), dtype=torch.int64, device=logits.device)
    if t_len:
        # One warp up to 512 experts: every reduction of the k rounds is then warp-level (two redux.sync on sm_90),
        # with no shared-memory barrier between warps (the kernel is a chain of k reductions: latency, not
        # bandwidth).
        kw = {} if logits.device.type != "cuda" else {"num_warps": 1 if n_exp <= 512 else 4 if n_exp <= 1024 else 8}
        _router_kernel[(t_len,)](logits, weights, ids, n_exp, logits.stride(0), TOPK=top_k,
                                 KP=triton.next_power_of_2(top_k), BE=triton.next_power_of_2(n_exp), **kw,
                                 **pdl(logits))
    return weights, ids


_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

OPS = [
    OpImpl(op="moe_router", name="triton", fn=moe_router, devices=frozenset({"cuda"}), dtypes=_DTYPES,
           priority=10),
]
