"""Triton silu_and_mul vs the fp64 oracle and criteria of tests/ops/test_activation.py, on contiguous and
row-strided inputs (the MoE shared expert's half of a fused projection), 3-D inputs and odd widths."""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import assert_pointwise, f64, randn  # noqa: E402
from ops.oracles import assert_bf16_within_one_ulp  # noqa: E402
from ops.test_activation import CRIT  # noqa: E402

from .conftest import DEVICE, reference, triton_ops  # noqa: E402


def oracle(x):
    xd = f64(x)
    half = xd.shape[-1] // 2
    return xd[..., :half] / (1.0 + torch.exp(-xd[..., :half])) * xd[..., half:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 37), (3, 5, 2 * 37), (4, 2 * 1500)])
def test_silu_and_mul(dtype, shape, gen):
    ops = triton_ops(dtype)
    assert ops.implementation("silu_and_mul").name == "triton"
    x = randn(gen, *shape, dtype=dtype, device=DEVICE, scale=3.0)
    out = ops.silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (*shape[:-1], shape[-1] // 2)
    assert_pointwise(out, oracle(x), CRIT[dtype], f"silu_and_mul {dtype} {shape}")
    ref = reference(dtype).silu_and_mul(x)
    if dtype == torch.bfloat16:
        assert_bf16_within_one_ulp(out, ref, "silu_and_mul vs reference")


def test_row_strided_view(gen):
    ops = triton_ops(torch.bfloat16)
    wide = randn(gen, 6, 2 * 40 + 9, dtype=torch.bfloat16, device=DEVICE, scale=3.0)
    x = wide[:, 3:3 + 80]                           # row stride 89, last dim contiguous
    assert_pointwise(ops.silu_and_mul(x), oracle(x), CRIT[torch.bfloat16], "strided silu_and_mul")


def test_odd_width_is_an_error(gen):
    with pytest.raises(ValueError, match="not even"):
        triton_ops(torch.float32).silu_and_mul(torch.zeros(2, 7, device=DEVICE))
