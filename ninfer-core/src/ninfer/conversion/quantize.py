"""Streaming an object into a quantized format while it is converted (docs/converter.md, "Quantization").

Invariants of :func:`write_quantized`:

- the object's sources are read in chunks of whole rows (rows of its last dim K, never more than
  ``chunk_bytes`` of source unless one row is larger), each chunk encoded on its own -- groups and row scales
  never cross rows, so encoding by chunks equals encoding the tensor whole;
- the first plane (groupwise base, fp8 codes) is written as each chunk is encoded; the later, smaller planes
  (q5/q6 high bits, scales) are kept until the sources end, then written at their 256-byte aligned offsets:
  memory stays bounded by one chunk plus those planes (at most 1/4 + 1/16 byte per weight);
- nvfp4's divisor is the whole tensor's, so its sources are read twice: once for the largest magnitude, once to
  encode, in chunks of whole 128-row scale tiles; its scale tiles (1/16 byte per weight) are kept, then written
  after the codes, then the divisor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

import torch

from ninfer.conversion.cast import _SOURCE_DTYPE
from ninfer.conversion.errors import ConversionError, SourceError
from ninfer.quant import fp8_row, nvfp4
from ninfer.quant.groupwise import ENCODER as GROUPWISE_ENCODER
from ninfer.quant.groupwise import GROUPWISE, SEARCH_ENCODER

PLANE_ALIGN = 256


def encoder_name(fmt: str, search: bool = False) -> str:
    if fmt == fp8_row.FORMAT:
        return fp8_row.ENCODER
    if fmt == nvfp4.FORMAT:
        return nvfp4.SEARCH_ENCODER if search else nvfp4.ENCODER
    return SEARCH_ENCODER if search else GROUPWISE_ENCODER


def _encode(fmt: str, rows: torch.Tensor, what: str, search: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if fmt == fp8_row.FORMAT:
        codes, scales = fp8_row.encode(rows, what)
        return codes, [scales]
    base, high, scales = GROUPWISE[fmt].encode(rows, what, search=search)
    return base, [high, scales]


def write_quantized(write: Callable[[Any], None], object_id: str, fmt: str, dtype: str, k: int,
                    spans: Iterable[tuple[str, BinaryIO, int, int]], chunk_bytes: int,
                    advance: Callable[[int], Any], search: bool = False,
                    device: torch.device | str = "cpu") -> int:
    """Encode the rows of ``spans`` (``(source name, file, offset, bytes)``, C order, source ``dtype``, rows of
    ``k`` elements) into ``fmt`` (``search``: the scale-search encoder) and ``write`` the object's bytes;
    returns the bytes written. ``device``: where the encoders run (the encoders are plain torch, so a GPU
    quantizes a large model in seconds where a few CPU cores take minutes)."""
    torch_dtype = _SOURCE_DTYPE.get(dtype)
    if torch_dtype is None or not torch_dtype.is_floating_point:
        raise ConversionError(f"object {object_id!r}: a {dtype} source cannot be quantized to {fmt}")
    row_bytes = k * torch_dtype.itemsize
    if fmt == nvfp4.FORMAT:
        return _write_nvfp4(write, object_id, torch_dtype, k, list(spans), chunk_bytes, advance, device, search)
    step = max(1, chunk_bytes // row_bytes) * row_bytes
    sides: list[list[torch.Tensor]] = []
    written = 0
    for nbytes, rows in _chunks(spans, torch_dtype, k, step):
        first, rest = _encode(fmt, rows.to(device), object_id, search)
        first, rest = first.cpu(), [r.cpu() for r in rest]
        write(memoryview(first.contiguous().view(torch.uint8).numpy()).cast("B"))
        written += first.numel() * first.element_size()
        sides.append(rest)
        advance(nbytes)
    for plane in range(len(sides[0]) if sides else 0):
        pad = -written % PLANE_ALIGN
        if pad:
            write(bytes(pad))
            written += pad
        for chunk in sides:
            data = chunk[plane].contiguous().view(torch.uint8)
            if data.numel():
                write(memoryview(data.numpy()).cast("B"))
                written += data.numel()
    return written


def _chunks(spans: Iterable[tuple[str, BinaryIO, int, int]], dtype: torch.dtype, k: int, step: int):
    """The sources' rows, ``step`` bytes (whole rows) at a time, as ``(bytes read, [rows, k] tensor)``."""
    for name, f, offset, nbytes in spans:
        f.seek(offset)
        remaining = nbytes
        while remaining:
            buf = bytearray(min(step, remaining))
            if f.readinto(buf) != len(buf):
                raise SourceError(f"source tensor {name!r} ends early in {f.name!r}: the file changed or is truncated")
            yield len(buf), torch.frombuffer(buf, dtype=dtype).view(-1, k)
            remaining -= len(buf)


def _tiles(chunks, tile: int):
    """``chunks`` (``(bytes, rows)``) regrouped into blocks of whole ``tile``-row tiles, as ``(source bytes, rows)``:
    a source tensor's rows need not end on a tile (the parts of a fused object), the blocks do; the rows' total is a
    whole number of tiles (checked by the caller)."""
    held: list[torch.Tensor] = []
    count = 0
    for _, rows in chunks:
        held.append(rows)
        count += rows.shape[0]
        whole = count - count % tile
        if whole:
            block = torch.cat(held) if len(held) > 1 else held[0]
            yield whole * block.shape[1] * block.element_size(), block[:whole]
            held = [block[whole:]] if count > whole else []
            count -= whole


def _write_nvfp4(write: Callable[[Any], None], object_id: str, dtype: torch.dtype, k: int,
                 spans: list[tuple[str, BinaryIO, int, int]], chunk_bytes: int, advance: Callable[[int], Any],
                 device: torch.device | str, search: bool) -> int:
    tile_bytes = nvfp4.LAYOUT_ROWS * k * dtype.itemsize
    step = max(1, chunk_bytes // tile_bytes) * tile_bytes
    if sum(nbytes for _, _, _, nbytes in spans) % tile_bytes:
        raise ConversionError(f"object {object_id!r}: {nvfp4.FORMAT} needs a whole number of "
                              f"{nvfp4.LAYOUT_ROWS}-row tiles")
    amax = 0.0   # a non-finite weight is refused by the encoder in the second pass, naming the object
    for _, rows in _chunks(spans, dtype, k, step):
        amax = max(amax, float(rows.to(device).abs().max()))
    divisor = nvfp4.divisor_for(amax)
    tiles: list[torch.Tensor] = []
    written = 0
    for nbytes, rows in _tiles(_chunks(spans, dtype, k, step), nvfp4.LAYOUT_ROWS):
        codes, scales, _ = nvfp4.encode(rows.to(device), object_id, divisor, search=search)
        data = codes.cpu().contiguous()
        write(memoryview(data.numpy()).cast("B"))
        written += data.numel()
        tiles.append(nvfp4.tile_scales(scales.cpu()))
        advance(nbytes)
    for t in tiles:
        write(memoryview(t.numpy()).cast("B"))
        written += t.numel()
    div = torch.tensor([divisor], dtype=torch.float32).view(torch.uint8)
    write(memoryview(div.numpy()).cast("B"))
    return written + 4
