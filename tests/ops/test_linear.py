"""linear: x @ W^T against a naive fp64 GEMM oracle.

Criteria (normwise, cap relative to max|ref|):
- fp32: rel 2e-6, cap 2e-5 -- fp32 accumulation over <= 200 terms stays near 1e-7 normwise.
- bf16: rel 8e-3, cap 2e-2 -- one bf16 rounding of the output (2^-9 relative) plus fp32 accumulation.
"""

import pytest
import torch

from .conftest import DTYPES, Normwise, assert_normwise, f64, randn, reference_ops

CRIT = {torch.float32: Normwise(2e-6, 2e-5), torch.bfloat16: Normwise(8e-3, 2e-2)}


def oracle(x, w):
    x, w = f64(x), f64(w)
    out = torch.zeros(x.shape[:-1] + (w.shape[0],), dtype=torch.float64)
    for j in range(w.shape[0]):  # one output feature at a time: a plain dot product per element
        out[..., j] = (x * w[j]).sum(-1)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64, 24), (2, 5, 200, 33)])
def test_linear_matches_fp64(device, dtype, shape, gen):
    *lead, n_in, n_out = shape
    ops = reference_ops(device, dtype)
    x = randn(gen, *lead, n_in, dtype=dtype, device=device)
    w = randn(gen, n_out, n_in, dtype=dtype, device=device, scale=n_in ** -0.5)
    x_before = x.clone()
    out = ops.linear(x, w)
    assert out.dtype == dtype and out.device.type == device
    assert_normwise(out, oracle(x, w), CRIT[dtype], f"linear {dtype} {shape}")
    assert torch.equal(x, x_before)


def test_linear_mixed_weight_dtype_uses_wider_type(device, gen):
    # bf16 weights with fp32 activations: the result must be as accurate as an fp32 GEMM on the bf16 values.
    ops = reference_ops(device, torch.float32)
    x = randn(gen, 7, 48, device=device)
    w = randn(gen, 16, 48, dtype=torch.bfloat16, device=device)
    out = ops.linear(x, w)
    assert out.dtype == torch.float32
    assert_normwise(out, oracle(x, w), CRIT[torch.float32], "linear mixed")
