"""``empty_bank`` / ``copy_expert`` (``ninfer.quant.packed``): a device cache of a quantized host bank's experts holds
them as stored. Checked for every quantized format: a slot filled from an expert decodes to that expert's values,
the other slots stay zero, and a bank of another format or shape is refused."""

from __future__ import annotations

import pytest
import torch
from ninfer.quant import QUANTIZED_FORMATS, QuantizationError, copy_expert, empty_bank, packed_view
from ops_triton.quant_cases import parent_bytes


def _bank(fmt: str, experts: int = 5, rows: int = 128, k: int = 64, seed: int = 0):
    dense = torch.randn(experts, rows, k, generator=torch.Generator().manual_seed(seed))
    parent = parent_bytes(fmt, dense.reshape(-1, k))
    return packed_view(fmt, parent, tuple(dense.shape), 0, dense.numel(), tuple(dense.shape))


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_a_slot_holds_the_expert_it_was_given(fmt):
    host = _bank(fmt)
    cache = empty_bank(host, 3, "cpu")
    assert cache.format == fmt and cache.shape == (3, 128, 64)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(cache.planes, host.planes, strict=True) if p.numel())
    copy_expert(cache, 2, host, 4)
    copy_expert(cache, 0, host, 1)
    values = host.dequantize()
    assert torch.equal(cache[2].dequantize(), values[4]) and torch.equal(cache[0].dequantize(), values[1])
    assert not cache[1].dequantize().any()
    with pytest.raises(QuantizationError, match="does not fit a slot"):
        copy_expert(cache, 0, _bank(fmt, rows=256), 0)


def test_a_slot_of_another_format_is_refused():
    with pytest.raises(QuantizationError, match="q8_g32_fp16 bank"):
        copy_expert(empty_bank(_bank("q4_g64_fp16"), 2, "cpu"), 0, _bank("q8_g32_fp16"), 0)
