"""V3 framing constants, the two 32-byte headers, and the format/layout table.

Invariants (docs/artifact-v3.md):
- entry header = ``NINFER\\0`` + version byte 3, ``json_bytes`` (LE u64, > 0), 16-byte artifact id;
  the JSON starts at byte 32 and the payload at ``align_up(32 + json_bytes, 4096)``;
- part header = ``NINPRT\\0`` + version byte 3, ``part_index`` (LE u64, its index in the file table),
  the same artifact id; the payload starts at byte 4096;
- tensor objects start at a multiple of 256 in the logical payload, resources anywhere;
- raw formats store little-endian words under ``contiguous_le_v1``; the quantized formats this engine
  implements (groupwise q4/q5/q6/q8 under ``row_split_k128_v1``, fp8 row-scaled under ``row_scale_v1``, nvfp4
  under ``block_scale_k16_m128x4_v1``; defined in :mod:`ninfer.quant`) are loaded as their stored bytes; a format
  V3 names that this engine does not implement would be known (so a file holding it parses) but interpreting it
  raises :class:`UnsupportedFormatError` (no such format today).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.artifact.errors import (
    BadMagicError,
    SchemaError,
    TruncatedFileError,
    UnknownFormatError,
    UnknownLayoutError,
    UnsupportedFormatError,
    UnsupportedVersionError,
)
from ninfer.quant import QuantizationError
from ninfer.quant import encoded_size as quantized_size

VERSION = 3
ENTRY_MAGIC_STEM = b"NINFER\x00"
PART_MAGIC_STEM = b"NINPRT\x00"
ENTRY_MAGIC = ENTRY_MAGIC_STEM + bytes([VERSION])
PART_MAGIC = PART_MAGIC_STEM + bytes([VERSION])
HEADER_BYTES = 32
ARTIFACT_ID_BYTES = 16
PAYLOAD_ALIGN = 4096                 # entry payload start is a multiple of this
PART_PAYLOAD_START = 4096            # fixed: parts carry no JSON
TENSOR_ALIGN = 256                   # logical payload offset alignment of tensor objects
RESOURCE_ALIGN = 1
MAX_RANK = 16
DEFAULT_MAX_FILE_BYTES = 32_000_000_000   # decimal 32 GB, counting header + JSON + padding + payload

CHECKSUM_ALGORITHM = "xxh64"
# "xxh64:" + 16 lowercase hex digits: fixed width so the writer can rewrite the JSON in place.
CHECKSUM_PLACEHOLDER = "xxh64:" + "0" * 16

LAYOUT_CONTIGUOUS = "contiguous_le_v1"
LAYOUT_ROW_SPLIT = "row_split_k128_v1"
LAYOUT_NVFP4 = "block_scale_k16_m128x4_v1"
LAYOUT_ROW_SCALE = "row_scale_v1"
RESOURCE_ENCODING = "raw_bytes_v1"

_ENTRY = struct.Struct("<8sQ16s")
_PART = struct.Struct("<8sQ16s")
assert _ENTRY.size == HEADER_BYTES and _PART.size == HEADER_BYTES


def align_up(value: int, alignment: int) -> int:
    """The smallest multiple of ``alignment`` that is >= ``value``."""
    return -(-value // alignment) * alignment


def element_count(shape: Sequence[int]) -> int:
    """Elements of a C-order shape; ``()`` is a scalar with one element."""
    return math.prod(shape)


def part_file_name(entry_name: str, index: int) -> str:
    """``<entry name>.part-NNNN``: index from 1, at least four digits (wider when needed)."""
    if index < 1:
        raise ValueError(f"part index must be >= 1, got {index}")
    return f"{entry_name}.part-{index:04d}"


def checksum_string(hexdigest: str) -> str:
    return f"{CHECKSUM_ALGORITHM}:{hexdigest}"


# -- headers -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EntryHeader:
    """The entry file's 32 bytes. Invariant: ``json_bytes > 0``; ``artifact_id`` is 16 bytes."""

    json_bytes: int
    artifact_id: bytes

    @property
    def payload_start(self) -> int:
        return align_up(HEADER_BYTES + self.json_bytes, PAYLOAD_ALIGN)

    def pack(self) -> bytes:
        return _ENTRY.pack(ENTRY_MAGIC, self.json_bytes, self.artifact_id)

    @classmethod
    def unpack(cls, raw: bytes, path) -> EntryHeader:
        if len(raw) < HEADER_BYTES:
            raise TruncatedFileError(f"{path}: {len(raw)} bytes, shorter than the 32-byte entry header")
        magic, json_bytes, artifact_id = _ENTRY.unpack(raw[:HEADER_BYTES])
        _check_magic(magic, ENTRY_MAGIC_STEM, "entry", path)
        if json_bytes == 0:
            raise SchemaError(f"{path}: entry header declares an empty JSON directory (json_bytes = 0)")
        return cls(json_bytes, artifact_id)


@dataclass(frozen=True)
class PartHeader:
    """A continuation part's 32 bytes. Invariant: ``part_index`` >= 1 is its file-table index."""

    part_index: int
    artifact_id: bytes

    def pack(self) -> bytes:
        return _PART.pack(PART_MAGIC, self.part_index, self.artifact_id)

    @classmethod
    def unpack(cls, raw: bytes, path) -> PartHeader:
        if len(raw) < HEADER_BYTES:
            raise TruncatedFileError(f"{path}: {len(raw)} bytes, shorter than the 32-byte part header")
        magic, index, artifact_id = _PART.unpack(raw[:HEADER_BYTES])
        _check_magic(magic, PART_MAGIC_STEM, "part", path)
        return cls(index, artifact_id)


def _check_magic(magic: bytes, stem: bytes, what: str, path) -> None:
    if magic[:7] != stem:
        raise BadMagicError(f"{path}: not a .ninfer {what} file (magic {magic.hex()}, "
                            f"expected {(stem + bytes([VERSION])).hex()})")
    if magic[7] != VERSION:
        raise UnsupportedVersionError(
            f"{path}: .ninfer container version {magic[7]}, this reader reads only version {VERSION}"
            + (" (upgrade V2 files offline)" if magic[7] == 2 else ""))


# -- formats -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FormatInfo:
    """One row of the format table.

    ``supported`` raw formats have ``element_bytes`` and ``dtype`` and store raw words under
    ``contiguous_le_v1``; ``quantized`` supported formats are held as their stored bytes (``dtype`` uint8,
    ``element_bytes`` None); the others are named by V3 but not loadable by this engine.
    """

    name: str
    layouts: tuple[str, ...]
    supported: bool
    element_bytes: int | None = None
    dtype: torch.dtype | None = None
    description: str = ""
    quantized: bool = False


FORMATS: dict[str, FormatInfo] = {f.name: f for f in (
    FormatInfo("bf16", (LAYOUT_CONTIGUOUS,), True, 2, torch.bfloat16, "bfloat16 words"),
    FormatInfo("fp16", (LAYOUT_CONTIGUOUS,), True, 2, torch.float16, "IEEE binary16 words"),
    FormatInfo("fp32", (LAYOUT_CONTIGUOUS,), True, 4, torch.float32, "IEEE binary32 words"),
    FormatInfo("int32", (LAYOUT_CONTIGUOUS,), True, 4, torch.int32, "two's complement 32-bit words"),
    FormatInfo("q4_g64_fp16", (LAYOUT_ROW_SPLIT,), True, None, torch.uint8, "4-bit codes, group 64, fp16 scale", True),
    FormatInfo("q5_g64_fp16", (LAYOUT_ROW_SPLIT,), True, None, torch.uint8, "5-bit codes, group 64, fp16 scale", True),
    FormatInfo("q6_g64_fp16", (LAYOUT_ROW_SPLIT,), True, None, torch.uint8, "6-bit codes, group 64, fp16 scale", True),
    FormatInfo("q8_g32_fp16", (LAYOUT_ROW_SPLIT,), True, None, torch.uint8, "8-bit codes, group 32, fp16 scale", True),
    FormatInfo("nvfp4", (LAYOUT_NVFP4,), True, None, torch.uint8, "E2M1 codes, E4M3 block-16 scales, fp32 divisor",
               True),
    FormatInfo("fp8_e4m3fn_row_bf16", (LAYOUT_ROW_SCALE,), True, None, torch.uint8, "E4M3FN codes, bf16 row scale", True),
)}

KNOWN_LAYOUTS: frozenset[str] = frozenset(
    {LAYOUT_CONTIGUOUS, LAYOUT_ROW_SPLIT, LAYOUT_NVFP4, LAYOUT_ROW_SCALE})

SUPPORTED_FORMATS: tuple[str, ...] = tuple(name for name, f in FORMATS.items() if f.supported)
RAW_FORMATS: tuple[str, ...] = tuple(name for name, f in FORMATS.items() if f.supported and not f.quantized)
QUANTIZED_FORMATS: tuple[str, ...] = tuple(name for name, f in FORMATS.items() if f.quantized)


def interpret(format: str, layout: str, *, object_id: str, path=None) -> FormatInfo:
    """The loadable format of an object, or the exact error saying why it cannot be loaded.

    Raises, in this order of checks, :class:`UnknownFormatError`, :class:`UnsupportedFormatError`
    (a known quantized format) or :class:`UnknownLayoutError` (unknown layout, or one not defined
    for the format).
    """
    where = f"{path}: object {object_id!r}" if path is not None else f"object {object_id!r}"
    info = FORMATS.get(format)
    if info is None:
        raise UnknownFormatError(f"{where} has unknown format {format!r} (known: {', '.join(FORMATS)})")
    if not info.supported:
        raise UnsupportedFormatError(
            f"{where} uses format {format!r} ({info.description}), which V3 defines but this engine "
            f"cannot load yet; loadable formats: {', '.join(SUPPORTED_FORMATS)}")
    if layout not in KNOWN_LAYOUTS:
        raise UnknownLayoutError(f"{where} has unknown layout {layout!r}")
    if layout not in info.layouts:
        raise UnknownLayoutError(f"{where}: layout {layout!r} is not defined for format {format!r} "
                                 f"(allowed: {', '.join(info.layouts)})")
    return info


def is_interpretable(format: str, layout: str) -> bool:
    info = FORMATS.get(format)
    return info is not None and info.supported and layout in info.layouts


def encoded_size(format: str, layout: str, shape: Sequence[int], *, object_id: str = "?") -> int:
    """Bytes of a loadable (format, layout, shape): elements x element width, no padding, for a raw
    format; the layout's plane sizes for a quantized one (a shape it cannot hold is a :class:`SchemaError`)."""
    info = interpret(format, layout, object_id=object_id)
    if info.quantized:
        try:
            return quantized_size(format, tuple(shape))
        except QuantizationError as exc:
            raise SchemaError(f"object {object_id!r}: {exc}") from None
    assert info.element_bytes is not None
    return element_count(shape) * info.element_bytes
