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

from .conftest import Normwise, assert_bits, assert_normwise, f64, rand, randn, reference_ops

OUT = {torch.float32: Normwise(2e-6, 2e-5), torch.bfloat16: Normwise(8e-3, 3e-2)}
STATE = Normwise(2e-6, 2e-5)


def oracle(q, k, v, g, beta, state, scale):
    """Naive token loop; returns (o[T, Hv, Dv], final state[Hv, Dk, Dv]) in fp64."""
    q, k, v, g, beta, s = f64(q), f64(k), f64(v), f64(g), f64(beta), f64(state).clone()
    t_len, hk, _ = q.shape
    hv = v.shape[1]
    r = hv // hk
    o = torch.empty(t_len, hv, v.shape[2], dtype=torch.float64)
    for t in range(t_len):
        for j in range(hv):
            qt, kt = q[t, j // r], k[t, j // r]
            qt = scale * qt / torch.sqrt((qt * qt).sum() + 1e-6)
            kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
            s[j] = torch.exp(g[t, j]) * s[j]
            delta = beta[t, j] * (v[t, j] - s[j].t() @ kt)
            s[j] = s[j] + torch.outer(kt, delta)
            o[t, j] = s[j].t() @ qt
    return o, s


def make_inputs(gen, t_len, hk, hv, dk, dv, dtype, device, g_min=-1.0):
    q = randn(gen, t_len, hk, dk, dtype=dtype, device=device)
    k = randn(gen, t_len, hk, dk, dtype=dtype, device=device)
    v = randn(gen, t_len, hv, dv, dtype=dtype, device=device)
    g = rand(gen, t_len, hv, lo=g_min, hi=0.0, device=device)      # log decay <= 0, fp32
    beta = rand(gen, t_len, hv, lo=0.0, hi=1.0, device=device)     # sigmoid range, fp32
    return q, k, v, g, beta


# (T, Hk, Hv, Dk, Dv): T around the chunk size 64 and its multiples; GQA ratio 1, 2 and 4; Dk != Dv.
CASES = [(1, 2, 2, 16, 16), (63, 1, 4, 16, 8), (64, 2, 2, 8, 12), (65, 2, 4, 16, 16), (130, 1, 2, 16, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t_len,hk,hv,dk,dv", CASES)
def test_chunk_prefill_matches_token_loop(device, dtype, t_len, hk, hv, dk, dv, gen):
    ops = reference_ops(device, dtype)
    q, k, v, g, beta = make_inputs(gen, t_len, hk, hv, dk, dv, dtype, device)
    state = randn(gen, hv, dk, dv, device=device, scale=0.5)
    ref_o, ref_s = oracle(q, k, v, g, beta, state, dk ** -0.5)
    out = ops.gdn_chunk_prefill(q, k, v, g, beta, state, dk ** -0.5)
    assert out.dtype == dtype and out.shape == (t_len, hv, dv)
    assert_normwise(out, ref_o, OUT[dtype], f"gdn prefill o T={t_len} {dtype}")
    assert state.dtype == torch.float32
    assert_normwise(state, ref_s, STATE, f"gdn prefill state T={t_len} {dtype}")


def test_chunk_prefill_strong_decay_and_split(device, gen):
    # Gates down to -30 per token: e^{G} underflows within a chunk; decays must be formed from differences
    # so nothing overflows. Splitting the sequence at a non-chunk boundary must continue the same state.
    ops = reference_ops(device, torch.float32)
    q, k, v, g, beta = make_inputs(gen, 100, 2, 2, 16, 16, torch.float32, device, g_min=-30.0)
    state0 = randn(gen, 2, 16, 16, device=device)
    ref_o, ref_s = oracle(q, k, v, g, beta, state0, 0.25)
    s = state0.clone()
    a = ops.gdn_chunk_prefill(q[:37], k[:37], v[:37], g[:37], beta[:37], s, 0.25)
    b = ops.gdn_chunk_prefill(q[37:], k[37:], v[37:], g[37:], beta[37:], s, 0.25)
    assert_normwise(torch.cat((a, b)), ref_o, OUT[torch.float32], "split strong-decay output")
    assert_normwise(s, ref_s, STATE, "split strong-decay state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,hv", [(2, 2), (1, 4)])
def test_recurrent_step_slots(device, dtype, hk, hv, gen):
    ops = reference_ops(device, dtype)
    n_slots, dk, dv, steps = 5, 16, 8, 3
    states = randn(gen, n_slots, hv, dk, dv, device=device, scale=0.5)
    before = states.clone()
    slots = torch.tensor([3, 0], dtype=torch.int64, device=device)
    seqs = [make_inputs(gen, steps, hk, hv, dk, dv, dtype, device) for _ in range(2)]
    outs = []
    for t in range(steps):  # several steps so the in-place state round trip is exercised
        row = [torch.stack([seq[i][t] for seq in seqs]) for i in range(5)]
        outs.append(ops.gdn_recurrent_step(*row, states, slots, dk ** -0.5))
    for b, slot in enumerate(slots.tolist()):
        ref_o, ref_s = oracle(*seqs[b], before[slot], dk ** -0.5)
        out_b = torch.stack([o[b] for o in outs])
        assert out_b.dtype == dtype
        assert_normwise(out_b, ref_o, OUT[dtype], f"recurrent row {b} {dtype}")
        assert_normwise(states[slot], ref_s, STATE, f"recurrent state slot {slot}")
    for slot in (1, 2, 4):
        assert_bits(states[slot].cpu(), before[slot].cpu(), f"untouched slot {slot}")
