"""Triton gdn_gates vs the fp64 oracle of tests/ops/test_gdn_gates.py, on row-strided views as the GDN layer
passes them (a and b are columns of one fused [b | a] projection).

Criterion: pointwise rtol 4e-6 (twice the reference's): the compiled kernel's exp/log are the GPU's fast
approximations (an H200 measured 2.01e-6 relative on a softplus of 4e-18), atol 1e-30 as there."""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import (
    Pointwise,  # noqa: E402
    assert_pointwise,  # noqa: E402
)
from ops.test_gdn_gates import gates_inputs, gates_oracle  # noqa: E402

from .conftest import DEVICE, reference, triton_ops  # noqa: E402

CRIT = Pointwise(4e-6, 1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t_len,hv", [(1, 4), (19, 6), (64, 32)])
def test_gates_match_fp64_on_strided_views(dtype, t_len, hv, gen):
    ops = triton_ops(dtype)
    assert ops.implementation("gdn_gates").name == "triton"
    a, b, neg_a, dt_bias = gates_inputs(gen, t_len, hv, dtype, DEVICE)
    fused = torch.cat((b, a), dim=1)                    # [T, 2Hv]: b then a, row stride 2Hv
    bv, av = fused[:, :hv], fused[:, hv:]
    g, beta = ops.gdn_gates(av, bv, neg_a, dt_bias)
    g_ref, beta_ref = gates_oracle(a, b, neg_a, dt_bias)
    assert_pointwise(g, g_ref, CRIT, f"triton gdn_gates g {dtype} T={t_len}")
    assert_pointwise(beta, beta_ref, CRIT, f"triton gdn_gates beta {dtype} T={t_len}")
    g_r, beta_r = reference(dtype).gdn_gates(a, b, neg_a, dt_bias)
    assert_pointwise(g, g_r, CRIT, "triton vs reference g")
    assert_pointwise(beta, beta_r, CRIT, "triton vs reference beta")


def test_empty_batch(gen):
    ops = triton_ops(torch.float32)
    z = torch.empty((0, 4), device=DEVICE)
    g, beta = ops.gdn_gates(z, z, -torch.ones(4, device=DEVICE), torch.zeros(4, device=DEVICE))
    assert g.shape == beta.shape == (0, 4)

