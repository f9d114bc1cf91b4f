"""gdn_gates (reference) against an fp64 oracle: g = neg_a * softplus(a + dt_bias), beta = sigmoid(b).

Criteria (pointwise): fp32 rtol 2e-6 (a few ulps through exp/log1p), atol 1e-30 -- the tiny gates of very
negative arguments (softplus(x) ~ e^x) must keep relative accuracy, since e^g multiplies the state every token.
"""

import pytest
import torch

from .conftest import DTYPES, Pointwise, assert_pointwise, f64, randn, reference_ops

CRIT = Pointwise(2e-6, 1e-30)


def gates_oracle(a, b, neg_a, dt_bias):
    x = f64(a) + f64(dt_bias)
    soft = torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
    return f64(neg_a) * soft, torch.sigmoid(f64(b))


def gates_inputs(gen, t_len, hv, dtype, device):
    # Arguments from -40 (softplus ~ 4e-18) through the threshold 20 to 30; b across the sigmoid's range.
    a = (torch.linspace(-40.0, 30.0, t_len * hv).reshape(t_len, hv)
         + 0.01 * randn(gen, t_len, hv)).to(dtype).to(device)
    b = randn(gen, t_len, hv, dtype=dtype, device=device, scale=4.0)
    neg_a = -torch.exp(randn(gen, hv)).to(device)
    dt_bias = (0.5 * randn(gen, hv)).to(device)
    return a, b, neg_a, dt_bias


@pytest.mark.parametrize("dtype", DTYPES)
def test_gates_match_fp64(device, dtype, gen):
    ops = reference_ops(device, dtype)
    a, b, neg_a, dt_bias = gates_inputs(gen, 37, 6, dtype, device)
    g, beta = ops.gdn_gates(a, b, neg_a, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (37, 6)
    g_ref, beta_ref = gates_oracle(a, b, neg_a, dt_bias)
    assert_pointwise(g, g_ref, CRIT, f"gdn_gates g {dtype}")
    assert_pointwise(beta, beta_ref, CRIT, f"gdn_gates beta {dtype}")
    assert (g <= 0).all()
