"""Quantized weight formats: their definitions, round-to-nearest encoders, decoders and the packed view the
loader hands to ops (docs/artifact-v3.md, "Quantized formats"). Nothing here is model specific."""

from ninfer.quant.errors import QuantizationError
from ninfer.quant.packed import (
    QUANTIZED_FORMATS,
    PackedWeight,
    copy_expert,
    empty_bank,
    encoded_size,
    is_quantized_format,
    packed_view,
    row_tile,
)

__all__ = ["QUANTIZED_FORMATS", "PackedWeight", "QuantizationError", "copy_expert", "empty_bank", "encoded_size",
           "is_quantized_format", "packed_view", "row_tile"]
