"""``min_tokens`` (OutputOptions, vLLM's field): stop tokens are held back until the output has that many tokens.

The mask provider alone (ninfer.constrained.min_tokens), then the embedded default model through the public Engine
(CPU, greedy): a request whose plain answer ends on a stop token keeps the same tokens up to that position and then
goes on to at least ``min_tokens``; with MTP speculation the tokens are the same as without; a grammar that can only
end still ends the output.
"""

from __future__ import annotations

import pytest
import torch
from ninfer.constrained.min_tokens import MinTokensMask
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.frontend import OutputOptions
from ninfer.contracts.program import DraftMaskProvider

VOCAB = 70   # three mask words; ids 31 and 63 are the words' sign bits


def _allowed(words: torch.Tensor) -> set[int]:
    return {t for t in range(VOCAB) if (int(words[t // 32]) >> (t % 32)) & 1}


class _Only:
    """A grammar's mask provider that allows ``ids`` (and after any drafts, the same)."""

    def __init__(self, ids):
        self.ids = set(ids)

    def fill_bitmask(self, words):
        words.zero_()
        for t in self.ids:
            words[t // 32] |= ((1 << (t % 32)) + (1 << 31)) % (1 << 32) - (1 << 31)

    def fill_bitmask_after(self, tokens, words):
        self.fill_bitmask(words)
        return True


def test_the_mask_holds_back_stop_tokens_until_min_tokens():
    words = torch.empty(3, dtype=torch.int32)
    mask = MinTokensMask(None, [31, 63, 5], committed=2, min_tokens=4)
    assert isinstance(mask, DraftMaskProvider)
    mask.fill_bitmask(words)
    assert _allowed(words) == set(range(VOCAB)) - {5, 31, 63}
    assert mask.fill_bitmask_after([7], words) and _allowed(words) == set(range(VOCAB)) - {5, 31, 63}
    assert mask.fill_bitmask_after([7, 8], words) and _allowed(words) == set(range(VOCAB))  # position 4: free
    assert not mask.fill_bitmask_after([7, 63], words)   # a stop among the drafts ended the output
    MinTokensMask(None, [5], committed=4, min_tokens=4).fill_bitmask(words)
    assert _allowed(words) == set(range(VOCAB))


def test_on_a_grammar_the_mask_is_the_grammars_less_the_stops_unless_it_can_only_end():
    words = torch.empty(3, dtype=torch.int32)
    MinTokensMask(_Only({3, 5, 40}), [5], committed=0, min_tokens=2).fill_bitmask(words)
    assert _allowed(words) == {3, 40}
    MinTokensMask(_Only({5}), [5], committed=0, min_tokens=2).fill_bitmask(words)
    assert _allowed(words) == {5}   # the grammar can only end here: never an empty mask

    class NoDrafts:   # a grammar's provider that cannot look past drafts: none are verified
        fill_bitmask = _Only({3, 5}).fill_bitmask

    assert not MinTokensMask(NoDrafts(), [5], committed=0, min_tokens=2).fill_bitmask_after([3], words)


def test_options_check_min_tokens():
    from ninfer.contracts.errors import InvalidRequestError

    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InvalidRequestError, match="min_tokens"):
            OutputOptions(min_tokens=bad)


@pytest.fixture(scope="module")
def engines(default_artifact):
    from ninfer import Engine

    plain = Engine.start(default_artifact, device="cpu", dtype="float32", max_concurrency=2, max_context=512)
    mtp = Engine.start(default_artifact, device="cpu", dtype="float32", max_concurrency=2, max_context=512,
                       speculative="mtp", num_speculative_tokens=2)
    try:
        yield plain, mtp
    finally:
        plain.close()
        mtp.close()


MESSAGES = [{"role": "user", "content": "Say hi."}]


def _chat(engine, **output):
    return engine.chat(MESSAGES, enable_thinking=False, output=OutputOptions(**output), max_tokens=60,
                       temperature=0)


def test_greedy_output_goes_on_past_the_stop_to_min_tokens(engines):
    plain_engine, mtp_engine = engines
    plain = _chat(plain_engine)
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 40, plain   # the premise: it ends early
    n = len(plain.token_ids)   # the last is the stop token
    held = _chat(plain_engine, min_tokens=n + 10)
    stops = set(plain_engine.frontend.eos_token_ids)
    assert held.token_ids[:n - 1] == plain.token_ids[:n - 1]
    assert len(held.token_ids) >= n + 10 and not stops & set(held.token_ids[:n + 9])
    # MTP verifies its drafts under the same mask: the same tokens.
    assert _chat(mtp_engine, min_tokens=n + 10).token_ids == held.token_ids
    # The stop may come once min_tokens tokens precede it: the plain answer's n - 1 changes nothing, n does.
    assert _chat(plain_engine, min_tokens=n - 1).token_ids == plain.token_ids
    assert _chat(plain_engine, min_tokens=n).token_ids[:n] != plain.token_ids


def test_a_grammar_that_can_only_end_ends_the_output(engines):
    plain_engine, _ = engines
    out = _chat(plain_engine, constraint=OutputConstraint.choice(["yes", "no"]), min_tokens=20)
    assert out.finish_reason == "stop" and len(out.token_ids) < 20
    assert out.output.content in ("yes", "no")


def test_under_ignore_eos_the_grammars_end_is_held_back_too(engines):
    """With ignore_eos and no stop ids, a grammar still ends on the model's EOS: min_tokens holds that back too."""
    plain_engine, _ = engines
    regex = OutputConstraint.regex("[a-z ]+")
    free = _chat(plain_engine, constraint=regex, ignore_eos=True)
    assert free.finish_reason == "stop" and len(free.token_ids) < 24, free   # the premise: the grammar ends early
    held = _chat(plain_engine, constraint=regex, ignore_eos=True, min_tokens=24)
    assert len(held.token_ids) >= 24 and held.token_ids[:len(free.token_ids) - 1] == free.token_ids[:-1]
    assert set(held.output.content) <= set("abcdefghijklmnopqrstuvwxyz ")
