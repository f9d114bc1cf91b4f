"""Grammar masks and logprobs inside MTP verification, through ``Program.run`` / ``commit`` (CPU fp32).

The embedded default model (its trained MTP head) decodes three sequences under a toy grammar (a
:class:`~ninfer.contracts.program.DraftMaskProvider` written here, independent of xgrammar): at every step a
pseudo-random third of the vocabulary is allowed, depending on the length and last token of the output so
far, and after ``end`` tokens only the stop token is, which ends the grammar. The driver advances each
sequence's grammar over the committed tokens only, as the engine's OutputSession does. A speculating Program
must commit exactly the plain Program's tokens (greedy and seeded, k = 1, 2, 4), every token allowed and
nothing past the stop token; the drafter must only ever propose allowed tokens; rows asking for logprobs get
plain decoding's logprobs at every committed position.
"""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.program import (
    DecodeRow,
    DraftMaskProvider,
    ExecutionUnit,
    PrefillChunk,
    ProgramError,
    RowSampling,
    TokenMaskProvider,
)
from ninfer.contracts.sampling import SamplingParams
from ninfer.program.token_bitmask import unpack_bitmask, words_per_row

from .test_speculative_program import _world, program, prompts

STOP = 7


def pack(allowed: torch.Tensor, words: torch.Tensor) -> None:
    """Write bool ``allowed`` [V] into int32 ``words`` (token_bitmask's layout)."""
    bits = torch.zeros(words.shape[0] * 32, dtype=torch.int64)
    bits[:allowed.shape[0]] = allowed.to(torch.int64)
    values = (bits.view(-1, 32) << torch.arange(32)).sum(dim=1)
    words.copy_(torch.where(values >= 2 ** 31, values - 2 ** 32, values).to(torch.int32))


class ToyGrammar:
    """Allowed tokens after an output: before ``end`` tokens, ids with ``(7919 t + 31 last + 17 len) % 3 == 0``
    but not STOP; after exactly ``end`` tokens, only STOP; after STOP, nothing (the grammar has ended)."""

    def __init__(self, vocab: int, end: int) -> None:
        self.vocab, self.end = vocab, end
        self.ids = torch.arange(vocab)

    def allowed(self, out: list[int]) -> torch.Tensor | None:
        if STOP in out:
            return None
        if len(out) >= self.end:
            return self.ids == STOP
        last = out[-1] if out else 0
        return ((7919 * self.ids + 31 * last + 17 * len(out)) % 3 == 0) & (self.ids != STOP)

    def accepts(self, out: list[int], start: int = 0) -> bool:
        """Whether every token of ``out`` from ``start`` on was allowed where it stands."""
        return all((a := self.allowed(out[:i])) is not None and bool(a[out[i]]) for i in range(start, len(out)))


class ToyMatcher:
    """The grammar at a committed output (``out``, shared with the driver); records every draft walk as
    (tokens, whether the grammar allows them all)."""

    def __init__(self, grammar: ToyGrammar, out: list[int], walks: list[tuple[list[int], bool]]) -> None:
        self.g, self.out, self.walks = grammar, out, walks

    def fill_bitmask(self, words: torch.Tensor) -> None:
        pack(self.g.allowed(self.out), words)

    def fill_bitmask_after(self, tokens, words) -> bool:
        tokens = [int(t) for t in tokens]
        ok = self.g.accepts(self.out + tokens, len(self.out))
        self.walks.append((tokens, ok))
        if not ok:
            return False
        allowed = self.g.allowed(self.out + tokens)
        if allowed is None:
            return False
        pack(allowed, words)
        return True


class MaskOnly:
    """A mask provider that cannot follow drafts (a TokenMaskProvider only)."""

    def fill_bitmask(self, words: torch.Tensor) -> None:
        words.fill_(-1)


def test_the_protocols_tell_the_providers_apart():
    g = ToyGrammar(64, 3)
    assert isinstance(ToyMatcher(g, [], []), DraftMaskProvider)
    assert isinstance(MaskOnly(), TokenMaskProvider) and not isinstance(MaskOnly(), DraftMaskProvider)
    words = torch.zeros(words_per_row(64), dtype=torch.int32)
    pack(g.allowed([5]), words)
    assert torch.equal(unpack_bitmask(words.view(1, -1), 64)[0], g.allowed([5]))


GREEDY = SamplingParams(temperature=0.0)


def greedy(i: int):
    return GREEDY, 0


def seeded(i: int):
    if i == 0:
        return SamplingParams(temperature=0.9), 11
    if i == 1:
        return SamplingParams(temperature=0.8, top_k=50, presence_penalty=0.4), 12
    return GREEDY, 0


def with_logprobs(i: int):
    params, seed = seeded(i)
    return SamplingParams(temperature=params.temperature, top_k=params.top_k,
                          presence_penalty=params.presence_penalty, logprobs=True, top_logprobs=3), seed


ENDS = (13, 22, 30)


def decode(prog, w, k: int, sampling, steps: int = 40):
    """Prefill the three prompts, then decode each (``k`` drafts a row) until it commits STOP or ``steps``
    tokens, committing every produced token. Returns the outputs, each step's PendingRow tokens, the
    logprobs, and every draft walk the grammars saw."""
    grammars = [ToyGrammar(w.vocab, e) for e in ENDS]
    outs: list[list[int]] = [[] for _ in ENDS]
    lps: list[list] = [[] for _ in ENDS]
    walks: list[tuple[list[int], bool]] = []
    produced: list[tuple[int, ...]] = []
    seqs = [prog.open_sequence(t) for t in prompts(w)]

    def row(i: int) -> RowSampling:
        params, seed = sampling(i)
        return RowSampling(params, seed, len(outs[i]), ToyMatcher(grammars[i], outs[i], walks))

    def commit(pending):
        for r in pending.rows:
            i = seqs.index(r.seq)
            outs[i].extend(r.tokens)
            if r.logprobs is not None:
                assert len(r.logprobs) == len(r.tokens)
                lps[i].extend(r.logprobs)
        prog.commit(pending, {r.seq: len(r.tokens) for r in pending.rows})

    for i, s in enumerate(seqs):
        n = prog.ledger_length(s)
        assert prog.reserve_units({s: n})[s]
        commit(prog.run(ExecutionUnit(chunks=(PrefillChunk(s, n, row(i)),))))
    while True:
        live = [i for i in range(len(seqs)) if STOP not in outs[i] and len(outs[i]) < steps]
        if not live:
            break
        rows = []
        for i in live:
            n = min(k, steps - len(outs[i]) - 1)
            assert prog.reserve_units({seqs[i]: n + 1})[seqs[i]]
            rows.append(DecodeRow(seqs[i], row(i), drafts=n))
        pending = prog.run(ExecutionUnit(decode=tuple(rows)))
        produced.extend(r.tokens for r in pending.rows)
        commit(pending)
    for g, out in zip(grammars, outs, strict=True):
        assert g.accepts(out)
    return outs, produced, lps, walks


_PLAIN: dict[str, tuple] = {}


def plain(w, name: str, sampling):
    if name not in _PLAIN:
        _PLAIN[name] = decode(program(w, 0), w, 0, sampling)
    return _PLAIN[name]


@pytest.fixture
def default_world(tmp_path_factory):
    return _world("default", tmp_path_factory)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_constrained_rows_commit_plain_constrained_tokens(default_world, k, name):
    w = default_world
    sampling = greedy if name == "greedy" else seeded
    want, _, _, plain_walks = plain(w, name, sampling)
    assert not plain_walks                                  # plain decoding never looks past its output
    assert [len(o) for o in want] == [e + 1 for e in ENDS]   # each grammar ended with its stop token
    prog = program(w, k)
    got, produced, _, walks = decode(prog, w, k, sampling)
    assert got == want
    # Nothing past a stop token is ever produced: the grammar's end cuts the verify row.
    assert all(STOP not in toks[:-1] for toks in produced)
    assert max(len(t) for t in produced) > 1                 # multi-token commits happened
    spec = prog.speculation
    print(f"{name} k={k}: {spec.verified} verifies, {spec.accepted}/{spec.drafted} drafts accepted")
    assert spec.drafted > spec.accepted > 0                  # drafts were verified: some kept, some rejected
    # The drafter followed the grammar: every draft it made was allowed, and some drafted the stop token (where
    # the walk ends: no mask exists after it).
    assert walks and all(toks and ok for toks, ok in walks)
    assert any(toks[-1] == STOP for toks, _ in walks)


def test_logprob_rows_get_plain_logprobs(default_world):
    w = default_world
    want, _, want_lps, _ = plain(w, "logprobs", with_logprobs)
    prog = program(w, 3)
    got, produced, got_lps, _ = decode(prog, w, 3, with_logprobs)
    assert got == want and prog.speculation.accepted > 0 and max(len(t) for t in produced) > 1
    for out, a, b in zip(got, got_lps, want_lps, strict=True):
        assert len(a) == len(b) == len(out)
        for x, y, t in zip(a, b, out, strict=True):
            assert x.token == y.token == t
            assert abs(x.logprob - y.logprob) < 1e-4
            assert [i for i, _ in x.top] == [i for i, _ in y.top]
            assert all(abs(p - q) < 1e-4 for (_, p), (_, q) in zip(x.top, y.top, strict=True))


def test_a_mask_that_cannot_follow_drafts_is_refused(default_world):
    prog = program(default_world, 2)
    seq = prog.open_sequence([1, 2, 3])
    prog.reserve_units({seq: 3})
    prog.commit(prog.run(ExecutionUnit(chunks=(PrefillChunk(seq, 3, RowSampling(GREEDY, 0, 0)),))), {seq: 1})
    prog.reserve_units({seq: 3})
    with pytest.raises(ProgramError, match="DraftMaskProvider"):
        prog.run(ExecutionUnit(decode=(DecodeRow(seq, RowSampling(GREEDY, 0, 1, MaskOnly()), drafts=2),)))
    # Untouched: it decodes plainly with the same mask.
    pending = prog.run(ExecutionUnit(decode=(DecodeRow(seq, RowSampling(GREEDY, 0, 1, MaskOnly())),)))
    assert len(pending.rows[0].tokens) == 1
    prog.commit(pending, {seq: 1})
