"""Value-changing format casts, applied chunk by chunk while a tensor streams into its object.

Only casts with one obvious meaning are supported: float to float (round to nearest even, the
torch conversion) and integer to ``int32``. Invariants of :func:`cast_chunk`:

- element-wise, so casting a tensor in chunks equals casting it whole;
- a finite source value never becomes infinite (a float overflow fails, naming the object), and an
  integer outside the int32 range fails instead of wrapping; NaN and infinities stay what they are.
"""

from __future__ import annotations

import sys

import torch

from ninfer.conversion.errors import ConversionError

ROUNDING = "round-to-nearest-even (torch.Tensor.to)"

_SOURCE_DTYPE = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32,
}
_FORMAT_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int32": torch.int32}
_FLOAT_SOURCES = frozenset({"F64", "F32", "F16", "BF16"})
_FLOAT_FORMATS = frozenset({"bf16", "fp16", "fp32"})
_INT_SOURCES = frozenset({"I64", "I32"})


def cast_supported(dtype: str, fmt: str) -> bool:
    """Whether a source tensor of safetensors ``dtype`` can be cast to storage format ``fmt``."""
    return ((dtype in _FLOAT_SOURCES and fmt in _FLOAT_FORMATS)
            or (dtype in _INT_SOURCES and fmt == "int32"))


def cast_chunk(raw: bytearray, dtype: str, fmt: str, what: str) -> memoryview:
    """Cast whole little-endian elements of ``dtype`` in ``raw`` to ``fmt``; ``what`` names the
    object in errors. Returns the little-endian bytes of the cast values."""
    if sys.byteorder != "little":  # torch reinterprets the buffer in native order
        raise ConversionError(f"object {what!r}: casting needs a little-endian host")
    if not cast_supported(dtype, fmt):
        raise ConversionError(f"object {what!r}: casting {dtype} to {fmt} is not supported")
    src = torch.frombuffer(raw, dtype=_SOURCE_DTYPE[dtype])
    target = _FORMAT_DTYPE[fmt]
    if dtype in _INT_SOURCES:
        info = torch.iinfo(torch.int32)
        if src.numel() and (int(src.min()) < info.min or int(src.max()) > info.max):
            raise ConversionError(f"object {what!r}: a {dtype} value lies outside the int32 range")
        out = src.to(target)
    else:
        out = src.to(target)
        if bool((torch.isfinite(src) & ~torch.isfinite(out)).any()):
            raise ConversionError(f"object {what!r}: a finite {dtype} value overflows {fmt}")
    return memoryview(out.contiguous().view(torch.uint8).numpy())
