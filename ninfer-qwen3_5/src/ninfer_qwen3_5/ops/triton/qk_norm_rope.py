"""Triton ``qk_norm_rope_cache``: a Qwen3.5 gated-attention layer's zero-centred q/k RMSNorms, both RoPEs and the
KV write in one launch.

Why: at decode the unfused step is five launches (``rms_norm_unit_offset`` of q and of k, ``rope`` of each, then
``kv_cache_write``), each a whole launch for a few KB of data: launch gaps, not bandwidth, are the cost.
This module does all of it in one kernel.

Layout: grid ``(T, Hq + Hkv)``, one program per (token, head); a head row is held in registers.
- Programs ``h < Hq`` do q head h; programs ``h >= Hq`` do k head ``h - Hq`` and also copy v head ``h - Hq``.
- A program reads its head's row once whole for the statistic ``inv = rsqrt(mean(x^2) + eps)`` (fp32), then
  in three pieces (dims ``[0, R/2)``, ``[R/2, R)``, ``[R, D)``; re-reads of the row hit L1), normalises each
  piece with that one ``inv``, rotates the first two and stores all three to ``q_out``/``k_out``. k programs
  store the same rounded k values, and the raw v row, at ``slot_mapping[t]`` of the pools
  ``[P, page, Hkv, D]`` (page ``slot // page``, offset ``slot % page``, int64 addressing, any pool strides).

Invariants (the composition ``rope(rms_norm_unit_offset(x, w, eps), cos, sin)`` then ``kv_cache_write``, cast
for cast; all three are core's ops, whose Triton helpers this kernel shares):
- Norm: ``(x * inv) * (1 + w)`` in fp32 (``norm.unit_offset_norm_rows``, the Triton norm's expression),
  rounded once to x.dtype (``_common.cast``: round to nearest even on every backend); elementwise, so a row
  normalised in pieces has the values it has whole.
- RoPE: the rounded normed values widened to fp32, ``rope.rotate_half`` (the rope kernel's expression, so the
  same FMA contraction on the GPU: checked in the sm_90 PTX) on pairs (j, j + R/2) with each half's own
  cos/sin columns, rounded once to x.dtype; dims ``>= R`` are the rounded normed values unchanged.
- Pools: the rounded k values and the raw v, cast to the pool dtype only if it differs (as
  ``kv_cache_write``); every other pool element is untouched.
- Relation to the composition of the Triton ops: the same arithmetic; the one possible difference is the
  order of the fp32 sum of squares (a [1, D] tile here, the norm kernel's [BLOCK_M, D] tile there), which
  the contract allows. Under the interpreter (numpy sums each row in one order) the results are bit-identical.
  On the GPU the kernel runs with the norm kernel's num_warps (``norm.row_config``), so a row is reduced in the
  same layout (threads x warps along the row; compared in the sm_90 TTGIR for D = 256 and 32): bit-identical
  results are expected there too (asserted by a GPU test for the Qwen3.5 head).
- Out-of-range slots as in ``kv_cache_write``: the host checks the range first and raises ``IndexError``
  before launching (one device->host sync), except while a CUDA graph is being captured; the kernel masks
  such a token's pool stores (never wraps), while its q_out/k_out rows are still written.
- PDL protocol (``_common.pdl_wait``): before the wait a program reads only the norm weights (q_norm or
  k_norm, by stride: no wrapper copy of them); q, k, v, cos, sin and slot_mapping are read after it.
- Inputs q, k, v may be row-strided views ``[T, H, D]`` (e.g. column slices of one projection output) with a
  contiguous last dim; q_out and k_out are new contiguous tensors of q's and k's dtypes.

Shapes are validated (``ValueError`` naming the mismatch). Fallback to the composition of the Triton ops
(``rms_norm_unit_offset``, ``rope``, ``kv_cache_write``): R odd or R > D (rope then raises its error), R == 0 (nothing to
rotate), or a q/k/v whose last dim is not contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton import kv_cache as _kv
from ninfer.ops.triton import norm as _norm
from ninfer.ops.triton import rope as _rope
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, next_pow2, pdl, pdl_wait
from ninfer.ops.triton.norm import inv_rms, unit_offset_norm_rows
from ninfer.ops.triton.rope import rotate_half


@triton.jit
def _weights(w_ptr, stride_w, j, jm, r, rm, HALF: tl.constexpr):
    """A norm weight's fp32 values for the three pieces (dims j, HALF + j, r)."""
    w1 = tl.load(w_ptr + j * stride_w, mask=jm, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + (HALF + j) * stride_w, mask=jm, other=0.0).to(tl.float32)
    wr = tl.load(w_ptr + r * stride_w, mask=rm, other=0.0).to(tl.float32)
    return w1, w2, wr


@triton.jit
def _norm_rope_head(xb, ob, w1, w2, wr, c1, c2, s1, s2, j, jm, r, rm, eps, D: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    """Norm + RoPE of one head row at ``xb`` (unit stride), stored contiguously at ``ob``; returns the three
    stored pieces (rounded to ob's dtype) as [1, BLOCK] tensors."""
    dt = ob.dtype.element_ty
    cols = tl.arange(0, BLOCK_D)[None, :]
    inv = inv_rms(tl.load(xb + cols, mask=cols < D, other=0.0).to(tl.float32), D, eps)
    x1 = tl.load(xb + j[None, :], mask=jm[None, :], other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF + j[None, :], mask=jm[None, :], other=0.0).to(tl.float32)
    xr = tl.load(xb + r[None, :], mask=rm[None, :], other=0.0).to(tl.float32)
    n1 = cast(unit_offset_norm_rows(x1, inv, w1), dt, INTERP).to(tl.float32)
    n2 = cast(unit_offset_norm_rows(x2, inv, w2), dt, INTERP).to(tl.float32)
    yr = cast(unit_offset_norm_rows(xr, inv, wr), dt, INTERP)  # pass-through dims: the rounded normed values
    y1, y2 = rotate_half(n1, n2, c1[None, :], c2[None, :], s1[None, :], s2[None, :])
    y1 = cast(y1, dt, INTERP)
    y2 = cast(y2, dt, INTERP)
    tl.store(ob + j[None, :], y1, mask=jm[None, :])
    tl.store(ob + HALF + j[None, :], y2, mask=jm[None, :])
    tl.store(ob + r[None, :], yr, mask=rm[None, :])
    return y1, y2, yr


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _qk_norm_rope_cache_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, kp_ptr,
                               vp_ptr, slot_ptr, eps, capacity, stride_qt, stride_qh, stride_kt, stride_kh,
                               stride_vt, stride_vh, stride_qw, stride_kw, stride_ct, stride_st,
                               stride_kpp, stride_kps, stride_kph, stride_kpd,
                               stride_vpp, stride_vps, stride_vph, stride_vpd,
                               HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                               PAGE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
                               BLOCK_REST: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    r = 2 * HALF + tl.arange(0, BLOCK_REST)  # the pass-through piece; all masked when R == D
    rm = r < D
    # Before the wait: the norm weights only (no kernel writes them).
    if h < HQ:
        w1, w2, wr = _weights(qw_ptr, stride_qw, j, jm, r, rm, HALF)
    else:
        w1, w2, wr = _weights(kw_ptr, stride_kw, j, jm, r, rm, HALF)
    pdl_wait(PDL)
    c1 = tl.load(cos_ptr + t * stride_ct + j, mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + j, mask=jm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + j, mask=jm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + j, mask=jm, other=0.0).to(tl.float32)
    if h < HQ:
        _norm_rope_head(q_ptr + t * stride_qt + h * stride_qh, qo_ptr + (t * HQ + h) * D, w1, w2, wr,
                        c1, c2, s1, s2, j, jm, r, rm, eps, D, HALF, BLOCK_D, INTERP)
    else:
        hk = h - HQ
        # The slot and the V row are requested before the K head's math and stores, with its loads: after them
        # they were two more memory round trips in a row.
        slot = tl.load(slot_ptr + t).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)[None, :]
        v = tl.load(v_ptr + t * stride_vt + hk * stride_vh + cols, mask=cols < D)
        y1, y2, yr = _norm_rope_head(k_ptr + t * stride_kt + hk * stride_kh, ko_ptr + (t * HKV + hk) * D,
                                     w1, w2, wr, c1, c2, s1, s2, j, jm, r, rm, eps, D, HALF, BLOCK_D, INTERP)
        ok = (slot >= 0) & (slot < capacity)
        page = slot // PAGE
        off = slot % PAGE
        kp = kp_ptr + page * stride_kpp + off * stride_kps + hk * stride_kph
        vp = vp_ptr + page * stride_vpp + off * stride_vps + hk * stride_vph
        # An out-of-range slot stores nothing: its bounds drop to 0 (kv_cache's form: a scalar bool and-ed
        # into a tensor mask is rejected by the triton 3.9 interpreter).
        lim_half = tl.where(ok, HALF, 0)
        lim_d = tl.where(ok, D, 0)
        kdt = kp_ptr.dtype.element_ty
        tl.store(kp + j[None, :] * stride_kpd, cast(y1, kdt, INTERP), mask=j[None, :] < lim_half)
        tl.store(kp + (HALF + j[None, :]) * stride_kpd, cast(y2, kdt, INTERP), mask=j[None, :] < lim_half)
        tl.store(kp + r[None, :] * stride_kpd, cast(yr, kdt, INTERP), mask=r[None, :] < lim_d)
        tl.store(vp + cols * stride_vpd, cast(v, vp_ptr.dtype.element_ty, INTERP), mask=cols < lim_d)


def _check_shapes(q, k, v, q_norm, k_norm, cos, sin, k_pool, v_pool, slot_mapping) -> None:
    def fail(what: str) -> None:
        raise ValueError(f"qk_norm_rope_cache: {what}")

    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            fail(f"{name} must be [T, H, D], got shape {tuple(x.shape)}")
    t_len, _, d = q.shape
    if k.shape[0] != t_len or k.shape[2] != d:
        fail(f"k {tuple(k.shape)} must be [T={t_len}, Hkv, D={d}] like q {tuple(q.shape)}")
    if v.shape != k.shape:
        fail(f"v {tuple(v.shape)} must have k's shape {tuple(k.shape)}")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if tuple(w.shape) != (d,):
            fail(f"{name} must be [D={d}], got shape {tuple(w.shape)}")
    if cos.dim() != 2 or cos.shape[0] != t_len:
        fail(f"cos must be [T={t_len}, R], got shape {tuple(cos.shape)}")
    if sin.shape != cos.shape:
        fail(f"sin {tuple(sin.shape)} must have cos's shape {tuple(cos.shape)}")
    hkv = k.shape[1]
    if k_pool.dim() != 4 or tuple(k_pool.shape[2:]) != (hkv, d):
        fail(f"k_pool must be [P, page, Hkv={hkv}, D={d}], got shape {tuple(k_pool.shape)}")
    if v_pool.shape != k_pool.shape:
        fail(f"v_pool {tuple(v_pool.shape)} must have k_pool's shape {tuple(k_pool.shape)}")
    if tuple(slot_mapping.shape) != (t_len,):
        fail(f"slot_mapping must be [T={t_len}], got shape {tuple(slot_mapping.shape)}")
    for name, x in (("k", k), ("v", v), ("q_norm", q_norm), ("k_norm", k_norm), ("cos", cos), ("sin", sin),
                    ("k_pool", k_pool), ("v_pool", v_pool)):
        if x.device != q.device:
            fail(f"{name} is on {x.device}, q on {q.device}")


def _composed(q, k, v, q_norm, k_norm, eps, cos, sin, k_pool, v_pool, slot_mapping):
    """The contract's definition on the Triton ops: five launches."""
    q_out = _rope.rope(_norm.rms_norm_unit_offset(q, q_norm, eps), cos, sin)
    k_out = _rope.rope(_norm.rms_norm_unit_offset(k, k_norm, eps), cos, sin)
    _kv.kv_cache_write(k_out, v, k_pool, v_pool, slot_mapping)
    return q_out, k_out


def qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
                       k_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       k_pool: torch.Tensor, v_pool: torch.Tensor,
                       slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_out, k_out)``; k_out and v are stored at ``slot_mapping`` in the pools (in place). One launch."""
    launch_ok(q)
    _check_shapes(q, k, v, q_norm, k_norm, cos, sin, k_pool, v_pool, slot_mapping)
    t_len, hq, d = q.shape
    hkv = k.shape[1]
    rot = cos.shape[-1]
    if rot % 2 or rot > d or rot == 0 or any(x.stride(-1) != 1 for x in (q, k, v)):
        return _composed(q, k, v, q_norm, k_norm, eps, cos, sin, k_pool, v_pool, slot_mapping)
    q_out = torch.empty((t_len, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t_len, hkv, d), dtype=k.dtype, device=k.device)
    if t_len == 0 or hq + hkv == 0:
        return q_out, k_out
    page = k_pool.shape[1]
    capacity = k_pool.shape[0] * page
    if (hkv and _kv.check_on_host(slot_mapping, k_pool.device)
            and bool(((slot_mapping < 0) | (slot_mapping >= capacity)).any())):
        raise IndexError(f"qk_norm_rope_cache: slot_mapping outside [0, {capacity})")
    slots = slot_mapping.to(device=k_pool.device, dtype=torch.int64)
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    half = rot // 2
    block_d = next_pow2(d)
    _qk_norm_rope_cache_kernel[(t_len, hq + hkv)](
        q, k, v, q_norm, k_norm, cos, sin, q_out, k_out, k_pool, v_pool, slots, eps, capacity,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_norm.stride(0),
        k_norm.stride(0), cos.stride(0), sin.stride(0), *k_pool.stride(), *v_pool.stride(),
        HQ=hq, HKV=hkv, D=d, HALF=half, PAGE=page, BLOCK_D=block_d, BLOCK_HALF=next_pow2(half),
        BLOCK_REST=next_pow2(d - rot), INTERP=INTERPRET, num_warps=_norm.row_config(d)["num_warps"], **pdl(q))
    return q_out, k_out


OPS = [OpImpl(op="qk_norm_rope_cache", name="triton", fn=qk_norm_rope_cache, devices=frozenset({"cuda"}),
              dtypes=KERNEL_DTYPES, priority=10)]
