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
