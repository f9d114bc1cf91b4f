"""Grammar masks inside DFlash / DFlash2 verification, through ``Program.run`` / ``commit`` (CPU fp32).

The MTP tests' toy grammar and driver (test_speculative_constrained_program: a pseudo-random third of the
vocabulary allowed per step, then only the stop token, which ends the grammar; the driver advances each
grammar over committed tokens only) on the embedded default model with a random drafter of each generation.
Constrained rows must validate and commit exactly the plain Program's tokens (greedy, and seeded for DFlash,
whose drafts are greedy); a DFlash2 row sampling its drafts validates and never produces a token past the stop
token. Both drafters mask every draft position with the grammar's mask after the drafts before it: every draft
walk the grammars see is allowed (the one-shot block's positions are chosen left to right).
"""

from __future__ import annotations

import pytest

from .test_dflash_program import _world, program
from .test_speculative_constrained_program import ENDS, STOP, decode, greedy, seeded

_PLAIN: dict[tuple, tuple] = {}


def plain(w, name: str, sampling):
    key = (w.name, name)
    if key not in _PLAIN:
        _PLAIN[key] = decode(program(w, 0), w, 0, sampling)
    return _PLAIN[key]


@pytest.mark.parametrize("k", [3, 7])
@pytest.mark.parametrize("world_name", ["default-dflash", "default-dflash2"])
def test_greedy_constrained_rows_commit_plain_constrained_tokens(tmp_path_factory, world_name, k):
    w = _world(world_name, tmp_path_factory)
    want, _, _, plain_walks = plain(w, "greedy", greedy)
    assert not plain_walks and [len(o) for o in want] == [e + 1 for e in ENDS]
    prog = program(w, k)
    got, produced, _, walks = decode(prog, w, k, greedy)
    assert got == want
    assert all(STOP not in toks[:-1] for toks in produced)
    spec = prog.speculation
    assert spec.drafted > 0   # (random drafters are seldom right: accepted drafts under masks are the MTP tests')
    assert walks and all(toks and ok for toks, ok in walks)
    assert any(toks[-1] == STOP for toks, _ in walks)


def test_seeded_constrained_rows_with_greedy_drafts_commit_plain_tokens(tmp_path_factory):
    w = _world("default-dflash", tmp_path_factory)
    want, _, _, _ = plain(w, "seeded", seeded)
    prog = program(w, 7)
    got, produced, _, walks = decode(prog, w, 7, seeded)
    assert got == want
    assert all(toks and ok for toks, ok in walks)


def test_sampled_dflash2_drafts_follow_the_grammar(tmp_path_factory):
    w = _world("default-dflash2", tmp_path_factory)
    prog = program(w, 7)
    got, produced, _, walks = decode(prog, w, 7, seeded)   # decode checks every output against its grammar
    assert [len(o) for o in got] == [e + 1 for e in ENDS] and all(o[-1] == STOP for o in got)
    assert all(STOP not in toks[:-1] for toks in produced)
    assert walks and all(toks and ok for toks, ok in walks)
    want, _, _, _ = plain(w, "seeded", seeded)
    assert got[2] == want[2]   # the greedy row among the sampled ones
