"""Masked sampling in SequenceProgram._sample, brute force on a tiny vocabulary.

Every non-empty allowed set of a 10-token vocabulary, under greedy and seeded sampling with and
without top-k / top-p / min-p, plus penalties: the drawn token is always allowed; greedy is the
allowed argmax; without filters the draw is the Gumbel argmax over the allowed set (so the mask
changes nothing when the unconstrained draw was allowed: it consumes no RNG); unconstrained rows
batched with constrained ones are bit-for-bit what they are alone.
"""

from __future__ import annotations

import pytest
import torch
from engine.doubles import ToyProgram
from ninfer.contracts.program import RowSampling, TokenMaskProvider
from ninfer.contracts.sampling import SamplingParams
from ninfer.ops.reference.sampling import hash_uniform
from ninfer.program.token_bitmask import apply_bitmask, unpack_bitmask, words_per_row

V = 10
MASKS = list(range(1, 1 << V))  # every non-empty allowed set, as an int bitset


class SetMask:
    """A TokenMaskProvider allowing exactly the ids in ``bits``."""

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def fill_bitmask(self, words: torch.Tensor) -> None:
        for w in range(words.shape[0]):
            chunk = (self.bits >> (32 * w)) & 0xFFFFFFFF
            words[w] = chunk - (1 << 32) if chunk >= 1 << 31 else chunk


def allowed_ids(bits: int) -> set[int]:
    return {i for i in range(V) if bits >> i & 1}


def test_set_mask_is_a_token_mask_provider():
    assert isinstance(SetMask(1), TokenMaskProvider)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 70, 248077])
def test_unpack_matches_the_bit_layout(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = torch.randint(-2**31, 2**31 - 1, (3, words_per_row(vocab)), dtype=torch.int32, generator=g)
    allowed = unpack_bitmask(words, vocab)
    ids = torch.arange(vocab)
    expected = ((words[:, ids // 32] >> (ids % 32)) & 1).bool()  # bit i % 32 of word i // 32
    assert torch.equal(allowed, expected)
    logits = torch.randn(3, vocab, generator=g)
    out = apply_bitmask(logits.clone(), words)
    assert torch.equal(out[allowed], logits[allowed])  # allowed logits bit-exact
    assert bool((out[~allowed] == float("-inf")).all())


CONFIGS = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=3),
    dict(temperature=1.3, top_p=0.6),
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=1.0, top_k=2, top_p=0.9, min_p=0.05),
]


@pytest.fixture(scope="module")
def program():
    return ToyProgram(vocab_size=V)


def _draw(program, logits, rows):
    tokens, _ = program._sample(logits, rows)
    return tokens


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_masked_draws_are_always_allowed(program, config):
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(**config)
    for seed in (0, 1, 2):
        # Ties included: logits on a coarse grid make equal maxima common.
        logits = (torch.randint(-3, 4, (len(MASKS), V), generator=g).float() * 0.5)
        rows = [(0, RowSampling(params, seed, b, SetMask(bits))) for b, bits in enumerate(MASKS)]
        tokens = _draw(program, logits, rows)
        for b, (bits, tok) in enumerate(zip(MASKS, tokens, strict=True)):
            allowed = allowed_ids(bits)
            assert tok in allowed, (bits, tok)
            if params.greedy:
                best = max(logits[b, i].item() for i in allowed)
                assert tok == min(i for i in allowed if logits[b, i].item() == best)
            elif config == dict(temperature=1.0):
                # No filters: the Gumbel-max over the allowed set, with the unmasked row's own noise.
                u = hash_uniform(torch.tensor([seed]), torch.tensor([b]), V)[0]
                score = logits[b].double() - torch.log(-torch.log(u))
                assert tok == max(allowed, key=lambda i: (score[i].item(), -i))


def test_penalties_never_revive_a_banned_token(program):
    seq = program.open_sequence([3, 4, 5])  # the prompt makes 3..5 "seen" for the repetition penalty
    try:
        params = SamplingParams(temperature=1.0, repetition_penalty=0.2, presence_penalty=-2.0,
                                frequency_penalty=-2.0)
        logits = torch.zeros(len(MASKS), V)
        rows = [(seq, RowSampling(params, 5, b, SetMask(bits))) for b, bits in enumerate(MASKS)]
        for bits, tok in zip(MASKS, _draw(program, logits, rows), strict=True):
            assert tok in allowed_ids(bits)
    finally:
        program.release(seq)


def test_unconstrained_rows_of_a_mixed_batch_are_unchanged(program):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, V, generator=g)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    plain = [(0, RowSampling(params, 11, b)) for b in range(12)]
    alone = _draw(program, logits, plain)
    mixed = [(0, RowSampling(params, 11, b, SetMask(0b11) if b % 3 == 0 else None)) for b in range(12)]
    together = _draw(program, logits, mixed)
    for b in range(12):
        if b % 3 == 0:
            assert together[b] in (0, 1)
        else:
            assert together[b] == alone[b]


def test_logprobs_stay_those_of_the_raw_distribution(program):
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0.0, logprobs=True)
    tokens, lps = program._sample(logits, [(0, RowSampling(params, 0, 0, SetMask(1 << 4)))])
    assert tokens == [4]
    assert lps[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[4].item())
