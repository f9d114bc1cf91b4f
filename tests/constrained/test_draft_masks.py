"""Grammar masks past drafted tokens (speculative verification): ``ConstraintMatcher.fill_bitmask_after`` and
``ninfer.program.draft_masks``, on a byte vocabulary (256 bytes and one EOS) with xgrammar.

The reference for "the mask after the committed output and ``d_1..d_i``" is a fresh matcher fed exactly those
tokens. Walking drafts must never move the matcher: its mask afterwards, and what a preview/commit then does,
are those of a matcher that never saw them.
"""

from __future__ import annotations

import random

import pytest
import torch
import xgrammar as xgr
from ninfer.constrained.matcher import ConstraintMatcher
from ninfer.contracts.program import DraftMaskProvider, ProgramError, RowSampling
from ninfer.contracts.sampling import SamplingParams
from ninfer.program.draft_masks import MaskedDrafting, VerifyMasks, may_verify
from ninfer.program.token_bitmask import unpack_bitmask, words_per_row

from .conftest import BYTE_EOS

VOCAB = 257
GRAMMAR = 'root ::= "ab" [0-9]{1,3} ("x" | "yz")\n'


@pytest.fixture
def compiled(byte_compiler):
    return byte_compiler.compile_grammar(xgr.Grammar.from_ebnf(GRAMMAR))


def b(text: str) -> list[int]:
    return list(text.encode())


def words() -> torch.Tensor:
    return torch.zeros(words_per_row(VOCAB), dtype=torch.int32)


def allowed(w: torch.Tensor) -> torch.Tensor:
    return unpack_bitmask(w.view(1, -1), VOCAB)[0]


def reference(compiled, tokens: list[int]) -> torch.Tensor:
    """The allowed tokens of a fresh matcher fed ``tokens``."""
    m = ConstraintMatcher(compiled, [BYTE_EOS])
    assert m.advance(tokens).accepted == len(tokens)
    m.commit()
    w = words()
    m.fill_bitmask(w)
    return allowed(w)


def test_the_matcher_is_a_draft_mask_provider(compiled):
    m = ConstraintMatcher(compiled, [BYTE_EOS])
    assert isinstance(m, DraftMaskProvider)
    params = SamplingParams(temperature=0.0)
    assert may_verify(RowSampling(params, 0, 0)) and may_verify(RowSampling(params, 0, 0, m))


def test_fill_bitmask_after_is_the_mask_after_the_drafts_and_moves_nothing(compiled):
    m = ConstraintMatcher(compiled, [BYTE_EOS])
    m.advance(b("a"))
    m.commit()
    before = words()
    m.fill_bitmask(before)
    for drafts in ("", "b", "b1", "b12", "b123", "b12y"):
        w = words()
        assert m.fill_bitmask_after(b(drafts), w)
        assert torch.equal(allowed(w), reference(compiled, b("a" + drafts)))
    after = words()
    m.fill_bitmask(after)
    assert torch.equal(before, after) and m.committed == 1
    # A pending preview is dropped first, as fill_bitmask does: the walk starts at the committed output.
    m.advance(b("b1"))
    w = words()
    assert m.fill_bitmask_after(b("b"), w) and torch.equal(allowed(w), reference(compiled, b("ab")))
    # The walk left the matcher where a matcher that never saw it is: a preview/commit continues normally.
    assert m.advance(b("b7x")).accepted == 3
    m.commit()
    assert m.advance([BYTE_EOS]).terminated


def test_fill_bitmask_after_fails_on_a_rejected_draft_or_the_grammar_end(compiled):
    m = ConstraintMatcher(compiled, [BYTE_EOS])
    w = words()
    assert not m.fill_bitmask_after(b("ac"), w)                  # "c" is not allowed after "a"
    assert not m.fill_bitmask_after(b("ab1x") + [BYTE_EOS], w)   # the grammar ended: no next token
    assert not m.fill_bitmask_after(b("ab1x") + [BYTE_EOS] + b("a"), w)
    assert not m.fill_bitmask_after(b("ab1234"), w)              # four digits
    assert m.fill_bitmask_after(b("ab1x"), w)
    assert allowed(w).nonzero().flatten().tolist() == [BYTE_EOS]  # only the end is left
    after = words()
    m.fill_bitmask(after)
    assert torch.equal(allowed(after), reference(compiled, [])) and not m.terminated


def test_verify_masks_follow_the_drafts_until_the_grammar_rejects_or_ends(compiled):
    m = ConstraintMatcher(compiled, [BYTE_EOS])
    m.advance(b("ab"))
    m.commit()
    cases = [("12x", 3), ("1q2", 1), ("9", 1), ("7yz", 3)]
    for drafts, valid in cases:
        v = VerifyMasks(m, 4, VOCAB)
        toks = b(drafts) + ([BYTE_EOS] if drafts == "7yz" else [])   # the end drafted: no mask after it
        for i, t in enumerate(toks):
            v.push(t)
            assert v.valid == min(i + 1, valid)
        assert v.valid == valid
        for i in range(valid + 1):
            assert torch.equal(allowed(v.words[i]), reference(compiled, b("ab") + toks[:i]))
        for i in range(valid + 1, 5):
            assert bool(allowed(v.words[i]).all())   # never read: every token allowed
    with pytest.raises(ProgramError, match="got another"):
        v.push(1)
    assert m.committed == 2 and torch.equal(allowed(v.words[0]), reference(compiled, b("ab")))


class MaskOnly:
    def fill_bitmask(self, w: torch.Tensor) -> None:
        w.fill_(-1)


def test_a_mask_that_cannot_look_past_drafts_cannot_verify():
    assert not may_verify(RowSampling(SamplingParams(), 0, 0, MaskOnly()))
    with pytest.raises(ProgramError, match="DraftMaskProvider"):
        VerifyMasks(MaskOnly(), 2, VOCAB)


@pytest.mark.parametrize("seed", range(4))
def test_masked_drafting_keeps_a_greedy_drafter_inside_the_grammar(compiled, seed):
    """A greedy drafter over random logits, driven the way ``Qwen35MTPHead.draft`` calls its ``constrain``:
    rows 0 and 2 are constrained, row 1 is not (its logits pass untouched)."""
    g = torch.Generator().manual_seed(seed)
    k, rows = 8, 3
    steps = [torch.randn(rows, VOCAB, generator=g) for _ in range(k)]
    matchers = [ConstraintMatcher(compiled, [BYTE_EOS]) for _ in range(2)]
    masks = [VerifyMasks(m, k, VOCAB) for m in matchers]
    masked = MaskedDrafting([(0, masks[0]), (2, masks[1])])
    toks: list[torch.Tensor] = []
    for logits in steps:
        drafted = torch.stack(toks, dim=1) if toks else torch.zeros((rows, 0), dtype=torch.int64)
        out = masked(drafted, logits)
        assert torch.equal(out[1], logits[1])
        toks.append(out.argmax(dim=-1))
    drafts = torch.stack(toks, dim=1)
    masked.finish(drafts)
    assert drafts[1].tolist() == [int(s[1].argmax()) for s in steps]
    for r, v in ((0, masks[0]), (2, masks[1])):
        d = drafts[r].tolist()
        assert v.drafts == d
        # Every draft is allowed; the grammar ends within 8 bytes, so the walk stops at the drafted EOS.
        end = d.index(BYTE_EOS)
        assert v.valid == end and 4 <= end <= 7   # "ab", 1-3 digits, "x" or "yz"
        probe = ConstraintMatcher(compiled, [BYTE_EOS])
        assert probe.advance(d).accepted == end + 1 and probe.advance(d).terminated
    assert all(m.committed == 0 for m in matchers)


def test_masked_drafting_refuses_drafts_it_did_not_see(compiled):
    masked = MaskedDrafting([(0, VerifyMasks(ConstraintMatcher(compiled, [BYTE_EOS]), 3, VOCAB))])
    with pytest.raises(ProgramError, match="out of step"):
        masked(torch.tensor([[97, 98]]), torch.zeros(1, VOCAB))


def test_random_walks_match_fresh_matchers(compiled):
    rng = random.Random(0)
    m = ConstraintMatcher(compiled, [BYTE_EOS])
    for _ in range(40):
        walk = [rng.choice(b("ab0123456789xyz")) for _ in range(rng.randint(0, 6))]
        w = words()
        ok = m.fill_bitmask_after(walk, w)
        probe = ConstraintMatcher(compiled, [BYTE_EOS])
        adv = probe.advance(walk)
        assert ok == (adv.accepted == len(walk) and not adv.terminated)
        if ok:
            assert torch.equal(allowed(w), reference(compiled, walk))
    assert m.committed == 0 and torch.equal(allowed(_filled(m)), reference(compiled, []))


def _filled(m: ConstraintMatcher) -> torch.Tensor:
    w = words()
    m.fill_bitmask(w)
    return w
