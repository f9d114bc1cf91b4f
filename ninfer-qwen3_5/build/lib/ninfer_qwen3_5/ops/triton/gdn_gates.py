"""Triton ``gdn_gates``: the GDN layer's two per-token gates in one elementwise kernel.

Same contract as :func:`ninfer_qwen3_5.ops.reference.gdn.gdn_gates`: ``g = neg_a * softplus(a + dt_bias)`` (softplus
passes x through above 20, as torch's does) and ``beta = sigmoid(b)``, both fp32 [T, Hv]. The reference is six
torch kernels (two casts, add, softplus, multiply, sigmoid) of a few hundred bytes each at decode: pure launch
gaps inside the decode graph, once per GDN layer. a and b may be row-strided views of one fused projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, next_pow2, pdl, pdl_wait


@triton.jit
def gates_math(a, b, dt, neg_a):
    """fp32 ``(g, beta) = (neg_a * softplus(a + dt), sigmoid(b))`` elementwise (shared with ``gdn_decode``)."""
    x = a + dt
    # log1p(e^x) = max(x, 0) + log1p(e^-|x|): no overflow; torch's threshold 20 kept exactly. log1p by Kahan's
    # trick (u = 1 + y rounded; log(u) * y / (u - 1)) keeps relative accuracy for tiny y = e^-|x|.
    y = tl.exp(-tl.abs(x))
    u = 1.0 + y
    exact = u == 1.0
    l1p = tl.where(exact, y, tl.log(u) * (y / tl.where(exact, 1.0, u - 1.0)))
    soft = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + l1p)
    return neg_a * soft, 1.0 / (1.0 + tl.exp(-b))


@triton.jit
def gates_row(a_ptr, b_ptr, na_ptr, dt_ptr, g_ptr, beta_ptr, t, H, sa_t, sb_t, BH: tl.constexpr):
    """Token t's gates: reads a[t], b[t] (row strides sa_t, sb_t), writes g[t], beta[t] ([T, H] fp32)."""
    h = tl.arange(0, BH)
    m = h < H
    a = tl.load(a_ptr + t * sa_t + h, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t * sb_t + h, mask=m, other=0.0).to(tl.float32)
    g, beta = gates_math(a, b, tl.load(dt_ptr + h, mask=m, other=0.0), tl.load(na_ptr + h, mask=m, other=0.0))
    tl.store(g_ptr + t * H + h, g, mask=m)
    tl.store(beta_ptr + t * H + h, beta, mask=m)


@triton.jit
def _gates_kernel(a_ptr, b_ptr, na_ptr, dt_ptr, g_ptr, beta_ptr, H, sa_t, sb_t, BH: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    gates_row(a_ptr, b_ptr, na_ptr, dt_ptr, g_ptr, beta_ptr, tl.program_id(0), H, sa_t, sb_t, BH)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` fp32 [T, Hv]: ``neg_a * softplus(a + dt_bias)`` and ``sigmoid(b)``."""
    t_len, hv = a.shape
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(-1) != 1:
        b = b.contiguous()
    neg_a = neg_a.float().contiguous()
    dt_bias = dt_bias.float().contiguous()
    g = torch.empty((t_len, hv), dtype=torch.float32, device=a.device)
    beta = torch.empty((t_len, hv), dtype=torch.float32, device=a.device)
    if t_len:
        kw = {} if INTERPRET else {"num_warps": 1}
        _gates_kernel[(t_len,)](a, b, neg_a, dt_bias, g, beta, hv, a.stride(0), b.stride(0), BH=next_pow2(hv), **kw, **pdl(a))
    return g, beta


OPS = [OpImpl(op="gdn_gates", name="triton", fn=gdn_gates, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES,
              priority=10)]
