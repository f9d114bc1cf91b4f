"""token_logprobs reference: the target's log-probability and the row logsumexp against an fp64 oracle."""

import pytest
import torch
from ninfer.ops.reference.logprobs import token_logprobs

from .conftest import randn


def oracle(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.double()
    lse = torch.logsumexp(x, dim=-1)
    return x.gather(1, targets[:, None]).squeeze(1) - lse, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_fp64_oracle(dtype, gen):
    logits = randn(gen, 7, 1000, dtype=dtype, scale=4.0)
    targets = torch.randint(0, 1000, (7,), generator=gen)
    lp, lse = token_logprobs(logits, targets)
    ref_lp, ref_lse = oracle(logits, targets)
    assert lp.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=2e-6, atol=2e-6)


def test_masked_tokens_and_bad_targets(gen):
    logits = randn(gen, 2, 50)
    logits[0, 10:] = float("-inf")
    lp, lse = token_logprobs(logits, torch.tensor([3, 49]))
    assert torch.isfinite(lse).all() and lp[0] <= 0
    assert token_logprobs(logits, torch.tensor([20, 0]))[0][0] == float("-inf")  # a masked target
    with pytest.raises(IndexError, match="outside the vocabulary"):
        token_logprobs(logits, torch.tensor([0, 50]))
    with pytest.raises(ValueError, match="need"):
        token_logprobs(logits, torch.tensor([0]))
