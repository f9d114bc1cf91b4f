"""Contract checks that the reference suite (tests/ops) and the Triton suite (tests/ops_triton) both run, each on
its own OpSet and device: the same cases and criteria, so a kernel passes exactly what the reference passes.
"""

from __future__ import annotations

import torch

from .conftest import Normwise, Pointwise, assert_bits, assert_normwise, assert_pointwise, f64, randn
from .oracles import (
    attention_oracle,
    conv1d_oracle,
    fill_pools,
    gated_rms_oracle,
    gdn_inputs,
    gdn_oracle,
    page_layouts,
    penalties_oracle,
    rms_oracle,
)


def call_sample(ops, device, logits, temperature, top_k, top_p, min_p, seeds, steps):
    """ops.sample with every argument made a tensor of the contract's dtype on device; tokens back on CPU."""
    return ops.sample(
        torch.as_tensor(logits, dtype=torch.float32).to(device),
        torch.as_tensor(temperature, dtype=torch.float32).to(device),
        torch.as_tensor(top_k, dtype=torch.int32).to(device),
        torch.as_tensor(top_p, dtype=torch.float32).to(device),
        torch.as_tensor(min_p, dtype=torch.float32).to(device),
        torch.as_tensor(seeds, dtype=torch.int64).to(device),
        torch.as_tensor(steps, dtype=torch.int64).to(device)).cpu()


def check_conv1d_update_slots(ops, device, dtype, channels, k, gen, crit, row_pad=0):
    """causal_conv1d_update of 3 rows through slots 4, 0, 2 of 6: outputs within crit of the oracle, new
    states bit-exact, untouched slots bit-identical. ``row_pad`` > 0 takes the rows out of a wider tensor
    (row stride != C). Returns (x, w, states before, states after, slots, y)."""
    states = randn(gen, 6, channels, k - 1, dtype=dtype, device=device)
    before = states.clone()
    slots = torch.tensor([4, 0, 2], dtype=torch.int64, device=device)
    x = randn(gen, 3, channels + row_pad, dtype=dtype, device=device)[:, :channels]
    w = randn(gen, channels, k, dtype=dtype, device=device)
    y = ops.causal_conv1d_update(x, w, states, slots)
    assert y.dtype == dtype and y.shape == (3, channels)
    for b, s in enumerate(slots.tolist()):
        ref_y, ref_state = conv1d_oracle(x[b:b + 1], w, before[s])
        assert_pointwise(y[b:b + 1], ref_y, crit, f"conv update row {b}")
        assert_bits(states[s].cpu(), ref_state.to(dtype), f"slot {s}")
    for s in (1, 3, 5):
        assert_bits(states[s].cpu(), before[s].cpu(), f"untouched slot {s}")
    return x, w, before, states, slots, y


def check_conv1d_update_out_slots(ops, device, dtype, channels, k, gen):
    """Lookahead form: rows read slots 4, 0, 2 and write out slots 1, 5, 3. Outputs and new states are
    bit-identical to the in-place call's; the read slots keep their old states."""
    states = randn(gen, 6, channels, k - 1, dtype=dtype, device=device)
    before = states.clone()
    slots = torch.tensor([4, 0, 2], dtype=torch.int64, device=device)
    outs = torch.tensor([1, 5, 3], dtype=torch.int64, device=device)
    x = randn(gen, 3, channels, dtype=dtype, device=device)
    w = randn(gen, channels, k, dtype=dtype, device=device)
    in_place = before.clone()
    y_ref = ops.causal_conv1d_update(x, w, in_place, slots)
    y = ops.causal_conv1d_update(x, w, states, slots, outs)
    assert_bits(y.cpu(), y_ref.cpu(), "conv update output with out_slots")
    for s, o in zip(slots.tolist(), outs.tolist(), strict=True):
        assert_bits(states[o].cpu(), in_place[s].cpu(), f"out slot {o} (read from {s})")
        assert_bits(states[s].cpu(), before[s].cpu(), f"read slot {s} unchanged")


def check_gdn_recurrent_out_slots(step, device, dtype, hk, hv, dk, dv, gen):
    """Lookahead form, ping-pong: two rows stepped 3 times, reading slots (3, 0) and writing (1, 4), then
    back. Outputs and final states are bit-identical to the in-place run; each step leaves its read slots
    as they were."""
    states = randn(gen, 5, hv, dk, dv, device=device, scale=0.5)
    in_place = states.clone()
    a = torch.tensor([3, 0], dtype=torch.int64, device=device)
    b = torch.tensor([1, 4], dtype=torch.int64, device=device)
    seqs = [gdn_inputs(gen, 3, hk, hv, dk, dv, dtype, device) for _ in range(2)]
    src, dst = a, b
    for t in range(3):
        row = [torch.stack([seq[i][t] for seq in seqs]) for i in range(5)]
        o_ref = step(*row, in_place, a, dk ** -0.5)
        kept = states[src].clone()
        o = step(*row, states, src, dk ** -0.5, dst)
        assert_bits(o.cpu(), o_ref.cpu(), f"recurrent output step {t} with out_slots")
        assert_bits(states[src].cpu(), kept.cpu(), f"read slots {src.tolist()} unchanged at step {t}")
        src, dst = dst, src
    assert_bits(states[src].cpu(), in_place[a].cpu(), "final states through out_slots")


def gdn_decode_case(gen, device, dtype, bsz, hk, hv, dk, dv, k=4):
    """Inputs of ``gdn_decode`` as the model passes them: mixed, z, a, b are column views of one fused
    projection row [mixed | z | b | a | pad]; states of bsz + 3 slots (at least 7); rows read permuted slots."""
    from ninfer_qwen3_5.ops.contracts import GDNDecodeParams

    slots_total = max(7, bsz + 3)

    c = 2 * hk * dk + hv * dv
    width = c + hv * dv + 2 * hv + 5
    fused = randn(gen, bsz, width, dtype=dtype, device=device)
    mixed, z = fused[:, :c], fused[:, c:c + hv * dv].view(bsz, hv, dv)
    b, a = fused[:, c + hv * dv:c + hv * dv + hv], fused[:, c + hv * dv + hv:c + hv * dv + 2 * hv]
    params = GDNDecodeParams(
        conv_weight=randn(gen, c, k, dtype=dtype, device=device, scale=0.5),
        neg_a=-torch.exp(randn(gen, hv, device=device, scale=0.5)), dt_bias=randn(gen, hv, device=device),
        norm_weight=randn(gen, dv, dtype=dtype, device=device), key_heads=hk, key_dim=dk, value_heads=hv,
        value_dim=dv, eps=1e-6, scale=dk ** -0.5)
    conv_states = randn(gen, slots_total, c, k - 1, dtype=dtype, device=device)
    states = randn(gen, slots_total, hv, dk, dv, device=device, scale=0.5)
    slots = torch.randperm(slots_total, generator=gen)[:bsz].to(device)
    return (mixed, z, a, b, params), conv_states, states, slots


def gdn_decode_oracle(mixed, z, a, b, p, conv_states, states, slots, dtype):
    """fp64 composition of the four ops' oracles with the contract's two roundings (conv output and o to
    dtype): returns (out[B, Hv, Dv], new conv states, new states) of the rows' slots."""
    kd = p.key_heads * p.key_dim
    soft = torch.nn.functional.softplus(f64(a) + f64(p.dt_bias))
    g, beta = f64(p.neg_a) * soft, torch.sigmoid(f64(b))
    outs, convs, recs = [], [], []
    for r, slot in enumerate(slots.tolist()):
        y, conv = conv1d_oracle(mixed[r:r + 1], p.conv_weight, conv_states[slot])
        y = y.to(dtype)
        q = y[:, :kd].view(1, p.key_heads, p.key_dim)
        k = y[:, kd:2 * kd].view(1, p.key_heads, p.key_dim)
        v = y[:, 2 * kd:].view(1, p.value_heads, p.value_dim)
        o, s = gdn_oracle(q, k, v, g[r:r + 1], beta[r:r + 1], states[slot], p.scale)
        outs.append(gated_rms_oracle(o[0].to(dtype), z[r], p.norm_weight, dtype))
        convs.append(conv)
        recs.append(s)
    return torch.stack(outs), torch.stack(convs), torch.stack(recs)


def check_gdn_decode(ops, device, dtype, bsz, hk, hv, dk, dv, gen, out_crit, state_crit):
    """``gdn_decode`` in place against the fp64 oracle; slots no row reads stay bit-identical."""
    (mixed, z, a, b, p), conv_states, states, slots = gdn_decode_case(gen, device, dtype, bsz, hk, hv, dk, dv)
    conv0, states0 = conv_states.clone(), states.clone()
    ref_o, ref_conv, ref_s = gdn_decode_oracle(mixed, z, a, b, p, conv0, states0, slots.cpu(), dtype)
    out = ops.gdn_decode(mixed, z, a, b, p, conv_states, states, slots)
    assert out.dtype == dtype and out.shape == (bsz, hv, dv)
    assert_normwise(out, ref_o, out_crit, f"gdn_decode output {dtype}")
    assert_bits(conv_states[slots].cpu(), ref_conv.to(dtype), "gdn_decode conv states")
    # 16-bit: the conv output is rounded to dtype, and an fp32 sum next to a rounding boundary may round to the
    # other neighbour than the fp64 oracle's (one ulp, 2^-8 relative, in a few of B*C values); that input moves
    # its head's state far beyond fp32 noise, so the state is held to a 16-bit-input criterion then.
    crit = state_crit if dtype == torch.float32 else Normwise(1e-3, 1e-2)
    assert_normwise(states[slots], ref_s, crit, f"gdn_decode states {dtype}")
    other = [s for s in range(states.shape[0]) if s not in slots.tolist()]
    assert_bits(states[other].cpu(), states0[other].cpu(), "untouched GDN states")
    assert_bits(conv_states[other].cpu(), conv0[other].cpu(), "untouched conv states")


def check_gdn_prefill(prefill, device, dtype, t_len, hk, hv, dk, dv, gen, out_crit, state_crit):
    """gdn_chunk_prefill from a random state: output and the in-place fp32 state against the token loop."""
    q, k, v, g, beta = gdn_inputs(gen, t_len, hk, hv, dk, dv, dtype, device)
    state = randn(gen, hv, dk, dv, device=device, scale=0.5)
    ref_o, ref_s = gdn_oracle(q, k, v, g, beta, state, dk ** -0.5)
    out = prefill(q, k, v, g, beta, state, dk ** -0.5)
    assert out.dtype == dtype and out.shape == (t_len, hv, dv)
    assert_normwise(out, ref_o, out_crit, f"gdn prefill o T={t_len} {dtype}")
    assert state.dtype == torch.float32
    assert_normwise(state, ref_s, state_crit, f"gdn prefill state T={t_len} {dtype}")


def check_gdn_strong_decay_split(prefill, device, gen, out_crit, state_crit):
    """Gates down to -30 per token: e^{G} underflows within a chunk, so decays must be formed from
    differences (nothing may overflow). Splitting the sequence at a non-chunk boundary (37) must continue
    the same state, in place."""
    q, k, v, g, beta = gdn_inputs(gen, 100, 2, 2, 16, 16, torch.float32, device, g_min=-30.0)
    state0 = randn(gen, 2, 16, 16, device=device)
    ref_o, ref_s = gdn_oracle(q, k, v, g, beta, state0, 0.25)
    s = state0.clone()
    a = prefill(q[:37], k[:37], v[:37], g[:37], beta[:37], s, 0.25)
    b = prefill(q[37:], k[37:], v[37:], g[37:], beta[37:], s, 0.25)
    assert_normwise(torch.cat((a, b)), ref_o, out_crit, "split strong-decay output")
    assert_normwise(s, ref_s, state_crit, "split strong-decay state")


def check_add_rms_norm(ops, device, dtype, hidden, gen, crit, eps):
    """add_rms_norm_unit_offset on 9 rows: the new residual is x + res rounded once to dtype (bit-exact), the output
    within crit of the oracle over it, the inputs untouched. Returns (x, res, w, y, new_res)."""
    x = randn(gen, 9, hidden, dtype=dtype, device=device)
    res = randn(gen, 9, hidden, dtype=dtype, device=device, scale=4.0)
    w = randn(gen, hidden, dtype=dtype, device=device, scale=0.3)
    x0, r0 = x.clone(), res.clone()
    y, new_res = ops.add_rms_norm_unit_offset(x, res, w, eps)
    expected_res = (f64(x) + f64(res)).to(dtype)  # exact in fp64, then the one rounding
    assert_bits(new_res.cpu(), expected_res, "add_rms_norm_unit_offset residual")
    assert_pointwise(y, rms_oracle(expected_res, w), crit, f"add_rms_norm_unit_offset {dtype}")
    assert torch.equal(x, x0) and torch.equal(res, r0), "inputs must not be modified"
    return x, res, w, y, new_res


def check_add_rms_norm_linear(ops, device, dtype, rows, hidden, n_out, gen, norm_crit, linear_crit, eps):
    """add_rms_norm_unit_offset_linear: the new residual bit-exact (x + res, one rounding), the normed rows within
    norm_crit of the oracle over it, y within linear_crit of the fp64 product of the *returned* normed rows (the
    block's later projections read those), the inputs untouched."""
    x = randn(gen, rows, hidden, dtype=dtype, device=device)
    res = randn(gen, rows, hidden, dtype=dtype, device=device, scale=4.0)
    w = randn(gen, hidden, dtype=dtype, device=device, scale=0.3)
    weight = randn(gen, n_out, hidden, dtype=dtype, device=device, scale=hidden ** -0.5)
    x0, r0 = x.clone(), res.clone()
    y, h, new_res = ops.add_rms_norm_unit_offset_linear(x, res, w, eps, weight)
    assert y.shape == (rows, n_out) and h.shape == new_res.shape == (rows, hidden) and y.dtype == dtype
    expected_res = (f64(x) + f64(res)).to(dtype)
    assert_bits(new_res.cpu(), expected_res, "add_rms_norm_unit_offset_linear residual")
    assert_pointwise(h, rms_oracle(expected_res, w), norm_crit, f"add_rms_norm_unit_offset_linear normed {dtype}")
    assert_normwise(y, f64(h) @ f64(weight).T, linear_crit, f"add_rms_norm_unit_offset_linear output {dtype}")
    assert torch.equal(x, x0) and torch.equal(res, r0), "inputs must not be modified"
    return x, res, w, weight, y, h, new_res


def check_gdn_recurrent_slots(step, device, dtype, hk, hv, dk, dv, gen, out_crit, state_crit):
    """Two rows stepped 3 times through slots 3 and 0 of 5 (the in-place state round trip is exercised):
    each row equals the token-loop oracle from its slot's initial state; untouched slots stay bit-identical."""
    n_slots, steps = 5, 3
    states = randn(gen, n_slots, hv, dk, dv, device=device, scale=0.5)
    before = states.clone()
    slots = torch.tensor([3, 0], dtype=torch.int64, device=device)
    seqs = [gdn_inputs(gen, steps, hk, hv, dk, dv, dtype, device) for _ in range(2)]
    outs = []
    for t in range(steps):
        row = [torch.stack([seq[i][t] for seq in seqs]) for i in range(5)]
        outs.append(step(*row, states, slots, dk ** -0.5))
    for b, slot in enumerate(slots.tolist()):
        ref_o, ref_s = gdn_oracle(*seqs[b], before[slot], dk ** -0.5)
        out_b = torch.stack([o[b] for o in outs])
        assert out_b.dtype == dtype
        assert_normwise(out_b, ref_o, out_crit, f"recurrent row {b} {dtype}")
        assert_normwise(states[slot], ref_s, state_crit, f"recurrent state slot {slot}")
    for slot in (1, 2, 4):
        assert_bits(states[slot].cpu(), before[slot].cpu(), f"untouched slot {slot}")


def check_paged_attention(ops, device, dtype, crit, page, hq, hkv, d, rows, gen, decode, also=None):
    """One case under the identity, offset and fragmented page layouts (NaN-poisoned pools, out-of-pool
    table entries past each row's pages): each within crit of the fp64 oracle, all three bit-identical.

    also(layout, out, call, what), when given, runs after each layout's checks; call(other_ops) repeats the
    same call on another OpSet. Returns the identity layout's output (CPU).
    """
    op = "paged_decode_attention" if decode else "paged_attention"
    ks = [randn(gen, kv_len, hkv, d, dtype=dtype) for _, kv_len in rows]
    vs = [randn(gen, kv_len, hkv, d, dtype=dtype) for _, kv_len in rows]
    q = randn(gen, sum(n for n, _ in rows), hq, d, dtype=dtype)
    scale = d ** -0.5
    kv_lens = torch.tensor([kv_len for _, kv_len in rows], dtype=torch.int32).to(device)
    cu_q = torch.tensor([0] + [n for n, _ in rows], dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    ref = attention_oracle(q, ks, vs, rows, scale)
    results = {}
    for layout, table, n_pool in page_layouts(rows, page, gen):
        k_pool, v_pool = fill_pools(ks, vs, table, n_pool, page, dtype)
        args = [t.to(device) for t in (q, k_pool, v_pool)]
        table = table.to(device)

        def call(op_set, args=args, table=table):
            if decode:
                return op_set.paged_decode_attention(*args, kv_lens, table, scale)
            return op_set.paged_attention(*args, cu_q, kv_lens, table, scale)

        out = call(ops)
        assert out.dtype == dtype and out.shape == q.shape
        what = f"{op} {layout} page={page} Hq={hq} Hkv={hkv} D={d} {dtype}"
        assert_normwise(out, ref, crit, what)
        results[layout] = out.cpu()
        if also is not None:
            also(layout, out, call, what)
    assert_bits(results["offset"], results["identity"], "offset layout vs identity")
    assert_bits(results["fragmented"], results["identity"], "fragmented layout vs identity")
    return results["identity"]


PENALTY_CRIT = Pointwise(1e-6, 1e-7)


def check_apply_penalties(ops, device, inputs, oracle_columns):
    """apply_penalties on inputs (oracles.penalty_inputs): penalised rows 0, 1, 3 within PENALTY_CRIT of the
    fp64 oracle over the first oracle_columns ids, the neutral row 2 bit-exact, the inputs untouched.
    Returns the output, on device."""
    logits, counts, prompt, rep, pres, freq = inputs
    on_device = [t.to(device) for t in inputs]
    saved = [t.clone() for t in on_device]
    out = ops.apply_penalties(*on_device)
    cols = slice(0, oracle_columns)
    ref = penalties_oracle(logits[:, cols], counts[:, cols], prompt[:, cols], rep, pres, freq)
    for b in (0, 1, 3):
        assert_pointwise(out[b, cols], ref[b], PENALTY_CRIT, f"penalised row {b}")
    assert_bits(out[2].cpu(), logits[2], "neutral row")
    assert (out[0] != on_device[0][0]).any() and (out[3] != on_device[0][3]).any()
    for before, after in zip(saved, on_device, strict=True):
        assert torch.equal(before, after), "inputs must not be modified"
    return out


def check_gated_decode_attention(ops, device, dtype, gen, rows=((1, 5), (1, 40), (1, 1)), page=4, hq=4, hkv=2, d=16,
                                 extra_pages=0):
    """``paged_decode_attention(..., gate)`` against the ungated op followed by torch's ``o * sigmoid(gate)``
    (gate a row-strided column view, as the model slices it from its projection). Returns (gated, composed)
    on the CPU. ``extra_pages`` widens the page table (the Triton kernel then splits rows)."""
    ks = [randn(gen, kv_len, hkv, d, dtype=dtype) for _, kv_len in rows]
    vs = [randn(gen, kv_len, hkv, d, dtype=dtype) for _, kv_len in rows]
    q = randn(gen, len(rows), hq, d, dtype=dtype).to(device)
    wide = randn(gen, len(rows), hq * d + 9, dtype=dtype, scale=3.0).to(device)
    gate = wide[:, 5:5 + hq * d]
    kv_lens = torch.tensor([kv_len for _, kv_len in rows], dtype=torch.int32).to(device)
    _, table, n_pool = next(iter(page_layouts(rows, page, gen)))
    if extra_pages:
        table = torch.cat([table, torch.zeros(table.shape[0], extra_pages, dtype=table.dtype)], dim=1)
    k_pool, v_pool = (t.to(device) for t in fill_pools(ks, vs, table, n_pool, page, dtype))
    table = table.to(device)
    plain = ops.paged_decode_attention(q, k_pool, v_pool, kv_lens, table, d ** -0.5)
    gated = ops.paged_decode_attention(q, k_pool, v_pool, kv_lens, table, d ** -0.5, gate)
    composed = (plain.reshape(len(rows), hq * d) * torch.sigmoid(gate)).reshape(plain.shape)
    assert gated.shape == plain.shape and gated.dtype == dtype
    # The gate matters (a mutation that dropped it would pass a comparison with the ungated output).
    assert not torch.equal(gated, plain)
    return gated.cpu(), composed.cpu()


def check_gated_prefill_attention(ops, device, dtype, gen, rows=((3, 5), (1, 40), (17, 17), (0, 4)), page=4, hq=4,
                                  hkv=2, d=16):
    """``paged_attention(..., gate)`` (rows of (query length, KV length): a chunk over a cached prefix, a decode-like
    row, a whole prompt, an empty row) against the ungated op followed by torch's ``o * sigmoid(gate)``, the gate a
    row-strided column view. Returns (gated, composed) on the CPU."""
    ks = [randn(gen, kv_len, hkv, d, dtype=dtype) for _, kv_len in rows]
    vs = [randn(gen, kv_len, hkv, d, dtype=dtype) for _, kv_len in rows]
    t_len = sum(q_len for q_len, _ in rows)
    q = randn(gen, t_len, hq, d, dtype=dtype).to(device)
    gate = randn(gen, t_len, hq * d + 9, dtype=dtype, scale=3.0).to(device)[:, 5:5 + hq * d]
    cu = [0]
    for q_len, _ in rows:
        cu.append(cu[-1] + q_len)
    cu_q = torch.tensor(cu, dtype=torch.int32).to(device)
    kv_lens = torch.tensor([kv_len for _, kv_len in rows], dtype=torch.int32).to(device)
    _, table, n_pool = next(iter(page_layouts(rows, page, gen)))
    k_pool, v_pool = (t.to(device) for t in fill_pools(ks, vs, table, n_pool, page, dtype))
    table = table.to(device)
    plain = ops.paged_attention(q, k_pool, v_pool, cu_q, kv_lens, table, d ** -0.5)
    gated = ops.paged_attention(q, k_pool, v_pool, cu_q, kv_lens, table, d ** -0.5, gate)
    composed = (plain.reshape(t_len, hq * d) * torch.sigmoid(gate)).reshape(plain.shape)
    assert gated.shape == plain.shape and gated.dtype == dtype
    assert not torch.equal(gated, plain)
    return gated.cpu(), composed.cpu()


def check_a_wrong_gate_is_refused(ops, device, dtype):
    """Both attentions refuse a gate that is not ``[rows, Hq*D]``, with a ValueError naming the gate."""
    import pytest

    pool = torch.zeros(2, 4, 2, 16, dtype=dtype, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="gate"):
        ops.paged_decode_attention(torch.zeros(1, 4, 16, dtype=dtype, device=device), pool, pool,
                                   torch.ones(1, dtype=torch.int32, device=device), table, 0.25,
                                   torch.zeros(1, 8, dtype=dtype, device=device))
    with pytest.raises(ValueError, match="gate"):
        ops.paged_attention(torch.zeros(2, 4, 16, dtype=dtype, device=device), pool, pool,
                            torch.tensor([0, 2], dtype=torch.int32, device=device),
                            torch.full((1,), 2, dtype=torch.int32, device=device), table, 0.25,
                            torch.zeros(2, 8, dtype=dtype, device=device))


# --- several sequences in one call (causal_conv1d_varlen, gdn_chunk_varlen) ---
VARLEN_LENS = (1, 2, 70, 64, 5, 130)   # a token, fewer tokens than the conv's K-1 state, across chunk boundaries
# A padded call: empty sequences sharing one slot (which must come out as it went in) between real ones, and tokens
# past the last offset that belong to no sequence.
PADDED = {"lens": (0, 5, 0, 70, 0), "slots": (9, 1, 9, 3, 9), "tail": 7}


def _varlen_layout(lens, device, slots=None, tail=0):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    # Distinct slots out of order, in a pool with slots no sequence uses.
    ids = list(slots) if slots is not None else [2 * i + 1 for i in reversed(range(len(lens)))]
    return (torch.tensor(cu, dtype=torch.int32, device=device), torch.tensor(ids, dtype=torch.int64, device=device),
            cu, ids, cu[-1] + tail)


def _pool_size(ids) -> int:
    return max(2 * len(ids) + 1, max(ids) + 2)


def check_conv1d_varlen(ops, device, dtype, channels, k, gen, crit: Pointwise, lens=VARLEN_LENS, slots=None, tail=0):
    """causal_conv1d_varlen over sequences of mixed lengths, each from its own slot: every sequence's output and new
    state against the one-sequence fp64 oracle; states exact copies; unused slots (and those of empty sequences)
    untouched. ``tail`` tokens past the last offset belong to no sequence."""
    cu_t, ids_t, cu, ids, t_len = _varlen_layout(lens, device, slots, tail)
    x = randn(gen, t_len, channels + 8, dtype=dtype, device=device)[:, :channels]   # row stride != C
    w = randn(gen, channels, k, dtype=dtype, device=device, scale=0.5)
    states = randn(gen, _pool_size(ids), channels, k - 1, dtype=dtype, device=device)
    before = states.clone()
    y = ops.causal_conv1d_varlen(x, w, states, cu_t, ids_t)
    assert y.shape == (t_len, channels) and y.dtype == dtype
    written = set()
    for i, slot in enumerate(ids):
        if cu[i + 1] == cu[i]:
            continue
        written.add(slot)
        want_y, want_s = conv1d_oracle(x[cu[i]:cu[i + 1]], w, before[slot])
        assert_pointwise(y[cu[i]:cu[i + 1]], want_y, crit, f"conv varlen output of sequence {i}")
        assert_bits(states[slot].cpu(), want_s.to(dtype), f"conv varlen state of sequence {i}")
    unused = [s for s in range(states.shape[0]) if s not in written]
    assert_bits(states[unused].cpu(), before[unused].cpu(), "unused slots")
    return x, w, before, states, cu_t, ids_t, y


def check_gdn_varlen(ops, device, dtype, hk, hv, dk, dv, gen, out_crit: Normwise, state_crit: Normwise,
                     lens=VARLEN_LENS, slots=None, tail=0):
    """gdn_chunk_varlen over sequences of mixed lengths, each from its own slot: every sequence's output and final
    state against the token loop; unused slots (and those of empty sequences) untouched. ``tail`` tokens past the
    last offset belong to no sequence."""
    cu_t, ids_t, cu, ids, t_len = _varlen_layout(lens, device, slots, tail)
    q, k, v, g, beta = gdn_inputs(gen, t_len, hk, hv, dk, dv, dtype, device)
    states = randn(gen, _pool_size(ids), hv, dk, dv, device=device, scale=0.5)
    before = states.clone()
    scale = dk ** -0.5
    out = ops.gdn_chunk_varlen(q, k, v, g, beta, states, cu_t, ids_t, scale)
    assert out.shape == (t_len, hv, dv) and out.dtype == dtype
    written = set()
    for i, slot in enumerate(ids):
        a, b = cu[i], cu[i + 1]
        if a == b:
            continue
        written.add(slot)
        want_o, want_s = gdn_oracle(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], before[slot], scale)
        assert_normwise(out[a:b], want_o, out_crit, f"gdn varlen output of sequence {i} (T={b - a})")
        assert_normwise(states[slot], want_s, state_crit, f"gdn varlen state of sequence {i} (T={b - a})")
    unused = [s for s in range(states.shape[0]) if s not in written]
    assert_bits(states[unused].cpu(), before[unused].cpu(), "unused slots")
    return (q, k, v, g, beta), before, states, cu_t, ids_t, out
