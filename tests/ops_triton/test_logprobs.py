"""Triton token_logprobs (one-pass online logsumexp) against the reference op: several vocab blocks, a ragged
last block, bf16 and strided rows, rows with -inf logits, bad targets."""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import randn  # noqa: E402

from .conftest import DEVICE, reference, triton_ops  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 17), (5, 9000), (2, 4096)])
def test_matches_reference(dtype, shape, gen):
    ops = triton_ops(dtype)
    assert ops.implementation("token_logprobs").name == "triton"
    logits = randn(gen, *shape, dtype=dtype, device=DEVICE, scale=5.0)
    targets = torch.randint(0, shape[1], (shape[0],), generator=gen).to(DEVICE)
    lp, lse = ops.token_logprobs(logits, targets)
    ref_lp, ref_lse = reference(dtype).token_logprobs(logits, targets)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lp, ref_lp, rtol=2e-6, atol=2e-6)


def test_strided_rows_and_minus_inf(gen):
    ops = triton_ops(torch.float32)
    wide = randn(gen, 4, 6000, device=DEVICE, scale=3.0)
    logits = wide[:, :5000]  # row stride 6000
    logits[1, :4500] = float("-inf")  # the first vocabulary block is all -inf
    targets = torch.tensor([0, 4700, 4999, 2], device=DEVICE)
    lp, lse = ops.token_logprobs(logits, targets)
    ref_lp, ref_lse = reference(torch.float32).token_logprobs(logits, targets)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lp, ref_lp, rtol=2e-6, atol=2e-6)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        ops.token_logprobs(logits, torch.tensor([0, 1, 2, 5000], device=DEVICE))
