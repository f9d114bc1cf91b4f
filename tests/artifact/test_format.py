"""Framing constants, header structs and the format table."""

from __future__ import annotations

import pytest
import torch
from ninfer.artifact.errors import (
    BadMagicError,
    SchemaError,
    TruncatedFileError,
    UnknownFormatError,
    UnknownLayoutError,
    UnsupportedVersionError,
)
from ninfer.artifact.format import (
    FORMATS,
    SUPPORTED_FORMATS,
    EntryHeader,
    PartHeader,
    align_up,
    encoded_size,
    interpret,
    part_file_name,
)

AID = bytes(range(16))


def test_entry_header_layout_and_round_trip():
    raw = EntryHeader(5000, AID).pack()
    assert raw == b"NINFER\x00\x03" + (5000).to_bytes(8, "little") + AID
    h = EntryHeader.unpack(raw, "f")
    assert h == EntryHeader(5000, AID) and h.payload_start == 8192
    assert EntryHeader(4064, AID).payload_start == 4096 and EntryHeader(4065, AID).payload_start == 8192


def test_part_header_layout_and_errors():
    raw = PartHeader(3, AID).pack()
    assert raw == b"NINPRT\x00\x03" + (3).to_bytes(8, "little") + AID
    assert PartHeader.unpack(raw, "p") == PartHeader(3, AID)
    with pytest.raises(BadMagicError, match="part"):
        PartHeader.unpack(EntryHeader(1, AID).pack(), "p")
    with pytest.raises(UnsupportedVersionError, match="version 4"):
        PartHeader.unpack(b"NINPRT\x00\x04" + raw[8:], "p")
    with pytest.raises(TruncatedFileError, match="p: 31 bytes"):
        PartHeader.unpack(raw[:31], "p")
    with pytest.raises(SchemaError, match="json_bytes = 0"):
        EntryHeader.unpack(EntryHeader(0, AID).pack(), "e")


def test_align_and_part_names():
    assert [align_up(n, 256) for n in (0, 1, 256, 257)] == [0, 256, 256, 512]
    assert part_file_name("m.ninfer", 1) == "m.ninfer.part-0001"
    assert part_file_name("m.ninfer", 12345) == "m.ninfer.part-12345"
    with pytest.raises(ValueError):
        part_file_name("m.ninfer", 0)


def test_format_table():
    raw = ("bf16", "fp16", "fp32", "int32")
    quantized = ("q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16", "nvfp4", "fp8_e4m3fn_row_bf16")
    assert SUPPORTED_FORMATS == raw + quantized
    assert {n: (FORMATS[n].element_bytes, FORMATS[n].dtype) for n in raw} == {
        "bf16": (2, torch.bfloat16), "fp16": (2, torch.float16), "fp32": (4, torch.float32),
        "int32": (4, torch.int32)}
    for name in quantized:
        assert FORMATS[name].quantized and FORMATS[name].dtype == torch.uint8
    # the container's worked sizes: Q4 [7168, 5120], Q5 [2, 130], FP8 [14336, 5120]
    assert encoded_size("q4_g64_fp16", "row_split_k128_v1", (7168, 5120)) == 19_496_960
    assert encoded_size("q5_g64_fp16", "row_split_k128_v1", (2, 130)) == 528
    assert encoded_size("fp8_e4m3fn_row_bf16", "row_scale_v1", (14336, 5120)) == 73_428_992
    assert encoded_size("fp32", "contiguous_le_v1", ()) == 4
    assert encoded_size("bf16", "contiguous_le_v1", (3, 5, 7)) == 210


def test_interpret_errors_name_the_object():
    with pytest.raises(UnknownFormatError, match="'w'.*'int4'"):
        interpret("int4", "contiguous_le_v1", object_id="w")
    assert interpret("nvfp4", "block_scale_k16_m128x4_v1", object_id="w").quantized
    with pytest.raises(UnknownLayoutError, match="'w'.*'row_scale_v1'.*'fp16'"):
        interpret("fp16", "row_scale_v1", object_id="w", path="m.ninfer")
    with pytest.raises(UnknownLayoutError, match="unknown layout"):
        interpret("fp16", "contiguous_be_v1", object_id="w")
