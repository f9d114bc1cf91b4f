"""Triton NeoX rotate-half ``rope`` on the first R dims of ``x[T, H, D]`` (R = cos.shape[-1]).

Invariants (those of :mod:`ninfer.ops.reference.rope`):
- For pairs (j, j + R/2): ``y_j = x_j c_j - x_{j+R/2} s_j`` and ``y_{j+R/2} = x_{j+R/2} c_{j+R/2} + x_j s_{j+R/2}``
  in fp32 (each half reads its own cos/sin columns, so tables that are not cat(f, f) work too), one rounding
  to x.dtype. Dims >= R are copied bit-exactly. The output is a new contiguous tensor.
- One program per (token, block of heads); cos/sin (fp32, any float dtype accepted) broadcast over heads.
- ``mrope_cos_sin``: one program per token forms its R/2 fp64 angles (position of the frequency's axis times
  inv_freq, both widened to fp64) and their fp64 cos/sin (libdevice), rounded once to fp32 and stored twice
  (cat(f, f)). The axis table is the reference's cached device tensor; positions may be strided (an expanded
  [3, T] view of one row needs no copy). The reference is ~8 torch launches per step (index_select, casts, mul,
  cat, cos, sin): inside the decode graph each is a launch gap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.reference import rope as _reference
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, next_pow2, pdl, pdl_wait


@triton.jit
def rotate_half(x1, x2, c1, c2, s1, s2):
    """The fp32 rotation of pair halves (j, j + R/2): ``(x1 c1 - x2 s1, x2 c2 + x1 s2)``, before the rounding
    (shared with ``qk_norm_rope_cache``: one expression, so both compile to the same products and fusions)."""
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


@triton.jit
def _cos_sin_kernel(pos_ptr, axis_ptr, inv_ptr, cos_ptr, sin_ptr, stride_pa, stride_pt, stride_ct, stride_st,
                    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    # The tables are computed before the PDL wait, only stored after it, so under PDL the math runs while the
    # previous kernel (the embedding, in the model) finishes. Safe because the launch right before this one never
    # writes what it reads early: the positions are a step input, made at least two launches back (the model
    # launches embed_rms_norm in between), and the axis table and inv_freq are parameters (the wrapper launches
    # without PDL when it had to convert inv_freq). The stores wait: cos/sin are fresh allocations, whose blocks
    # the previous launch may still be reading under an earlier owner.
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK_HALF)
    m = i < HALF
    axis = tl.load(axis_ptr + i, mask=m, other=0)
    pos = tl.load(pos_ptr + axis * stride_pa + t * stride_pt, mask=m, other=0)
    f = pos.to(tl.float64) * tl.load(inv_ptr + i, mask=m, other=0.0).to(tl.float64)
    c = tl.cos(f).to(tl.float32)
    s = tl.sin(f).to(tl.float32)
    pdl_wait(PDL)
    tl.store(cos_ptr + t * stride_ct + i, c, mask=m)
    tl.store(cos_ptr + t * stride_ct + HALF + i, c, mask=m)
    tl.store(sin_ptr + t * stride_st + i, s, mask=m)
    tl.store(sin_ptr + t * stride_st + HALF + i, s, mask=m)


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, sections, interleaved: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, R] fp32 for ``positions[3, T]`` (or ``[T]`` / ``[1, T]`` when sections is None)."""
    launch_ok(positions)
    half = inv_freq.shape[0]
    if positions.dim() == 1:
        positions = positions[None]
    axes = _reference.axis_of_frequency(half, sections, interleaved)
    if max(axes, default=0) >= positions.shape[0]:
        raise ValueError(f"mrope_cos_sin: sections need 3 position axes, got {positions.shape[0]}")
    t_len = positions.shape[1]
    cos = torch.empty((t_len, 2 * half), dtype=torch.float32, device=positions.device)
    sin = torch.empty((t_len, 2 * half), dtype=torch.float32, device=positions.device)
    if t_len == 0 or half == 0:
        return cos, sin
    axis = _reference.axis_tensor(tuple(axes), positions.device)
    inv = inv_freq if inv_freq.device == positions.device else inv_freq.to(positions.device)
    inv = inv.contiguous()
    # A converted inv_freq was written by the launch right before: the kernel reads it before its wait, so no PDL.
    launch = pdl(positions) if inv is inv_freq else {"PDL": False}
    _cos_sin_kernel[(t_len,)](positions, axis, inv, cos, sin, positions.stride(0), positions.stride(1),
                              cos.stride(0), sin.stride(0), HALF=half, BLOCK_HALF=next_pow2(half),
                              **({} if INTERPRET else {"num_warps": 1}), **launch)
    return cos, sin


OPS = [OpImpl(op="rope", name="triton", fn=rope, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES, priority=10),
       OpImpl(op="mrope_cos_sin", name="triton", fn=mrope_cos_sin, devices=frozenset({"cuda"}), priority=10)]
