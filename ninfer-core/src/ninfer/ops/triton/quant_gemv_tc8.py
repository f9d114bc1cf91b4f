"""Decode-sized products with an 8-bit weight on the tensor cores: :mod:`~ninfer.ops.triton.quant_gemv_tc`'s
scheme for ``q8_g32_fp16`` and ``fp8_e4m3fn_row_bf16`` weights and bf16 activations, up to :data:`MAX_ROWS` rows
of x, chosen by the same switch (``NINFER_QUANT_GEMV``) and with the same launch (:func:`quant_gemv_tc.launch`:
split-K, the partials' kernel, the norm prologue and the SwiGLU epilogue).

Decode: the base plane is read as uint16, so one 32-bit register holds the bytes of lanes ``2e .. 2e+3``; inline
PTX turns it into two bf16x2 registers, lanes (2e, 2e+2) and (2e+1, 2e+3). Under the interpreter the same values
come from plain integer ops.

- q8 (two's complement codes, bytes ``b = s m`` with sign bit s): code = (128 + m) + (-128 - 128 s). bf16
  ``0x4300 | m`` is exactly 128 + m (7 mantissa bits) and ``0xC300 | (b & 0x80)`` is -128 or -256 (bit 7 of the
  byte lands on the exponent's low bit), made by one ``lop3`` each; one ``bf16x2`` fma adds them, exactly (an
  integer of at most 8 significant bits). Seven instructions a register.
- fp8 (E4M3FN bits ``s eeee mmm``): ``prmt`` sign-extends bytes (0, 2) and (1, 3) into 16-bit halves, a shift by 4
  and a mask put the sign at bit 15 and the rest at bits 4..10: a bf16 whose value is the E4M3 value times 2^-120
  (the 4-bit exponent fills the low bits of bf16's 8-bit one; E4M3 subnormals become bf16 subnormals with the
  same mantissa). One ``bf16x2`` multiply by 2^120 restores it exactly, subnormals included (bf16 fma has no
  flush-to-zero form). Eight instructions a register.

Lane order (``PERM`` 1): within each 32-lane chunk, A's column ``i * 16 + e`` is lane ``2e + i``: a decode
register's pair (2e, 2e+2) is then adjacent in k as the dot operand wants it; x is permuted the same way in
registers. ``PERM`` 0 (natural order, a layout conversion in the loop) and other decodes (``ASM``, PTX of the
same operands) are for tools/quant_gemv_tc8_candidates.py's comparison.

Products: q8 as q4 (``acc[BN, GPI * MP] += codes @ blockdiag(x^T)`` over GPI groups of 32 lanes, each group's sum
times its fp16 scale in fp32); fp8 ``acc[BN, MP] += codes[BN, BK] @ x^T[BK, MP]`` with x's rows in the first
columns (MP always 8: the tensor cores' narrowest N, rows past M masked to zero) and the row's bf16 scale applied
after the loop. Exactness as in quant_gemv_tc (the ``U_TC`` bound of tests/ops_triton/quant_cases.py). fp8 takes
rows whose K is a multiple of :data:`FP8_BK`; q8 rows of whole K steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import quant_gemv_tc
from ninfer.ops.triton._common import cast, l2_prefetch, next_pow2, pdl_wait
from ninfer.ops.triton._quant import KernelWeight
from ninfer.ops.triton._splitk import store_out
from ninfer.ops.triton.quant_gemv_tc import inv_rms

#: Most rows of x the kernels take.
MAX_ROWS = 8
#: Whether split-K partials are added inside the kernel by default (``gemv_tc(in_kernel_sum=None)``). Off: with
#: the ticket epilogue these kernels' K loops build differently (more registers; at eight rows of q8 more loads
#: issued ahead of the math), and the separate sum kernel measured faster at every split 9B shape, one and eight
#: rows (docs/kernels.md).
IN_KERNEL_SUM = False
#: K lanes of an fp8 program's step.
FP8_BK = 256
Q8 = "q8_g32_fp16"
FP8 = "fp8_e4m3fn_row_bf16"
# q8: (BN, GPI) by MP (GPI * MP >= 8). fp8: BN a program (x padded to 8 columns whatever the rows).
Q8_SHAPES = {1: (128, 8), 2: (256, 4), 4: (256, 2), 8: (256, 1)}
FP8_BN = 128

#: The decodes the engine runs (PTX; ``$2`` the input word, ``$0``/``$1`` the even-lane and odd-lane bf16x2 pairs).
Q8_ASM = """{
.reg .b32 t, c, w1, one;
mov.b32 one, 0x3F803F80;
lop3.b32 t, $2, 0x007F007F, 0x43004300, 0xea;
lop3.b32 c, $2, 0x00800080, 0xC300C300, 0xea;
fma.rn.bf16x2 $0, t, one, c;
shr.u32 w1, $2, 8;
lop3.b32 t, w1, 0x007F007F, 0x43004300, 0xea;
lop3.b32 c, w1, 0x00800080, 0xC300C300, 0xea;
fma.rn.bf16x2 $1, t, one, c;
}"""

FP8_ASM = """{
.reg .b32 t, s, k;
mov.b32 k, 0x7B807B80;
mov.b32 s, 0x80008000;
prmt.b32 t, $2, 0, 0xA280;
shl.b32 t, t, 4;
and.b32 t, t, 0x87F087F0;
fma.rn.bf16x2 $0, t, k, s;
prmt.b32 t, $2, 0, 0xB391;
shl.b32 t, t, 4;
and.b32 t, t, 0x87F087F0;
fma.rn.bf16x2 $1, t, k, s;
}"""


@triton.jit
def codes(h, ASM: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr):
    """uint16 elements ``h`` (two codes each) -> the bf16 values of byte 0 and byte 1 of every element, by the PTX
    ``ASM`` on the GPU and by plain ops under the interpreter (q8: int8 codes, FP8: E4M3FN)."""
    if INTERP:
        if FP8:
            c0 = (h & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16)
            c1 = (h >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16)
        else:
            v = h.to(tl.int32)
            c0 = (((v & 255) ^ 128) - 128).to(tl.float32).to(tl.bfloat16)
            c1 = ((((v >> 8) & 255) ^ 128) - 128).to(tl.float32).to(tl.bfloat16)
        return c0, c1
    else:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r", [h], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                         pack=2)


@triton.jit
def _a_order(c0, c1, BN: tl.constexpr, BB: tl.constexpr, PERM: tl.constexpr):
    """A ``[BN, BB]`` from the even-lane and odd-lane codes ``[BN, BB // 2]`` (PERM 0: natural lane order; PERM 1:
    within each 32-lane chunk, column ``i * 16 + e`` is lane ``2e + i``)."""
    if PERM == 0:
        a = tl.reshape(tl.join(c0, c1), (BN, BB))
    else:
        cw = tl.join(tl.reshape(c0, (BN, BB // 32, 16)), tl.reshape(c1, (BN, BB // 32, 16)))   # [BN, CH, 16, 2]
        a = tl.reshape(tl.permute(cw, (0, 1, 3, 2)), (BN, BB))
    return a


@triton.jit
def _x_order(xv, MP: tl.constexpr, BB: tl.constexpr, PERM: tl.constexpr):
    """x's K step ``[MP, BB]`` (natural lanes) in the order of :func:`_a_order`."""
    if PERM == 0:
        xo = xv
    else:
        xo = tl.reshape(tl.permute(tl.reshape(xv, (MP, BB // 32, 16, 2)), (0, 1, 3, 2)), (MP, BB))
    return xo


@triton.jit
def x_step(x_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, inv, xoff, roff, lane, lmask, nstore, sh, sro, M, K,
           MP: tl.constexpr, NORM: tl.constexpr, INTERP: tl.constexpr):
    """x's K step ``[MP, BB]`` at ``lane``; with NORM the normed rows of ``x + r`` (stored by row block 0's
    programs, with the new residual, over their K run)."""
    xv = tl.load(x_ptr + xoff, mask=lmask, other=0.0)
    if NORM:
        rv = tl.load(r_ptr + roff, mask=lmask, other=0.0)
        res = cast(xv.to(tl.float32) + rv.to(tl.float32), ro_ptr.dtype.element_ty, INTERP)
        nw = tl.load(nw_ptr + lane, mask=lane < K, other=0.0).to(tl.float32)
        xv = cast((res.to(tl.float32) * inv) * (1.0 + nw), h_ptr.dtype.element_ty, INTERP)
        rows_lane = tl.minimum(tl.arange(0, MP)[:, None], M - 1)
        tl.store(ro_ptr + rows_lane * sro + lane, res, mask=nstore & (lane < K))
        tl.store(h_ptr + rows_lane * sh + lane, xv, mask=nstore & (lane < K))
    return xv


@triton.jit
def _dot(a, xb, INTERP: tl.constexpr):
    if INTERP:
        d = tl.dot(a.to(tl.float32), xb.to(tl.float32), input_precision="ieee")
    else:
        d = tl.dot(a, xb)
    return d


@triton.jit(do_not_specialize=["M", "TPS"])
def _tc8_kernel(x_ptr, b_ptr, s_ptr, y_ptr, p_ptr, cnt_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, eps, M, N, OUT, K, BYTES,
                TPS, S, sx, sb, ss, sy, sp, sr, sh, sro,
                BN: tl.constexpr, BB: tl.constexpr, MP: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr,
                REDUCE: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr, ASM: tl.constexpr, PERM: tl.constexpr,
                L2PF: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    """Program (row block, K run) reading ``BB`` bytes (= lanes) of each of ``BN`` rows a K step.

    q8 (``GPI = BB // 32`` groups a step): ``acc[BN, GPI * MP] += codes[BN, BB] @ blockdiag(x^T)``, each group's
    column times its fp16 scale, the groups added after the loop. fp8: ``acc[BN, MP] += codes[BN, BB] @ x^T``
    (MP >= 8, rows past M zero), times the row's bf16 scale after the loop."""
    GPI: tl.constexpr = BB // 32
    HB: tl.constexpr = BB // 2           # uint16 elements of a row a K step
    NC: tl.constexpr = MP if FP8 else GPI * MP
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    n = pid * BN + tl.arange(0, BN)
    nm = n < N
    r = tl.where(nm, n, 0)               # in-bounds rows: only the store is masked
    hh = tl.arange(0, HB)[None, :]
    m2 = tl.arange(0, MP)[:, None]
    k2 = tl.arange(0, BB)[None, :]
    xoff = tl.minimum(m2, M - 1) * sx + k2
    roff = tl.minimum(m2, M - 1) * sr + k2
    xmask = (m2 < M) & (k2 >= 0)
    nstore = xmask & ((m2 * 0 + pid) == 0)
    cc = tl.arange(0, NC)[None, :]
    diag = (tl.arange(0, BB)[:, None] // 32) == (cc // MP)
    gcol = cc // MP
    acc = tl.zeros((BN, NC), dtype=tl.float32)
    t0 = sid * TPS
    t1 = tl.minimum(t0 + TPS, BYTES // BB)
    # The run's bytes of every row asked of L2 while the previous kernel finishes (weights are never written).
    l2_prefetch(b_ptr + r * (sb // 2) + t0 * HB, tl.zeros((BN,), dtype=tl.int32) + (t1 - t0) * BB, L2PF, INTERP)
    pdl_wait(PDL)
    inv = tl.zeros((MP, 1), dtype=tl.float32)
    if NORM:
        inv = inv_rms(x_ptr, r_ptr, ro_ptr.dtype.element_ty, M, K, eps, sx, sr, MP, 512, INTERP)[:, None]
    for t in range(t0, t1):
        h = tl.load(b_ptr + r[:, None] * (sb // 2) + t * HB + hh)                  # [BN, HB] uint16
        c0, c1 = codes(h, ASM, FP8, INTERP)
        a = _a_order(c0, c1, BN, BB, PERM)
        lane = t * BB + k2
        xv = x_step(x_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, inv, xoff + t * BB, roff + t * BB, lane,
                    xmask & (lane < K), nstore, sh, sro, M, K, MP, NORM, INTERP)
        xt = tl.trans(_x_order(xv, MP, BB, PERM))                                   # [BB, MP]
        if FP8:
            acc += _dot(a, xt, INTERP)
        else:
            xw = tl.reshape(tl.broadcast_to(xt[:, None, :], (BB, GPI, MP)), (BB, NC))
            d = _dot(a, tl.where(diag, xw, 0.0), INTERP)
            acc += d * tl.load(s_ptr + r[:, None] * ss + t * GPI + gcol).to(tl.float32)
    if FP8:
        out = acc * tl.load(s_ptr + r * ss).to(tl.float32)[:, None]
    else:
        out = tl.sum(tl.reshape(acc, (BN, GPI, MP)), 1)                             # [BN, MP]
    store_out(out, y_ptr, p_ptr, cnt_ptr, x_ptr, n, nm, pid, sid, S, sp, sy, M, N, OUT, BN, MP, SPLIT, REDUCE, SWIGLU,
              INTERP)


def launch_shape(rows: int, w: KernelWeight) -> tuple[int, int, int] | None:
    """(MP, BN, GPI for q8 or BK for fp8) for ``rows`` rows of x with ``w``, or None when these kernels cannot take
    the call (another format, too many rows, a row not whole K steps, a base plane at an odd byte)."""
    if w.format not in (Q8, FP8) or not 1 <= rows <= MAX_ROWS:
        return None
    if w.base.storage_offset() % 2 or w.base_stride % 2:   # the base plane is read as uint16
        return None
    if w.format == FP8:
        return (8, FP8_BN, FP8_BK) if w.lanes % FP8_BK == 0 else None
    mp = next_pow2(rows)
    bn, gpi = Q8_SHAPES[mp]
    return (mp, bn, gpi) if w.lanes % (32 * gpi) == 0 else None


def gemv_tc(x2: torch.Tensor, w: KernelWeight, *, norm: tuple | None = None, swiglu: bool = False,
            out_dtype: torch.dtype | None = None, split: int | None = None, asm: str | None = None, perm: int = 1,
            shape: tuple[int, int, int] | None = None, in_kernel_sum: bool | None = None,
            l2_prefetch: bool | None = None) -> torch.Tensor:
    """:func:`quant_gemv_tc.gemv_tc`'s contract for a q8 or fp8 weight. ``asm``, ``perm`` and ``shape`` (MP, BN,
    GPI or BK) replace the decode, the lane order and the launch shape (for the candidates' comparison);
    ``in_kernel_sum`` None is :data:`IN_KERNEL_SUM`; ``l2_prefetch`` None is
    :data:`quant_gemv_tc.L2_PREFETCH`."""
    m, _ = x2.shape
    chosen = launch_shape(m, w)
    if chosen is None or x2.dtype != torch.bfloat16:
        raise ValueError(f"8-bit tensor-core gemv: cannot take {m} rows of {x2.dtype} with a {w.format} weight of "
                         f"{w.lanes} lanes a row")
    mp, bn, q = shape or chosen
    fp8 = w.format == FP8
    step = q if fp8 else 32 * q
    return quant_gemv_tc.launch(_tc8_kernel, x2, w, nbytes=w.lanes, step=step, bn=bn, norm=norm, swiglu=swiglu,
                                out_dtype=out_dtype, split=split,
                                in_kernel_sum=IN_KERNEL_SUM if in_kernel_sum is None else in_kernel_sum,
                                l2_prefetch=l2_prefetch,
                                BB=step, MP=mp, FP8=fp8, PERM=perm,
                                ASM=asm or (FP8_ASM if fp8 else Q8_ASM))
