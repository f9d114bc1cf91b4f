"""Tensor-core decode GEMVs for the 8-bit formats (q8_g32_fp16, fp8_e4m3fn_row_bf16): an experiment modelled on
ninfer.ops.triton.quant_gemv_tc (q4). Not part of the engine.

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
import triton
import triton.language as tl
from ninfer.ops.triton._common import INTERPRET, cast, next_pow2, pdl, pdl_wait

# ---------------------------------------------------------------- q8 decode
_Q8 = {
    0: """{
.reg .b32 t, c, w1, one;
mov.b32 one, 0x3F803F80;
lop3.b32 t, $2, 0x007F007F, 0x43004300, 0xea;
lop3.b32 c, $2, 0x00800080, 0xC300C300, 0xea;
fma.rn.bf16x2 $0, t, one, c;
shr.u32 w1, $2, 8;
lop3.b32 t, w1, 0x007F007F, 0x43004300, 0xea;
lop3.b32 c, w1, 0x00800080, 0xC300C300, 0xea;
fma.rn.bf16x2 $1, t, one, c;
}""",
    1: """{
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
}""",
}

# ---------------------------------------------------------------- fp8 decode
_FP8 = {
    0: """{
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
}""",
    1: """{
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
}""",
    2: """{
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
}""",
}

Q8_ASM = {k: v for k, v in _Q8.items()}      # plain strings (emulator)
FP8_ASM = {k: v for k, v in _FP8.items()}
Q8_A0 = tl.constexpr(_Q8[0])
Q8_A1 = tl.constexpr(_Q8[1])
FP8_A0 = tl.constexpr(_FP8[0])
FP8_A1 = tl.constexpr(_FP8[1])
FP8_A2 = tl.constexpr(_FP8[2])


@triton.jit
def _q8_codes(h, DEC: tl.constexpr, INTERP: tl.constexpr):
    """uint16 elements ``h`` (two int8 codes each) -> bf16 codes of byte 0 and byte 1 of every element."""
    if INTERP:
        v = h.to(tl.int32)
        c0 = (((v & 255) ^ 128) - 128).to(tl.float32).to(tl.bfloat16)
        c1 = ((((v >> 8) & 255) ^ 128) - 128).to(tl.float32).to(tl.bfloat16)
        return c0, c1
    else:
        if DEC == 0:
            return tl.inline_asm_elementwise(Q8_A0, "=r,=r,r", [h], dtype=(tl.bfloat16, tl.bfloat16),
                                             is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(Q8_A1, "=r,=r,r", [h], dtype=(tl.bfloat16, tl.bfloat16),
                                             is_pure=True, pack=2)


@triton.jit
def _fp8_codes(h, DEC: tl.constexpr, INTERP: tl.constexpr):
    """uint16 elements ``h`` (two E4M3FN codes each) -> bf16 values of byte 0 and byte 1 of every element."""
    if INTERP:
        b0 = (h & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16)
        b1 = (h >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16)
        return b0, b1
    else:
        if DEC == 0:
            return tl.inline_asm_elementwise(FP8_A0, "=r,=r,r", [h], dtype=(tl.bfloat16, tl.bfloat16),
                                             is_pure=True, pack=2)
        elif DEC == 1:
            return tl.inline_asm_elementwise(FP8_A1, "=r,=r,r", [h], dtype=(tl.bfloat16, tl.bfloat16),
                                             is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(FP8_A2, "=r,=r,r", [h], dtype=(tl.bfloat16, tl.bfloat16),
                                             is_pure=True, pack=2)


@triton.jit
def _a_order(c0, c1, BN: tl.constexpr, BB: tl.constexpr, PERM: tl.constexpr):
    """A [BN, BB] from the even-lane and odd-lane codes [BN, BB // 2]. PERM 0: natural lane order; PERM 1: within
    each 32-lane chunk k = i * 16 + e for lane 2e + i (a decode register's pair (2e, 2e + 2) is then k-adjacent,
    as the dot operand wants it)."""
    if PERM == 0:
        a = tl.reshape(tl.join(c0, c1), (BN, BB))
    else:
        cw = tl.join(tl.reshape(c0, (BN, BB // 32, 16)), tl.reshape(c1, (BN, BB // 32, 16)))   # [BN, CH, 16, 2]
        a = tl.reshape(tl.permute(cw, (0, 1, 3, 2)), (BN, BB))
    return a


@triton.jit
def _x_order(xv, MP: tl.constexpr, BB: tl.constexpr, PERM: tl.constexpr):
    """x's K step [MP, BB] (natural lanes) in the order of :func:`_a_order`."""
    if PERM == 0:
        xo = xv
    else:
        xo = tl.reshape(tl.permute(tl.reshape(xv, (MP, BB // 32, 16, 2)), (0, 1, 3, 2)), (MP, BB))
    return xo


@triton.jit
def _inv_rms(x_ptr, r_ptr, res_ty, M, K, eps, sx, sr, MP: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    m = tl.arange(0, MP)[:, None]
    row = tl.minimum(m, M - 1)
    ss2 = tl.zeros((MP,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)[None, :]
        km = (k < K) & (m < M)
        xv = tl.load(x_ptr + row * sx + k, mask=km, other=0.0).to(tl.float32)
        rv = tl.load(r_ptr + row * sr + k, mask=km, other=0.0).to(tl.float32)
        res = cast(xv + rv, res_ty, INTERP).to(tl.float32)
        ss2 += tl.sum(res * res, 1)
    return tl.rsqrt(ss2 / K + eps)


@triton.jit(do_not_specialize=["M", "TPS"])
def _q8_tc_kernel(x_ptr, b_ptr, s_ptr, y_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, eps, M, N, K, BYTES, TPS, sx, sb, ss,
                  sy, sp, sr, sh, sro,
                  BN: tl.constexpr, GPI: tl.constexpr, MP: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr,
                  DEC: tl.constexpr, PERM: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    """q8_g32_fp16: program (row block, split) of ``acc[BN, GPI * MP] += codes[BN, 32 GPI] @ blockdiag(x^T)``,
    each group's column scaled by its fp16 scale, groups added after the loop."""
    BB: tl.constexpr = 32 * GPI          # bytes (= lanes) of a row per K step
    HB: tl.constexpr = 16 * GPI          # uint16 elements of a row per K step
    NC: tl.constexpr = GPI * MP
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    n = pid * BN + tl.arange(0, BN)
    nm = n < N
    r = tl.where(nm, n, 0)
    hh = tl.arange(0, HB)[None, :]
    m2 = tl.arange(0, MP)[:, None]
    k2 = tl.arange(0, BB)[None, :]
    xoff = tl.minimum(m2, M - 1) * sx + k2
    xmask = (m2 < M) & (k2 >= 0)
    BB // 32
    kk = tl.arange(0, BB)[:, None]
    cc = tl.arange(0, NC)[None, :]
    diag = (kk // 32) == (cc // MP)
    gcol = cc // MP
    acc = tl.zeros((BN, NC), dtype=tl.float32)
    t0 = sid * TPS
    t1 = tl.minimum(t0 + TPS, BYTES // BB)
    sbh = sb // 2
    pdl_wait(PDL)
    if NORM:
        inv = _inv_rms(x_ptr, r_ptr, ro_ptr.dtype.element_ty, M, K, eps, sx, sr, MP, 512, INTERP)[:, None]
        roff = tl.minimum(m2, M - 1) * sr + k2
        nstore = xmask & ((m2 * 0 + pid) == 0)
    for t in range(t0, t1):
        h = tl.load(b_ptr + r[:, None] * sbh + t * HB + hh)                      # [BN, HB] uint16
        c0, c1 = _q8_codes(h, DEC, INTERP)
        a = _a_order(c0, c1, BN, BB, PERM)
        lane = t * BB + k2
        lmask = xmask & (lane < K)
        xv = tl.load(x_ptr + xoff + t * BB, mask=lmask, other=0.0)                # [MP, BB]
        if NORM:
            rv = tl.load(r_ptr + roff + t * BB, mask=lmask, other=0.0)
            res = cast(xv.to(tl.float32) + rv.to(tl.float32), ro_ptr.dtype.element_ty, INTERP)
            nw = tl.load(nw_ptr + lane, mask=lane < K, other=0.0).to(tl.float32)
            xv = cast((res.to(tl.float32) * inv) * (1.0 + nw), h_ptr.dtype.element_ty, INTERP)
            rows_lane = tl.minimum(m2, M - 1)
            tl.store(ro_ptr + rows_lane * sro + lane, res, mask=nstore & (lane < K))
            tl.store(h_ptr + rows_lane * sh + lane, xv, mask=nstore & (lane < K))
        xt = tl.trans(_x_order(xv, MP, BB, PERM))                                 # [BB, MP]
        xw = tl.reshape(tl.broadcast_to(xt[:, None, :], (BB, GPI, MP)), (BB, NC))
        xb = tl.where(diag, xw, 0.0)
        if INTERP:
            d = tl.dot(a.to(tl.float32), xb.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(a, xb)
        sc = tl.load(s_ptr + r[:, None] * ss + t * GPI + gcol).to(tl.float32)
        acc += d * sc
    out = tl.sum(tl.reshape(acc, (BN, GPI, MP)), 1)                               # [BN, MP]
    mm = tl.arange(0, MP)[None, :]
    keep = nm[:, None] & (mm < M)
    if SPLIT:
        tl.store(y_ptr + sid * sp + mm * N + n[:, None], out, mask=keep)
    else:
        y = cast(out, x_ptr.dtype.element_ty, INTERP).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + mm * sy + n[:, None], y, mask=keep)


@triton.jit(do_not_specialize=["M", "TPS"])
def _fp8_tc_kernel(x_ptr, b_ptr, s_ptr, y_ptr, r_ptr, nw_ptr, h_ptr, ro_ptr, eps, M, N, K, BYTES, TPS, sx, sb, ss,
                   sy, sp, sr, sh, sro,
                   BN: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr, SPLIT: tl.constexpr,
                   NORM: tl.constexpr, DEC: tl.constexpr, PERM: tl.constexpr, INTERP: tl.constexpr,
                   PDL: tl.constexpr):
    """fp8_e4m3fn_row_bf16: program (row block, split) of ``acc[BN, NP] += codes[BN, BK] @ x^T[BK, NP]`` (x's MP
    rows in the first columns, zeros after), times the row's bf16 scale at the end."""
    HB: tl.constexpr = BK // 2
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    n = pid * BN + tl.arange(0, BN)
    nm = n < N
    r = tl.where(nm, n, 0)
    hh = tl.arange(0, HB)[None, :]
    m2 = tl.arange(0, MP)[:, None]
    k2 = tl.arange(0, BK)[None, :]
    xoff = tl.minimum(m2, M - 1) * sx + k2
    xmask = (m2 < M) & (k2 >= 0)
    cc2 = tl.arange(0, NP)[None, :]
    acc = tl.zeros((BN, NP), dtype=tl.float32)
    t0 = sid * TPS
    t1 = tl.minimum(t0 + TPS, BYTES // BK)
    sbh = sb // 2
    pdl_wait(PDL)
    if NORM:
        inv = _inv_rms(x_ptr, r_ptr, ro_ptr.dtype.element_ty, M, K, eps, sx, sr, MP, 512, INTERP)[:, None]
        roff = tl.minimum(m2, M - 1) * sr + k2
        nstore = xmask & ((m2 * 0 + pid) == 0)
    for t in range(t0, t1):
        h = tl.load(b_ptr + r[:, None] * sbh + t * HB + hh)                      # [BN, HB] uint16
        c0, c1 = _fp8_codes(h, DEC, INTERP)
        a = _a_order(c0, c1, BN, BK, PERM)
        lane = t * BK + k2
        lmask = xmask & (lane < K)
        xv = tl.load(x_ptr + xoff + t * BK, mask=lmask, other=0.0)                # [MP, BK]
        if NORM:
            rv = tl.load(r_ptr + roff + t * BK, mask=lmask, other=0.0)
            res = cast(xv.to(tl.float32) + rv.to(tl.float32), ro_ptr.dtype.element_ty, INTERP)
            nw = tl.load(nw_ptr + lane, mask=lane < K, other=0.0).to(tl.float32)
            xv = cast((res.to(tl.float32) * inv) * (1.0 + nw), h_ptr.dtype.element_ty, INTERP)
            rows_lane = tl.minimum(m2, M - 1)
            tl.store(ro_ptr + rows_lane * sro + lane, res, mask=nstore & (lane < K))
            tl.store(h_ptr + rows_lane * sh + lane, xv, mask=nstore & (lane < K))
        xt = tl.trans(_x_order(xv, MP, BK, PERM))                                 # [BK, MP]
        if MP == NP:
            xb = xt
        else:   # x's rows in the first MP columns of [BK, NP], zeros after
            xw = tl.reshape(tl.broadcast_to(xt[:, None, :], (BK, NP // MP, MP)), (BK, NP))
            xb = tl.where(cc2 < MP, xw, 0.0)
        if INTERP:
            d = tl.dot(a.to(tl.float32), xb.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(a, xb)
        acc += d
    scale = tl.load(s_ptr + r * ss).to(tl.float32)
    acc = acc * scale[:, None]
    mm = tl.arange(0, NP)[None, :]
    keep = nm[:, None] & (mm < M)
    if SPLIT:
        tl.store(y_ptr + sid * sp + mm * N + n[:, None], acc, mask=keep)
    else:
        y = cast(acc, x_ptr.dtype.element_ty, INTERP).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + mm * sy + n[:, None], y, mask=keep)


@triton.jit
def _sum_kernel(p_ptr, y_ptr, x_ptr, S, N, OUT, sp, SWIGLU: tl.constexpr, BLOCK: tl.constexpr,
                INTERP: tl.constexpr):
    m = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    msk = j < OUT
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(p_ptr + s * sp + m * N + j, mask=msk, other=0.0)
        if SWIGLU:
            acc_u += tl.load(p_ptr + s * sp + m * N + OUT + j, mask=msk, other=0.0)
    if SWIGLU:
        g = cast(acc, x_ptr.dtype.element_ty, INTERP).to(tl.float32)
        u = cast(acc_u, x_ptr.dtype.element_ty, INTERP).to(tl.float32)
        acc = g / (1.0 + tl.exp(-g)) * u
    y = cast(acc, x_ptr.dtype.element_ty, INTERP).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + m * OUT + j, y, mask=msk)


# (BN, GPI) by MP for q8 (GPI groups of 32 lanes a K step; GPI * MP >= 8); (BN, BK) by MP for fp8 (NP = 8).
Q8_SHAPES = {1: (128, 8), 2: (256, 4), 4: (256, 2), 8: (256, 1)}
FP8_SHAPES = {1: (128, 256), 2: (128, 256), 4: (128, 256), 8: (128, 256)}
_TARGET_PROGRAMS = 264


def gemv_tc8(x2: torch.Tensor, w, *, norm=None, split: int | None = None, out_dtype=None, dec: int = 0,
             perm: int = 1, shapes: dict | None = None, fp8_mp: int | None = None) -> torch.Tensor:
    """``x2[M, K] @ decode(w).T`` for a q8_g32_fp16 or fp8_e4m3fn_row_bf16 KernelWeight ``w`` and bf16 ``x2``."""
    m, k = x2.shape
    assert 1 <= m <= 8 and x2.dtype == torch.bfloat16
    fp8 = w.format == "fp8_e4m3fn_row_bf16"
    # fp8: x always as 8 rows (rows past M masked to zero: the narrowest tensor-core N, no padding code in the loop)
    mp = (fp8_mp or 8) if fp8 else next_pow2(m)
    assert fp8 or w.format == "q8_g32_fp16"
    bn, q = (shapes or (FP8_SHAPES if fp8 else Q8_SHAPES))[mp]
    step = q if fp8 else 32 * q                        # bytes of a row a K step
    nbytes = w.lanes
    if nbytes % step or w.base.storage_offset() % 2 or w.base_stride % 2:
        raise ValueError("gemv_tc8: shape not taken")
    y = torch.empty((m, w.n), dtype=out_dtype or x2.dtype, device=x2.device)
    steps = nbytes // step
    programs = triton.cdiv(w.n, bn)
    s = split or max(1, min(steps, -(-_TARGET_PROGRAMS // programs)))
    tps = -(-steps // s)
    s = -(-steps // tps)
    partials = s > 1
    part = torch.empty((s, m, w.n), dtype=torch.float32, device=x2.device) if partials else y
    if norm is None:
        r2 = nw = hn = ro = x2
        eps = 0.0
    else:
        r2, nw, eps, hn, ro = norm
    kw = {} if INTERPRET else {"num_warps": 4}
    args = (x2, w.base.view(torch.uint16), w.scales, part, r2, nw, hn, ro, float(eps), m, w.n, k, nbytes, tps,
            x2.stride(0), w.base_stride, w.scale_stride, y.stride(0), part.stride(0) if partials else 0,
            r2.stride(0), hn.stride(0), ro.stride(0))
    if fp8:
        _fp8_tc_kernel[(programs, s)](*args, BN=bn, BK=q, MP=mp, NP=max(8, mp), SPLIT=partials,
                                      NORM=norm is not None, DEC=dec, PERM=perm, INTERP=INTERPRET, **pdl(x2), **kw)
    else:
        _q8_tc_kernel[(programs, s)](*args, BN=bn, GPI=q, MP=mp, SPLIT=partials, NORM=norm is not None, DEC=dec,
                                     PERM=perm, INTERP=INTERPRET, **pdl(x2), **kw)
    if partials:
        block = 1024
        _sum_kernel[(m, triton.cdiv(w.n, block))](part, y, x2, s, w.n, w.n, part.stride(0), SWIGLU=False,
                                                  BLOCK=block, INTERP=INTERPRET)
    return y
