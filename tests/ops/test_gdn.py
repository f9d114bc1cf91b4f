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

from .conftest import Normwise, assert_normwise, randn, reference_ops
from .oracles import gdn_inputs, gdn_oracle
from .shared_checks import check_gdn_recurrent_slots

OUT = {torch.float32: Normwise(2e-6, 2e-5), torch.bfloat16: Normwise(8e-3, 3e-2)}
STATE = Normwise(2e-6, 2e-5)


# (T, Hk, Hv, Dk, Dv): T around the chunk size 64 and its multiples; GQA ratio 1, 2 and 4; Dk != Dv.
CASES = [(1, 2, 2, 16, 16), (63, 1, 4, 16, 8), (64, 2, 2, 8, 12), (65, 2, 4, 16, 16), (130, 1, 2, 16, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t_len,hk,hv,dk,dv", CASES)
def test_chunk_prefill_matches_token_loop(device, dtype, t_len, hk, hv, dk, dv, gen):
    ops = reference_ops(device, dtype)
    q, k, v, g, beta = gdn_inputs(gen, t_len, hk, hv, dk, dv, dtype, device)
    state = randn(gen, hv, dk, dv, device=device, scale=0.5)
    ref_o, ref_s = gdn_oracle(q, k, v, g, beta, state, dk ** -0.5)
    out = ops.gdn_chunk_prefill(q, k, v, g, beta, state, dk ** -0.5)
    assert out.dtype == dtype and out.shape == (t_len, hv, dv)
    assert_normwise(out, ref_o, OUT[dtype], f"gdn prefill o T={t_len} {dtype}")
    assert state.dtype == torch.float32
    assert_normwise(state, ref_s, STATE, f"gdn prefill state T={t_len} {dtype}")


def test_chunk_prefill_strong_decay_and_split(device, gen):
    # Gates down to -30 per token: e^{G} underflows within a chunk; decays must be formed from differences
    # so nothing overflows. Splitting the sequence at a non-chunk boundary must continue the same state.
    ops = reference_ops(device, torch.float32)
    q, k, v, g, beta = gdn_inputs(gen, 100, 2, 2, 16, 16, torch.float32, device, g_min=-30.0)
    state0 = randn(gen, 2, 16, 16, device=device)
    ref_o, ref_s = gdn_oracle(q, k, v, g, beta, state0, 0.25)
    s = state0.clone()
    a = ops.gdn_chunk_prefill(q[:37], k[:37], v[:37], g[:37], beta[:37], s, 0.25)
    b = ops.gdn_chunk_prefill(q[37:], k[37:], v[37:], g[37:], beta[37:], s, 0.25)
    assert_normwise(torch.cat((a, b)), ref_o, OUT[torch.float32], "split strong-decay output")
    assert_normwise(s, ref_s, STATE, "split strong-decay state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,hv", [(2, 2), (1, 4)])
def test_recurrent_step_slots(device, dtype, hk, hv, gen):
    ops = reference_ops(device, dtype)
    check_gdn_recurrent_slots(ops.gdn_recurrent_step, device, dtype, hk, hv, 16, 8, gen, OUT[dtype], STATE)
