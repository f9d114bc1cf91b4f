"""rms_norm_unit_offset / add_rms_norm_unit_offset / add_rms_norm_unit_offset_linear / gated_rms_norm against fp64 oracles with the contract's declared casts.

Criteria (pointwise, |err| <= rtol |ref| + atol max|ref|):
- fp32: rtol 4e-6, atol 1e-6 -- fp32 mean of squares and a few products.
- bf16 (rms_norm_unit_offset, add_rms_norm_unit_offset): rtol 2^-8 -- the single output rounding (<= 2^-9) with margin.
- bf16 gated_rms_norm: rtol 2^-7 -- the oracle applies the declared cast of the normalised value, but the
  model-faithful bf16 product n * weight adds one more bf16 rounding before the final one.
"""

import pytest
import torch

from .conftest import DTYPES, Pointwise, assert_pointwise, randn, reference_ops
from .oracles import NORM_EPS as EPS
from .oracles import assert_bf16_within_one_ulp, gated_rms_bf16_cast_chain, gated_rms_oracle, rms_oracle
from .shared_checks import check_add_rms_norm, check_add_rms_norm_linear
from .test_linear import CRIT as LINEAR_CRIT

CRIT = {torch.float32: Pointwise(4e-6, 1e-6), torch.bfloat16: Pointwise(2 ** -8, 1e-6)}
CRIT_GATED = {torch.float32: Pointwise(4e-6, 1e-6), torch.bfloat16: Pointwise(2 ** -7, 1e-6)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_zero_centred(device, dtype, gen):
    ops = reference_ops(device, dtype)
    x = randn(gen, 4, 3, 96, dtype=dtype, device=device, scale=2.5)
    w = randn(gen, 96, dtype=dtype, device=device, scale=0.3)
    out = ops.rms_norm_unit_offset(x, w, EPS)
    assert out.dtype == dtype
    assert_pointwise(out, rms_oracle(x, w), CRIT[dtype], f"rms_norm_unit_offset {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(device, dtype, gen):
    check_add_rms_norm(reference_ops(device, dtype), device, dtype, 64, gen, CRIT[dtype], EPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_cast_order(device, dtype, gen):
    ops = reference_ops(device, dtype)
    x = randn(gen, 6, 4, 32, dtype=dtype, device=device, scale=2.0)
    gate = randn(gen, 6, 4, 32, dtype=dtype, device=device, scale=2.0)
    w = (1.0 + randn(gen, 32, scale=0.2)).to(dtype).to(device)  # plain weight around 1
    out = ops.gated_rms_norm(x, gate, w, EPS)
    assert out.dtype == dtype
    assert_pointwise(out, gated_rms_oracle(x, gate, w, dtype), CRIT_GATED[dtype], f"gated_rms_norm {dtype}")


def test_gated_rms_norm_uses_plain_weight_not_one_plus(device, gen):
    # A zero weight must zero the output (1 + w would not): guards against reusing the zero-centred norm.
    ops = reference_ops(device, torch.float32)
    x = randn(gen, 3, 16, device=device)
    gate = randn(gen, 3, 16, device=device)
    out = ops.gated_rms_norm(x, gate, torch.zeros(16, device=device), EPS)
    assert torch.count_nonzero(out) == 0


def test_gated_rms_norm_bf16_cast_chain_bitwise(device, gen):
    # The declared cast chain changes bf16 bits by up to an ulp, which the tolerance above cannot see. Model
    # every cast exactly (bf16*bf16 products are exact in fp64, so each rounding happens where the contract
    # puts it); production then differs only where fp32-vs-fp64 noise straddles a bf16 rounding boundary.
    ops = reference_ops(device, torch.bfloat16)
    x = randn(gen, 64, 64, dtype=torch.bfloat16, device=device, scale=2.0)
    gate = randn(gen, 64, 64, dtype=torch.bfloat16, device=device, scale=2.0)
    w = (1.0 + randn(gen, 64, scale=0.2)).to(torch.bfloat16).to(device)
    out = ops.gated_rms_norm(x, gate, w, EPS)
    assert_bf16_within_one_ulp(out, gated_rms_bf16_cast_chain(x, gate, w), "gated_rms_norm bf16 cast chain")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_linear(device, dtype, gen):
    # The block's pre-norm and first projection (linear's criteria for y, over the normed rows returned).
    check_add_rms_norm_linear(reference_ops(device, dtype), device, dtype, 3, 64, 24, gen, CRIT[dtype],
                              LINEAR_CRIT[dtype], EPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_swiglu_is_the_composition(device, dtype, gen):
    # By definition (contract): add_rms_norm_unit_offset_linear, then silu_and_mul of its output -- bit for bit; a gate_up
    # with an odd number of rows is an error naming the op.
    ops = reference_ops(device, dtype)
    x = randn(gen, 3, 64, dtype=dtype, device=device)
    res = randn(gen, 3, 64, dtype=dtype, device=device)
    w = randn(gen, 64, dtype=dtype, device=device, scale=0.3)
    gate_up = randn(gen, 2 * 24, 64, dtype=dtype, device=device, scale=0.125)
    act, h, new_res = ops.add_rms_norm_unit_offset_swiglu(x, res, w, EPS, gate_up)
    y, h2, res2 = ops.add_rms_norm_unit_offset_linear(x, res, w, EPS, gate_up)
    assert torch.equal(act, ops.silu_and_mul(y)) and torch.equal(h, h2) and torch.equal(new_res, res2)
    with pytest.raises(ValueError, match="add_rms_norm_unit_offset_swiglu"):
        ops.add_rms_norm_unit_offset_swiglu(x, res, w, EPS, gate_up[:-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_rms_norm_is_the_gather_then_rms_norm(device, dtype, gen):
    ops = reference_ops(device, dtype)
    table = randn(gen, 50, 96, dtype=dtype, device=device, scale=2.5)
    w = randn(gen, 96, dtype=dtype, device=device, scale=0.3)
    tokens = torch.tensor([3, 49, 0, 3, 17], device=device)
    normed, rows = ops.embed_rms_norm_unit_offset(tokens, table, w, EPS)
    assert torch.equal(rows, table[tokens]) and rows.data_ptr() != table.data_ptr()
    assert normed.dtype == dtype
    assert_pointwise(normed, rms_oracle(table[tokens], w), CRIT[dtype], f"embed_rms_norm_unit_offset {dtype}")
    if device == "cpu":   # on CUDA torch's index_select checks ids with a device-side assert instead
        with pytest.raises(IndexError):
            ops.embed_rms_norm_unit_offset(torch.tensor([50], device=device), table, w, EPS)
