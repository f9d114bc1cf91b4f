"""Triton Gated DeltaNet chunked prefill: ``gdn_chunk_prefill`` (the decode step is :mod:`.gdn_step`'s).

Same contracts and recurrence as :mod:`ninfer_qwen3_5.ops.reference.gdn` (read its docstring for the chunked algebra):
per value head j with key head j // (Hv / Hk), q and k L2-normalised in fp32 (eps 1e-6 inside the rsqrt), q
scaled, then  S <- e^g S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q.

Invariants:
- All arithmetic is fp32. With fp32 inputs every tl.dot uses ``input_precision=_DOT_PRECISION`` = "ieee" (FMA
  units): the state stays within 2e-6 (normwise) of the fp64 recurrence, which tf32 (~3e-4) cannot give -- the
  fp32 path is the oracle setting. With 16-bit inputs the chunked prefill's dots use ``_DOT_PRECISION_16`` =
  "tf32" (tensor cores): the inputs themselves carry bf16's 2^-9 rounding, the model's every other op rounds
  to bf16, and FMA dots made the prefill kernels the largest item of a long prefill (docs/dev/perf-log.md).
  The exception is the 16x16 merge dots of the chunk inverse (always "ieee": the inverse stays fp32-accurate
  at any input dtype; they are a small part of the prep kernel's work).
  ("tf32x3" is not offered: its build hit an illegal memory access under Triton 3.6.)
- States are read and written in place (``state`` / ``states[slots[b]]``); other slots are never touched.
- No host synchronisation: grids and scratch sizes depend only on shapes and the slot ids are read on the device,
  so a prefill step can be captured in a CUDA graph (the decode step's invariants are :mod:`.gdn_step`'s).
- q/k/v may be strided views (the model splits them out of one conv output); only the last dim must be
  contiguous (otherwise they are copied).

Prefill pipeline (chunks of L = 64 tokens), per segment of at most ``_SEG_CHUNKS`` chunks:
1. ``_gdn_chunk_prep_kernel`` -- one program per (chunk, value head), fully parallel: normalises q/k, forms the
   chunk-local cumulative gate G, A = strict_lower(beta_t e^{G_t-G_s} k_t.k_s), inverts the unit lower
   triangular (I + A) blockwise (``_unit_lower_inv_inplace``: A goes to the program's own 64x64 block of the
   AQK scratch; the four 16x16 diagonal blocks are inverted by forward substitution, 15 steps for all four
   at once; the off-diagonal blocks follow from X_ij = -X_ii sum_{k=j}^{i-1} A_ik X_kj with 16x16 IEEE dots;
   the inverse is read back whole), and writes the chunk-only quantities
   U = (I+A)^-1 diag(beta) V,  W = (I+A)^-1 diag(beta e^G) K,  QG = diag(e^G) Q,  KD = diag(e^{G_L-G}) K,
   AQK = (Q K^T) * M (M the causal decay mask; stored over the inverse)  and G_L, to fp32 scratch.
   (The blockwise inverse replaced a row-by-row substitution over all 64 rows: 63 serial steps of [64, 64]
   cross-warp reductions.)
2. ``_gdn_chunk_scan_kernel`` -- one program per (value head, Dv tile), sequential over the chunks, carrying
   the state tile in registers:  Delta = U - W S;  O = QG S + AQK Delta;  S <- e^{G_L} S + KD^T Delta.
   It reads the initial state from, and writes the final state back into, the caller's state tensor.
Segments bound the scratch (and keep in-kernel offsets within int32); they split at chunk boundaries, so the
result does not depend on the segment size.
A call of one token, and each one-token sequence of a VARLEN call, is one step of the recurrence instead
(:func:`~ninfer_qwen3_5.ops.triton.gdn_step.run_one_token`, the decode step's update): prep and scan would spend a whole 64-row chunk on it, and a
flat step (a prefill-step graph) carries each decode row as such a sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ninfer.ops.registry import OpImpl

from ninfer_qwen3_5.ops.triton.gdn_step import (
    _DTYPES,
    _check_heads,
    _interpreting,
    _last_contig,
    _pow2,
    run_one_token,
)

CHUNK = 64
# 128 chunks = 8192 tokens per segment: scratch <= 8192 * Hv * (4 * 128 + 64) * 4 B (~600 MB at Hv = 32).
_SEG_CHUNKS = 128
# Launch settings on CUDA (ignored by the interpreter); module-level so a benchmark can vary them.
_DOT_PRECISION = "ieee"  # fp32 inputs; see the module docstring before changing
_DOT_PRECISION_16 = "tf32"  # 16-bit inputs, chunked prefill only
_PREP_KW = {"num_warps": 8, "num_stages": 1}
_SCAN_KW = {"num_warps": 8, "num_stages": 1}


@triton.jit
def _load_in(ptr, t, tm, s_t, col0, KS: tl.constexpr, D: tl.constexpr):
    # [BT, KS] fp32 slice of an input (token stride s_t, head already applied); rows t >= T and cols >= D
    # load as 0.
    cols = col0 + tl.arange(0, KS)
    return tl.load(ptr + t[:, None] * s_t + cols[None, :], mask=tm[:, None] & (cols < D)[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _load_scr(ptr, r, col0, KS: tl.constexpr, W: tl.constexpr):
    # [rows, KS] slice of a scratch buffer of row width W; slices past W (when 4 * KS > W) load as 0.
    cols = col0 + tl.arange(0, KS)
    return tl.load(ptr + r[:, None] * W + cols[None, :], mask=(cols < W)[None, :], other=0.0)


@triton.jit
def _store_scr(ptr, r, col0, x, KS: tl.constexpr, W: tl.constexpr):
    cols = col0 + tl.arange(0, KS)
    tl.store(ptr + r[:, None] * W + cols[None, :], x, mask=(cols < W)[None, :])


@triton.jit
def _blk_t(ptr, bi, bj, BS: tl.constexpr, W: tl.constexpr):
    # Block (bi, bj) of a row-major [*, W] scratch matrix M, transposed: [c, r] = M[bi*BS + r, bj*BS + c].
    i = tl.arange(0, BS)
    return tl.load(ptr + (bi * BS + i)[None, :] * W + (bj * BS + i)[:, None])


@triton.jit
def _blk_t_store(ptr, bi, bj, xt, BS: tl.constexpr, W: tl.constexpr):
    # Inverse of _blk_t: block (bi, bj) of M <- xt^T.
    i = tl.arange(0, BS)
    tl.store(ptr + (bi * BS + i)[None, :] * W + (bj * BS + i)[:, None], xt)


@triton.jit
def _mm(a, b):
    # The inversion's merge dots: IEEE fp32 whatever the input dtype (the inverse must stay fp32-accurate).
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _diag_inv_t(p, BS: tl.constexpr, W: tl.constexpr):
    # X_b^T = ((I + A_bb)^-1)^T for the 4 diagonal [BS, BS] blocks of the strictly lower A at p, by forward
    # substitution one row of X_b per step: row i = e_i - sum_{c<i} A_bb[i, c] row_c (rows c < i are final,
    # A_bb[i, c] = 0 for c >= i). Held transposed, row i of X_b is a column of X_b^T and the sum runs along
    # the rows' axis 1 (within a warp, no barrier); A_bb[i, :] is read back from the scratch each step,
    # broadcast over the rows (no cross-warp extraction). The four chains are independent.
    rr = tl.arange(0, BS)
    col = rr[None, :] + 0 * rr[:, None]          # [BS, BS] column index
    eye = tl.where(rr[:, None] == col, 1.0, 0.0)
    x0, x1, x2, x3 = eye, eye, eye, eye
    for i in range(1, BS):
        a0 = tl.load(p + (0 * BS + i) * W + 0 * BS + col)
        a1 = tl.load(p + (1 * BS + i) * W + 1 * BS + col)
        a2 = tl.load(p + (2 * BS + i) * W + 2 * BS + col)
        a3 = tl.load(p + (3 * BS + i) * W + 3 * BS + col)
        upd = col == i
        x0 = tl.where(upd, x0 - tl.sum(x0 * a0, 1)[:, None], x0)
        x1 = tl.where(upd, x1 - tl.sum(x1 * a1, 1)[:, None], x1)
        x2 = tl.where(upd, x2 - tl.sum(x2 * a2, 1)[:, None], x2)
        x3 = tl.where(upd, x3 - tl.sum(x3 * a3, 1)[:, None], x3)
    return x0, x1, x2, x3


@triton.jit
def _unit_lower_inv_inplace(p, BT: tl.constexpr):
    # Replaces the strictly lower [BT, BT] fp32 matrix A stored row-major at p (this program's scratch) by
    # (I + A)^-1, blockwise over 4 x 4 blocks of BS = BT / 4: X_ii = (I + A_ii)^-1 by substitution on
    # [BS, BS] tiles, then for i > j  X_ij = -X_ii sum_{k=j}^{i-1} A_ik X_kj  by small IEEE dots, all done
    # transposed (X_ij^T = -(sum_k X_kj^T A_ik^T) X_ii^T; the transposes are free in the pointer arithmetic).
    # The blocks above the diagonal are A's zeros and stay. The caller puts a barrier after storing A.
    BS: tl.constexpr = BT // 4
    tl.static_assert(BS >= 16)
    x00, x11, x22, x33 = _diag_inv_t(p, BS, BT)
    a10 = _blk_t(p, 1, 0, BS, BT)
    a20 = _blk_t(p, 2, 0, BS, BT)
    a21 = _blk_t(p, 2, 1, BS, BT)
    a30 = _blk_t(p, 3, 0, BS, BT)
    a31 = _blk_t(p, 3, 1, BS, BT)
    a32 = _blk_t(p, 3, 2, BS, BT)
    x10 = -_mm(_mm(x00, a10), x11)
    x21 = -_mm(_mm(x11, a21), x22)
    x32 = -_mm(_mm(x22, a32), x33)
    x20 = -_mm(_mm(x00, a20) + _mm(x10, a21), x22)
    x31 = -_mm(_mm(x11, a31) + _mm(x21, a32), x33)
    x30 = -_mm(_mm(x00, a30) + _mm(x10, a31) + _mm(x20, a32), x33)
    tl.debug_barrier()  # every thread has read its A blocks before any is overwritten
    _blk_t_store(p, 0, 0, x00, BS, BT)
    _blk_t_store(p, 1, 1, x11, BS, BT)
    _blk_t_store(p, 2, 2, x22, BS, BT)
    _blk_t_store(p, 3, 3, x33, BS, BT)
    _blk_t_store(p, 1, 0, x10, BS, BT)
    _blk_t_store(p, 2, 1, x21, BS, BT)
    _blk_t_store(p, 3, 2, x32, BS, BT)
    _blk_t_store(p, 2, 0, x20, BS, BT)
    _blk_t_store(p, 3, 1, x31, BS, BT)
    _blk_t_store(p, 3, 0, x30, BS, BT)


@triton.jit
def seq_chunks(length, BT: tl.constexpr):
    """The chunks of a VARLEN call's sequence of ``length`` tokens: ceil(length / BT), except none for one token (the
    one-token kernel steps such a sequence: a decode row of a flat step)."""
    return tl.where(length == 1, 0, (length + BT - 1) // BT)


@triton.jit
def varlen_chunk(cu_ptr, NSEQ, c, BT: tl.constexpr, BS: tl.constexpr):
    """Chunk ``c`` of a call over NSEQ <= BS sequences (``cu_ptr``: their NSEQ + 1 token offsets; sequence i has
    :func:`seq_chunks` chunks, in sequence order): (its sequence's first token, that sequence's length, the chunk's
    index within it, the call's chunk count). A ``c`` past the count matches no sequence. The offsets are read in
    one vector load, not one sequence after another: a flat step's many short rows made that serial chain of loads
    the cost of every program."""
    i = tl.arange(0, BS)
    m = i < NSEQ
    s0 = tl.load(cu_ptr + i, mask=m, other=0)
    lens = tl.load(cu_ptr + i + 1, mask=m, other=0) - s0
    n = seq_chunks(lens, BT)
    cum = tl.cumsum(n, 0)                        # inclusive
    seq = tl.sum((cum <= c).to(tl.int32), 0)     # sequences whose chunks all come before c
    sel = i == seq
    start = tl.sum(tl.where(sel, s0, 0), 0)
    length = tl.sum(tl.where(sel, lens, 0), 0)
    local = c - tl.sum(tl.where(sel, cum - n, 0), 0)
    return start, length, local, tl.sum(n, 0)


# In the prep kernel every head dim (Dk, Dv <= 128) is handled as 4 column slices of KS = max(16, B / 4)
# (32 at 128): Triton's IEEE fp32 dot runs on FMA units and materialises its operands per thread, so one
# [64, 128] x [128, 64] dot spills heavily, while dots whose K is one slice do not. Slices past the padded
# width are all-zero (masked) and only cost time at the tiny test dims. Order: Q's quantities and QK first,
# AQK held in registers; then A, the inverse, W/KD/U; AQK stored last (offline sm_90 compile, Triton 3.6,
# tf32: 16 B of spill this way, 88-240 B with Q after the inverse or A in a separate scratch).
@triton.jit(do_not_specialize=["T", "NPAD", "NCH", "NSEQ"], do_not_specialize_on_alignment=["cu_ptr"])
def _gdn_chunk_prep_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr,
                           w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gl_ptr, cu_ptr,
                           T, NPAD, NCH, NSEQ, scale,
                           sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h,
                           R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                           VARLEN: tl.constexpr = False, BS: tl.constexpr = 2):
    # c: the chunk of the segment (one sequence of T tokens), or VARLEN of the call (NSEQ sequences at cu_ptr,
    # each chunked from its own first token; programs past the call's chunk count return at once).
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // R
    KS: tl.constexpr = max(16, BK // 4)
    VS: tl.constexpr = max(16, BV // 4)
    rows = tl.arange(0, BT)
    start = 0
    length = T
    local = c
    if VARLEN:
        start, length, local, total = varlen_chunk(cu_ptr, NSEQ, c, BT, BS)
        if c >= total:
            return
    t = local * BT + rows      # within the sequence
    tm = t < length
    tok = start + t            # within the call's inputs
    r = h * NPAD + c * BT + rows   # scratch rows [Hv, NPAD, width]; the full padded width is stored (pad columns 0)
    # Padded tokens (t >= length) load as q = k = v = 0, g = beta = 0: they add nothing to U, W, O or S.
    g = tl.load(g_ptr + tok * sg_t + h * sg_h, mask=tm, other=0.0).to(tl.float32)
    beta = tl.load(b_ptr + tok * sb_t + h * sb_h, mask=tm, other=0.0).to(tl.float32)
    # G_t in fp64: a parallel fp32 scan rounds G_t and G_s through different partial sums, so G_t - G_s (and
    # e^{G_t - G_s}) near the diagonal carried errors of ~ulp(|G|) -- 6e-5 relative in the state at gates
    # of -30/token -- while the terms that dominate are exactly those near the diagonal.
    # In fp64 every difference is exact to fp32 rounding of the true segment sum. [64] and [64, 64] fp64 ops:
    # negligible cost.
    cum64 = tl.cumsum(g.to(tl.float64), 0)                                   # G_t
    # G_L taken from the same cumsum: e^{G_L - G_s} is exactly 1 at s = L.
    g_last64 = tl.sum(tl.where(rows == BT - 1, cum64, 0.0), 0)
    tl.store(gl_ptr + h * NCH + c, g_last64.to(tl.float32))
    causal = rows[:, None] >= rows[None, :]
    # Mask before exp: above the diagonal G_t - G_s >= 0 could overflow; M is 0 there anyway.
    decay = tl.exp(tl.where(causal, (cum64[:, None] - cum64[None, :]).to(tl.float32), float("-inf")))
    gamma = tl.exp(cum64.to(tl.float32))

    kp = k_ptr + hk * sk_h
    k0 = _load_in(kp, tok, tm, sk_t, 0 * KS, KS, DK)
    k1 = _load_in(kp, tok, tm, sk_t, 1 * KS, KS, DK)
    k2 = _load_in(kp, tok, tm, sk_t, 2 * KS, KS, DK)
    k3 = _load_in(kp, tok, tm, sk_t, 3 * KS, KS, DK)
    rk = tl.rsqrt(tl.sum(k0 * k0, 1) + tl.sum(k1 * k1, 1) + tl.sum(k2 * k2, 1) + tl.sum(k3 * k3, 1) + 1e-6)
    k0, k1, k2, k3 = k0 * rk[:, None], k1 * rk[:, None], k2 * rk[:, None], k3 * rk[:, None]
    qp = q_ptr + hk * sq_h
    q0 = _load_in(qp, tok, tm, sq_t, 0 * KS, KS, DK)
    q1 = _load_in(qp, tok, tm, sq_t, 1 * KS, KS, DK)
    q2 = _load_in(qp, tok, tm, sq_t, 2 * KS, KS, DK)
    q3 = _load_in(qp, tok, tm, sq_t, 3 * KS, KS, DK)
    rq = tl.rsqrt(tl.sum(q0 * q0, 1) + tl.sum(q1 * q1, 1) + tl.sum(q2 * q2, 1) + tl.sum(q3 * q3, 1) + 1e-6)
    rq = rq * scale
    q0, q1, q2, q3 = q0 * rq[:, None], q1 * rq[:, None], q2 * rq[:, None], q3 * rq[:, None]
    _store_scr(qg_ptr, r, 0 * KS, q0 * gamma[:, None], KS, BK)
    _store_scr(qg_ptr, r, 1 * KS, q1 * gamma[:, None], KS, BK)
    _store_scr(qg_ptr, r, 2 * KS, q2 * gamma[:, None], KS, BK)
    _store_scr(qg_ptr, r, 3 * KS, q3 * gamma[:, None], KS, BK)
    qk = tl.dot(q0, tl.trans(k0), input_precision=PREC)
    qk = tl.dot(q1, tl.trans(k1), qk, input_precision=PREC)
    qk = tl.dot(q2, tl.trans(k2), qk, input_precision=PREC)
    qk = tl.dot(q3, tl.trans(k3), qk, input_precision=PREC)
    aqk_v = tl.where(causal, qk * decay, 0.0)
    kk = tl.dot(k0, tl.trans(k0), input_precision=PREC)
    kk = tl.dot(k1, tl.trans(k1), kk, input_precision=PREC)
    kk = tl.dot(k2, tl.trans(k2), kk, input_precision=PREC)
    kk = tl.dot(k3, tl.trans(k3), kk, input_precision=PREC)
    a = tl.where(rows[:, None] > rows[None, :], beta[:, None] * kk * decay, 0.0)
    # (I + A)^-1 blockwise in this program's own [BT, BT] block of the AQK scratch (AQK is held in registers
    # and written there last). Barriers: other threads read back what one thread stored.
    sp = aqk_ptr + (h * NPAD + c * BT) * BT
    sq = rows[:, None] * BT + rows[None, :]
    tl.store(sp + sq, a)
    tl.debug_barrier()
    _unit_lower_inv_inplace(sp, BT)
    tl.debug_barrier()
    inv = tl.load(sp + sq)

    bg = (beta * gamma)[:, None]
    tail = tl.exp((g_last64 - cum64).to(tl.float32))[:, None]
    _store_scr(w_ptr, r, 0 * KS, tl.dot(inv, bg * k0, input_precision=PREC), KS, BK)
    _store_scr(w_ptr, r, 1 * KS, tl.dot(inv, bg * k1, input_precision=PREC), KS, BK)
    _store_scr(w_ptr, r, 2 * KS, tl.dot(inv, bg * k2, input_precision=PREC), KS, BK)
    _store_scr(w_ptr, r, 3 * KS, tl.dot(inv, bg * k3, input_precision=PREC), KS, BK)
    _store_scr(kd_ptr, r, 0 * KS, k0 * tail, KS, BK)
    _store_scr(kd_ptr, r, 1 * KS, k1 * tail, KS, BK)
    _store_scr(kd_ptr, r, 2 * KS, k2 * tail, KS, BK)
    _store_scr(kd_ptr, r, 3 * KS, k3 * tail, KS, BK)
    vp = v_ptr + h * sv_h
    bb = beta[:, None]
    _store_scr(u_ptr, r, 0 * VS, tl.dot(inv, bb * _load_in(vp, tok, tm, sv_t, 0 * VS, VS, DV), input_precision=PREC),
               VS, BV)
    _store_scr(u_ptr, r, 1 * VS, tl.dot(inv, bb * _load_in(vp, tok, tm, sv_t, 1 * VS, VS, DV), input_precision=PREC),
               VS, BV)
    _store_scr(u_ptr, r, 2 * VS, tl.dot(inv, bb * _load_in(vp, tok, tm, sv_t, 2 * VS, VS, DV), input_precision=PREC),
               VS, BV)
    _store_scr(u_ptr, r, 3 * VS, tl.dot(inv, bb * _load_in(vp, tok, tm, sv_t, 3 * VS, VS, DV), input_precision=PREC),
               VS, BV)

    tl.debug_barrier()  # every thread has read the inverse before AQK overwrites it
    tl.store(sp + sq, aqk_v)


@triton.jit(do_not_specialize=["T", "NPAD", "NCH", "GLW"], do_not_specialize_on_alignment=["cu_ptr", "slot_ptr"])
def _gdn_chunk_scan_kernel(w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, gl_ptr, st_ptr, o_ptr, cu_ptr, slot_ptr,
                           T, NPAD, NCH, GLW, ss_s, ss_h, ss_k, so_t, so_h,
                           DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           BVS: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr = False,
                           BS: tl.constexpr = 2):
    # The whole [Dk, BVS] state tile stays in registers; its dots have a narrow N (BVS), which keeps the
    # FMA dot's operands small enough (a 4-slice variant like the prep kernel's compiled worse here).
    # VARLEN: program_id(2) is the call's sequence i, whose chunks follow those of sequences 0..i-1 and whose
    # state is slot slot_ptr[i] of the [S, Hv, Dk, Dv] states; otherwise one sequence, NCH chunks, st_ptr its state.
    h = tl.program_id(0)
    vb = tl.program_id(1)
    rows = tl.arange(0, BT)
    dk = tl.arange(0, BK)
    dv = vb * BVS + tl.arange(0, BVS)
    dvm = dv < DV
    smask = (dk < DK)[:, None] & dvm[None, :]
    start = 0
    length = T
    base = 0
    nch = NCH
    if VARLEN:
        i = tl.program_id(2)
        start = tl.load(cu_ptr + i)
        length = tl.load(cu_ptr + i + 1) - start
        if length <= 1:   # empty (its state stays as it is), or the one-token kernel's (not ours to touch)
            return
        nch = seq_chunks(length, BT)
        j = tl.arange(0, BS)   # the chunks of sequences 0..i-1, from one vector load of their offsets
        j0 = tl.load(cu_ptr + j, mask=j < i, other=0)
        base = tl.sum(seq_chunks(tl.load(cu_ptr + j + 1, mask=j < i, other=0) - j0, BT), 0)
        st_ptr += tl.load(slot_ptr + i).to(tl.int64) * ss_s
    s_ptrs = st_ptr + h * ss_h + dk[:, None] * ss_k + dv[None, :]
    s = tl.load(s_ptrs, mask=smask, other=0.0)
    for c in range(nch):
        r = h * NPAD + (base + c) * BT + rows
        w = tl.load(w_ptr + r[:, None] * BK + dk[None, :])
        u = tl.load(u_ptr + r[:, None] * BV + dv[None, :], mask=dvm[None, :], other=0.0)
        delta = u - tl.dot(w, s, input_precision=PREC)                   # Delta = U - W S0
        qg = tl.load(qg_ptr + r[:, None] * BK + dk[None, :])
        aqk = tl.load(aqk_ptr + r[:, None] * BT + rows[None, :])
        o = tl.dot(qg, s, input_precision=PREC) + tl.dot(aqk, delta, input_precision=PREC)
        t = c * BT + rows
        tl.store(o_ptr + (start + t)[:, None] * so_t + h * so_h + dv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=(t < length)[:, None] & dvm[None, :])
        kd = tl.load(kd_ptr + r[:, None] * BK + dk[None, :])
        g_last = tl.load(gl_ptr + h * GLW + base + c)
        s = s * tl.exp(g_last) + tl.dot(tl.trans(kd), delta, input_precision=PREC)
    tl.store(s_ptrs, s, mask=smask)


def prefill_inputs(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """A chunked prefill call's checked inputs: (q, k, v with a contiguous last dim, R = Hv / Hk, BK, BV)."""
    r = _check_heads(q.shape[1], v.shape[1])
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError(f"{op}: the state must be fp32 with a contiguous last dim")
    bk, bv = _pow2(q.shape[2]), _pow2(v.shape[2])
    if bk > 128 or bv > 128:
        # The kernels hold head dims as 4 slices of at most 32 (Qwen3.5 uses 128).
        raise ValueError(f"{op} (triton): head dims up to 128 supported, got Dk={q.shape[2]}, Dv={v.shape[2]}")
    return _last_contig(q), _last_contig(k), _last_contig(v), r, bk, bv


def prefill_scratch(hv: int, chunks: int, bk: int, bv: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The fp32 scratch the prep kernel writes and the scan reads, for ``chunks`` chunk rows: W, U, QG, KD, AQK
    ([Hv, chunks * CHUNK, width]) and G_L ([Hv, chunks])."""
    rows, f32 = chunks * CHUNK, torch.float32
    return (torch.empty((hv, rows, bk), dtype=f32, device=device), torch.empty((hv, rows, bv), dtype=f32, device=device),
            torch.empty((hv, rows, bk), dtype=f32, device=device), torch.empty((hv, rows, bk), dtype=f32, device=device),
            torch.empty((hv, rows, CHUNK), dtype=f32, device=device), torch.empty((hv, chunks), dtype=f32, device=device))


def run_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               o: torch.Tensor, state: torch.Tensor, scale: float, scratch: tuple[torch.Tensor, ...], *, chunks: int,
               r: int, bk: int, bv: int, bvs: int, cu: torch.Tensor | None = None,
               slots: torch.Tensor | None = None) -> None:
    """The prep and scan launches over ``chunks`` chunks: of one sequence (``q[T]`` ..., ``state[Hv, Dk, Dv]``), or,
    with ``cu`` and ``slots``, of the sequences they describe (``state[S, Hv, Dk, Dv]``; VARLEN, ``chunks`` the
    call's bound)."""
    w, u, qg, kd, aqk, gl = scratch
    hv, dk, dv, t_len = v.shape[1], q.shape[2], v.shape[2], q.shape[0]
    npad, glw = w.shape[1], gl.shape[1]
    varlen = cu is not None
    interp = _interpreting(q)
    prec = _DOT_PRECISION if q.dtype == torch.float32 else _DOT_PRECISION_16
    nseq = slots.shape[0] if varlen else 1
    _gdn_chunk_prep_kernel[(chunks, hv)](
        q, k, v, g, beta, w, u, qg, kd, aqk, gl, cu if varlen else gl, t_len, npad, glw, nseq, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        R=r, DK=dk, DV=dv, BK=bk, BV=bv, BT=CHUNK, PREC=prec, VARLEN=varlen, BS=_pow2(nseq, 2),
        **({} if interp else _PREP_KW))
    if varlen:
        run_one_token(q, k, v, g, beta, o, state, scale, r=r, cu=cu, slots=slots)
    state_strides = state.stride()[:3] if varlen else (0, *state.stride()[:2])
    _gdn_chunk_scan_kernel[(hv, triton.cdiv(dv, bvs)) + ((nseq,) if varlen else ())](
        w, u, qg, kd, aqk, gl, state, o, cu if varlen else gl, slots if varlen else gl, t_len, npad, chunks, glw,
        *state_strides, o.stride(0), o.stride(1),
        DK=dk, DV=dv, BK=bk, BV=bv, BVS=bvs, BT=CHUNK, PREC=prec, VARLEN=varlen, BS=_pow2(nseq, 2),
        **({} if interp else _SCAN_KW))


def gdn_chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, scale: float, *, block_v_scan: int | None = None) -> torch.Tensor:
    """Gated delta rule over one sequence ``[T, H, D]`` from ``state[Hv, Dk, Dv]`` (fp32, updated in place)."""
    q, k, v, r, bk, bv = prefill_inputs("gdn_chunk_prefill", q, k, v, state)
    t_len, hv, dv = q.shape[0], v.shape[1], v.shape[2]
    o = torch.empty((t_len, hv, dv), dtype=q.dtype, device=q.device)
    if t_len == 0:
        return o
    if t_len == 1:   # a step of the recurrence, as a one-token sequence of a VARLEN call gets (the same bits)
        run_one_token(q, k, v, g, beta, o, state, scale, r=r)
        return o
    # Scan tile over Dv: the scan is the sequential critical path, so it is split over Dv to put more
    # programs on the SMs (Hv * Dv / 16 = 128 for Hv = 16, Dv = 128), at the cost of re-reading the chunk's
    # W/QG/KD/AQK once per tile (L2-resident). A narrow tile also keeps the FMA dots' operands in registers
    # (BVS = 32 spilled more in an offline sm_90 compile).
    bvs = min(block_v_scan or 16, bv)
    seg = min(_SEG_CHUNKS, triton.cdiv(t_len, CHUNK))
    scratch = prefill_scratch(hv, seg, bk, bv, q.device)
    for t0 in range(0, t_len, seg * CHUNK):
        t1 = min(t_len, t0 + seg * CHUNK)
        run_chunks(q[t0:t1], k[t0:t1], v[t0:t1], g[t0:t1], beta[t0:t1], o[t0:t1], state, scale, scratch,
                   chunks=triton.cdiv(t1 - t0, CHUNK), r=r, bk=bk, bv=bv, bvs=bvs)
    return o


OPS = [
    OpImpl(op="gdn_chunk_prefill", name="triton", fn=gdn_chunk_prefill, devices=frozenset({"cuda"}),
           dtypes=_DTYPES, priority=10),
]
