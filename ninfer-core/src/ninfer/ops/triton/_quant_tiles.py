"""Reading quantized weights inside Triton kernels: a host-side description of one weight operand
(:class:`Operand`) and the device helpers that turn its stored codes into values.

Formats (docs/artifact-v3.md, "Quantized formats"; :mod:`ninfer.quant`) are a constexpr code per operand
(:data:`DENSE`, :data:`FP8_ROW`, :data:`NVFP4`, or the groupwise code width 4/5/6/8), so one kernel source serves
every format and a kernel mixing formats (an expert bank in q4, a shared expert in q8 or dense) compiles one variant.

Invariants:
- A code's value is recovered exactly in the arithmetic the caller chooses: groupwise codes are integers of at
  most 8 bits and E4M3FN codes have 4 significant bits, so both are exact in bf16, fp16 and fp32. Scales are
  applied in fp32 after the codes' dot with the activations (one multiply per group or row, not per weight);
  ``scale * code`` is exact in fp32, so this differs from decoding first only by fp32 summation order.
- nvfp4 codes decode to ``e2m1 * 2^-14`` exactly (:func:`~ninfer.ops.triton._quant.e2m1_scaled`). Its block
  scales (one E4M3 per 16 lanes, read from the 128 x 4 tiles by the bank's global row) are applied in fp32 after
  each block's dot in the GEMV, and to the weights themselves in the GEMM's tile (``e2m1 * block scale`` is exact
  in bf16, fp16 and fp32); the ``2^14`` (exact) and the per-tensor divisor -- one for a whole bank, its experts'
  views share it -- come once, after the whole dot. The reference's decoded weight ``e2m1 * scale / divisor``
  rounds in fp32, so unlike the other formats this differs from decoding first by that rounding too.
- Rows are addressed by int64 indices into the planes' rows (row r of expert e of a bank of N rows per expert
  is ``e * N + r``); the caller keeps every index in range (clamping rows it does not store).
- Groupwise rows are stored padded to whole groups with code 0, so weight loads of a stored group need no lane
  mask; activations are masked to K. fp8 and dense rows hold exactly K values and are masked to K. nvfp4 rows hold
  K % 64 == 0 lanes and a bank's experts N % 128 == 0 rows (whole scale tiles), so only whole blocks are masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ninfer.ops.triton._common import cast
from ninfer.ops.triton._quant import e2m1_scaled, kernel_weight, nvfp4_scale_row
from ninfer.quant import PackedWeight, nvfp4
from ninfer.quant.fp8_row import FORMAT as _FP8_NAME
from ninfer.quant.groupwise import BASE_BYTES, GROUPWISE

DENSE = 0
FP8_ROW = 1
NVFP4 = 2
# The groupwise formats' codes are their bit widths; the kernels below assume these group sizes.
_CODES = {name: spec.bits for name, spec in GROUPWISE.items()}
_CODES[_FP8_NAME] = FP8_ROW
_CODES[nvfp4.FORMAT] = NVFP4
assert all(spec.group == (32 if spec.bits == 8 else 64) for spec in GROUPWISE.values()) and BASE_BYTES == 32


@dataclass(frozen=True)
class Operand:
    """One weight as the kernels read it: ``fmt`` (a format code), three plane tensors passed as pointers
    (unused planes repeat the first; nvfp4: codes, the divisor, the scale tiles, as
    :class:`~ninfer.ops.triton._quant.KernelWeight` orders them), their row strides in elements (nvfp4's scale
    stride: bytes a 128-row tile row), the logical ``k``, ``slots`` (groups per stored row for groupwise formats,
    16-lane scale blocks for nvfp4, else 32-lane chunks covering K), and ``rows`` per expert (or of the matrix)."""

    fmt: int
    planes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    strides: tuple[int, int, int]
    k: int
    slots: int
    rows: int

    @property
    def grouped(self) -> bool:
        """A groupwise format: scaled per group of a row, after the group's dot."""
        return self.fmt in (4, 5, 6, 8)

    @property
    def slot_lanes(self) -> int:
        """Lanes of K one slot (:attr:`slots`) covers."""
        return {4: 64, 5: 64, 6: 64, NVFP4: 16}.get(self.fmt, 32)

    @property
    def slot_bytes(self) -> int:
        """Elements of one slot in :func:`rows_dot`'s code tile: a block's 8 code bytes for nvfp4, else 32."""
        return 8 if self.fmt == NVFP4 else 32

    def args(self) -> tuple:
        return (*self.planes, *self.strides)


def operand(w: torch.Tensor | PackedWeight, what: str) -> Operand:
    """The :class:`Operand` of a bank ``[E, N, K]`` or matrix ``[N, K]``, packed or dense (a dense one is used
    as is when contiguous, else copied)."""
    shape = tuple(w.shape)
    if len(shape) not in (2, 3):
        raise ValueError(f"{what}: expected a bank [E, N, K] or a matrix [N, K], got shape {list(shape)}")
    k, rows = shape[-1], shape[-2]
    if not isinstance(w, PackedWeight):
        flat = w.contiguous().view(-1, k)
        return Operand(DENSE, (flat, flat, flat), (flat.stride(0),) * 3, k, -(-k // 32), rows)
    code = _CODES.get(w.format)
    if code is None:
        raise ValueError(f"{what}: no Triton kernel reads {w.format!r} weights")
    want = rows * (shape[0] if len(shape) == 3 else 1)
    if code == NVFP4:
        # The kernels address scale tiles by global row (expert e's row r is e * rows + r): every expert must
        # start on a tile, as the layout requires of the weights it stores.
        if not nvfp4.fits(shape):
            raise ValueError(f"{what}: an {w.format} weight needs N % {nvfp4.LAYOUT_ROWS} == 0 and K % "
                             f"{nvfp4.LAYOUT_K} == 0, got shape {list(shape)}")
        kw = kernel_weight(PackedWeight(w.format, (want, k), w.planes), what)
        return Operand(code, (kw.base, kw.high, kw.scales), (kw.base_stride, 0, kw.scale_stride), k, k // 16, rows)
    for p in w.planes:
        if p.shape[0] != want:
            raise ValueError(f"{what}: {w.format} plane of {p.shape[0]} rows for shape {list(shape)} ({want} rows)")
        if p.dim() != 2 and not (code == FP8_ROW and p.dim() == 1):
            raise ValueError(f"{what}: {w.format} plane of shape {list(p.shape)} is not [rows, bytes]")
        if p.dim() == 2 and p.shape[1] > 1 and p.stride(1) != 1:
            raise ValueError(f"{what}: {w.format} planes must be contiguous along a row")
    if code == FP8_ROW:
        codes, scales = w.planes
        return Operand(code, (codes, scales, scales), (codes.stride(0), codes.stride(0), scales.stride(0)), k,
                       -(-k // 32), rows)
    base, high, scales = w.planes
    high_arg = high if high.numel() else base    # q4/q8 have no high plane: any valid pointer
    return Operand(code, (base, high_arg, scales), (base.stride(0), high_arg.stride(0), scales.stride(0)), k,
                   GROUPWISE[w.format].groups_per_row(k), rows)


@triton.jit
def _xload(x_ptr, x_up, k, m, SWIGLU: tl.constexpr, RDT: tl.constexpr, INTERP: tl.constexpr):
    """Activations at lanes ``k`` in fp32 (0 where ``m`` is false). SWIGLU: ``round(silu(g) * u)`` to RDT from
    ``g = x[k]``, ``u = x[x_up + k]`` (a shared expert's projection)."""
    if SWIGLU:
        g = tl.load(x_ptr + k, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + x_up + k, mask=m, other=0.0).to(tl.float32)
        v = cast(g / (1.0 + tl.exp(-g)) * u, RDT, INTERP).to(tl.float32)
    else:
        v = tl.load(x_ptr + k, mask=m, other=0.0).to(tl.float32)
    return v


@triton.jit
def _nibble_codes(w0, w1, rows, slot, i, sm, s0, s1, FMT: tl.constexpr):
    """Signed codes of the even (2i) and odd (2i+1) lanes of 64-lane groups ``slot`` (q4/q5/q6), int32.
    ``rows``, ``slot`` and ``i`` are pre-broadcast index tensors; ``sm`` masks groups past the row (None: all
    are stored)."""
    b_ptrs = w0 + rows * s0 + slot * 32 + i
    if sm is None:
        b = tl.load(b_ptrs).to(tl.int32)
    else:
        b = tl.load(b_ptrs, mask=sm, other=0).to(tl.int32)
    lo = b & 15
    hi = b >> 4
    if FMT != 4:
        # High planes: lane l's (FMT - 4) bits start at bit l * (FMT - 4) of the group's high bytes (LSB first);
        # an even lane's bits and the next lane's share one byte.
        bp = 2 * (FMT - 4) * i
        h_ptrs = w1 + rows * s1 + slot * (8 * (FMT - 4)) + (bp >> 3)
        if sm is None:
            hb = tl.load(h_ptrs).to(tl.int32)
        else:
            hb = tl.load(h_ptrs, mask=sm, other=0).to(tl.int32)
        sh = bp & 7
        lo = lo | (((hb >> sh) & ((1 << (FMT - 4)) - 1)) << 4)
        hi = hi | (((hb >> (sh + FMT - 4)) & ((1 << (FMT - 4)) - 1)) << 4)
    # Two's complement of FMT bits, sign-extended: (u ^ half) - half.
    lo = (lo ^ (1 << (FMT - 1))) - (1 << (FMT - 1))
    hi = (hi ^ (1 << (FMT - 1))) - (1 << (FMT - 1))
    return lo, hi


@triton.jit
def rows_dot(w0, w1, w2, s0, s1, s2, rows, x_ptr, x_up, K, SLOTS,
             FMT: tl.constexpr, R: tl.constexpr, NG: tl.constexpr, NCH: tl.constexpr,
             SWIGLU: tl.constexpr, RDT: tl.constexpr, INTERP: tl.constexpr):
    """GEMV helper: ``[R]`` fp32 ``sum_k W[rows, k] * x[k]`` over the whole row, in NCH chunks of NG slots
    (64-lane groups for q4/q5/q6, 32-lane groups for q8, 16-lane scale blocks for nvfp4, 32-lane chunks for
    fp8 and dense). Each chunk's codes are reduced over the lanes, then scaled per group (groupwise) or block
    (nvfp4) into an ``[R, NG]`` fp32 accumulator; fp8 applies its row scale once at the end, nvfp4 its
    ``2^14 / divisor``. Every stored byte of the rows is loaded once."""
    i = tl.arange(0, 32)
    g = tl.arange(0, NG)
    r3 = rows[:, None, None]
    i3 = i[None, None, :]
    acc = tl.zeros((R, NG), dtype=tl.float32)
    for c in tl.static_range(NCH):
        slot = c * NG + g
        sm = slot < SLOTS
        if FMT == 2:
            # [R, NG, 8]: a block's 8 code bytes (lanes 2j in the low nibble, 2j + 1 in the high one) times x,
            # summed per block, then times the block's E4M3 scale: one multiply per block, not per weight.
            j = tl.arange(0, 8)
            b = tl.load(w0 + r3 * s0 + slot[None, :, None] * 8 + j[None, None, :], mask=sm[None, :, None], other=0)
            b = b.to(tl.int32)
            ke = slot[:, None] * 16 + 2 * j[None, :]
            xe = _xload(x_ptr, x_up, ke, ke < K, SWIGLU, RDT, INTERP)
            xo = _xload(x_ptr, x_up, ke + 1, ke + 1 < K, SWIGLU, RDT, INTERP)
            part = tl.sum(e2m1_scaled(b & 15) * xe[None, :, :] + e2m1_scaled(b >> 4) * xo[None, :, :], 2)
            sc = tl.load(w2 + nvfp4_scale_row(rows, s2)[:, None] + ((slot // 4) * 512 + slot % 4)[None, :],
                         mask=sm[None, :], other=0)
            acc += part * sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif FMT == 4 or FMT == 5 or FMT == 6:
            lo, hi = _nibble_codes(w0, w1, r3, slot[None, :, None], i3, sm[None, :, None], s0, s1, FMT)
            ke = slot[:, None] * 64 + 2 * i[None, :]
            xe = _xload(x_ptr, x_up, ke, ke < K, SWIGLU, RDT, INTERP)
            xo = _xload(x_ptr, x_up, ke + 1, ke + 1 < K, SWIGLU, RDT, INTERP)
            part = tl.sum(lo.to(tl.float32) * xe[None, :, :] + hi.to(tl.float32) * xo[None, :, :], 2)
        else:
            k = slot[:, None] * 32 + i[None, :]
            km = k < K
            ptrs = w0 + r3 * s0 + k[None, :, :]
            if FMT == 8:
                w = tl.load(ptrs, mask=sm[None, :, None], other=0).to(tl.int8, bitcast=True).to(tl.float32)
            elif FMT == 1:
                w = tl.load(ptrs, mask=km[None, :, :], other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                w = tl.load(ptrs, mask=km[None, :, :], other=0.0).to(tl.float32)
            part = tl.sum(w * _xload(x_ptr, x_up, k, km, SWIGLU, RDT, INTERP)[None, :, :], 2)
        if FMT == 0 or FMT == 1:
            acc += part
        elif FMT != 2:
            sc = tl.load(w2 + rows[:, None] * s2 + slot[None, :], mask=sm[None, :], other=0.0)
            acc += part * sc.to(tl.float32)
    out = tl.sum(acc, 1)
    if FMT == 1:
        out = out * tl.load(w2 + rows * s2).to(tl.float32)
    elif FMT == 2:
        out = out * 16384.0 / tl.load(w1)        # times 2^14 exactly, then one rounding: the divisor's
    return out


@triton.jit
def tile_codes(w0, w1, w2, s0, s1, s2, rows, c, K, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               DT: tl.constexpr):
    """GEMM helper: the ``[BN, BK]`` weight tile of K-chunk ``c`` in dtype DT (exact: codes, or dense values),
    lanes in K order (converted through fp32: exact, and the interpreter has no direct integer -> bf16 cast).
    Groupwise: chunk c is group c (BK = its 64 or 32 lanes; the caller scales by
    :func:`tile_scales`). fp8 and dense: lanes ``[c * BK, (c + 1) * BK)`` masked to K. nvfp4: chunk c is
    scale-tile column c (BK = 64) with its block scales applied, ``e2m1 * block scale`` (at most 6 significant
    bits in ``[2^-10, 2688]``: exact in bf16, fp16 and fp32); the caller divides by the divisor."""
    if FMT == 2:
        j = tl.arange(0, BK // 2)
        b = tl.load(w0 + rows[:, None] * s0 + (c * (BK // 2) + j)[None, :]).to(tl.int32)
        # The scale of code byte j is block j // 8 of the tile column (repeated addresses: one load per block).
        s = tl.load(w2 + nvfp4_scale_row(rows, s2)[:, None] + c * 512 + (j // 8)[None, :])
        s = s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
        # [BN, 32, 2] -> [BN, 64]: lane 2j from the low nibble, 2j + 1 from the high one.
        w = tl.reshape(tl.join(e2m1_scaled(b & 15) * s, e2m1_scaled(b >> 4) * s), (BN, BK)).to(DT)
    elif FMT == 4 or FMT == 5 or FMT == 6:
        i = tl.arange(0, BK // 2)
        lo, hi = _nibble_codes(w0, w1, rows[:, None], c, i[None, :], None, s0, s1, FMT)
        # [BN, 32, 2] -> [BN, 64]: lane 2i from the low nibble, 2i + 1 from the high one.
        w = tl.reshape(tl.join(lo, hi), (BN, BK)).to(tl.float32).to(DT)
    else:
        kk = tl.arange(0, BK)
        ptrs = w0 + rows[:, None] * s0 + (c * BK + kk)[None, :]
        if FMT == 8:
            w = tl.load(ptrs).to(tl.int8, bitcast=True).to(tl.float32).to(DT)
        else:
            km = (c * BK + kk) < K
            if FMT == 1:
                w = tl.load(ptrs, mask=km[None, :], other=0).to(tl.float8e4nv, bitcast=True)
                w = w.to(tl.float32).to(DT)
            else:
                w = tl.load(ptrs, mask=km[None, :], other=0.0).to(DT)
    return w


@triton.jit
def tile_scales(w2, s2, rows, c):
    """The fp32 scales of group ``c`` of ``rows`` (groupwise), or the row scales (fp8: pass c = 0)."""
    return tl.load(w2 + rows * s2 + c).to(tl.float32)
