"""Decode variants of the 8-bit tensor-core GEMVs (ninfer.ops.triton.quant_gemv_tc8, q8_g32_fp16 and
fp8_e4m3fn_row_bf16) for their comparison (tools/sass_report.py, tools/gpu_quant_gemv_sweep.py): each variant is the
engine's kernel with another decode (its ``ASM``), lane order (``PERM``) or launch shape. The engine runs
q8 DEC 0 and fp8 DEC 1, both with PERM 1.

Decode (inline PTX, inputs read as uint16 elements, pack=2: one 32-bit register w = bytes b0 b1 b2 b3 of lanes
2e, 2e+1, 2e+2, 2e+3; outputs two bf16x2 registers: (lane 2e, lane 2e+2) = even lanes and (2e+1, 2e+3) = odd
lanes, so A = join(even, odd) reshaped is in natural lane order).

q8 (two's complement int8 codes):
  DEC 0 "sign split": code = m - 128 * s (m = b & 0x7F, s = bit 7). M = bf16(128 + m) = 0x4300 | m (exact magic,
        7 mantissa bits); C = bf16(-128 - 128 s) = 0xC300 | (b & 0x80) (bit 7 of the byte is the bf16 exponent
        lsb: 0xC300 = -128, 0xC380 = -256); code = M + C, one bf16x2 fma (result an integer of <= 8 significant
        bits: exact). Per word: 4 lop3 + 1 shr + 2 fma = 7.
  DEC 1 "f32 magic": w ^= 0x80808080; prmt each byte into 0x4B0000bb (= 2^23 + u); sub (2^23 + 128) in f32;
        cvt.rn.bf16x2.f32 packs two. Per word: 1 + 4 + 4 + 2 = 11.
fp8 (E4M3FN bits s eeee mmm):
  bf16 bits s<<15 | (eeee mmm)<<4 hold the value times 2^-120 (the 4-bit exponent lands in the low bits of the
  8-bit exponent field, E4M3 subnormals become bf16 subnormals with the same mantissa): one bf16x2 multiply by
  2^120 (fma with -0 addend) gives the exact value (bf16 fma keeps subnormal inputs: no .ftz form exists).
  DEC 0 "shift": odd lanes: (w >> 4) & 0x07F007F0 | (w & 0x80008000); even lanes: the same on w << 8.
        Per word: 3 shifts + 4 lop3 + 2 fma = 9.
  DEC 1 "prmt": prmt sign-extends bytes (b0, b2) / (b1, b3) to int16 pairs; << 4; & 0x87F087F0 (sign at 15, the
        rest at 4..10); fma by 2^120. Per word: 2 prmt + 2 shl + 2 lop3 + 2 fma = 8.
  DEC 2 "cvt": cvt.rn.f16x2.e4m3x2 (sm_89+) on each b16 half, cvt.f32.f16 of the four, cvt.rn.bf16x2.f32 of
        the even and the odd pair. Per word: 2 + 4 + 2 = 8.
"""

from __future__ import annotations

import torch
from ninfer.ops.triton import quant_gemv_tc8

_Q8_F32_MAGIC = """{
.reg .b32 u, k, f0, f1, f2, f3;
.reg .f32 g0, g1, g2, g3, off;
mov.b32 k, 0x4B4B0000;
mov.f32 off, 0f4B000080;
xor.b32 u, $2, 0x80808080;
prmt.b32 f0, u, k, 0x7440;
prmt.b32 f1, u, k, 0x7441;
prmt.b32 f2, u, k, 0x7442;
prmt.b32 f3, u, k, 0x7443;
mov.b32 g0, f0;
mov.b32 g1, f1;
mov.b32 g2, f2;
mov.b32 g3, f3;
sub.f32 g0, g0, off;
sub.f32 g1, g1, off;
sub.f32 g2, g2, off;
sub.f32 g3, g3, off;
cvt.rn.bf16x2.f32 $0, g2, g0;
cvt.rn.bf16x2.f32 $1, g3, g1;
}"""

_FP8_SHIFT = """{
.reg .b32 t, u, s, k;
mov.b32 k, 0x7B807B80;
mov.b32 s, 0x80008000;
shr.u32 t, $2, 4;
and.b32 t, t, 0x07F007F0;
lop3.b32 t, $2, 0x80008000, t, 0xea;
fma.rn.bf16x2 $1, t, k, s;
shl.b32 u, $2, 8;
shl.b32 t, $2, 4;
and.b32 t, t, 0x07F007F0;
lop3.b32 t, u, 0x80008000, t, 0xea;
fma.rn.bf16x2 $0, t, k, s;
}"""

_FP8_CVT = """{
.reg .b16 lo, hi;
.reg .b32 h0, h1;
.reg .f16 e0, e1, e2, e3;
.reg .f32 f0, f1, f2, f3;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 h0, lo;
cvt.rn.f16x2.e4m3x2 h1, hi;
mov.b32 {e0, e1}, h0;
mov.b32 {e2, e3}, h1;
cvt.f32.f16 f0, e0;
cvt.f32.f16 f1, e1;
cvt.f32.f16 f2, e2;
cvt.f32.f16 f3, e3;
cvt.rn.bf16x2.f32 $0, f2, f0;
cvt.rn.bf16x2.f32 $1, f3, f1;
}"""


#: The decodes by (format, DEC): PTX of the engine kernel's operands (quant_gemv_tc8.Q8_ASM's).
ASM = {("q8_g32_fp16", 0): quant_gemv_tc8.Q8_ASM, ("q8_g32_fp16", 1): _Q8_F32_MAGIC,
       ("fp8_e4m3fn_row_bf16", 0): _FP8_SHIFT, ("fp8_e4m3fn_row_bf16", 1): quant_gemv_tc8.FP8_ASM,
       ("fp8_e4m3fn_row_bf16", 2): _FP8_CVT}


def gemv_tc8(x2: torch.Tensor, w, *, dec: int = 0, perm: int = 1, shape: tuple[int, int, int] | None = None,
             norm=None, split: int | None = None, out_dtype=None) -> torch.Tensor:
    """The engine's 8-bit tensor-core GEMV with decode ``dec`` of the weight's format, lane order ``perm`` and
    launch ``shape`` (MP, BN, GPI for q8 or BK for fp8; default the engine's)."""
    return quant_gemv_tc8.gemv_tc(x2, w, asm=ASM[(w.format, dec)], perm=perm, shape=shape, norm=norm,
                                  split=split, out_dtype=out_dtype)
