"""Triton causal_conv1d_update (one decode token per row, state in conv_states[slots[b]], in place) against
the reference suite's fp64 oracle.

Criteria (tests/ops/test_conv1d.py): output pointwise fp32 rtol 2e-6 / atol 1e-6, bf16 rtol 2^-8 / atol
2^-9; the new state is a copy of inputs and must be bit-exact; untouched slots bit-identical to before.
"""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import assert_bits, assert_pointwise, randn  # noqa: E402
from ops.oracles import conv1d_oracle  # noqa: E402
from ops.shared_checks import (  # noqa: E402
    PADDED,
    check_conv1d_update_out_slots,
    check_conv1d_update_slots,
    check_conv1d_varlen,
)
from ops.test_conv1d import CRIT  # noqa: E402

from .conftest import DEVICE, reference, triton_ops  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels,k", [(16, 4), (300, 4), (40, 2)])
def test_update_slots(dtype, channels, k, gen):
    ops = triton_ops(dtype)
    assert ops.implementation("causal_conv1d_update").name == "triton"
    # Rows of a wider projection (the GDN's qkv[:b_rows]): row stride != C.
    x, w, before, states, slots, y = check_conv1d_update_slots(ops, DEVICE, dtype, channels, k, gen, CRIT[dtype],
                                                               row_pad=8)
    ref_states = before.clone()
    ref_out = reference(dtype).causal_conv1d_update(x, w, ref_states, slots)
    assert_bits(states.cpu(), ref_states.cpu(), "states vs torch reference")
    assert_pointwise(y, ref_out.double().cpu(), CRIT[dtype], "output vs torch reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels,k", [(16, 4), (300, 4)])
def test_update_out_slots(dtype, channels, k, gen):
    check_conv1d_update_out_slots(triton_ops(dtype), DEVICE, dtype, channels, k, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t_len,channels,k", [(1, 16, 4), (2, 40, 4), (3, 300, 4), (37, 24, 4), (5, 16, 2),
                                              (1, 8, 1)])
def test_prefill_matches_oracle_from_a_state(dtype, t_len, channels, k, gen):
    """Chunks shorter than, equal to and longer than the K-1 state columns, continuing a non-zero state; x a
    row-strided column view (the GDN's qkv out of the fused [qkv | z] projection)."""
    ops = triton_ops(dtype)
    assert ops.implementation("causal_conv1d_prefill").name == "triton"
    wide = randn(gen, t_len, channels + 11, dtype=dtype, device=DEVICE)
    x = wide[:, 3:3 + channels]
    w = randn(gen, channels, k, device=DEVICE)
    state = randn(gen, channels, k - 1, dtype=dtype, device=DEVICE)
    ref_y, ref_state = conv1d_oracle(x, w, state)
    ref_ops_state = state.clone()
    ref_ops_y = reference(dtype).causal_conv1d_prefill(x, w, ref_ops_state)
    y = ops.causal_conv1d_prefill(x, w, state)
    assert y.dtype == dtype and y.shape == (t_len, channels)
    assert_pointwise(y, ref_y, CRIT[dtype], f"triton conv prefill T={t_len} C={channels} K={k} {dtype}")
    assert_bits(state.cpu(), ref_state.to(dtype), "conv_state after the chunk")
    assert_bits(state.cpu(), ref_ops_state.cpu(), "conv_state vs the reference op")
    assert_pointwise(y, ref_ops_y.double().cpu(), CRIT[dtype], "output vs the reference op")


def test_prefill_pieces_then_steps_equal_one_pass(gen):
    # Prefill chunks of 1, 2 and 6 tokens, then three decode steps, in slot 1: one pass of the oracle over all
    # 12 inputs; slot 0 is never touched.
    ops = triton_ops(torch.float32)
    c, k = 24, 4
    x = randn(gen, 12, c, device=DEVICE)
    w = randn(gen, c, k, device=DEVICE)
    states = torch.zeros(2, c, k - 1, device=DEVICE)
    parts = [ops.causal_conv1d_prefill(x[a:b], w, states[1]) for a, b in ((0, 1), (1, 3), (3, 9))]
    parts += [ops.causal_conv1d_update(x[t:t + 1], w, states, torch.tensor([1], device=DEVICE)) for t in (9, 10, 11)]
    ref_y, ref_state = conv1d_oracle(x, w, torch.zeros(c, k - 1))
    assert_pointwise(torch.cat(parts), ref_y, CRIT[torch.float32], "pieces + steps")
    assert_bits(states[1].cpu(), ref_state.float(), "state after pieces + steps")
    assert torch.count_nonzero(states[0]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels,k", [(24, 4), (300, 4), (40, 2)])
def test_varlen_is_the_one_sequence_kernel_per_sequence(dtype, channels, k, gen):
    """Against the oracle, and bit for bit what causal_conv1d_prefill gives each sequence alone."""
    ops = triton_ops(dtype)
    assert ops.implementation("causal_conv1d_varlen").name == "triton"
    x, w, before, states, cu, ids, y = check_conv1d_varlen(ops, DEVICE, dtype, channels, k, gen, CRIT[dtype])
    alone = before.clone()
    bounds = cu.tolist()
    for i, slot in enumerate(ids.tolist()):
        part = ops.causal_conv1d_prefill(x[bounds[i]:bounds[i + 1]], w, alone[slot])
        assert_bits(y[bounds[i]:bounds[i + 1]].cpu(), part.cpu(), f"sequence {i} output")
    assert_bits(states.cpu(), alone.cpu(), "states")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_empty_sequences_and_a_tail(dtype, gen):
    check_conv1d_varlen(triton_ops(dtype), DEVICE, dtype, 24, 4, gen, CRIT[dtype], **PADDED)
