"""Helpers shared by the quantized-weight kernels (:mod:`~ninfer.ops.triton.quant_gemv`,
:mod:`~ninfer.ops.triton.quant_gemm`): how a :class:`~ninfer.quant.PackedWeight` is handed to a kernel, and the
in-kernel decoding of its codes.

A kernel reads the packed planes directly (docs/artifact-v3.md, "Quantized formats"):

- ``KIND_NIBBLE`` (q4/q5/q6, 64 lanes a group): base byte ``j`` of a row holds lanes ``2j`` (low nibble) and
  ``2j + 1`` (high nibble); the code bits above the low four of lane ``k`` are bits ``[k*H, k*H + H)`` of the
  row's high plane (``H = bits - 4``), so base byte ``j``'s two lanes sit in high byte ``(j*H) >> 2`` at bit
  ``(2*j*H) & 7`` (even lane) and ``H`` above (odd lane); the scale of base byte ``j`` is ``scales[j >> 5]``.
- ``KIND_BYTE`` (q8, 32 lanes a group): byte ``k`` is lane ``k`` (two's complement); its scale ``scales[k >> 5]``.
- ``KIND_FP8`` (fp8 row): byte ``k`` is lane ``k`` (E4M3FN bits); one bf16 scale per row.
- ``KIND_NVFP4`` (nvfp4): base byte ``j`` holds lanes ``2j`` (low nibble) and ``2j + 1`` as E2M1 codes; ``scales`` is
  the plane of 128 x 4 E4M3 block-scale tiles (``scale_stride``: bytes a 128-row tile row), ``high`` the one-element
  fp32 divisor (:mod:`~ninfer.ops.triton.quant_nvfp4` reads them; it and the MoE expert kernels decode codes and
  address the tiles through :func:`e2m1_scaled` and :func:`nvfp4_scale_row`).

Invariant: decoded codes are exact fp32 integers (or exact E4M3 values), and ``code * scale`` is exact in fp32
(at most 8 + 11 significant bits), so a kernel's weights are exactly the reference's decoded values; only the
order of the fp32 accumulation differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ninfer.quant import PackedWeight
from ninfer.quant.fp8_row import FORMAT as FP8_ROW
from ninfer.quant.groupwise import GROUPWISE
from ninfer.quant.nvfp4 import FORMAT as NVFP4
from ninfer.quant.nvfp4 import LAYOUT_K, LAYOUT_ROWS, TILE_BYTES

KIND_NIBBLE, KIND_BYTE, KIND_FP8, KIND_NVFP4 = 0, 1, 2, 3
#: The stored formats the Triton quantized ops read: the dense weight-reading ops (quant_linear) and the MoE expert
#: kernels (quant_moe) alike.
KERNEL_FORMATS: frozenset[str] = frozenset((*GROUPWISE, FP8_ROW, NVFP4))


@dataclass(frozen=True)
class KernelWeight:
    """A 2-D packed weight ``[N, K]`` as kernel arguments.

    ``base``/``high``/``scales`` are the planes (``high`` is ``base`` where the format has none, never read);
    ``lanes`` the lanes stored per row (K padded to 128 for the groupwise formats, K for fp8); ``*_stride`` the
    row strides of the planes, in their elements (each plane's last stride is 1)."""

    format: str
    kind: int
    bits: int
    group: int
    n: int
    k: int
    lanes: int
    base: torch.Tensor
    high: torch.Tensor
    scales: torch.Tensor
    base_stride: int
    high_stride: int
    scale_stride: int


def kernel_weight(weight: PackedWeight, op: str) -> KernelWeight:
    """The kernel view of ``weight`` for ``op``; a ``ValueError`` naming the problem for a weight it cannot take."""
    if not isinstance(weight, PackedWeight):
        raise TypeError(f"{op}: expected a packed quantized weight, got {type(weight).__name__}")
    if len(weight.shape) != 2:
        raise ValueError(f"{op}: a {weight.format} weight must be [N, K], got shape {list(weight.shape)}")
    n, k = weight.shape
    if weight.format == FP8_ROW:
        codes, scales = weight.planes
        if codes.shape != (n, k) or scales.shape != (n,):
            raise ValueError(f"{op}: {FP8_ROW} planes {[tuple(p.shape) for p in weight.planes]} do not match "
                             f"shape {list(weight.shape)}")
        _unit_stride(op, weight.format, codes, scales)
        return KernelWeight(FP8_ROW, KIND_FP8, 8, k, n, k, k, codes, codes, scales, codes.stride(0), 0,
                            scales.stride(0))
    if weight.format == NVFP4:
        codes, tiles, divisor = weight.planes
        if (codes.shape != (n, k // 2) or tiles.shape != (n // LAYOUT_ROWS, k // LAYOUT_K * TILE_BYTES)
                or divisor.shape != (1,) or divisor.dtype != torch.float32):
            raise ValueError(f"{op}: {NVFP4} planes {[tuple(p.shape) for p in weight.planes]} do not match "
                             f"shape {list(weight.shape)}")
        _unit_stride(op, weight.format, codes, tiles)
        return KernelWeight(NVFP4, KIND_NVFP4, 4, 16, n, k, k, codes, divisor, tiles, codes.stride(0), 0,
                            tiles.stride(0))
    spec = GROUPWISE.get(weight.format)
    if spec is None:
        raise ValueError(f"{op}: no Triton kernel reads {weight.format!r} weights")
    base, high, scales = weight.planes
    gpr = spec.groups_per_row(k)
    if base.shape != (n, gpr * 32) or high.shape != (n, gpr * spec.high_bytes) or scales.shape != (n, gpr):
        raise ValueError(f"{op}: {weight.format} planes {[tuple(p.shape) for p in weight.planes]} do not match "
                         f"shape {list(weight.shape)}")
    _unit_stride(op, weight.format, base, scales, *((high,) if spec.high_bits else ()))
    kind = KIND_BYTE if spec.bits == 8 else KIND_NIBBLE
    hi = high if spec.high_bits else base
    return KernelWeight(spec.name, kind, spec.bits, spec.group, n, k, gpr * spec.group, base, hi, scales,
                        base.stride(0), hi.stride(0), scales.stride(0))


def _unit_stride(op: str, fmt: str, *planes: torch.Tensor) -> None:
    for p in planes:
        if p.dim() and p.shape[-1] > 1 and p.stride(-1) != 1:
            raise ValueError(f"{op}: a {fmt} plane of shape {tuple(p.shape)} has last stride {p.stride(-1)}; the "
                             f"kernels read row-contiguous planes")


def check_input(x: torch.Tensor, w: KernelWeight, op: str) -> None:
    if x.shape[-1] != w.k:
        raise ValueError(f"{op}: x has {x.shape[-1]} input features, weight expects {w.k}")
    if x.device != w.base.device:
        raise ValueError(f"{op}: x is on {x.device}, the {w.format} weight on {w.base.device}")


@triton.jit
def int_code(u, HALF: tl.constexpr):
    """The fp32 value of the two's-complement code whose unsigned bits are ``u`` (int32, ``0 <= u < 2*HALF``):
    ``(u ^ HALF) - HALF``, formed as ``float(2^23 + (u ^ HALF)) - (2^23 + HALF)`` from the bits (exact, and
    an integer op and a float add instead of a slow int-to-float conversion)."""
    return (u ^ (0x4B000000 | HALF)).to(tl.float32, bitcast=True) - (8388608.0 + HALF)


@triton.jit
def nibble_codes(b, hx, jb, BITS: tl.constexpr):
    """fp32 codes ``(even lane, odd lane)`` of base bytes ``b`` (int32) whose global byte indices in their row are
    ``jb`` (broadcastable to b), ``hx`` (int32) the high byte holding their upper bits (unused for q4)."""
    lo = b & 15
    hi = b >> 4
    if BITS > 4:
        HB: tl.constexpr = BITS - 4
        se = (jb * (2 * HB)) & 7
        lo = lo | (((hx >> se) & ((1 << HB) - 1)) << 4)
        hi = hi | (((hx >> (se + HB)) & ((1 << HB) - 1)) << 4)
    return int_code(lo, 1 << (BITS - 1)), int_code(hi, 1 << (BITS - 1))


@triton.jit
def fp8_code(b):
    """fp32 value of E4M3FN bits ``b`` (uint8): exact."""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_scaled(c):
    """fp32 ``e2m1(c) * 2^-14`` of 4-bit nvfp4 codes ``c`` (int32), through the fp16 with the code's bits at 9..12 and
    15: E2M1 and that fp16 field share their layout up to the exponent bias, subnormal codes included, so one bit
    operation and one exact conversion decode a code. Callers put the ``2^14`` back in their scale."""
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def nvfp4_scale_row(rows, st):
    """Byte offset, in an nvfp4 scale plane, of the block scales of ``rows`` in their tile's first 64 weights
    (``st``: bytes a 128-row tile row); block ``b`` of a row is ``(b // 4) * 512 + b % 4`` bytes further."""
    return (rows // 128) * st + (rows % 32) * 16 + ((rows // 32) % 4) * 4


@triton.jit
def load_tile(b_ptr, h_ptr, s_ptr, rows, j0, sb, sh, ss, LIMIT, KIND: tl.constexpr, BITS: tl.constexpr,
              RN: tl.constexpr, BB: tl.constexpr, MASKED: tl.constexpr):
    """Raw tile of the ``RN`` rows ``rows`` (in bounds) and the ``BB`` bytes from byte ``j0`` (a multiple of BB) of
    each row, every plane read contiguously: ``(base bytes [RN, BB] uint8, the high byte of each base byte
    [RN, BB] (each high byte loaded once, repeated in registers), group scales [RN, BB / 32] fp32)``; where a
    format has no high plane or (fp8) no group scales, the base tile stands in (unused). Bytes from ``LIMIT`` on
    (a multiple of 32 for the groupwise formats) read as 0 when ``MASKED``."""
    r = rows[:, None]
    jb = j0 + tl.arange(0, BB)
    if MASKED:
        b = tl.load(b_ptr + r * sb + jb[None, :], mask=jb[None, :] < LIMIT, other=0)
    else:
        b = tl.load(b_ptr + r * sb + jb[None, :])
    hx = b
    sc = b
    if KIND == 0:
        if BITS > 4:
            PER: tl.constexpr = 4 // (BITS - 4)          # base bytes per high byte: q5 4, q6 2
            hj = j0 // PER + tl.arange(0, BB // PER)
            if MASKED:
                h = tl.load(h_ptr + r * sh + hj[None, :], mask=hj[None, :] < LIMIT // PER, other=0)
            else:
                h = tl.load(h_ptr + r * sh + hj[None, :])
            hx = tl.reshape(tl.broadcast_to(h[:, :, None], (RN, BB // PER, PER)), (RN, BB))
    if KIND != 2:
        gj = j0 // 32 + tl.arange(0, BB // 32)
        if MASKED:
            sc = tl.load(s_ptr + r * ss + gj[None, :], mask=gj[None, :] < LIMIT // 32, other=0.0).to(tl.float32)
        else:
            sc = tl.load(s_ptr + r * ss + gj[None, :]).to(tl.float32)
    return b, hx, sc


@triton.jit
def decode_tile(b, hx, BB: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr):
    """fp32 codes of a raw tile (:func:`load_tile`), unscaled: nibble formats ``(even lanes, odd lanes)`` of each
    byte; q8 and fp8 ``(codes, same)``."""
    if KIND == 0:
        c0, c1 = nibble_codes(b.to(tl.int32), hx.to(tl.int32), tl.arange(0, BB)[None, :], BITS)
    elif KIND == 1:
        c0 = int_code(b.to(tl.int32), 128)
        c1 = c0
    else:
        c0 = fp8_code(b)
        c1 = c0
    return c0, c1
