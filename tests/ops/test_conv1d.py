"""causal_conv1d_prefill / causal_conv1d_update (depthwise causal conv + SiLU, stateful) vs an fp64 oracle.

Criteria: output pointwise -- fp32 rtol 2e-6 / atol 1e-6 (a K-term fp32 dot product then SiLU), bf16 rtol
2^-8 / atol 2^-9 (one output rounding; atol for values near zero after cancellation). The new state is a copy
of inputs and must be bit-exact; untouched slots must be bit-identical to before.
"""

import pytest
import torch

from .conftest import DTYPES, Pointwise, assert_bits, assert_pointwise, randn, reference_ops
from .oracles import conv1d_oracle
from .shared_checks import (
    PADDED,
    check_conv1d_update_out_slots,
    check_conv1d_update_slots,
    check_conv1d_varlen,
)

CRIT = {torch.float32: Pointwise(2e-6, 1e-6), torch.bfloat16: Pointwise(2 ** -8, 2 ** -9)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t_len", [1, 2, 3, 4, 37])
@pytest.mark.parametrize("fresh", [True, False])
def test_prefill(device, dtype, t_len, fresh, gen):
    ops = reference_ops(device, dtype)
    c, k = 24, 4
    x = randn(gen, t_len, c, dtype=dtype, device=device)
    w = randn(gen, c, k, dtype=dtype, device=device, scale=0.7)
    state = (torch.zeros(c, k - 1, dtype=dtype) if fresh else randn(gen, c, k - 1, dtype=dtype)).to(device)
    ref_y, ref_state = conv1d_oracle(x, w, state)
    y = ops.causal_conv1d_prefill(x, w, state)
    assert y.dtype == dtype and y.shape == (t_len, c)
    assert_pointwise(y, ref_y, CRIT[dtype], f"conv prefill T={t_len} {dtype}")
    # T < K-1 keeps part of the old state: the window shift must be exact either way.
    assert_bits(state.cpu(), ref_state.to(dtype), "conv_state after prefill")


def test_prefill_in_two_pieces_equals_one(device, gen):
    # Splitting a sequence must not change anything: the state carries exactly the needed history.
    ops = reference_ops(device, torch.float32)
    x = randn(gen, 20, 8, device=device)
    w = randn(gen, 8, 4, device=device)
    s1, s2 = torch.zeros(8, 3, device=device), torch.zeros(8, 3, device=device)
    whole = ops.causal_conv1d_prefill(x, w, s1)
    a = ops.causal_conv1d_prefill(x[:2], w, s2)
    b = ops.causal_conv1d_prefill(x[2:], w, s2)
    ref_y, _ = conv1d_oracle(x, w, torch.zeros(8, 3))
    assert_pointwise(torch.cat((a, b)), ref_y, CRIT[torch.float32], "split prefill")
    assert_bits(s1.cpu(), s2.cpu(), "state after split vs whole")
    assert_pointwise(whole, ref_y, CRIT[torch.float32], "whole prefill")


@pytest.mark.parametrize("dtype", DTYPES)
def test_update_slots(device, dtype, gen):
    check_conv1d_update_slots(reference_ops(device, dtype), device, dtype, 16, 4, gen, CRIT[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_update_out_slots(device, dtype, gen):
    check_conv1d_update_out_slots(reference_ops(device, dtype), device, dtype, 16, 4, gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [4, 2])
def test_varlen_sequences_from_their_slots(device, dtype, k, gen):
    check_conv1d_varlen(reference_ops(device, dtype), device, dtype, 24, k, gen, CRIT[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_empty_sequences_and_a_tail(device, dtype, gen):
    check_conv1d_varlen(reference_ops(device, dtype), device, dtype, 24, 4, gen, CRIT[dtype], **PADDED)
