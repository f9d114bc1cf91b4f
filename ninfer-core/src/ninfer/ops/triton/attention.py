"""Triton paged causal GQA attention: ``paged_decode_attention`` (split-K flash-decoding) and
``paged_attention`` (prefill over a cached prefix, variable query lengths).

Shared invariants (the contract's, plus how this implementation keeps them):
- Position p of row b lives at ``pool[page_tables[b, p // page], p % page]``. Page-table entries and pool
  slots are only *loaded* under the mask ``p < kv_lens[b]``, so entries past a row's pages and slots past
  its length (garbage, NaN) are never read. Page ids are widened to int64 before scaling by the page stride
  (a large pool exceeds 2^31 elements).
- Scores, the online softmax and both accumulations are fp32. fp32 inputs use IEEE fp32 dot products (not
  tf32); bf16/fp16 inputs use tensor-core dots with fp32 accumulation. Prefill rounds the probabilities to
  the KV dtype before the P @ V product (flash-attention practice; ~2^-9 relative per weight in bf16);
  decode carries them as a hi + lo pair (see ``_pv``), matching the reference's accuracy.
- The arithmetic of a row depends only on its own kv_len and KV values: block boundaries are positions, not
  pages, so identity / offset / fragmented page tables give bit-identical outputs, and the split-K partition
  of a decode row is a function of its own kv_len (never of the batch, the page-table width or the grid).
  The exception is the prefill's KV-split candidate (``NINFER_ATTN_SPLIT=1``, off by default): its parts follow
  the launch's size (:func:`~ninfer.ops.triton.attention_parts.kv_splits`).
- No host syncs: every grid is derived from tensor shapes, so both launches are CUDA-graph safe.
- One compiled variant per launch configuration, whatever the batch: the integers that follow it (the row count,
  the page-table width, the grid's split count and the partial buffers' strides it sets) are not specialised on
  (``do_not_specialize``), the metadata pointers (kv lengths, page tables, row offsets: views into a step's packed
  metadata at varying offsets) not on alignment, and the combine's split tile is the policy's maximum, not the
  grid's. What still selects a variant: prefill's ``BLOCK_B`` (the
  row count rounded up to a power of two), decode's ``DIRECT`` (a page table short enough for one split),
  ``HAS_GATE`` and, with the KV-split candidate, prefill's ``KV_SPLIT`` (a small launch); start-up warm-up
  (``ninfer.program.warmup``) runs each. The prefill
  kernel needs no host-side maximum query length: each program finds its (row, query block) on the device
  from ``cu_q`` with a prefix sum.
- The softmax runs in base 2 with ``scale * log2(e)`` folded into the scores; the running max starts at a
  finite -1e30 (not -inf) so fully masked rows never form inf - inf. A query with no visible key (only
  possible for invalid input such as kv_len = 0, e.g. CUDA-graph padding rows) outputs zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.registry import OpImpl
from ninfer.ops.triton import attention_parts, attention_sdpa
from ninfer.ops.triton._common import INTERPRET, KERNEL_DTYPES, cast, launch_ok, mm, next_pow2, pdl, pdl_wait
from ninfer.ops.triton.attention_parts import (
    _NEG,
    _locate,
    _part_offsets,
    _prefill_combine_kernel,
    _sigmoid_gate,
    _store_out,
)

_LOG2E = 1.4426950408889634

# Decode split-K policy (module constants, so a row's partition never depends on the launch):
# a row of n KV tiles is cut into min(MAX_SPLITS, ceil(n_tokens / MIN_SPLIT_TOKENS)) splits of equal tile
# counts. MIN_SPLIT_TOKENS is one bf16 D=256 tile: at short contexts a decode step is latency-bound, and one tile
# per program puts the most programs in flight, which short rows need and long ones do not mind
# (tools/bench_triton_attention.py --decode-only measures it); MAX_SPLITS bounds the fp32 partial buffer
# (B * Hq * MAX_SPLITS * D * 4 bytes) and the combine's loop.
MIN_SPLIT_TOKENS = 32
MAX_SPLITS = 64


def _decode_config(d: int, dtype: torch.dtype) -> dict:
    """Tile sizes by head dim and dtype only (never by batch shape: the split partition depends on BLOCK_N)."""
    block_d = max(16, next_pow2(d))
    wide = block_d * (4 if dtype == torch.float32 else 2) > 256  # bytes of one K row above 256
    # fp32 at D=256 (IEEE FMA dots) spills heavily with 4 warps (5 KB stack per thread in the sm_90 build);
    # 8 warps compile without spills. bf16 at D=256: 142 registers, no spills, HMMA + cp.async pipelining.
    return dict(BLOCK_N=32 if wide else 64, num_warps=8 if wide and dtype == torch.float32 else 4, num_stages=2)


@triton.jit
def _pv(p, v, P_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr, INTERP: tl.constexpr):
    """p[M, N] fp32 @ v[N, D] with fp32 accumulation.

    With P_SPLIT (16-bit V only) p is written as hi + lo, two values of V's dtype, and both halves are
    multiplied: p then carries ~16 significant bits instead of 8, which removes the extra bf16 rounding of
    the attention weights (interpreter measurement, bf16, 100-512 keys: normwise error vs fp64 1.6e-3 /
    1.9e-3 without, 1.49e-3 / 1.67e-3 with = the torch reference's, whose only rounding is the output's).
    It costs a second P @ V tensor-core product: cheap when memory-bound (decode), not in compute-bound
    prefill, which therefore keeps the single bf16 rounding of p (standard flash-attention practice).
    """
    p_hi = cast(p, v.dtype, INTERP)
    out = mm(p_hi, v, FP32_DOT, INTERP)
    if P_SPLIT:
        out += mm(cast(p - p_hi.to(tl.float32), v.dtype, INTERP), v, FP32_DOT, INTERP)
    return out


@triton.jit(do_not_specialize=["num_splits", "stride_ptb", "stride_ab", "stride_ah", "stride_mb", "stride_mh"],
            do_not_specialize_on_alignment=["kv_lens_ptr", "pt_ptr"])
def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, kv_lens_ptr, pt_ptr, acc_ptr, ml_ptr, out_ptr, gate_ptr,
        qk_scale, num_splits,
        stride_qb, stride_qh, stride_qd,
        stride_kp, stride_ks, stride_kh, stride_kd,
        stride_vp, stride_vs, stride_vh, stride_vd,
        stride_ptb,
        stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ms,
        stride_ob, stride_oh, stride_od, stride_gb,
        R: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        MIN_SPLIT_TILES: tl.constexpr, MAX_SPLITS_C: tl.constexpr, DIRECT: tl.constexpr,
        HAS_GATE: tl.constexpr, P_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr, INTERP: tl.constexpr,
        PDL: tl.constexpr):
    """Program (b, kv head, split): the R query heads of one KV head over one split of row b's positions.

    The R heads are the rows of a BLOCK_H >= 16 tile (tl.dot's minimum), so each K/V tile is loaded once for
    the whole group. Writes unnormalised partials (acc, m, l) for the combine kernel, or, when the launch
    has a single split (DIRECT), the normalised output directly (bit-identical to combining one split).
    PDL: only kv_lens (a step input) is read before the wait; q and the KV written this step come after it.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + b)
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    n_split = tl.minimum(tl.cdiv(n_tiles, MIN_SPLIT_TILES), MAX_SPLITS_C)
    n_split = tl.maximum(tl.minimum(n_split, num_splits), 1)  # the clamp to the grid only bites on kv_len > capacity
    tiles_per = tl.cdiv(n_tiles, n_split)
    t_lo = s * tiles_per
    t_hi = tl.minimum(t_lo + tiles_per, n_tiles)
    pdl_wait(PDL)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < R
    d_mask = offs_d < D
    heads = kvh * R + offs_h
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for t in range(t_lo, t_hi):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_len
        page = tl.load(pt_ptr + b * stride_ptb + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        slot = (offs_n % PAGE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + (page * stride_kp + slot * stride_ks + kvh * stride_kh)[:, None]
                    + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        # V is requested with K, before the scores (its address needs only the page): one memory round trip per
        # tile instead of two in a row. V past kv_len is masked to 0 (not read): the pool may hold NaN there and
        # 0 * NaN would poison acc.
        v = tl.load(v_ptr + (page * stride_vp + slot * stride_vs + kvh * stride_vh)[:, None]
                    + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        scores = mm(q, tl.trans(k), FP32_DOT, INTERP) * qk_scale
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _pv(p, v, P_SPLIT, FP32_DOT, INTERP)
        m_i = m_new

    if DIRECT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        omask = h_mask[:, None] & d_mask[None, :]
        if HAS_GATE:
            g = tl.load(gate_ptr + b * stride_gb + heads[:, None] * D + offs_d[None, :], mask=omask, other=0.0)
            out = _sigmoid_gate(out, g, out_ptr.dtype.element_ty, INTERP)
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 cast(out, out_ptr.dtype.element_ty, INTERP), mask=omask)
    else:
        base = b * stride_ab + heads * stride_ah + s * stride_as
        tl.store(acc_ptr + base[:, None] + offs_d[None, :], acc, mask=h_mask[:, None] & d_mask[None, :])
        ml_base = b * stride_mb + heads * stride_mh + s * stride_ms
        tl.store(ml_ptr + ml_base, m_i, mask=h_mask)
        tl.store(ml_ptr + ml_base + 1, l_i, mask=h_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_ab", "stride_ah", "stride_mb", "stride_mh"],
            do_not_specialize_on_alignment=["kv_lens_ptr"])
def _decode_combine_kernel(
        acc_ptr, ml_ptr, kv_lens_ptr, out_ptr, gate_ptr, num_splits,
        stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ms,
        stride_ob, stride_oh, stride_od, stride_gb,
        D: tl.constexpr, BLOCK_N: tl.constexpr,
        MIN_SPLIT_TILES: tl.constexpr, MAX_SPLITS_C: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr, INTERP: tl.constexpr,
        PDL: tl.constexpr):
    """Program (b, query head): merges the row's splits in split order (a fixed, batch-independent order).
    PDL: kv_lens (a step input) before the wait, the split kernel's partials after it."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_len = tl.load(kv_lens_ptr + b)
    n_tiles = tl.cdiv(kv_len, BLOCK_N)
    n_split = tl.minimum(tl.cdiv(n_tiles, MIN_SPLIT_TILES), MAX_SPLITS_C)
    n_split = tl.maximum(tl.minimum(n_split, num_splits), 1)
    pdl_wait(PDL)

    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < n_split
    ml_base = b * stride_mb + h * stride_mh + offs_s * stride_ms
    m = tl.load(ml_ptr + ml_base, mask=s_mask, other=_NEG)
    l_s = tl.load(ml_ptr + ml_base + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    l_tot = tl.sum(tl.exp2(m - m_max) * l_s, 0)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, n_split):
        m_s = tl.load(ml_ptr + b * stride_mb + h * stride_mh + s * stride_ms)
        part = tl.load(acc_ptr + b * stride_ab + h * stride_ah + s * stride_as + offs_d, mask=d_mask, other=0.0)
        acc = acc + tl.exp2(m_s - m_max) * part
    out = acc / tl.where(l_tot > 0, l_tot, 1.0)
    if HAS_GATE:
        g = tl.load(gate_ptr + b * stride_gb + h * D + offs_d, mask=d_mask, other=0.0)
        out = _sigmoid_gate(out, g, out_ptr.dtype.element_ty, INTERP)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od, cast(out, out_ptr.dtype.element_ty, INTERP),
             mask=d_mask)


def _check(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[int, int, int, int]:
    launch_ok(q)
    hq, d = q.shape[1], q.shape[2]
    page, hkv = k_pool.shape[1], k_pool.shape[2]
    if hq % hkv:
        raise ValueError(f"paged attention: {hq} query heads are not a multiple of {hkv} KV heads")
    if d > 256 or k_pool.shape[3] != d or v_pool.shape != k_pool.shape:
        raise ValueError(f"paged attention: head dim {d} (<= 256) must match pools {tuple(k_pool.shape)}")
    return hq, hkv, d, page


def _gate_input(op: str, gate: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The output gate of ``q[rows, Hq, D]``, checked ([rows, Hq*D] in q's dtype) with a contiguous last dim."""
    if gate is None:
        return None
    rows, hq, d = q.shape
    if gate.shape != (rows, hq * d) or gate.dtype != q.dtype:
        raise ValueError(f"{op}: gate {tuple(gate.shape)} {gate.dtype} must be [rows, Hq*D] = {(rows, hq * d)} "
                         f"{q.dtype}")
    return gate if gate.stride(-1) == 1 else gate.contiguous()


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_lens: torch.Tensor,
                           page_tables: torch.Tensor, scale: float, gate: torch.Tensor | None = None, *,
                           config: dict | None = None) -> torch.Tensor:
    """One query per row, ``q[B, Hq, D]`` over ``kv_lens[b]`` paged positions (split-K + combine). ``gate[B, Hq*D]``:
    the output gate, applied where the output is stored (the combine, or the split kernel when it is direct):
    the two elementwise launches of ``o * sigmoid(gate)`` are gone.

    ``config`` overrides tile sizes / split policy (benchmark sweeps only; the partition then changes too).
    """
    hq, hkv, d, page = _check(q, k_pool, v_pool)
    bsz = q.shape[0]
    gate = _gate_input("paged_decode_attention", gate, q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    cfg = dict(_decode_config(d, q.dtype), MIN_SPLIT_TOKENS=MIN_SPLIT_TOKENS, MAX_SPLITS=MAX_SPLITS)
    cfg.update(config or {})
    block_n, block_d = cfg["BLOCK_N"], max(16, next_pow2(d))
    r = hq // hkv
    block_h = max(16, next_pow2(r))
    min_tiles = max(1, cfg["MIN_SPLIT_TOKENS"] // block_n)
    # Grid splits from the page-table *width* (a shape): enough for the longest row this table can describe.
    capacity_tiles = triton.cdiv(page_tables.shape[1] * page, block_n)
    num_splits = max(1, min(cfg["MAX_SPLITS"], triton.cdiv(capacity_tiles, min_tiles)))
    direct = num_splits == 1
    if direct:
        acc = ml = out  # unused by the kernel when DIRECT
        sa = (0, 0, 0, 0, 0, 0)
    else:
        acc = torch.empty((bsz, hq, num_splits, block_d), dtype=torch.float32, device=q.device)
        ml = torch.empty((bsz, hq, num_splits, 2), dtype=torch.float32, device=q.device)
        sa = acc.stride()[:3] + ml.stride()[:3]
    # A converted kv_lens is the output of a launch of its own, which the split kernel must not read before its
    # PDL wait: then it launches plainly.
    converted = (kv_lens.dtype != torch.int32 or kv_lens.device != q.device or page_tables.dtype != torch.int32
                 or page_tables.device != q.device)
    kv_lens = kv_lens.to(device=q.device, dtype=torch.int32)
    page_tables = page_tables.to(device=q.device, dtype=torch.int32)
    launch = {"PDL": False} if converted else pdl(q)
    common = dict(D=d, BLOCK_N=block_n, MIN_SPLIT_TILES=min_tiles, MAX_SPLITS_C=cfg["MAX_SPLITS"])
    g, sg = (gate, gate.stride(0)) if gate is not None else (out, 0)
    _decode_split_kernel[(bsz, hkv, num_splits)](
        q, k_pool, v_pool, kv_lens, page_tables, acc, ml, out, g, scale * _LOG2E, num_splits,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), page_tables.stride(0), *sa, *out.stride(), sg,
        R=r, PAGE=page, BLOCK_H=block_h, BLOCK_D=block_d, DIRECT=direct, HAS_GATE=gate is not None,
        P_SPLIT=cfg.get("P_SPLIT", True) and q.dtype != torch.float32,
        FP32_DOT=q.dtype == torch.float32, INTERP=INTERPRET,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch, **common)
    if not direct:
        # The split tile covers the policy's most splits, not this grid's: one variant for every page-table width
        # (lanes past a row's splits load nothing and add zeros), the tile a decode graph's longest table uses.
        _decode_combine_kernel[(bsz, hq)](
            acc, ml, kv_lens, out, g, num_splits, *sa, *out.stride(), sg,
            BLOCK_S=next_pow2(cfg["MAX_SPLITS"]), BLOCK_D=block_d, HAS_GATE=gate is not None, INTERP=INTERPRET,
            num_warps=4, **pdl(q), **common)
    return out


def _prefill_config(d: int, dtype: torch.dtype) -> dict:
    block_d = max(16, next_pow2(d))
    if dtype == torch.float32:  # the smallest spill-free tile at D=256 in the sm_90 build (IEEE FMA dots)
        return dict(BLOCK_M=16, BLOCK_N=32, num_warps=8, num_stages=1)
    if block_d > 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


@triton.jit(do_not_specialize=["n_rows", "stride_ptb", "n_split"],
            do_not_specialize_on_alignment=["cu_q_ptr", "kv_lens_ptr", "pt_ptr"])
def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, cu_q_ptr, kv_lens_ptr, pt_ptr, out_ptr, gate_ptr, part_ptr,
        qk_scale, n_rows, n_split,
        stride_qt, stride_qh, stride_qd,
        stride_kp, stride_ks, stride_kh, stride_kd,
        stride_vp, stride_vs, stride_vh, stride_vd,
        stride_ptb,
        stride_ot, stride_oh, stride_od, stride_gt,
        R: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        P_SPLIT: tl.constexpr, FP32_DOT: tl.constexpr, INTERP: tl.constexpr, HAS_GATE: tl.constexpr = False,
        KV_SPLIT: tl.constexpr = False):
    """Program (query block, kv head). A block is BLOCK_M (query, head-in-group) pairs of one row, row-major
    over queries (pair m = query m // R, head m % R), so one K/V tile serves the whole GQA group.

    KV_SPLIT (the candidate of :mod:`~ninfer.ops.triton.attention_parts`): program (query block, kv head, part s of
    ``n_split``) covers the s-th of ``n_split`` equal runs of the block's key tiles and stores its unnormalised
    partials where ``_part_offsets`` says, for the combine kernel."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    row, q_start, q_len, blk = _locate(cu_q_ptr, n_rows, pid, R, BLOCK_B, BLOCK_M)
    if row < n_rows:
        kv_len = tl.load(kv_lens_ptr + row)

        offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        qi = offs_m // R
        head = kvh * R + offs_m % R
        m_mask = qi < q_len
        q_pos = kv_len - q_len + qi                  # absolute position of each query
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh
                    + offs_d[None, :] * stride_qd, mask=m_mask[:, None] & d_mask[None, :], other=0.0)

        last_q = tl.minimum(q_len - 1, ((blk + 1) * BLOCK_M - 1) // R)
        hi = kv_len - q_len + last_q + 1             # keys this block can see: positions < hi (<= kv_len)
        m_i = tl.full([BLOCK_M], _NEG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        t0 = 0
        t1 = tl.cdiv(hi, BLOCK_N)
        if KV_SPLIT:
            per = tl.cdiv(t1, n_split)
            t0 = tl.program_id(2) * per
            t1 = tl.minimum(t1, t0 + per)
        for t in range(t0, t1):
            offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < hi
            page = tl.load(pt_ptr + row * stride_ptb + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
            slot = (offs_n % PAGE).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + (page * stride_kp + slot * stride_ks + kvh * stride_kh)[:, None]
                        + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
            scores = mm(q, tl.trans(k), FP32_DOT, INTERP) * qk_scale
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + (page * stride_vp + slot * stride_vs + kvh * stride_vh)[:, None]
                        + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + _pv(p, v, P_SPLIT, FP32_DOT, INTERP)
            m_i = m_new
        if KV_SPLIT:
            ml, part = _part_offsets(pid, kvh, tl.program_id(2), tl.num_programs(1), n_split, BLOCK_M, BLOCK_D)
            pairs = tl.arange(0, BLOCK_M)
            tl.store(part_ptr + ml + pairs, m_i)
            tl.store(part_ptr + ml + BLOCK_M + pairs, l_i)
            tl.store(part_ptr + part + pairs[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], acc)
        else:
            _store_out(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], out_ptr, gate_ptr, q_start, qi, head, m_mask,
                       offs_d, d_mask, stride_ot, stride_oh, stride_od, stride_gt, D, HAS_GATE, INTERP)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, cu_q: torch.Tensor,
                    kv_lens: torch.Tensor, page_tables: torch.Tensor, scale: float, gate: torch.Tensor | None = None,
                    *, config: dict | None = None, splits: int | None = None) -> torch.Tensor:
    """Causal GQA for ``q[T, Hq, D]`` split into rows by ``cu_q`` (see the module invariants). ``gate[T, Hq*D]``:
    the output gate, applied where the output is stored (no elementwise launches after). ``splits``: the parts each
    block's keys are cut into (default :func:`~ninfer.ops.triton.attention_parts.kv_splits`; more than 1 runs the
    KV_SPLIT kernel and the combine)."""
    hq, hkv, d, page = _check(q, k_pool, v_pool)
    t_len, n_rows = q.shape[0], kv_lens.shape[0]
    gate = _gate_input("paged_attention", gate, q)
    if config is None and attention_sdpa.usable(q):   # NINFER_ATTN_SDPA=1, a candidate
        return attention_sdpa.paged_attention_sdpa(q, k_pool, v_pool, cu_q, kv_lens, page_tables, scale, gate)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t_len == 0 or n_rows == 0:
        return out
    cfg = dict(_prefill_config(d, q.dtype))
    cfg.update(config or {})
    r = hq // hkv
    block_m = cfg["BLOCK_M"]
    # Upper bound on blocks (sum over rows of ceil(q_len * R / BLOCK_M)) from shapes alone; extra programs
    # find row == n_rows and exit.
    n_prog = triton.cdiv(t_len * r, block_m) + n_rows
    n_split = splits or attention_parts.kv_splits(n_prog, hkv, q.device)
    page_tables = page_tables.to(device=q.device, dtype=torch.int32)
    cu_q = cu_q.to(device=q.device, dtype=torch.int32)
    block_d, gated = max(16, next_pow2(d)), out if gate is None else gate
    # The parts' partials: per (block, kv head, part) BLOCK_M maxima and sums and a [BLOCK_M, BLOCK_D] accumulator.
    parts = (torch.empty(n_prog * hkv * n_split * block_m * (2 + block_d), dtype=torch.float32, device=q.device)
             if n_split > 1 else out)
    _prefill_kernel[(n_prog, hkv, n_split)](
        q, k_pool, v_pool, cu_q, kv_lens.to(device=q.device, dtype=torch.int32), page_tables, out, gated, parts,
        scale * _LOG2E, n_rows, n_split, *q.stride(), *k_pool.stride(), *v_pool.stride(), page_tables.stride(0),
        *out.stride(), 0 if gate is None else gate.stride(0), HAS_GATE=gate is not None,
        R=r, D=d, PAGE=page, BLOCK_B=next_pow2(n_rows), BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d,
        P_SPLIT=cfg.get("P_SPLIT", False) and q.dtype != torch.float32, FP32_DOT=q.dtype == torch.float32,
        INTERP=INTERPRET, KV_SPLIT=n_split > 1, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if n_split > 1:
        _prefill_combine_kernel[(n_prog, hkv)](
            cu_q, parts, out, gated, n_rows, n_split, *out.stride(), 0 if gate is None else gate.stride(0),
            R=r, D=d, BLOCK_B=next_pow2(n_rows), BLOCK_M=block_m, BLOCK_D=block_d, DC=min(block_d, 64),
            INTERP=INTERPRET, HAS_GATE=gate is not None, num_warps=4)
    return out


OPS = [
    OpImpl(op="paged_attention", name="triton", fn=paged_attention, devices=frozenset({"cuda"}),
           dtypes=KERNEL_DTYPES, priority=10),
    OpImpl(op="paged_decode_attention", name="triton", fn=paged_decode_attention, devices=frozenset({"cuda"}),
           dtypes=KERNEL_DTYPES, priority=10),
]
