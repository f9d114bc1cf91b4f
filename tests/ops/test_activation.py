"""silu_and_mul: silu(x[..., :I]) * x[..., I:] against an fp64 elementwise oracle.

Criteria (pointwise): fp32 rtol 1e-6 (a few ulps of fp32 math), bf16 rtol 2^-8 (one output rounding of
at most 2^-9 relative, doubled for margin); atol 1e-6 * max|ref| absorbs fp32 cancellation near zero.
"""

import pytest
import torch

from .conftest import DTYPES, Pointwise, assert_pointwise, f64, randn, reference_ops

CRIT = {torch.float32: Pointwise(1e-6, 1e-6), torch.bfloat16: Pointwise(2 ** -8, 1e-6)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_fp64(device, dtype, gen):
    ops = reference_ops(device, dtype)
    x = randn(gen, 3, 5, 2 * 37, dtype=dtype, device=device, scale=3.0)
    out = ops.silu_and_mul(x)
    xd = f64(x)
    gate, up = xd[..., :37], xd[..., 37:]
    ref = gate / (1.0 + torch.exp(-gate)) * up
    assert out.dtype == dtype and out.shape == (3, 5, 37)
    assert_pointwise(out, ref, CRIT[dtype], f"silu_and_mul {dtype}")
