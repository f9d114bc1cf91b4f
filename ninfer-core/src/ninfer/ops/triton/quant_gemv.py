"""Decode-sized products with a packed quantized weight: a streaming dequant-GEMV (A16: x stays in its dtype).

Each program owns ``BN`` output rows and streams their packed bytes in ``[BN, BB]`` byte tiles (contiguous within
each row: vectorised loads of the base plane; the q5/q6 high bits and the group scales are gathered per byte
and come from the same few cache lines), decodes them in registers to fp32 weights ``code * scale`` (exact; see
:mod:`~ninfer.ops.triton._quant`) and reduces them against each of the ``M <= 16`` rows of x, so the weight is
read once for all rows and never materialised. The next tile is requested while one is reduced; the first one
before the PDL wait (:func:`~ninfer.ops.triton._common.pdl_wait`: weights are parameters). For the nibble
formats each byte's two lanes multiply x's even and odd lanes (two strided loads of x, which stays in L1/L2).
fp8 rows accumulate ``code * x`` and take their bf16 row scale once at the end.

Split-K (``split > 1``, for weights with too few rows to occupy the device): program ``(i, s)`` reduces the
s-th run of K tiles into an fp32 partial ``[S, M, N]``; the program that arrives last at its row block adds them
in split order and rounds once (:mod:`~ninfer.ops.triton._splitk`: deterministic, no second launch).

Fused variants, as :mod:`~ninfer.ops.triton.linear` fuses the bf16 GEMV: ``norm`` forms the block's
``add_rms_norm_unit_offset`` of x in every program (a first pass over the row for its sum of squares, then the
normed lanes as they are needed; program 0 stores the normed rows and the new residual) and ``swiglu`` reads gate
row n and up row ``NI + n`` and stores ``silu(g) * u`` with g and u rounded to x's dtype first.

Rounding: every product and sum in fp32 (per tile a tree sum, tiles in K order), the result rounded once to
x's dtype (``logits``: then stored as fp32). A row's result does not depend on the other rows of the call.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ninfer.ops.triton._common import INTERPRET, cast, next_pow2, pdl, pdl_wait
from ninfer.ops.triton._quant import KIND_FP8, KIND_NIBBLE, KernelWeight, decode_tile, load_tile
from ninfer.ops.triton._splitk import store_out, sum_partials, tickets

# Most rows of x the GEMV takes (the weight tile is reduced against each row on the CUDA cores; the GEMM's tensor
# cores win beyond some row count that the H200 sweep has to find).
MAX_ROWS = 16
# Lanes of one K tile: [BN, 2048] nibble tiles are 1 KB a row, byte tiles [BN, 1024] 1 KB a row.
_LANES_NIBBLE = 2048
_LANES_BYTE = 1024
# Output rows per program.
_BN = 4
# Row programs below which the GEMV splits K (about two waves of programs on a large GPU).
_MIN_PROGRAMS = 256


@triton.jit
def _act(x_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, row, lanes, K, inv, sx, sr, sh, sro, store, NORM: tl.constexpr,
         INTERP: tl.constexpr):
    """fp32 activations of x row ``row`` at ``lanes`` (0 past K); with ``NORM`` the normed lanes of the block's
    pre-norm (``inv`` the row's rsqrt), whose normed and residual values are stored where ``store`` holds."""
    km = lanes < K
    xv = tl.load(x_ptr + row * sx + lanes, mask=km, other=0.0).to(tl.float32)
    if NORM:
        rv = tl.load(r_ptr + row * sr + lanes, mask=km, other=0.0).to(tl.float32)
        res = cast(xv + rv, ro_ptr.dtype.element_ty, INTERP)
        nw = tl.load(nw_ptr + lanes, mask=km, other=0.0).to(tl.float32)
        hv = cast((res.to(tl.float32) * inv) * (1.0 + nw), h_ptr.dtype.element_ty, INTERP)
        tl.store(ro_ptr + row * sro + lanes, res, mask=km & store)
        tl.store(h_ptr + row * sh + lanes, hv, mask=km & store)
        xv = hv.to(tl.float32)
    return xv


@triton.jit
def _reduce(acc, c0, c1, sc, x_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, invs, M, K, k0, sx, sr, sh, sro, store, rows,
            BM: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr, KIND: tl.constexpr, NORM: tl.constexpr,
            INTERP: tl.constexpr):
    """``acc[BM, BN] += w . x[m]`` over the tile's lanes from lane ``k0``, for every row m: codes times x summed
    per scale group (32 bytes), times the group's scale, groups summed (fp8: codes times x, summed)."""
    LPB: tl.constexpr = 2 if KIND == 0 else 1
    lanes = k0 + tl.arange(0, LPB * BB)     # contiguous x loads; a nibble tile's even/odd lanes split in registers
    for m in tl.static_range(BM):
        row = tl.minimum(M - 1, m)      # rows past M (BM is a power of two) repeat row M-1; never stored
        inv = tl.sum(tl.where(rows == m, invs, 0.0), 0)
        xv = _act(x_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, row, lanes, K, inv, sx, sr, sh, sro, store, NORM, INTERP)
        if KIND == 0:
            xe, xo = tl.split(tl.reshape(xv, (BB, 2)))
            prod = c0 * xe[None, :] + c1 * xo[None, :]
        else:
            prod = c0 * xv[None, :]
        if KIND == 2:
            part = tl.sum(prod, 1)
        else:
            part = tl.sum(tl.sum(tl.reshape(prod, (BN, BB // 32, 32)), 2) * sc, 1)
        acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    return acc


@triton.jit
def _qgemv_kernel(x_ptr, b_ptr, h_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, r_ptr, nw_ptr, hn_ptr, ro_ptr, eps,
                  M, N, K, NI, BYTES, TPS, sx, sb, sh, ss, sy, sr, shn, sro,
                  KIND: tl.constexpr, BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr,
                  EVEN: tl.constexpr, SPLIT: tl.constexpr, REDUCE: tl.constexpr, NORM: tl.constexpr,
                  SWIGLU: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    LPB: tl.constexpr = 2 if KIND == 0 else 1       # lanes per byte
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    n = pid * BN + tl.arange(0, BN)
    nm = n < N
    n_in = tl.where(nm, n, 0)            # in-bounds rows: only the store is masked
    n_up = n_in + NI
    rows = tl.arange(0, BM)
    jj = tl.arange(0, BB)
    t0 = sid * TPS
    t1 = tl.minimum(t0 + TPS, tl.cdiv(BYTES, BB))
    # The first tile streams while the previous kernel finishes.
    b, hx, sc = load_tile(b_ptr, h_ptr, s_ptr, n_in, t0 * BB, sb, sh, ss, BYTES, KIND, BITS, BN, BB, not EVEN)
    if SWIGLU:
        ub, uhx, usc = load_tile(b_ptr, h_ptr, s_ptr, n_up, t0 * BB, sb, sh, ss, BYTES, KIND, BITS, BN, BB, not EVEN)
    pdl_wait(PDL)
    store = (tl.arange(0, LPB * BB) * 0 + pid + sid) == 0
    invs = tl.zeros((BM,), dtype=tl.float32)
    if NORM:  # inv rms of each row of the block's pre-norm input: a first pass over the row
        for m in tl.static_range(BM):
            row = tl.minimum(M - 1, m)
            ss2 = 0.0
            for k0 in range(0, K, BB):
                km = (k0 + jj) < K
                xv = tl.load(x_ptr + row * sx + k0 + jj, mask=km, other=0.0).to(tl.float32)
                rv = tl.load(r_ptr + row * sr + k0 + jj, mask=km, other=0.0).to(tl.float32)
                res = cast(xv + rv, ro_ptr.dtype.element_ty, INTERP).to(tl.float32)
                ss2 += tl.sum(res * res, 0)
            invs = tl.where(rows == m, tl.rsqrt(ss2 / K + eps), invs)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    lim = tl.minimum(BYTES, t1 * BB)
    for t in range(t0, t1):
        c0, c1 = decode_tile(b, hx, BB, KIND, BITS)
        cs = sc
        if SWIGLU:
            u0, u1 = decode_tile(ub, uhx, BB, KIND, BITS)
            us = usc
        # Next tile in flight while this one is reduced (all masked off past the run: no traffic).
        b, hx, sc = load_tile(b_ptr, h_ptr, s_ptr, n_in, (t + 1) * BB, sb, sh, ss, lim, KIND, BITS, BN, BB, True)
        if SWIGLU:
            ub, uhx, usc = load_tile(b_ptr, h_ptr, s_ptr, n_up, (t + 1) * BB, sb, sh, ss, lim, KIND, BITS, BN, BB,
                                     True)
        acc = _reduce(acc, c0, c1, cs, x_ptr, r_ptr, nw_ptr, hn_ptr, ro_ptr, invs, M, K, t * BB * LPB, sx, sr, shn,
                      sro, store, rows, BM, BN, BB, KIND, NORM, INTERP)
        if SWIGLU:
            acc_u = _reduce(acc_u, u0, u1, us, x_ptr, r_ptr, nw_ptr, hn_ptr, ro_ptr, invs, M, K, t * BB * LPB, sx, sr,
                            shn, sro, store, rows, BM, BN, BB, KIND, NORM, INTERP)
    if KIND == 2:  # fp8: the row scale, once
        acc = acc * tl.load(s_ptr + n_in * ss).to(tl.float32)[None, :]
        if SWIGLU:
            acc_u = acc_u * tl.load(s_ptr + n_up * ss).to(tl.float32)[None, :]
    keep = (rows[:, None] < M) & nm[None, :]
    if SPLIT > 1:  # unrounded fp32 partial sums, added by the last program of the row block (or after the launch)
        store_out(tl.trans(acc), y_ptr, part_ptr, cnt_ptr, x_ptr, n, nm, pid, sid, SPLIT, M * N, sy, M, N, N, BN, BM,
                  True, REDUCE, False, INTERP)
    else:
        if SWIGLU:
            g = cast(acc, x_ptr.dtype.element_ty, INTERP).to(tl.float32)
            u = cast(acc_u, x_ptr.dtype.element_ty, INTERP).to(tl.float32)
            acc = g / (1.0 + tl.exp(-g)) * u
        y = cast(acc, x_ptr.dtype.element_ty, INTERP).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * sy + n[None, :], y, mask=keep)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def auto_split(programs: int, tiles: int) -> int:
    """K splits for ``programs`` row programs over ``tiles`` K tiles: enough for about :data:`_MIN_PROGRAMS`
    programs, at most one split per tile."""
    if programs >= _MIN_PROGRAMS:
        return 1
    return max(1, min(tiles, -(-_MIN_PROGRAMS // programs)))


def gemv(x2: torch.Tensor, w: KernelWeight, *, norm: tuple | None = None, swiglu: bool = False,
         out_dtype: torch.dtype | None = None, block_n: int | None = None, split: int | None = None,
         lanes: int | None = None, warps: int = 4) -> torch.Tensor:
    """``x2[M, K] @ decode(w).T`` (``M <= MAX_ROWS``, x2 row-contiguous), rounded to x2's dtype, stored as
    ``out_dtype`` (default x2's). ``norm = (residual2, norm_weight, eps, normed_out, residual_out)``: x2 is first
    replaced by its ``add_rms_norm_unit_offset`` with residual2, stored to the given ``[M, K]`` outputs.
    ``swiglu``: w is ``[2I, K]`` (gate rows, then up rows); the result is ``silu_and_mul`` of the product,
    ``[M, I]``. ``block_n``/``split``/``lanes``/``warps``: launch-shape overrides (tests, sweeps); the fused
    variants never split."""
    m, k = x2.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"quantized gemv: {m} rows; it takes 1 to {MAX_ROWS}")
    if swiglu and w.n % 2:
        raise ValueError(f"add_rms_norm_unit_offset_swiglu: gate_up has {w.n} rows, not [2I, N]")
    n = w.n // 2 if swiglu else w.n
    lanes = lanes or (_LANES_NIBBLE if w.kind == KIND_NIBBLE else _LANES_BYTE)
    lpb = 2 if w.kind == KIND_NIBBLE else 1
    row_bytes = w.lanes // lpb
    bb = min(next_pow2(row_bytes), lanes // lpb)
    tiles = -(-row_bytes // bb)
    if w.kind != KIND_FP8 and bb % 32:
        raise ValueError(f"quantized gemv: a K tile of {bb} bytes does not hold whole scale groups (32 bytes)")
    bn = block_n or _BN         # one row block size for every M: a row's reduction never depends on the batch
    programs = -(-n // bn)
    fused = norm is not None or swiglu
    s = 1 if fused else (split or auto_split(programs, tiles))
    tps = -(-tiles // s)
    s = -(-tiles // tps)                      # no empty splits
    y = torch.empty((m, n), dtype=out_dtype or x2.dtype, device=x2.device)
    if n == 0:
        return y
    part = torch.empty((s, m, n), dtype=torch.float32, device=x2.device) if s > 1 else y
    cnt = tickets(x2.device, programs) if s > 1 else None
    if norm is None:
        r2 = nw = hn = ro = x2
        eps = 0.0
    else:
        r2, nw, eps, hn, ro = norm
    kw = {} if INTERPRET else {"num_warps": warps}
    _qgemv_kernel[(programs, s)](
        x2, w.base, w.high, w.scales, y, part, part if cnt is None else cnt, r2, nw, hn, ro, float(eps), m, n, k, n,
        row_bytes, tps, x2.stride(0), w.base_stride, w.high_stride, w.scale_stride, y.stride(0), r2.stride(0),
        hn.stride(0), ro.stride(0), KIND=w.kind, BITS=w.bits, BM=next_pow2(m), BN=bn, BB=bb,
        EVEN=row_bytes % bb == 0, SPLIT=s, REDUCE=cnt is not None, NORM=norm is not None, SWIGLU=swiglu,
        INTERP=INTERPRET, **pdl(x2), **kw)
    if s > 1 and cnt is None:
        sum_partials(part, y, x2, False)
    return y
