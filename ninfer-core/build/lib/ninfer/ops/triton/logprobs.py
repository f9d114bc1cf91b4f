"""Triton ``token_logprobs``: one pass over each row of logits (online max and sum of exponentials).

Invariants (the contract's, plus): one program per row reads the row once in blocks of ``BLOCK_V`` and keeps
a running maximum and a rescaled running sum in fp32, so no [N, V] temporary is made (the torch reference
materialises several, and over a scoring window's [8k, 248k] fp32 logits those passes are a large share of
the scoring time; docs/dev/perf-log.md). Any float dtype and row stride are read in place. The target is
checked on the host first (one sync), as the reference does. The result differs from the reference only by
the order of the fp32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.reference.logprobs import check_targets
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import KERNEL_DTYPES, launch_ok

_BLOCK_V = 4096


@triton.jit
def _row_lse_kernel(x_ptr, t_ptr, lp_ptr, lse_ptr, V, stride_x, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], -float("inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(base + v0 + offs, mask=v0 + offs < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # Lanes that have seen only -inf keep m = -inf: rescale with 0 there instead of exp(nan).
        scale = tl.where(m_new == -float("inf"), 0.0, tl.exp(m - m_new))
        s = s * scale + tl.where(m_new == -float("inf"), 0.0, tl.exp(x - m_new))
        m = m_new
    top = tl.max(m, 0)
    total = tl.sum(tl.where(m == -float("inf"), 0.0, s * tl.exp(m - top)), 0)
    lse = top + tl.log(total)
    t = tl.load(t_ptr + row)
    xt = tl.load(base + t).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(lp_ptr + row, xt - lse)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    launch_ok(logits)
    check_targets(logits, targets)
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _row_lse_kernel[(n,)](logits, targets.to(device=logits.device, dtype=torch.int64).contiguous(), lp, lse,
                              vocab, logits.stride(0), BLOCK_V=_BLOCK_V, num_warps=8)
    return lp, lse


OPS = [OpImpl(op="token_logprobs", name="triton", fn=token_logprobs, devices=frozenset({"cuda"}),
              dtypes=KERNEL_DTYPES, priority=10)]
