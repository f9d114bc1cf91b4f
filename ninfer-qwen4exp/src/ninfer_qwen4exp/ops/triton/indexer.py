"""Triton QSA, the indexer: its side-pool write (``indexer_cache_write``) and its block selection (``qsa_select``),
for prefill and decode, with no host synchronisation (every grid and buffer follows from tensor shapes, so both ops
can be captured in CUDA graphs). The attention over the selection is :mod:`.sparse_attention`.

``qsa_select`` is three kernels:

1. ``_block_keys_kernel``, program (row, tile of blocks): the key of every complete block of the row, from the side
   pools' raw token keys and angles: the fp32 mean of the block's r keys rounded to the activation dtype, the
   ``1 + w`` RMSNorm rounded, its first R dims rotated with the cos | sin of the block's first token, rounded:
   the reference's ``_block_keys``, cast for cast. Written to a scratch ``[rows, NB, d]``, where NB is the most
   complete blocks the page table's width can describe.
2. ``_scores_kernel``, program (query, tile of blocks): ``s_j = sum_heads relu(q_h . k_j) / sqrt(d)`` as an IEEE
   fp32 product of the query's ``[h, d]`` (heads padded to the dot's 16 rows) and the blocks' ``[d, tile]``; tiles
   past the blocks the query sees (``j >= n_vis``) do nothing, as do the block-key programs past a row's blocks,
   so a decode graph's grids, sized for the longest row its page tables allow, cost little at short contexts.
   Queries are taken in chunks so that one launch's scores stay within :data:`SCORE_ELEMENTS` fp32 values.
3. ``_select_kernel``, program (query): the ``block_topk``-th best of its ``n_vis`` scores, found exactly by
   bisection over the scores' order-preserving 32-bit keys (32 counting passes over the visible scores only: no
   sort, nothing sized by the page tables); then blocks scoring above it, then blocks equal to it, lowest block id
   first, until ``block_topk`` are kept; their positions are written in ascending block order, then the tail
   ``[n_vis * r, p]``, then ``-1``. A query that sees at most ``block_topk`` complete blocks keeps ``[0, p]``.

Relation to the reference (``ninfer_qwen4exp.ops.reference.qsa``): the same block keys and scores up to the order
of fp32 sums (the block mean, the norm's statistic, the dot products, the sum over heads), hence the same
selection wherever no two scores are within that rounding of each other at the boundary. Where scores tie exactly
at the threshold (``relu`` makes exact zeros common) the kernel keeps the lowest block ids; ``torch.topk``'s choice
among equal values is unspecified, so both are the contract. Positions come out sorted (the contract sets no order).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, mm, next_pow2
from ninfer.ops.triton.kv_cache import check_on_host

from ninfer_qwen4exp.ops.triton.rows import query_position, row_metadata

#: Most fp32 scores one ``_scores_kernel`` launch materialises (queries are taken in chunks beyond it).
SCORE_ELEMENTS = 1 << 22


@triton.jit
def _pooled(key_ptr, koff, pm, c, cm, RATIO: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr):
    """The blocks' mean raw keys at columns ``c`` (fp32 mean of the r tokens, rounded to DT), as fp32 ``[J, C]``."""
    x = tl.load(key_ptr + koff[:, :, None] + c[None, None, :], mask=pm[:, :, None] & cm[None, None, :],
                other=0.0).to(tl.float32)
    return cast(tl.sum(x, 1) / RATIO, DT, INTERP).to(tl.float32)


@triton.jit
def _block_keys_kernel(key_ptr, rope_ptr, kn_ptr, kv_lens_ptr, pt_ptr, blk_ptr, eps,
                       stride_kp, stride_ks, stride_rp, stride_rs, stride_ptb, stride_bb, stride_bj,
                       RATIO: tl.constexpr, DI: tl.constexpr, ROT: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, INTERP: tl.constexpr):
    """Program (row, tile of blocks): the keys of the row's complete blocks in the tile (module docstring, 1)."""
    b = tl.program_id(0)
    nb = tl.load(kv_lens_ptr + b) // RATIO
    if tl.program_id(1) * BLOCK_J < nb:   # tiles past the row's complete blocks: nothing to do
        _block_keys_tile(key_ptr, rope_ptr, kn_ptr, pt_ptr, blk_ptr, eps, b, nb, stride_kp, stride_ks, stride_rp,
                         stride_rs, stride_ptb, stride_bb, stride_bj, RATIO, DI, ROT, PAGE, BLOCK_J, BLOCK_R, BLOCK_D,
                         BLOCK_HALF, BLOCK_REST, INTERP)


@triton.jit
def _block_keys_tile(key_ptr, rope_ptr, kn_ptr, pt_ptr, blk_ptr, eps, b, nb, stride_kp, stride_ks, stride_rp, stride_rs,
                     stride_ptb, stride_bb, stride_bj, RATIO: tl.constexpr, DI: tl.constexpr, ROT: tl.constexpr,
                     PAGE: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, INTERP: tl.constexpr):
    DT: tl.constexpr = blk_ptr.dtype.element_ty
    HALF: tl.constexpr = ROT // 2
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    jm = j < nb
    i = tl.arange(0, BLOCK_R)
    pos = j[:, None] * RATIO + i[None, :]
    pm = jm[:, None] & (i[None, :] < RATIO)
    page = tl.load(pt_ptr + b * stride_ptb + pos // PAGE, mask=pm, other=0).to(tl.int64)
    koff = page * stride_kp + (pos % PAGE) * stride_ks
    cols = tl.arange(0, BLOCK_D)
    whole = _pooled(key_ptr, koff, pm, cols, cols < DI, RATIO, DT, INTERP)
    inv = tl.rsqrt(tl.sum(whole * whole, 1) / DI + eps)
    # The rotated halves (dims h and HALF + h) and the rest (dims >= ROT), each normalised with the row's one inv.
    h = tl.arange(0, BLOCK_HALF)
    hm = h < HALF
    rest = ROT + tl.arange(0, BLOCK_REST)
    rm = rest < DI
    n1 = cast(_normed(key_ptr, koff, pm, h, hm, kn_ptr, inv, RATIO, DT, INTERP), DT, INTERP).to(tl.float32)
    n2 = cast(_normed(key_ptr, koff, pm, HALF + h, hm, kn_ptr, inv, RATIO, DT, INTERP), DT, INTERP).to(tl.float32)
    nr = _normed(key_ptr, koff, pm, rest, rm, kn_ptr, inv, RATIO, DT, INTERP)
    first = tl.load(pt_ptr + b * stride_ptb + (j * RATIO) // PAGE, mask=jm, other=0).to(tl.int64)
    roff = (first * stride_rp + ((j * RATIO) % PAGE) * stride_rs)[:, None]
    am = jm[:, None] & hm[None, :]
    c1 = tl.load(rope_ptr + roff + h[None, :], mask=am, other=0.0).to(tl.float32)
    c2 = tl.load(rope_ptr + roff + HALF + h[None, :], mask=am, other=0.0).to(tl.float32)
    s1 = tl.load(rope_ptr + roff + ROT + h[None, :], mask=am, other=0.0).to(tl.float32)
    s2 = tl.load(rope_ptr + roff + ROT + HALF + h[None, :], mask=am, other=0.0).to(tl.float32)
    out = blk_ptr + b * stride_bb + j[:, None] * stride_bj
    tl.store(out + h[None, :], cast(n1 * c1 - n2 * s1, DT, INTERP), mask=am)
    tl.store(out + HALF + h[None, :], cast(n2 * c2 + n1 * s2, DT, INTERP), mask=am)
    tl.store(out + rest[None, :], cast(nr, DT, INTERP), mask=jm[:, None] & rm[None, :])


@triton.jit
def _normed(key_ptr, koff, pm, c, cm, kn_ptr, inv, RATIO: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr):
    """fp32 ``x * inv * (1 + w)`` of the blocks' mean keys at columns ``c``, before its rounding to DT."""
    w = tl.load(kn_ptr + c, mask=cm, other=0.0).to(tl.float32)
    return (_pooled(key_ptr, koff, pm, c, cm, RATIO, DT, INTERP) * inv[:, None]) * (1.0 + w[None, :])


@triton.jit(do_not_specialize=["n_rows", "t0", "nb"])
def _scores_kernel(q_ptr, blk_ptr, cu_q_ptr, kv_lens_ptr, sc_ptr, sqrt_d, n_rows, t0, nb,
                   stride_qt, stride_qh, stride_bb, stride_bj, stride_sc,
                   H: tl.constexpr, DI: tl.constexpr, RATIO: tl.constexpr, BLOCK_B: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr, INTERP: tl.constexpr):
    """Program (query of the chunk, tile of blocks): the query's scores of the tile (module docstring, 2)."""
    tq = tl.program_id(0)
    t = t0 + tq
    b, _, p = query_position(cu_q_ptr, kv_lens_ptr, t, n_rows, BLOCK_B)
    n_vis = (p + 1) // RATIO
    hh = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dm = d < DI
    q = tl.load(q_ptr + t * stride_qt + hh[:, None] * stride_qh + d[None, :],
                mask=(hh[:, None] < H) & dm[None, :], other=0.0).to(tl.float32)
    if tl.program_id(1) * BLOCK_J < n_vis:   # tiles past what the query sees: nothing to score (never read)
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        jm = j < n_vis
        k = tl.load(blk_ptr + b * stride_bb + j[:, None] * stride_bj + d[None, :], mask=jm[:, None] & dm[None, :],
                    other=0.0).to(tl.float32)
        s = tl.sum(tl.maximum(mm(q, tl.trans(k), True, INTERP), 0.0), 0) / sqrt_d
        tl.store(sc_ptr + tq * stride_sc + j, s, mask=jm & (j < nb))


@triton.jit
def _score_keys(s):
    """Order-preserving int64 keys in [0, 2^32) of fp32 scores (+0.0 for -0.0, so equal scores get equal keys)."""
    bits = (s + 0.0).to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648


@triton.jit
def _kth_key(sc_row, n_vis, TOPK: tl.constexpr, BLOCK_J: tl.constexpr):
    """The key of the TOPK-th best of the ``n_vis`` scores at ``sc_row``: the largest key k with at least TOPK keys
    >= k, found bit by bit from the top (32 counting passes over the visible scores only)."""
    prefix = tl.full([], 0, tl.int64)
    for step in range(0, 32):
        cand = prefix | (tl.full([], 1, tl.int64) << (31 - step))
        count = tl.full([], 0, tl.int32)
        for j0 in range(0, n_vis, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            jm = j < n_vis
            key = _score_keys(tl.load(sc_row + j, mask=jm, other=0.0))
            count += tl.sum(((key >= cand) & jm).to(tl.int32), 0)
        prefix = tl.where(count >= TOPK, cand, prefix)
    return prefix


@triton.jit(do_not_specialize=["n_rows", "t0"])
def _select_kernel(sc_ptr, cu_q_ptr, kv_lens_ptr, sel_ptr, n_rows, t0, stride_sc, stride_sel,
                   RATIO: tl.constexpr, TOPK: tl.constexpr, WIDTH: tl.constexpr, SPARSE: tl.constexpr,
                   BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program (query of the chunk): its row of ``sel`` (module docstring, 4). Every entry is stored once."""
    tq = tl.program_id(0)
    t = t0 + tq
    _, _, p = query_position(cu_q_ptr, kv_lens_ptr, t, n_rows, BLOCK_B)
    n_vis = (p + 1) // RATIO
    row = sel_ptr + t * stride_sel
    kept_end = tl.full([], 0, tl.int32)    # entries [0, kept_end) hold the kept blocks' positions
    tail_at = tl.full([], 0, tl.int32)     # the entry where the tail (dense: position 0) starts
    tail_from = tl.full([], 0, tl.int32)   # the tail's first position
    if SPARSE:
        if n_vis > TOPK:
            sc_row = sc_ptr + tq * stride_sc
            thr = _kth_key(sc_row, n_vis, TOPK, BLOCK_J)
            better = tl.full([], 0, tl.int32)
            for j0 in range(0, n_vis, BLOCK_J):
                j = j0 + tl.arange(0, BLOCK_J)
                jm = j < n_vis
                key = _score_keys(tl.load(sc_row + j, mask=jm, other=0.0))
                better += tl.sum(((key > thr) & jm).to(tl.int32), 0)
            need = TOPK - better   # blocks scoring exactly the threshold to keep, the lowest ids first
            kept = tl.full([], 0, tl.int32)
            ties = tl.full([], 0, tl.int32)
            i = tl.arange(0, BLOCK_R)
            for j0 in range(0, n_vis, BLOCK_J):
                j = j0 + tl.arange(0, BLOCK_J)
                jm = j < n_vis
                key = _score_keys(tl.load(sc_row + j, mask=jm, other=0.0))
                tie = ((key == thr) & jm).to(tl.int32)
                keep = (jm & ((key > thr) | ((tie > 0) & (ties + tl.cumsum(tie, 0) - tie < need)))).to(tl.int32)
                at = kept + tl.cumsum(keep, 0) - keep
                tl.store(row + at[:, None] * RATIO + i[None, :], (j[:, None] * RATIO + i[None, :]).to(tl.int64),
                         mask=(keep[:, None] > 0) & (at[:, None] < TOPK) & (i[None, :] < RATIO))
                kept += tl.sum(keep, 0)
                ties += tl.sum(tie, 0)
            kept_end = tl.minimum(kept, TOPK) * RATIO
            tail_at = kept_end * 0 + TOPK * RATIO
            tail_from = n_vis * RATIO
    # The tail (or the whole dense range [0, p]) and the padding, past the kept blocks' entries.
    for w0 in range(0, WIDTH, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        off = w - tail_at
        val = tl.where((off >= 0) & (off <= p - tail_from), tail_from + off, -1)
        tl.store(row + w, val.to(tl.int64), mask=(w >= kept_end) & (w < WIDTH))


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _side_write_kernel(k_ptr, c_ptr, s_ptr, kp_ptr, rp_ptr, slot_ptr, capacity, stride_k, stride_c, stride_s,
                       stride_kpp, stride_kps, stride_rpp, stride_rps, DI: tl.constexpr, R: tl.constexpr,
                       W: tl.constexpr, PAGE: tl.constexpr, BLOCK_W: tl.constexpr, INTERP: tl.constexpr):
    """Program (token): its side-pool rows (the contract), zero-padded; an out-of-range slot stores nothing."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ok = (slot >= 0) & (slot < capacity)
    page = slot // PAGE
    off = slot % PAGE
    w = tl.arange(0, BLOCK_W)
    store = w < tl.where(ok, W, 0)   # a vector bound, not a scalar mask (the interpreter wants one)
    DT: tl.constexpr = kp_ptr.dtype.element_ty
    key = tl.load(k_ptr + t * stride_k + w, mask=w < DI, other=0.0)
    tl.store(kp_ptr + page * stride_kpp + off * stride_kps + w, cast(key.to(tl.float32), DT, INTERP), mask=store)
    cos = tl.load(c_ptr + t * stride_c + w, mask=w < R, other=0.0).to(tl.float32)
    sin = tl.load(s_ptr + t * stride_s + (w - R), mask=(w >= R) & (w < 2 * R), other=0.0).to(tl.float32)
    # As the reference: the angles rounded to the keys' dtype, then stored in the pool's.
    ang = cast(cast(tl.where(w < R, cos, sin), k_ptr.dtype.element_ty, INTERP).to(tl.float32),
               rp_ptr.dtype.element_ty, INTERP)
    tl.store(rp_ptr + page * stride_rpp + off * stride_rps + w, ang, mask=store)


def indexer_cache_write(key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_pool: torch.Tensor,
                        rope_pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The tokens' raw indexer keys and rotary cos | sin, zero-padded, at their slots (the contract), one launch."""
    launch_ok(key_pool)
    t, d = key.shape
    r, width, page = cos.shape[-1], key_pool.shape[-1], key_pool.shape[1]
    if d > width or 2 * r > width or cos.shape != sin.shape or key_pool.shape != rope_pool.shape:
        raise ValueError(f"indexer_cache_write: keys of {d} and angles of {r} + {sin.shape[-1]} do not fit side "
                         f"pools {tuple(key_pool.shape)} and {tuple(rope_pool.shape)}")
    if key_pool.shape[2] != 1 or key_pool.stride(-1) != 1 or rope_pool.stride(-1) != 1:
        raise ValueError("indexer_cache_write: side pools must be [P, page, 1, W] with a contiguous last dim")
    capacity = key_pool.shape[0] * page
    if t == 0:
        return
    if check_on_host(slot_mapping, key_pool.device) and bool(((slot_mapping < 0) | (slot_mapping >= capacity)).any()):
        raise IndexError(f"indexer_cache_write: slot_mapping outside [0, {capacity})")
    key, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, cos, sin))
    slots = slot_mapping.to(device=key_pool.device, dtype=torch.int64)
    _side_write_kernel[(t,)](
        key, cos, sin, key_pool, rope_pool, slots, capacity, key.stride(0), cos.stride(0), sin.stride(0),
        key_pool.stride(0), key_pool.stride(1), rope_pool.stride(0), rope_pool.stride(1), DI=d, R=r, W=width,
        PAGE=page, BLOCK_W=next_pow2(width), INTERP=INTERPRET, num_warps=1 if width <= 256 else 4)


def dot_width(d: int) -> int:
    """The scores kernel's lanes for indexer width ``d``: a power of two, at least 16 (the tensor cores' narrowest
    K; a narrower dot does not build for the GPU)."""
    return max(16, next_pow2(d))


def qsa_select(q: torch.Tensor, key_pool: torch.Tensor, rope_pool: torch.Tensor, k_norm: torch.Tensor, eps: float,
               cu_q: torch.Tensor, kv_lens: torch.Tensor, page_tables: torch.Tensor, ratio: int, block_topk: int,
               rotary: int) -> torch.Tensor:
    """The positions each query attends to (the contract; module docstring for the kernels and ties)."""
    launch_ok(q)
    t, h, d = q.shape
    page, width_w = key_pool.shape[1], key_pool.shape[-1]
    if 2 * rotary > rope_pool.shape[-1] or d > width_w or rotary % 2 or rotary > d:
        raise ValueError(f"qsa_select: pools of width {width_w} cannot hold keys of {d} and rotary {rotary}")
    if key_pool.shape[2] != 1 or rope_pool.shape[:3] != key_pool.shape[:3] or key_pool.stride(-1) != 1 \
            or rope_pool.stride(-1) != 1:
        raise ValueError(f"qsa_select: side pools {tuple(key_pool.shape)} and {tuple(rope_pool.shape)} must be "
                         f"[P, page, 1, W] with a contiguous last dim")
    width = block_topk * ratio + ratio - 1
    sel = torch.empty((t, width), dtype=torch.int64, device=q.device)
    if t == 0:
        return sel
    cu_q, kv_lens, page_tables, n_rows = row_metadata(q, cu_q, kv_lens, page_tables)
    q = q if q.stride(-1) == 1 else q.contiguous()
    nb = page_tables.shape[1] * page // ratio     # the most complete blocks a row of this table can hold
    sparse = nb > block_topk                     # else every query keeps all it sees
    block_b = next_pow2(n_rows)
    common = dict(RATIO=ratio, BLOCK_B=block_b)
    chunk = max(1, SCORE_ELEMENTS // max(nb, 1)) if sparse else t
    if sparse:
        blk = torch.empty((n_rows, nb, d), dtype=q.dtype, device=q.device)
        block_j = 16
        _block_keys_kernel[(n_rows, triton.cdiv(nb, block_j))](
            key_pool, rope_pool, k_norm, kv_lens, page_tables, blk, float(eps), key_pool.stride(0),
            key_pool.stride(1), rope_pool.stride(0), rope_pool.stride(1), page_tables.stride(0), blk.stride(0),
            blk.stride(1), RATIO=ratio, DI=d, ROT=rotary, PAGE=page, BLOCK_J=block_j, BLOCK_R=next_pow2(ratio),
            BLOCK_D=next_pow2(d), BLOCK_HALF=next_pow2(rotary // 2), BLOCK_REST=next_pow2(max(d - rotary, 1)),
            INTERP=INTERPRET)
    for t0 in range(0, t, chunk):
        tc = min(chunk, t - t0)
        scores = sel   # unused by a dense-only select
        if sparse:
            scores = torch.empty((tc, nb), dtype=torch.float32, device=q.device)
            block_js = 64   # with 8 warps: no spills at d = 128 in the sm_90 build (tools/sass_report.py qsa)
            _scores_kernel[(tc, triton.cdiv(nb, block_js))](
                q, blk, cu_q, kv_lens, scores, math.sqrt(d), n_rows, t0, nb, q.stride(0), q.stride(1),
                blk.stride(0), blk.stride(1), scores.stride(0), H=h, DI=d, BLOCK_H=max(16, next_pow2(h)),
                BLOCK_D=dot_width(d), BLOCK_J=block_js, INTERP=INTERPRET, **({} if INTERPRET else {"num_warps": 8}),
                **common)
        _select_kernel[(tc,)](
            scores, cu_q, kv_lens, sel, n_rows, t0, scores.stride(0), sel.stride(0), TOPK=block_topk,
            WIDTH=width, SPARSE=sparse, BLOCK_J=256, BLOCK_R=next_pow2(ratio), BLOCK_W=min(1024, next_pow2(width)),
            **common)
    return sel


OPS = [
    OpImpl(op="indexer_cache_write", name="triton", fn=indexer_cache_write, devices=frozenset({"cuda"}),
           dtypes=KERNEL_DTYPES, priority=10),
    OpImpl(op="qsa_select", name="triton", fn=qsa_select, devices=frozenset({"cuda"}), dtypes=KERNEL_DTYPES,
           priority=10),
]
