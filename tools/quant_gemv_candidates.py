"""Candidate quantized decode GEMVs measured by tools/gpu_quant_gemv_sweep.py against the engine's
(``ninfer.ops.triton.quant_gemv``): experiments for issue 32's decode speed, not used by the engine.

- :func:`gemv` (``_qgemv3``): CUDA cores, like the engine's GEMV, but every tensor of a tile is 3-D
  ``[BN rows, G groups, 32 bytes]`` and x is loaded in that same layout (bf16 pairs as one 32-bit word for the
  nibble formats), so nothing crosses threads through shared memory inside the K loop; per-group sums are kept
  ``[BM, BN, G]`` and reduced once after the loop. (The engine's kernel splits x into even/odd lanes and regroups
  the products per scale group with reshapes, which the compiler lowers to shared-memory layout conversions with
  barriers in every K step, once per row of x.)
- :func:`gemv_tc` (``_qgemv_tc``): tensor cores with the decoded codes as the A operand (``[64 weight rows, one
  scale group]``, from registers) and x^T as B (M padded to 16), one group per dot scaled in fp32.

- :func:`gemv_tc35` (``_qgemv_tc3`` / ``_qgemv_tc5``, q4 only): tensor cores with the codes decoded to exact bf16 by
  inline PTX (lop3 + bf16x2 fma, two codes per instruction pair), several scale groups per dot through a
  block-diagonal x^T, split-K. Read offline (sm_90 SASS, Triton 3.6): ~3.9-4.4 loop instructions per weight byte at
  one row against the engine kernel's ~16, no layout-conversion barriers in the loop; not yet timed.

All keep the engine's exactness rule: codes (exact in bf16) times x, products and sums in fp32, the group scale
applied in fp32. Neither has the fused norm/SwiGLU variants nor split-K.
"""

from __future__ import annotations

import triton
import triton.language as tl
from ninfer.ops.triton._common import cast, mm, pdl_wait
from ninfer.ops.triton._quant import fp8_code, int_code
from ninfer.ops.triton.quant_gemv_tc import _k_step, lanes


@triton.jit
def _qgemv3(x_ptr, b_ptr, h_ptr, s_ptr, y_ptr, M, N, K, BYTES, sx, sb, sh, ss, sy,
            KIND: tl.constexpr, BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
            XW: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    nm = n < N
    r2 = tl.where(nm, n, 0)[:, None]
    r3 = r2[:, :, None]
    g3 = tl.arange(0, G)[None, :, None]
    t3 = tl.arange(0, 32)[None, None, :]
    z3 = r3 * 0
    gs = tl.arange(0, G)[None, :]
    acc = tl.zeros((BM, BN, G), dtype=tl.float32)
    m3 = tl.arange(0, BM)[:, None, None]
    pdl_wait(PDL)
    for j0 in range(0, BYTES, G * 32):
        jj = j0 + g3 * 32 + t3 + z3                              # [BN, G, 32] byte index within the row
        jm = jj < BYTES
        b = tl.load(b_ptr + r3 * sb + jj, mask=jm, other=0).to(tl.int32)
        if KIND == 0:
            lo = b & 15
            hi = b >> 4
            if BITS > 4:
                HB: tl.constexpr = BITS - 4
                PER: tl.constexpr = 4 // HB
                hx = tl.load(h_ptr + r3 * sh + jj // PER, mask=jm, other=0).to(tl.int32)
                se = (jj * (2 * HB)) & 7
                lo = lo | (((hx >> se) & ((1 << HB) - 1)) << 4)
                hi = hi | (((hx >> (se + HB)) & ((1 << HB) - 1)) << 4)
            c0 = int_code(lo, 1 << (BITS - 1))
            c1 = int_code(hi, 1 << (BITS - 1))
        elif KIND == 1:
            c0 = int_code(b, 128)
            c1 = c0
        else:
            c0 = fp8_code(b.to(tl.uint8))
            c1 = c0
        if KIND != 2:
            sg = j0 // 32 + gs
            sc = tl.load(s_ptr + r2 * ss + sg, mask=sg < BYTES // 32, other=0.0).to(tl.float32)
        for m in tl.static_range(BM):
            row = tl.minimum(M - 1, m)
            if KIND == 0:
                if XW:
                    w = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + row * (sx // 2) + jj, mask=jj < K // 2, other=0)
                    xe = (w << 16).to(tl.float32, bitcast=True)
                    xo = (w & -65536).to(tl.float32, bitcast=True)
                else:
                    xe = tl.load(x_ptr + row * sx + 2 * jj, mask=2 * jj < K, other=0.0).to(tl.float32)
                    xo = tl.load(x_ptr + row * sx + 2 * jj + 1, mask=2 * jj + 1 < K, other=0.0).to(tl.float32)
                p = c0 * xe + c1 * xo
            else:
                xv = tl.load(x_ptr + row * sx + jj, mask=jj < K, other=0.0).to(tl.float32)
                p = c0 * xv
            s2 = tl.sum(p, 2)
            if KIND != 2:
                s2 = s2 * sc
            if BM == 1:
                acc += s2[None]
            else:
                acc = tl.where(m3 == m, acc + s2[None], acc)
    out = tl.sum(acc, 2)                                          # [BM, BN]
    if KIND == 2:
        out = out * tl.load(s_ptr + tl.where(nm, n, 0) * ss).to(tl.float32)[None, :]
    rows = tl.arange(0, BM)
    keep = (rows[:, None] < M) & nm[None, :]
    y = cast(out, x_ptr.dtype.element_ty, INTERP).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * sy + n[None, :], y, mask=keep)


def gemv(x2, w, bn=4, g=32, warps=4):
    """``x2 @ decode(w).T`` with :func:`_qgemv3` (``bn`` weight rows, ``g`` 32-byte groups a K step)."""
    import torch
    from ninfer.ops.triton._common import INTERPRET, next_pow2, pdl
    m, k = x2.shape
    lpb = 2 if w.kind == 0 else 1
    row_bytes = w.lanes // lpb
    g = min(g, max(1, next_pow2(row_bytes) // 32))
    y = torch.empty((m, w.n), dtype=x2.dtype, device=x2.device)
    xw = x2.dtype == torch.bfloat16 and k % 2 == 0 and x2.stride(0) % 2 == 0
    kw = {} if INTERPRET else {"num_warps": warps}
    _qgemv3[(triton.cdiv(w.n, bn),)](x2, w.base, w.high, w.scales, y, m, w.n, k, row_bytes, x2.stride(0),
                                      w.base_stride, w.high_stride, w.scale_stride, y.stride(0),
                                      KIND=w.kind, BITS=w.bits, BM=next_pow2(m), BN=bn, G=g, XW=xw,
                                      INTERP=INTERPRET, **pdl(x2), **kw)
    return y


@triton.jit
def _qgemv_tc(x_ptr, b_ptr, s_ptr, y_ptr, M, N, K, BYTES, sx, sb, ss, sy,
              KIND: tl.constexpr, BITS: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, GK: tl.constexpr,
              INTERP: tl.constexpr, PDL: tl.constexpr):
    """y^T[BN, MP] = W[BN, K] @ x^T: decoded codes as the A operand (registers), x^T as B; one scale group (GK
    lanes) per dot, scaled in fp32 into the accumulator. q4/q8 (no high plane) and fp8."""
    LPB: tl.constexpr = 2 if KIND == 0 else 1
    GB: tl.constexpr = GK // LPB                  # bytes of a group
    pid = tl.program_id(0)
    n = pid * BN + tl.arange(0, BN)
    nm = n < N
    r = tl.where(nm, n, 0)[:, None]
    jb = tl.arange(0, GB)[None, :]
    mrow = tl.arange(0, MP)
    mr = tl.minimum(mrow, M - 1)[:, None]
    acc = tl.zeros((BN, MP), dtype=tl.float32)
    pdl_wait(PDL)
    for j0 in range(0, BYTES, GB):
        b = tl.load(b_ptr + r * sb + j0 + jb).to(tl.int32)      # [BN, GB]
        if KIND == 0:
            lo = int_code(b & 15, 8)
            hi = int_code(b >> 4, 8)
            w = tl.reshape(tl.join(lo, hi), (BN, GK)).to(x_ptr.dtype.element_ty)   # lanes 2j, 2j+1
        elif KIND == 1:
            w = int_code(b, 128).to(x_ptr.dtype.element_ty)
        else:
            w = fp8_code(b.to(tl.uint8)).to(x_ptr.dtype.element_ty)
        lanes = j0 * LPB + tl.arange(0, GK)[None, :]
        xt = tl.load(x_ptr + mr * sx + lanes, mask=lanes < K, other=0.0)               # [MP, GK]
        part = mm(w, tl.trans(xt), False, INTERP)                                                # [BN, MP] fp32
        if KIND == 2:
            acc += part
        else:
            sc = tl.load(s_ptr + r * ss + j0 // 32 + tl.arange(0, GB // 32)[None, :]).to(tl.float32)
            if GB == 32:
                acc += part * sc
            else:
                acc += part * tl.sum(sc, 1)[:, None]   # one group per step: GB // 32 == 1 only
    if KIND == 2:
        acc = acc * tl.load(s_ptr + tl.where(nm, n, 0) * ss).to(tl.float32)[:, None]
    keep = nm[:, None] & (mrow[None, :] < M)
    y = cast(acc, x_ptr.dtype.element_ty, INTERP).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + mrow[None, :] * sy + n[:, None], y, mask=keep)


def gemv_tc(x2, w, bn=64, warps=4):
    """``x2 @ decode(w).T`` with :func:`_qgemv_tc` (q4, q8, fp8; ``bn`` weight rows a program)."""
    import torch
    from ninfer.ops.triton._common import INTERPRET, pdl
    m, k = x2.shape
    if w.bits not in (4, 8):
        raise ValueError(f"gemv_tc reads q4, q8 and fp8 weights, not {w.format}")
    lpb = 2 if w.kind == 0 else 1
    row_bytes = w.lanes // lpb
    gk = 64 if w.kind == 0 else (32 if w.kind == 1 else 64)
    y = torch.empty((m, w.n), dtype=x2.dtype, device=x2.device)
    kw = {} if INTERPRET else {"num_warps": warps}
    _qgemv_tc[(triton.cdiv(w.n, bn),)](x2, w.base, w.scales, y, m, w.n, k, row_bytes, x2.stride(0), w.base_stride,
                                        w.scale_stride, y.stride(0), KIND=w.kind, BITS=w.bits,
                                        MP=16, BN=bn, GK=gk, INTERP=INTERPRET, **pdl(x2), **kw)
    return y


# ---- tensor-core candidates with the codes decoded to exact bf16 by inline PTX (q4 only) -------------------------
# The base plane is read as uint16 (four nibbles, lanes 4e..4e+3); the asm turns a 32-bit word into four bf16 pairs
# with one lop3 (the nibble, xor 8, into the bf16 128 + code's mantissa) and one bf16x2 fma (minus 136) each, exact.
# A = the codes [BN, 64*GPI] straight from registers (Triton carries the dot-operand layout back through the
# join/permute/reshape), B = a block-diagonal x^T [64*GPI, GPI*MP] (column g*MP + m is row m of x on group g's lanes,
# zeros elsewhere), so one dot gives every row's per-group sums; the fp16 group scale applies in fp32; groups summed
# after the loop; split-K partials [S, M, N] in fp32 summed by the wrapper. Within a 64-lane group the decode's lane
# order is k = c*16 + e for physical lane 4e + c: tc3 takes x pre-permuted that way, tc5 permutes it in registers.

# Decode for the tc3/tc5 candidates: uint16 input (pack=2: one 32-bit word = uint16 e0 (bytes 0,1) and e1 (bytes 2,3)), four bf16
# outputs c0..c3 of 2 elements each: c_i = (nibble i of e0, nibble i of e1) = (n_i, n_{4+i}) of the word.
_ASM_B = tl.constexpr("""{
.reg .b32 t, one, m;
mov.b32 one, 0x3F803F80;
mov.b32 m, 0xC308C308;
lop3.b32 t, $4, 0x000F000F, 0x43084308, 0x6a;
fma.rn.bf16x2 $0, t, one, m;
shr.u32 t, $4, 4;
lop3.b32 t, t, 0x000F000F, 0x43084308, 0x6a;
fma.rn.bf16x2 $1, t, one, m;
shr.u32 t, $4, 8;
lop3.b32 t, t, 0x000F000F, 0x43084308, 0x6a;
fma.rn.bf16x2 $2, t, one, m;
shr.u32 t, $4, 12;
lop3.b32 t, t, 0x000F000F, 0x43084308, 0x6a;
fma.rn.bf16x2 $3, t, one, m;
}""")


@triton.jit
def dec_b(h, INTERP: tl.constexpr):
    """h: uint16 tensor (each element = 2 bytes = 4 nibbles, lanes 4e..4e+3) -> (c0, c1, c2, c3) bf16 codes of
    nibble 0..3 of each element (the asm decodes two elements per instruction pair)."""
    if INTERP:
        v = h.to(tl.int32)
        c0 = ((((v & 15) ^ 8) - 8).to(tl.float32)).to(tl.bfloat16)
        c1 = (((((v >> 4) & 15) ^ 8) - 8).to(tl.float32)).to(tl.bfloat16)
        c2 = (((((v >> 8) & 15) ^ 8) - 8).to(tl.float32)).to(tl.bfloat16)
        c3 = (((((v >> 12) & 15) ^ 8) - 8).to(tl.float32)).to(tl.bfloat16)
        return c0, c1, c2, c3
    else:
        return tl.inline_asm_elementwise(_ASM_B, "=r,=r,=r,=r,r", [h],
                                         dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                         is_pure=True, pack=2)


@triton.jit
def _qgemv_tc3(x_ptr, b_ptr, s_ptr, p_ptr, M, N, BYTES, TPS, sx, sb, ss, sp,
               BN: tl.constexpr, GPI: tl.constexpr, MP: tl.constexpr, INTERP: tl.constexpr):
    """As _qgemv_tc2 but the base plane read as uint16 (b_ptr: *u16, BYTES in bytes) and decoded by dec_b; logical
    k within a group = c*16 + e <-> physical lane 4e + c: x_ptr holds xp[g*64 + c*16 + e] = x[g*64 + 4e + c]."""
    BB: tl.constexpr = 32 * GPI          # bytes a row per iteration
    HB: tl.constexpr = 16 * GPI          # uint16 a row per iteration
    NC: tl.constexpr = GPI * MP
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    n = pid * BN + tl.arange(0, BN)
    nm = n < N
    r = tl.where(nm, n, 0)
    r3 = r[:, None, None]
    g3 = tl.arange(0, GPI)[None, :, None]
    e3 = tl.arange(0, 16)[None, None, :]
    kk = tl.arange(0, 2 * BB)[:, None]
    cc = tl.arange(0, NC)[None, :]
    mrow = cc % MP
    bmask = ((kk // 64) == (cc // MP)) & (mrow < M)
    boff = tl.minimum(mrow, M - 1) * sx + kk
    gcol = tl.arange(0, NC)[None, :] // MP
    acc = tl.zeros((BN, NC), dtype=tl.float32)
    t0 = sid * TPS
    t1 = tl.minimum(t0 + TPS, BYTES // BB)
    sbh = sb // 2
    for t in range(t0, t1):
        h = tl.load(b_ptr + r3 * sbh + t * HB + g3 * 16 + e3)         # [BN, GPI, 16] uint16
        c0, c1, c2, c3 = dec_b(h, INTERP)
        cw = tl.join(tl.join(c0, c1), tl.join(c2, c3))              # [BN, GPI, 16, 2(i1), 2(i0)] = c_{2*i0 + i1}
        a = tl.reshape(tl.permute(cw, (0, 1, 4, 3, 2)), (BN, 2 * BB))  # k = g*64 + (2*i0 + i1)*16 + e
        xb = tl.load(x_ptr + boff + 2 * t * BB, mask=bmask, other=0.0)
        if INTERP:
            d = tl.dot(a.to(tl.float32), xb.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(a, xb)
        sc = tl.load(s_ptr + r[:, None] * ss + t * GPI + gcol).to(tl.float32)
        acc += d * sc
    out = tl.sum(tl.reshape(acc, (BN, GPI, MP)), 1)
    mm = tl.arange(0, MP)[None, :]
    tl.store(p_ptr + sid * sp + mm * N + n[:, None], out, mask=nm[:, None] & (mm < M))


@triton.jit
def _qgemv_tc5(x_ptr, b_ptr, s_ptr, p_ptr, M, N, BYTES, TPS, sx, sb, ss, sp,
               BN: tl.constexpr, GPI: tl.constexpr, MP: tl.constexpr, INTERP: tl.constexpr):
    """_qgemv_tc3 reading x in its natural lane order (no pre-permutation): each step loads x[:, chunk] as
    [MP, GPI, 16(e), 4(c)] and permutes it to the decode's order (k = g*64 + c*16 + e) in registers, then forms the
    block-diagonal B with a select."""
    BB: tl.constexpr = 32 * GPI
    HB: tl.constexpr = 16 * GPI
    NC: tl.constexpr = GPI * MP
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    n = pid * BN + tl.arange(0, BN)
    nm = n < N
    r = tl.where(nm, n, 0)
    r3 = r[:, None, None]
    g3, e3, m4, g4, e4, c4, xoff, xmask, diag, gcol = lanes(M, sx, GPI, MP)   # x in natural lane order
    acc = tl.zeros((BN, NC), dtype=tl.float32)
    t0 = sid * TPS
    t1 = tl.minimum(t0 + TPS, BYTES // BB)
    sbh = sb // 2
    for t in range(t0, t1):   # the engine's K step (its _codes is dec_b's decode), without the norm
        h = tl.load(b_ptr + r3 * sbh + t * HB + g3 * 16 + e3)         # [BN, GPI, 16] uint16
        acc = _k_step(acc, h, t, x_ptr, s_ptr, x_ptr, x_ptr, x_ptr, x_ptr, 0.0, r, xoff, xoff, xmask, xmask, diag,
                      gcol, M, 2 * BYTES, ss, 0, 0, BN, GPI, MP, False, INTERP)
    out = tl.sum(tl.reshape(acc, (BN, GPI, MP)), 1)
    mm = tl.arange(0, MP)[None, :]
    tl.store(p_ptr + sid * sp + mm * N + n[:, None], out, mask=nm[:, None] & (mm < M))




def perm_tc3(k: int):
    """tc3's x lane order: xp[..., g*64 + c*16 + e] = x[..., g*64 + 4e + c] (k a multiple of 64)."""
    import torch
    return torch.arange(k).view(k // 64, 16, 4).permute(0, 2, 1).reshape(k)


def gemv_tc35(x2, w, *, natural_x: bool, bn: int = 128, gpi: int = 8, mp: int | None = None,
              split: int | None = None, warps: int = 4):
    """``x2 @ decode(w).T`` (q4 only) with :func:`_qgemv_tc5` (``natural_x``) or :func:`_qgemv_tc3` (x2 already in
    :func:`perm_tc3` order), rounded to x2's dtype; ``split`` K runs (default: about two programs per SM)."""
    import torch
    from ninfer.ops.triton._common import INTERPRET
    if w.format != "q4_g64_fp16":
        raise ValueError(f"the tc3/tc5 candidates read q4_g64_fp16 weights, not {w.format}")
    m, k = x2.shape
    mp = mp or triton.next_power_of_2(m)
    nbytes = w.lanes // 2
    bb = 32 * gpi
    if nbytes % bb or m > mp:
        raise ValueError(f"tc3/tc5: {nbytes} bytes a row are not whole {bb}-byte steps, or {m} rows > mp {mp}")
    iters = nbytes // bb
    programs = triton.cdiv(w.n, bn)
    split = split or max(1, min(iters, -(-264 // programs)))
    tps = -(-iters // split)
    s = -(-iters // tps)
    part = torch.empty((s, m, w.n), dtype=torch.float32, device=x2.device)
    fn = _qgemv_tc5 if natural_x else _qgemv_tc3
    kw = {} if INTERPRET else {"num_warps": warps}
    fn[(programs, s)](x2, w.base.view(torch.uint16), w.scales, part, m, w.n, nbytes, tps, x2.stride(0),
                      w.base_stride, w.scale_stride, part.stride(0), BN=bn, GPI=gpi, MP=mp, INTERP=INTERPRET, **kw)
    return part.sum(0).to(x2.dtype)
