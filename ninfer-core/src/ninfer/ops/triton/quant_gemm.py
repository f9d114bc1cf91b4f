"""Prefill-sized products with a packed quantized weight: tensor-core GEMMs that decode weight tiles in registers.

A16 (x in its own dtype), every format: a program owns a ``[BM, BN]`` output tile. For the groupwise formats it
steps through K one scale group at a time (64 lanes for q4/q5/q6, 32 for q8): the group's codes are decoded to x's
dtype (exact: |code| <= 127), multiplied with x's lanes on the tensor cores (fp32 accumulation), and the
``[BM, BN]`` product is scaled by the group's fp16 scales in fp32 and added to the accumulator. So the weights
are exactly the decoded values ``scale * code`` (a bf16 weight ``scale * code`` would round them), at one fp32
multiply-add per output and group. fp8 rows: the E4M3 codes (exact in bf16, fp16 and fp32) are multiplied in
``[BK]`` chunks and the row scale applied once at the end.

A8 (fp8 weights only, and only for a use whose activation policy allows 8-bit activations: the caller's
decision, see :func:`fp8_linear_a8`): each row of x is quantized to E4M3 with a per-row fp32 scale
(:func:`quantize_rows_fp8`), the codes multiplied on the FP8 tensor cores, and each ``[BK]`` chunk's fp32 product
scaled by ``x_scale[m] * w_scale[n]`` into the fp32 accumulator: Hopper's FP8 MMA accumulates with fewer bits
than fp32, so partial sums are promoted to fp32 every chunk rather than accumulated across all of K inside the
tensor cores.

Rounding: the result is rounded once to x's dtype (``logits``: then stored as fp32). Rows of x are independent:
a row's result does not depend on M or on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.reference.a8 import A8_MIN_AMAX
from ninfer.ops.triton._common import INTERPRET, TL_DTYPE, cast, mm
from ninfer.ops.triton._quant import KIND_FP8, KernelWeight, fp8_code, int_code, nibble_codes

E4M3_MAX = 448.0
# A8_MIN_AMAX comes from the reference: one definition of the A8 activation quantization.
_BN = 64
_BK_FP8 = 64
_BK_A8 = 128


def block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


@triton.jit
def output_tile(M, N, BM: tl.constexpr, BN: tl.constexpr):
    """This program's ``[BM, BN]`` output tile: ``(rows, columns, rows clamped to M - 1, columns past N at 0)``;
    the clamped ones index loads (only the store is masked). Row blocks of one weight tile are consecutive
    programs, so that tile is read from L2 after the first."""
    num_m = tl.cdiv(M, BM)
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    return rm, rn, tl.minimum(rm, M - 1), tl.where(rn < N, rn, 0)


@triton.jit
def _qgemm_kernel(x_ptr, b_ptr, h_ptr, s_ptr, y_ptr, M, N, K, LANES, sx, sb, sh, ss, sy,
                  KIND: tl.constexpr, BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  FP32_DOT: tl.constexpr, INTERP: tl.constexpr):
    rm, rn, rm_in, rn_in = output_tile(M, N, BM, BN)
    xdt = x_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if KIND == 2:
        kk = tl.arange(0, BK)
        for k0 in range(0, K, BK):
            km = (k0 + kk) < K
            a = tl.load(x_ptr + rm_in[:, None] * sx + (k0 + kk)[None, :], mask=km[None, :], other=0.0)
            c = tl.load(b_ptr + rn_in[:, None] * sb + (k0 + kk)[None, :], mask=km[None, :], other=0)
            acc += mm(a, tl.trans(fp8_code(c).to(xdt)), FP32_DOT, INTERP)
        acc = acc * tl.load(s_ptr + rn_in * ss).to(tl.float32)[None, :]
    else:
        jj = tl.arange(0, 32)              # a group's 32 base bytes
        kk = tl.arange(0, BK)              # its lanes (BK = the group size)
        for g in range(0, LANES // BK):
            jb = g * 32 + jj
            b = tl.load(b_ptr + rn_in[:, None] * sb + jb[None, :]).to(tl.int32)
            if KIND == 0:
                hx = b
                if BITS > 4:
                    hx = tl.load(h_ptr + rn_in[:, None] * sh + ((jb * (BITS - 4)) >> 2)[None, :]).to(tl.int32)
                c0, c1 = nibble_codes(b, hx, jb[None, :], BITS)
                c = tl.interleave(c0, c1)  # lanes 2j, 2j + 1 of byte j: the group's 64 lanes in order
            else:
                c = int_code(b, 128)
            km = (g * BK + kk) < K
            a = tl.load(x_ptr + rm_in[:, None] * sx + (g * BK + kk)[None, :], mask=km[None, :], other=0.0)
            part = mm(a, tl.trans(c.to(xdt)), FP32_DOT, INTERP)
            acc += part * tl.load(s_ptr + rn_in * ss + g).to(tl.float32)[None, :]
    y = cast(acc, xdt, INTERP).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * sy + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm(x2: torch.Tensor, w: KernelWeight, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A16 ``x2[M, K] @ decode(w).T`` (x2 row-contiguous), rounded to x2's dtype, stored as ``out_dtype``."""
    m, k = x2.shape
    y = torch.empty((m, w.n), dtype=out_dtype or x2.dtype, device=x2.device)
    if m == 0 or w.n == 0:
        return y
    bm = block_m(m)
    bk = _BK_FP8 if w.kind == KIND_FP8 else w.group
    kw = {} if INTERPRET else {"num_warps": 4, "num_stages": 3}
    _qgemm_kernel[(triton.cdiv(m, bm) * triton.cdiv(w.n, _BN),)](
        x2, w.base, w.high, w.scales, y, m, w.n, k, w.lanes, x2.stride(0), w.base_stride, w.high_stride,
        w.scale_stride, y.stride(0), KIND=w.kind, BITS=w.bits, BM=bm, BN=_BN,
        BK=bk, FP32_DOT=x2.dtype == torch.float32, INTERP=INTERPRET, **kw)
    return y


@triton.jit
def _e4m3(v, INTERP: tl.constexpr):
    """E4M3FN bits (uint8) of fp32 ``v`` (|v| <= 448), rounded to nearest even. The GPU converts in hardware;
    the triton 3.9 interpreter mis-rounds values that round up into the next binade, so there the value is
    first rounded on its bits to a multiple of its E4M3 quantum (``2^(e-3)``, subnormals ``2^-9``), which the
    interpreter then converts exactly."""
    if INTERP:
        a = tl.abs(v)
        e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
        q = ((e - 3) << 23).to(tl.float32, bitcast=True)
        r = ((a / q + 8388608.0) - 8388608.0) * q        # a / q < 16 is exact; + 2^23 rounds it to even
        v = tl.where(v < 0, -r, r)
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, sx, sq, MIN_AMAX, BK: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0)
    kk = tl.arange(0, BK)
    amax = 0.0
    for k0 in range(0, K, BK):
        xv = tl.load(x_ptr + row * sx + k0 + kk, mask=(k0 + kk) < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(xv), 0))
    inv = tl.where(amax >= MIN_AMAX, tl.math.div_rn(448.0, tl.maximum(amax, MIN_AMAX)), 0.0)
    tl.store(s_ptr + row, tl.math.div_rn(amax, 448.0))
    for k0 in range(0, K, BK):
        km = (k0 + kk) < K
        xv = tl.load(x_ptr + row * sx + k0 + kk, mask=km, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * sq + k0 + kk, _e4m3(tl.minimum(tl.maximum(xv * inv, -448.0), 448.0), INTERP), mask=km)


def quantize_rows_fp8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row E4M3 activations: ``(codes [M, K] uint8, scales [M] fp32)`` with ``scale = amax / 448`` and
    ``code = e4m3(clamp(x * (448 / amax), -448, 448))`` (each division correctly rounded in fp32, the E4M3 rounding
    to nearest even), so ``code * scale`` is x to E4M3 precision; a row with ``amax <`` :data:`A8_MIN_AMAX` (zero
    included) gets zero codes."""
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.uint8, device=x2.device)
    s = torch.empty((m,), dtype=torch.float32, device=x2.device)
    if m and k:
        _quant_rows_kernel[(m,)](x2, q, s, k, x2.stride(0), q.stride(0), A8_MIN_AMAX,
                                 BK=min(triton.next_power_of_2(k), 1024), INTERP=INTERPRET)
    return q, s


@triton.jit
def _fp8_a8_kernel(q_ptr, sx_ptr, c_ptr, s_ptr, y_ptr, M, N, K, sq, sc, ss, sy, XDT: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INTERP: tl.constexpr):
    rm, rn, rm_in, rn_in = output_tile(M, N, BM, BN)
    kk = tl.arange(0, BK)
    scale = tl.load(sx_ptr + rm_in)[:, None] * tl.load(s_ptr + rn_in * ss).to(tl.float32)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        km = (k0 + kk) < K
        a = tl.load(q_ptr + rm_in[:, None] * sq + (k0 + kk)[None, :], mask=km[None, :], other=0)
        b = tl.load(c_ptr + rn_in[:, None] * sc + (k0 + kk)[None, :], mask=km[None, :], other=0)
        part = tl.dot(a.to(tl.float8e4nv, bitcast=True), tl.trans(b.to(tl.float8e4nv, bitcast=True)))
        acc += part * scale                 # promoted to fp32 (and scaled) every BK lanes
    y = cast(acc, XDT, INTERP).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * sy + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm_a8(x2: torch.Tensor, w: KernelWeight, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A8 ``x2[M, K] @ decode(w).T`` for an fp8 weight: x2's rows quantized by :func:`quantize_rows_fp8`, the
    product on the FP8 tensor cores, rounded to x2's dtype and stored as ``out_dtype``."""
    if w.kind != KIND_FP8:
        raise ValueError(f"A8 GEMM: only fp8 weights take 8-bit activations, got {w.format}")
    m, k = x2.shape
    y = torch.empty((m, w.n), dtype=out_dtype or x2.dtype, device=x2.device)
    if m == 0 or w.n == 0:
        return y
    q, s = quantize_rows_fp8(x2)
    bm = block_m(m)
    kw = {} if INTERPRET else {"num_warps": 4, "num_stages": 3}
    _fp8_a8_kernel[(triton.cdiv(m, bm) * triton.cdiv(w.n, _BN),)](
        q, s, w.base, w.scales, y, m, w.n, k, q.stride(0), w.base_stride, w.scale_stride, y.stride(0),
        XDT=TL_DTYPE[x2.dtype], BM=bm, BN=_BN, BK=_BK_A8, INTERP=INTERPRET, **kw)
    return y
