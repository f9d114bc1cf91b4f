"""The converter's quantizing writer: encoding a multi-source object a few rows at a time writes exactly the
bytes of encoding it whole, planes at their aligned offsets."""

from __future__ import annotations

import io

import pytest
import torch
from ninfer.conversion.errors import ConversionError
from ninfer.conversion.quantize import write_quantized
from ninfer.quant import encoded_size, packed_view


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16",
                                 "fp8_e4m3fn_row_bf16"])
def test_chunked_encoding_equals_whole(fmt):
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(7, 200, generator=g), torch.randn(5, 200, generator=g)
    files = [io.BytesIO(a.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()),
             io.BytesIO(b.to(torch.bfloat16).view(torch.uint8).numpy().tobytes())]
    for f, name in zip(files, ("a", "b"), strict=True):
        f.name = name

    def run(chunk_bytes: int) -> bytes:
        out = bytearray()
        spans = [(f.name, f, 0, len(f.getvalue())) for f in files]
        n = write_quantized(lambda data: out.extend(bytes(data)), "obj", fmt, "BF16", 200, spans, chunk_bytes,
                            lambda _: None)
        assert n == len(out)
        return bytes(out)

    whole, rows = run(1 << 20), run(3 * 200 * 2)          # everything at once / three rows a chunk
    assert whole == rows and len(whole) == encoded_size(fmt, (12, 200))
    parent = torch.frombuffer(bytearray(whole), dtype=torch.uint8)
    got = packed_view(fmt, parent, (12, 200), 0, 2400, (12, 200)).dequantize(torch.float64)
    want = torch.cat((a, b)).to(torch.bfloat16).double()
    assert float((got - want).abs().max()) < 0.2 * float(want.abs().max())


def test_integer_source_is_refused():
    f = io.BytesIO(bytes(64 * 4))
    f.name = "ids"
    with pytest.raises(ConversionError, match="'obj': a I32 source cannot be quantized"):
        write_quantized(lambda d: None, "obj", "q8_g32_fp16", "I32", 16, [("ids", f, 0, 64 * 4)], 1 << 20,
                        lambda _: None)
