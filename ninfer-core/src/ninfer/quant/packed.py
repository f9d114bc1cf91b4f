""":class:`PackedWeight`: a quantized weight as the loader hands it over -- zero-copy plane views of its
parent object's stored bytes, never decoded.

Invariants: ``shape`` is the logical shape ``[..., K]`` (rank >= 2); ``planes`` are views, row-major over the
``rows = prod(shape[:-1])`` rows, in the format's plane order (groupwise: ``base [rows, gpr*32] uint8``,
``high [rows, gpr*H] uint8``, ``scales [rows, gpr] fp16``; fp8 row: ``codes [rows, K] uint8``,
``scales [rows] bf16``; nvfp4: ``codes [rows, K/2] uint8``, ``tiles [rows/128, (K/64)*512] uint8`` (the block
scales in the layout's tiles), ``divisor [1] fp32``). Taking a row range or an expert of a bank is a view of the
same planes (nvfp4: of whole 128-row tiles, the divisor shared).
``activations`` is ``"a8"`` only on an fp8 row weight whose every use allows 8-bit activations; views keep it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.errors import NotSupportedError
from ninfer.quant import nvfp4
from ninfer.quant.errors import QuantizationError
from ninfer.quant.fp8_row import FORMAT as FP8_ROW
from ninfer.quant.fp8_row import decode as fp8_decode
from ninfer.quant.fp8_row import scale_offset as fp8_scale_offset
from ninfer.quant.groupwise import GROUPWISE

ACTIVATIONS: tuple[str, ...] = ("a16", "a8")


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A quantized weight (see the module docstring for the invariants)."""

    format: str
    shape: tuple[int, ...]
    planes: tuple[torch.Tensor, ...]
    # "a8": every use of the weight allows 8-bit activations (AllowA8) and the format has an A8 product (fp8
    # row), so the ops quantize the activations per token to E4M3; else "a16" (activations stay as given).
    activations: str = "a16"

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations {self.activations!r} is not one of {ACTIVATIONS}")
        if self.activations == "a8" and self.format != FP8_ROW:
            raise NotSupportedError(f"8-bit activations need an {FP8_ROW} weight, this one is {self.format}")

    @property
    def rows(self) -> int:
        return self.planes[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.planes[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.planes)

    def dim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: int) -> PackedWeight:
        """Expert ``index`` of a bank ``[E, N, K]``: a ``[N, K]`` view."""
        if len(self.shape) != 3 or not isinstance(index, int):
            raise TypeError(f"a packed {self.format} weight of shape {list(self.shape)} is indexed only by one "
                            f"expert of a rank-3 bank")
        n = self.shape[1]
        if not -self.shape[0] <= index < self.shape[0]:
            raise IndexError(f"expert {index} of a bank of {self.shape[0]}")
        index %= self.shape[0]
        return PackedWeight(self.format, tuple(self.shape[1:]), _row_planes(self.format, self.planes, index * n,
                                                                            (index + 1) * n), self.activations)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight's values in ``dtype`` (computed in at least fp32): for reference ops and tests only."""
        k = self.shape[-1]
        if self.format == FP8_ROW:
            flat = fp8_decode(self.planes[0], self.planes[1], dtype)
        elif self.format == nvfp4.FORMAT:
            codes, tiles, divisor = self.planes
            flat = nvfp4.decode(codes, nvfp4.untile_scales(tiles, k), float(divisor[0]), dtype)
        else:
            flat = GROUPWISE[self.format].decode(*self.planes, k, dtype)
        return flat.reshape(self.shape)


def empty_bank(like: PackedWeight, experts: int, device: torch.device | str) -> PackedWeight:
    """A zeroed bank of ``experts`` experts on ``device`` laid out as the bank ``like`` (``[E, N, K]``, separable:
    ``like[e]`` is a view) stores one: every plane's rows for one expert times ``experts``; nvfp4's divisor, shared
    by the whole tensor, is ``like``'s. What a device cache of a host bank's experts holds (:func:`copy_expert`)."""
    one = like[0]
    planes = [torch.zeros((experts * p.shape[0], *p.shape[1:]), dtype=p.dtype, device=device) for p in one.planes]
    if like.format == nvfp4.FORMAT:
        planes[2] = one.planes[2].to(device=device, copy=True)
    return PackedWeight(like.format, (experts, *like.shape[1:]), tuple(planes), like.activations)


def copy_expert(dst: PackedWeight, slot: int, src: PackedWeight, expert: int, non_blocking: bool = False) -> None:
    """Copy expert ``expert`` of bank ``src`` into slot ``slot`` of bank ``dst`` (same format and expert shape),
    plane by plane; nvfp4's shared divisor is not copied (:func:`empty_bank` took it from the source)."""
    if dst.format != src.format or dst.shape[1:] != src.shape[1:]:
        raise QuantizationError(f"an expert of a {src.format} bank {list(src.shape)} does not fit a slot of a "
                                f"{dst.format} bank {list(dst.shape)}")
    planes = zip(dst[slot].planes, src[expert].planes, strict=True)
    for i, (d, s) in enumerate(planes):
        if not (dst.format == nvfp4.FORMAT and i == 2):
            d.copy_(s, non_blocking=non_blocking)


QUANTIZED_FORMATS: tuple[str, ...] = (*GROUPWISE, FP8_ROW, nvfp4.FORMAT)


def is_quantized_format(fmt: str) -> bool:
    return fmt in QUANTIZED_FORMATS


def row_tile(fmt: str) -> int:
    """The rows a format's scales span together (a row block of a packed weight must be whole tiles): 1 but for
    nvfp4's 128-row scale tiles."""
    return nvfp4.LAYOUT_ROWS if fmt == nvfp4.FORMAT else 1


def _row_planes(fmt: str, planes: tuple[torch.Tensor, ...], r0: int, r1: int) -> tuple[torch.Tensor, ...]:
    """Rows ``[r0, r1)`` of ``planes`` (views). nvfp4: whole 128-row scale tiles, the divisor shared."""
    if fmt != nvfp4.FORMAT:
        return tuple(p[r0:r1] for p in planes)
    if r0 % row_tile(fmt) or r1 % row_tile(fmt):
        raise QuantizationError(f"rows [{r0}, {r1}) of an {fmt} weight do not start and end on its "
                                f"{nvfp4.LAYOUT_ROWS}-row scale tiles")
    codes, tiles, divisor = planes
    return codes[r0:r1], tiles[r0 // nvfp4.LAYOUT_ROWS:r1 // nvfp4.LAYOUT_ROWS], divisor


def encoded_size(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of a quantized object of logical ``shape``."""
    if fmt == FP8_ROW:
        from ninfer.quant.fp8_row import encoded_size as fp8_size
        return fp8_size(shape)
    if fmt in GROUPWISE:
        return GROUPWISE[fmt].encoded_size(shape)
    if fmt == nvfp4.FORMAT:
        return nvfp4.encoded_size(shape)
    raise QuantizationError(f"{fmt!r} is not a quantized format this engine implements")


def packed_view(fmt: str, parent: torch.Tensor, parent_shape: tuple[int, ...], begin: int, end: int,
                shape: tuple[int, ...], what: str = "weight") -> PackedWeight:
    """Elements ``[begin, end)`` of a quantized parent (its stored bytes ``parent``, uint8, of logical
    ``parent_shape``) as a :class:`PackedWeight` of ``shape``: views, never a copy. The range must be whole
    rows of the parent and ``shape`` must keep the parent's K (a row block or an expert slice)."""
    k = parent_shape[-1]
    if len(shape) < 2 or shape[-1] != k or begin % k or end % k:
        raise QuantizationError(
            f"{what}: elements [{begin}, {end}) of a {fmt} parent {list(parent_shape)} as shape {list(shape)} is not "
            f"a block of whole rows with the parent's K = {k}; a quantized parameter must be a row block or an "
            f"expert slice (re-order rows at conversion)")
    rows = 1
    for d in parent_shape[:-1]:
        rows *= d
    r0, r1 = begin // k, end // k
    if fmt == FP8_ROW:
        off = fp8_scale_offset(rows, k)
        codes = parent[:rows * k].view(rows, k)
        scales = parent[off:off + rows * 2].view(torch.bfloat16)
        return PackedWeight(fmt, tuple(shape), (codes[r0:r1], scales[r0:r1]))
    if fmt == nvfp4.FORMAT:
        scale_off, div_off, total = nvfp4.plane_offsets(rows, k)
        codes = parent[:scale_off].view(rows, k // 2)
        tiles = parent[scale_off:div_off].view(rows // nvfp4.LAYOUT_ROWS, k // nvfp4.LAYOUT_K * nvfp4.TILE_BYTES)
        divisor = parent[div_off:total].view(torch.float32)
        try:
            planes = _row_planes(fmt, (codes, tiles, divisor), r0, r1)
        except QuantizationError as exc:
            raise QuantizationError(f"{what}: {exc}") from None
        return PackedWeight(fmt, tuple(shape), planes)
    spec = GROUPWISE.get(fmt)
    if spec is None:
        raise QuantizationError(f"{what}: {fmt!r} is not a quantized format this engine implements")
    high_off, scale_off, total, gpr = spec.plane_offsets(rows, k)
    base = parent[:rows * gpr * 32].view(rows, gpr * 32)
    high = parent[high_off:high_off + rows * gpr * spec.high_bytes].view(rows, gpr * spec.high_bytes)
    scales = parent[scale_off:total].view(torch.float16).view(rows, gpr)
    return PackedWeight(fmt, tuple(shape), (base[r0:r1], high[r0:r1], scales[r0:r1]))
