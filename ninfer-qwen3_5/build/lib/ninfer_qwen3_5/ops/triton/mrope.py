"""Triton ``mrope_cos_sin``: the (M)RoPE cos/sin table in one launch (the reference is ~8 torch launches per step:
index_select, casts, mul, cat, cos, sin; inside the decode graph each is a launch gap).

Invariants (those of :mod:`ninfer_qwen3_5.ops.reference.mrope`): one program per token forms its R/2 fp64 angles
(position of the frequency's axis times inv_freq, both widened to fp64) and their fp64 cos/sin (libdevice), rounded
once to fp32 and stored twice (cat(f, f)). The axis table is the reference's cached device tensor; positions may be
strided (an expanded [3, T] view of one row needs no copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, launch_ok, next_pow2, pdl, pdl_wait

from ninfer_qwen3_5.ops.reference import mrope as _reference


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def _cos_sin_kernel(pos_ptr, axis_ptr, inv_ptr, cos_ptr, sin_ptr, stride_pa, stride_pt, stride_ct, stride_st,
                    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    # The tables are computed before the PDL wait, only stored after it, so under PDL the math runs while the
    # previous kernel (the embedding, in the model) finishes. Safe because the launch right before this one never
    # writes what it reads early: the positions are a step input, made at least two launches back (the model
    # launches embed_rms_norm_unit_offset in between), and the axis table and inv_freq are parameters (the wrapper launches
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


OPS = [OpImpl(op="mrope_cos_sin", name="triton", fn=mrope_cos_sin, devices=frozenset({"cuda"}), priority=10)]
