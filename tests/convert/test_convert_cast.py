"""Value-changing casts: element-wise (chunking does not matter), overflow and range checked."""

from __future__ import annotations

import pytest
import torch
from convert_synth_ckpt import raw_bytes
from ninfer.conversion.cast import cast_chunk, cast_supported
from ninfer.conversion.errors import ConversionError


def _cast(t: torch.Tensor, dtype: str, fmt: str) -> bytes:
    return bytes(cast_chunk(bytearray(raw_bytes(t)), dtype, fmt, "obj"))


def test_float_cast_is_elementwise_and_rounds_like_torch():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    t[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    whole = _cast(t, "F32", "bf16")
    assert whole == raw_bytes(t.to(torch.bfloat16))
    assert b"".join(_cast(t[i:i + 96], "F32", "bf16") for i in range(0, 1000, 96)) == whole
    assert _cast(t.to(torch.bfloat16), "BF16", "fp32") == raw_bytes(t.to(torch.bfloat16).float())
    assert _cast(t.double(), "F64", "fp16") == raw_bytes(t.double().to(torch.float16))


def test_finite_overflow_fails_naming_the_object():
    with pytest.raises(ConversionError, match=r"object 'obj'.*finite F32 value overflows fp16"):
        _cast(torch.tensor([1.0, 70000.0]), "F32", "fp16")
    # An infinity that was already infinite is not an overflow.
    assert _cast(torch.tensor([float("inf")]), "F32", "fp16") == raw_bytes(torch.tensor([float("inf")]).half())


def test_int64_to_int32_is_range_checked():
    ok = torch.tensor([-(2**31), 0, 2**31 - 1], dtype=torch.int64)
    assert _cast(ok, "I64", "int32") == raw_bytes(ok.to(torch.int32))
    with pytest.raises(ConversionError, match=r"outside the int32 range"):
        _cast(torch.tensor([2**31], dtype=torch.int64), "I64", "int32")


def test_supported_casts():
    assert cast_supported("F32", "bf16") and cast_supported("I64", "int32")
    for dtype, fmt in (("F32", "int32"), ("I32", "fp32"), ("F8_E4M3", "bf16"), ("U8", "int32")):
        assert not cast_supported(dtype, fmt)
        with pytest.raises(ConversionError, match="not supported"):
            cast_chunk(bytearray(4), dtype, fmt, "obj")
