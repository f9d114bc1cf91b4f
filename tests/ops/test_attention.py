"""paged_attention / paged_decode_attention vs an fp64 dense causal GQA oracle.

Every case runs under three page-table layouts -- identity, contiguous with an offset, and fragmented (a random
permutation of the pool) -- which must give bit-identical outputs. Pools start as NaN so reading any slot
past a row's length poisons the output, and page-table entries past a row's pages point outside the pool so
reading them raises.
Criteria (normwise, cap relative to max|ref|): fp32 rel 2e-6 / cap 2e-5 (fp32 softmax and two GEMMs over
<= 33 keys); bf16 rel 8e-3 / cap 3e-2 (one bf16 rounding of the output dominates).
"""

import pytest
import torch

from .conftest import DTYPES, Normwise, reference_ops
from .shared_checks import check_paged_attention

CRIT = {torch.float32: Normwise(2e-6, 2e-5), torch.bfloat16: Normwise(8e-3, 3e-2)}

# (q_len, kv_len) per row: last positions 0, 1, 14, 15, 16, 32 and prefill over a prefix; one empty row.
ROWS = [(1, 1), (2, 2), (1, 17), (16, 16), (5, 33), (0, 4), (2, 15)]


def run_case(device, dtype, page, hq, hkv, d, rows, gen, decode):
    check_paged_attention(reference_ops(device, dtype), device, dtype, CRIT[dtype], page, hq, hkv, d, rows, gen,
                          decode)


GEOMETRIES = [(page, hq, hkv, 8) for page in (1, 16, 7) for hq, hkv in ((2, 2), (8, 2))] + [(16, 4, 1, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page,hq,hkv,d", GEOMETRIES)
def test_paged_attention(device, dtype, page, hq, hkv, d, gen):
    run_case(device, dtype, page, hq, hkv, d, ROWS, gen, decode=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page,hq,hkv,d", [(1, 2, 2, 8), (16, 8, 2, 8), (7, 4, 1, 256)])
def test_paged_decode_attention(device, dtype, page, hq, hkv, d, gen):
    run_case(device, dtype, page, hq, hkv, d, [(1, n) for n in (1, 2, 15, 16, 17, 33)], gen, decode=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_the_output_gate(device, dtype, kind, gen):
    # By definition (contract): the ungated output times torch's sigmoid(gate), in q.dtype -- bit for bit;
    # a gate of the wrong shape names the problem.
    from .shared_checks import (
        check_a_wrong_gate_is_refused,
        check_gated_decode_attention,
        check_gated_prefill_attention,
    )

    check = check_gated_decode_attention if kind == "decode" else check_gated_prefill_attention
    gated, composed = check(reference_ops(device, dtype), device, dtype, gen)
    assert torch.equal(gated, composed)
    check_a_wrong_gate_is_refused(reference_ops(device, dtype), device, dtype)
