"""gdn_chunk_prefill / gdn_recurrent_step vs the naive fp64 token loop of the gated delta rule.

Oracle (per token t, value head j, key head j // r):
    q, k <- x / sqrt(sum x^2 + 1e-6);  q <- scale q;  S <- e^{g} S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
Criteria (normwise, cap relative to max|ref|):
- output fp32: rel 2e-6, cap 2e-5 (fp32 chunked algebra incl. a 64x64 triangular solve: ~3e-7 seen).
- output bf16: rel 8e-3, cap 3e-2 (the output's bf16 rounding, 2^-9 relative, dominates).
- final state (always fp32, computed in fp32 from the represented inputs): rel 2e-6, cap 2e-5.
Untouched decode slots must be bit-identical.
"""

import pytest
import torch

from .conftest import Normwise, reference_ops
from .shared_checks import (
    PADDED,
    check_gdn_prefill,
    check_gdn_recurrent_out_slots,
    check_gdn_recurrent_slots,
    check_gdn_strong_decay_split,
    check_gdn_varlen,
)

OUT = {torch.float32: Normwise(2e-6, 2e-5), torch.bfloat16: Normwise(8e-3, 3e-2)}
STATE = Normwise(2e-6, 2e-5)


# (T, Hk, Hv, Dk, Dv): T around the chunk size 64 and its multiples; GQA ratio 1, 2 and 4; Dk != Dv.
CASES = [(1, 2, 2, 16, 16), (63, 1, 4, 16, 8), (64, 2, 2, 8, 12), (65, 2, 4, 16, 16), (130, 1, 2, 16, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t_len,hk,hv,dk,dv", CASES)
def test_chunk_prefill_matches_token_loop(device, dtype, t_len, hk, hv, dk, dv, gen):
    ops = reference_ops(device, dtype)
    check_gdn_prefill(ops.gdn_chunk_prefill, device, dtype, t_len, hk, hv, dk, dv, gen, OUT[dtype], STATE)


def test_chunk_prefill_strong_decay_and_split(device, gen):
    ops = reference_ops(device, torch.float32)
    check_gdn_strong_decay_split(ops.gdn_chunk_prefill, device, gen, OUT[torch.float32], STATE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,hv", [(2, 2), (1, 4)])
def test_recurrent_step_slots(device, dtype, hk, hv, gen):
    ops = reference_ops(device, dtype)
    check_gdn_recurrent_slots(ops.gdn_recurrent_step, device, dtype, hk, hv, 16, 8, gen, OUT[dtype], STATE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_step_out_slots(device, dtype, gen):
    ops = reference_ops(device, dtype)
    check_gdn_recurrent_out_slots(ops.gdn_recurrent_step, device, dtype, 1, 4, 16, 8, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,hv,dk,dv", [(1, 2, 16, 8), (2, 2, 8, 12)])
def test_chunk_varlen_sequences_from_their_slots(device, dtype, hk, hv, dk, dv, gen):
    check_gdn_varlen(reference_ops(device, dtype), device, dtype, hk, hv, dk, dv, gen, OUT[dtype], STATE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_varlen_empty_sequences_and_a_tail(device, dtype, gen):
    check_gdn_varlen(reference_ops(device, dtype), device, dtype, 1, 2, 16, 8, gen, OUT[dtype], STATE,
                     **PADDED)
