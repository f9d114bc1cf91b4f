"""gdn_decode (a GDN layer's decode step after its input projection) vs the fp64 composition of the oracles of
the four ops it is defined by: gates, causal conv update, recurrent step, gated RMSNorm.

Criteria: those of gdn_recurrent_step's output and state (tests/ops/test_gdn.py); the conv states are copies of
inputs (bit-exact); slots no row reads stay bit-identical.
"""

import pytest
import torch

from .conftest import reference_ops
from .shared_checks import check_gdn_decode
from .test_gdn import OUT, STATE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bsz,hk,hv,dk,dv", [(1, 2, 2, 16, 16), (3, 1, 4, 16, 8), (2, 2, 4, 12, 40)])
def test_gdn_decode_matches_the_composed_oracles(device, dtype, bsz, hk, hv, dk, dv, gen):
    check_gdn_decode(reference_ops(device, dtype), device, dtype, bsz, hk, hv, dk, dv, gen, OUT[dtype], STATE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_in_and_step_split_the_fused_projection(device, dtype, gen):
    """gdn_decode_in (pre-norm, [qkv | z | b | a] projection, gates, conv) then gdn_decode_step equals
    add_rms_norm_linear then gdn_decode on the same rows: the row blocks are split in the layer's order."""
    from .conftest import randn
    from .shared_checks import gdn_decode_case

    ops = reference_ops(device, dtype)
    hk, hv, dk, dv, hidden = 1, 2, 8, 8, 16
    (mixed, _, _, _, p), conv_states, states, slots = gdn_decode_case(gen, device, dtype, 2, hk, hv, dk, dv)
    c, vd = mixed.shape[1], hv * dv
    x, residual = randn(gen, 2, hidden, dtype=dtype, device=device), randn(gen, 2, hidden, dtype=dtype, device=device)
    norm_w = randn(gen, hidden, dtype=dtype, device=device, scale=0.1)
    weight = randn(gen, c + vd + 2 * hv, hidden, dtype=dtype, device=device, scale=0.25)
    conv2, states2 = conv_states.clone(), states.clone()
    y, z, g, beta, res = ops.gdn_decode_in(x, residual, norm_w, 1e-6, weight, p, conv_states, slots)
    o = ops.gdn_decode_step(y, z, g, beta, p, states, slots)
    proj, _, res2 = ops.add_rms_norm_linear(x, residual, norm_w, 1e-6, weight)
    m, z2, b2, a2 = proj.split([c, vd, hv, hv], dim=-1)
    o2 = ops.gdn_decode(m, z2.reshape(2, hv, dv), a2, b2, p, conv2, states2, slots)
    for a, b, what in ((o, o2, "output"), (states, states2, "states"), (conv_states, conv2, "conv states"),
                       (res, res2, "residual")):
        assert torch.equal(a, b), what
    with pytest.raises(ValueError, match=r"gdn_decode_in: weight has \d+ rows, the layer needs"):
        ops.gdn_decode_in(x, residual, norm_w, 1e-6, weight[1:], p, conv_states, slots)
