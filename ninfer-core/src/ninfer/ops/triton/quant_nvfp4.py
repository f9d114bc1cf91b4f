"""Products with an ``nvfp4`` weight (``block_scale_k16_m128x4_v1``, :mod:`ninfer.quant.nvfp4`): a CUDA-core
dequant-GEMV for decode rows and a tensor-core GEMM, both reading the stored planes (codes, tiled E4M3 block
scales, the fp32 divisor) directly.

Decoding: a 4-bit code ``s e e m`` becomes the fp16 whose bits are ``s << 15 | (e e m) << 9``. Its value is the
code's E2M1 value times ``2^-14`` for every code, the subnormal ``e = 0`` ones included (E2M1 and that fp16
field share their layout up to the exponent bias), so one bit operation and one exact conversion decode a code.
The ``2^14`` goes into the final scale. A code times its block scale has at most 2 + 4 significant bits and lies
in ``[2^-10, 2688]``: exact in bf16, fp16 and fp32, so the GEMM feeds the tensor cores the exact values
``e2m1 * block_scale`` and divides by the per-tensor divisor once, after the whole sum. The GEMV sums codes times
x per 16-lane block, scales each block's sum by its block scale in fp32, and divides once at the end.

Each program reads the block scales of its rows from the 128 x 4 tiles (byte ``(r % 32) * 16 + (r // 32) * 4 + c``
of tile ``(r // 128, k // 64)``, c the block within the tile's 64 weights).

Rounding: products and sums in fp32 (the GEMM's on the tensor cores), one division by the divisor, the result
rounded once to x's dtype (stored as ``out_dtype`` after that). A row's result does not depend on the other rows of
its call; the GEMV and the GEMM round differently, so a row's bits depend on which one its call took
(:func:`ninfer.ops.triton.quant_linear.takes_gemv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton._common import INTERPRET, cast, mm, next_pow2, pdl, pdl_wait
from ninfer.ops.triton._quant import KernelWeight, e2m1_scaled, nvfp4_scale_row
from ninfer.ops.triton.quant_gemm import block_m, output_tile

# Scale blocks (16 weights, 8 code bytes) a GEMV program reduces per K step.
_NB = 64
# Weight rows per GEMV program.
_BN = 4
# GEMM output columns per program; its K step is one 64-weight scale-tile column.
_GEMM_BN = 64
_GEMM_BK = 64


@triton.jit
def _nvfp4_gemv_kernel(x_ptr, c_ptr, t_ptr, d_ptr, y_ptr, M, N, K, sx, sc, st, sy,
                       BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, XW: tl.constexpr,
                       INTERP: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    nm = n < N
    r2 = tl.where(nm, n, 0)[:, None]
    r3 = r2[:, :, None]
    z3 = r3 * 0
    b2 = tl.arange(0, NB)[None, :]
    b3 = b2[:, :, None]
    t3 = tl.arange(0, 8)[None, None, :]
    srow = nvfp4_scale_row(r2, st)
    KB = K // 16                                  # scale blocks a row
    acc1 = tl.zeros((BN, NB), dtype=tl.float32)      # one row (decode): in the layout of a block's sums
    acc = tl.zeros((BM, BN, NB), dtype=tl.float32)
    m3 = tl.arange(0, BM)[:, None, None]
    pdl_wait(PDL)
    for blk0 in range(0, KB, NB):
        jj = (blk0 + b3) * 8 + t3 + z3            # [BN, NB, 8] code byte of the row
        bm = (blk0 + b3 + z3) < KB
        codes = tl.load(c_ptr + r3 * sc + jj, mask=bm, other=0).to(tl.int32)
        v0 = e2m1_scaled(codes & 15)              # lane 2j
        v1 = e2m1_scaled(codes >> 4)              # lane 2j + 1
        blk = blk0 + b2
        s = tl.load(t_ptr + srow + (blk // 4) * 512 + blk % 4, mask=blk < KB, other=0)
        s = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        for m in tl.static_range(BM):
            row = tl.minimum(M - 1, m)
            if XW:   # bf16 rows: one 32-bit word holds lanes 2j and 2j + 1
                w = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + row * (sx // 2) + jj, mask=bm, other=0)
                xe = (w << 16).to(tl.float32, bitcast=True)
                xo = (w & -65536).to(tl.float32, bitcast=True)
            else:
                xe = tl.load(x_ptr + row * sx + 2 * jj, mask=bm, other=0.0).to(tl.float32)
                xo = tl.load(x_ptr + row * sx + 2 * jj + 1, mask=bm, other=0.0).to(tl.float32)
            part = tl.sum(v0 * xe + v1 * xo, 2) * s
            if BM == 1:
                acc1 += part
            else:
                acc = tl.where(m3 == m, acc + part[None], acc)
    if BM == 1:
        acc = acc1[None]
    out = tl.sum(acc, 2) * 16384.0 / tl.load(d_ptr)
    rows = tl.arange(0, BM)
    y = cast(out, x_ptr.dtype.element_ty, INTERP).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * sy + n[None, :], y, mask=(rows[:, None] < M) & nm[None, :])


@triton.jit
def _nvfp4_gemm_kernel(x_ptr, c_ptr, t_ptr, d_ptr, y_ptr, M, N, K, sx, sc, st, sy,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP32_DOT: tl.constexpr,
                       INTERP: tl.constexpr):
    rm, rn, rm_in, rn_in = output_tile(M, N, BM, BN)
    xdt = x_ptr.dtype.element_ty
    HB: tl.constexpr = BK // 2
    jb = tl.arange(0, HB)
    srow = nvfp4_scale_row(rn_in, st)[:, None] + (jb // 8)[None, :]   # this K step's 4 blocks: 8 code bytes each
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(x_ptr + rm_in[:, None] * sx + (k0 + tl.arange(0, BK))[None, :])
        codes = tl.load(c_ptr + rn_in[:, None] * sc + (k0 // 2 + jb)[None, :]).to(tl.int32)
        s = tl.load(t_ptr + srow + (k0 // 64) * 512).to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
        w0 = e2m1_scaled(codes & 15) * s                        # exact: e2m1 * block scale
        w1 = e2m1_scaled(codes >> 4) * s
        w = tl.reshape(tl.join(w0, w1), (BN, BK)).to(xdt)       # lanes 2j, 2j + 1
        acc += mm(a, tl.trans(w), FP32_DOT, INTERP)
    out = acc / tl.load(d_ptr)
    y = cast(out, xdt, INTERP).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None] * sy + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemv(x2: torch.Tensor, w: KernelWeight, *, out_dtype: torch.dtype | None = None, block_n: int | None = None,
         blocks: int | None = None, warps: int = 4) -> torch.Tensor:
    """``x2[M, K] @ decode(w).T`` on the CUDA cores (``M <= 16``, x2 row-contiguous), rounded to x2's dtype, stored
    as ``out_dtype``. ``block_n``/``blocks``/``warps``: launch-shape overrides (tests, sweeps)."""
    m, k = x2.shape
    y = torch.empty((m, w.n), dtype=out_dtype or x2.dtype, device=x2.device)
    if m == 0 or w.n == 0:
        return y
    bn = block_n or _BN
    xw = x2.dtype == torch.bfloat16 and x2.stride(0) % 2 == 0     # K is a multiple of 64
    kw = {} if INTERPRET else {"num_warps": warps}
    _nvfp4_gemv_kernel[(triton.cdiv(w.n, bn),)](
        x2, w.base, w.scales, w.high, y, m, w.n, k, x2.stride(0), w.base_stride, w.scale_stride, y.stride(0),
        BM=next_pow2(m), BN=bn, NB=blocks or _NB, XW=xw, INTERP=INTERPRET, **pdl(x2), **kw)
    return y


def gemm(x2: torch.Tensor, w: KernelWeight, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x2[M, K] @ decode(w).T`` on the tensor cores (x2 row-contiguous), rounded to x2's dtype, stored as
    ``out_dtype``."""
    m, k = x2.shape
    y = torch.empty((m, w.n), dtype=out_dtype or x2.dtype, device=x2.device)
    if m == 0 or w.n == 0:
        return y
    bm = block_m(m)
    kw = {} if INTERPRET else {"num_warps": 4, "num_stages": 3}
    _nvfp4_gemm_kernel[(triton.cdiv(m, bm) * triton.cdiv(w.n, _GEMM_BN),)](
        x2, w.base, w.scales, w.high, y, m, w.n, k, x2.stride(0), w.base_stride, w.scale_stride, y.stride(0),
        BM=bm, BN=_GEMM_BN, BK=_GEMM_BK, FP32_DOT=x2.dtype == torch.float32, INTERP=INTERPRET, **kw)
    return y
