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

Both keep the engine's exactness rule: codes (exact in bf16) times x, products and sums in fp32, the group scale
applied in fp32. Neither has the fused norm/SwiGLU variants nor split-K.
"""

from __future__ import annotations

import triton
import triton.language as tl
from ninfer.ops.triton._common import cast, mm, pdl_wait
from ninfer.ops.triton._quant import fp8_code, int_code


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
