"""Triton NeoX rotate-half ``rope`` on the first R dims of ``x[T, H, D]`` (R = cos.shape[-1]).

Invariants (those of :mod:`ninfer.ops.reference.rope`):
- For pairs (j, j + R/2): ``y_j = x_j c_j - x_{j+R/2} s_j`` and ``y_{j+R/2} = x_{j+R/2} c_{j+R/2} + x_j s_{j+R/2}``
  in fp32 (each half reads its own cos/sin columns, so tables that are not cat(f, f) work too), one rounding
  to x.dtype. Dims >= R are copied bit-exactly. The output is a new contiguous tensor.
- One program per (token, block of heads); cos/sin (fp32, any float dtype accepted) broadcast over heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, next_pow2


@triton.jit
def rotate_half(x1, x2, c1, c2, s1, s2):
    """The fp32 rotation of pair halves (j, j + R/2): ``(x1 c1 - x2 s1, x2 c2 + x1 s2)``, before the rounding
    (shared with fused kernels that rotate after a norm: one expression, so all compile to the same products and
    fusions)."""
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, stride_xt, stride_xh, stride_xd, stride_ct, stride_st,
                 stride_yt, stride_yh, H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                 INTERP: tl.constexpr):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < H
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + j, mask=j_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + j, mask=j_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + j, mask=j_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + j, mask=j_mask, other=0.0).to(tl.float32)
    mask = h_mask[:, None] & j_mask[None, :]
    xb = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    yb = y_ptr + t * stride_yt + heads[:, None] * stride_yh
    x1 = tl.load(xb + j[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xb + (HALF + j[None, :]) * stride_xd, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = rotate_half(x1, x2, c1[None, :], c2[None, :], s1[None, :], s2[None, :])
    tl.store(yb + j[None, :], cast(y1, y_ptr.dtype.element_ty, INTERP), mask=mask)
    tl.store(yb + HALF + j[None, :], cast(y2, y_ptr.dtype.element_ty, INTERP), mask=mask)
    if BLOCK_REST > 0:  # pass-through dims, copied without any conversion
        k = 2 * HALF + tl.arange(0, BLOCK_REST)
        rmask = h_mask[:, None] & (k[None, :] < D)
        tl.store(yb + k[None, :], tl.load(xb + k[None, :] * stride_xd, mask=rmask), mask=rmask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x[T, H, D]`` on its first R = cos.shape[-1] dims."""
    launch_ok(x)
    rot = cos.shape[-1]
    t_len, heads, d = x.shape
    if rot % 2 or rot > d:
        raise ValueError(f"rope: rotary dim {rot} must be even and <= head dim {d}")
    y = torch.empty((t_len, heads, d), dtype=x.dtype, device=x.device)
    if t_len == 0 or heads == 0:
        return y
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    half = rot // 2
    block_half = next_pow2(half) if half else 0
    block_h = max(1, min(next_pow2(heads), 4096 // max(1, next_pow2(d))))
    if half == 0:  # nothing to rotate: the whole head is pass-through
        return y.copy_(x)
    _rope_kernel[(t_len, triton.cdiv(heads, block_h))](
        x, cos, sin, y, *x.stride(), cos.stride(0), sin.stride(0), y.stride(0), y.stride(1),
        H=heads, D=d, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_REST=next_pow2(d - rot) if d > rot else 0, INTERP=INTERPRET, num_warps=4)
    return y


OPS = [OpImpl(op="rope", name="triton", fn=rope, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES, priority=10)]
