"""Speculative acceptance per draft position (``EngineStats.spec_drafted_by_position`` and
``spec_accepted_by_position``): the accounting of one verify row against an independent count, the commit
path's checks of a PendingRow's ``drafted``, and the embedded default model at k = 3, where the per-position
counts must agree with the Program's own totals (also when Replay resumes make the Program decode a row
plainly although the unit allowed it drafts, and beside a constrained row that may not draft)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from ninfer import Engine, EngineOptions
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.errors import EngineFailure
from ninfer.contracts.frontend import OutputOptions
from ninfer.contracts.program import PendingBatch, PendingRow
from ninfer.contracts.sampling import SamplingParams
from ninfer.engine.commit import _count_verifies
from ninfer.engine.scheduler import ScheduledUnit
from ninfer.engine.stats import EngineCounters, EngineStats, count_verify, counter_values

from .test_multi_prefill import burst

CODE = ["import os\nimport sys\n\n\ndef main():\n", "class Queue:\n    def __init__(self, maxsize=0):\n",
        "# file: Lib/json/__init__.py\n", "def join(a, *p):\n    \"\"\"Join two or more pathname components",
        "import re\n", "from collections import", "    for i in range(len(", "x = {\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def _reference(rows: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Position j (1-based): rows that drafted >= j tokens, and rows whose accepted prefix reaches j."""
    deepest = max((n for n, _ in rows), default=0)
    return ([sum(n >= j for n, _ in rows) for j in range(1, deepest + 1)],
            [sum(a >= j for _, a in rows) for j in range(1, deepest + 1)])


def test_one_verify_row_counts_its_positions():
    c = EngineCounters()
    count_verify(c, 3, 1)
    assert (c.spec_drafted_by_position, c.spec_accepted_by_position) == ([1, 1, 1], [1, 0, 0])
    count_verify(c, 1, 0)
    assert (c.spec_drafted_by_position, c.spec_accepted_by_position) == ([2, 1, 1], [1, 0, 0])
    count_verify(c, 4, 4)   # a deeper row than any before extends both lists
    assert (c.spec_drafted_by_position, c.spec_accepted_by_position) == ([3, 2, 2, 1], [2, 1, 1, 1])


def test_random_rows_match_the_reference_count():
    rng = random.Random(5)
    for _ in range(50):
        rows = [(n, rng.randint(0, n)) for n in (rng.randint(1, 8) for _ in range(rng.randint(1, 40)))]
        c = EngineCounters()
        for n, a in rows:
            count_verify(c, n, a)
        drafted, accepted = _reference(rows)
        assert c.spec_drafted_by_position == drafted and c.spec_accepted_by_position == accepted
        assert sum(drafted) == sum(n for n, _ in rows) and sum(accepted) == sum(a for _, a in rows)
        assert drafted[0] == len(rows)


@pytest.mark.parametrize(("drafted", "accepted"), [(0, 0), (2, 3), (2, -1), (True, 0), (-1, 0)])
def test_an_impossible_verify_row_is_refused(drafted, accepted):
    c = EngineCounters()
    with pytest.raises(ValueError, match="a verify row drafts >= 1 tokens"):
        count_verify(c, drafted, accepted)
    assert c.spec_drafted_by_position == [] and c.spec_accepted_by_position == []


def test_published_counts_are_copies_and_rates_follow():
    c = EngineCounters()
    for n, a in ((3, 3), (3, 1), (2, 0), (3, 2)):
        count_verify(c, n, a)
    values = counter_values(c)
    assert values["spec_drafted_by_position"] == (4, 4, 3) and values["spec_accepted_by_position"] == (3, 2, 1)
    count_verify(c, 1, 1)   # the published snapshot must not see the worker's later counts
    assert values["spec_drafted_by_position"] == (4, 4, 3)
    stats = EngineStats(status="running", queue_depth=0, running=0, paused=0, outstanding=0, submitted=0,
                        pages_used=0, pages_total=1, state_slots_used=0, state_slots_total=1, page_size=4,
                        **values)
    assert stats.spec_acceptance_by_position() == (3 / 4, 2 / 4, 1 / 3)
    assert EngineStats(status="running", queue_depth=0, running=0, paused=0, outstanding=0, submitted=0,
                       pages_used=0, pages_total=1, state_slots_used=0, state_slots_total=1,
                       page_size=4).spec_acceptance_by_position() == ()


def _unit(drafts: tuple[int, ...], chunks: int = 0) -> ScheduledUnit:
    # Only the rows' number and their draft counts matter to the accounting.
    return ScheduledUnit(decode=tuple(SimpleNamespace() for _ in drafts),
                         chunks=tuple(SimpleNamespace(samples=True) for _ in range(chunks)), drafts=drafts)


def test_commit_counts_verify_rows_only():
    c = EngineCounters()
    pending = PendingBatch(1, (PendingRow(0, (5, 6, 7), drafted=3),   # kept 2 of 3 drafts
                               PendingRow(1, (5,), drafted=0),        # allowed 2 drafts, ran plainly
                               PendingRow(2, (5,), drafted=1),        # kept none of 1 draft
                               PendingRow(3, (5,))))                  # a chunk's sample
    _count_verifies(_unit((3, 2, 1), chunks=1), pending, c)
    assert (c.spec_drafted_by_position, c.spec_accepted_by_position) == ([2, 1, 1], [1, 1, 0])


@pytest.mark.parametrize("row", [PendingRow(0, (5,), drafted=3),          # more drafts than the unit allowed
                                 PendingRow(0, (5, 6, 7), drafted=1),     # more tokens than drafted + 1
                                 PendingRow(0, (5, 6)),                   # a plain row with two tokens
                                 PendingRow(0, (5,), drafted=-1)])
def test_commit_refuses_a_row_the_unit_did_not_allow(row):
    with pytest.raises(EngineFailure, match="PendingBatch row of sequence 0 verified"):
        _count_verifies(_unit((2,)), PendingBatch(1, (row,)), EngineCounters())


def test_a_chunk_sample_cannot_have_verified_drafts():
    pending = PendingBatch(1, (PendingRow(0, (5,)), PendingRow(1, (5, 6), drafted=1)))
    with pytest.raises(EngineFailure, match="sequence 1 verified 1 drafts with 2 tokens; the unit allowed 0..0"):
        _count_verifies(_unit((3,), chunks=1), pending, EngineCounters())


def _start(artifact, max_context: int = 160, **options) -> Engine:
    return Engine.start(artifact, EngineOptions(device="cpu", dtype="float32", max_context=max_context, page_size=4,
                                                speculative="mtp", num_speculative_tokens=3, **options))


def _check_consistent(stats, k: int) -> None:
    drafted, accepted = stats.spec_drafted_by_position, stats.spec_accepted_by_position
    assert len(drafted) == len(accepted) == k   # 32-token requests at k = 3 verify 3 drafts often
    assert drafted[0] == stats.spec_verifies > 0
    assert sum(drafted) == stats.spec_drafted and sum(accepted) == stats.spec_accepted > 0
    assert all(drafted[j] >= drafted[j + 1] for j in range(k - 1))
    assert all(accepted[j] >= accepted[j + 1] for j in range(k - 1))
    assert all(0 <= a <= d for a, d in zip(accepted, drafted, strict=True))
    assert stats.spec_acceptance_by_position() == tuple(a / d for a, d in zip(accepted, drafted, strict=True))


def test_default_model_positions_agree_with_the_totals(default_artifact):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    with _start(default_artifact, max_concurrency=8) as engine:
        json_req = engine.submit(CODE[2], sampling=SamplingParams(temperature=1.0, max_tokens=24, seed=3),
                                 output=OutputOptions(constraint=OutputConstraint.json_schema(schema)))
        handles = [engine.submit(p, sampling=GREEDY) for p in CODE[:6]]
        assert all(h.result().token_ids for h in handles)
        json_req.result()
        stats = engine.stats()
    _check_consistent(stats, 3)


@pytest.mark.parametrize("context_cache", [False, True])
def test_positions_agree_with_the_totals_across_resumes(default_artifact, context_cache):
    # 28 pages of 4 tokens hold far less than 8 running requests of ~45 tokens: preempted requests resume by
    # Replay (no context cache) or from their Snapshot, and the Program decodes a resumed row plainly for one
    # step although the unit allowed it drafts. The burst is submitted while the worker is held in its first
    # forward, so every run schedules the same steps.
    host = {"cache_host_mib": 64} if context_cache else {}  # Snapshots live on the (opt-in) Host tier
    with _start(default_artifact, max_concurrency=8, prefill_chunk_size=16, num_pages=28, max_context=96,
                context_cache=context_cache, **host) as engine:
        tokens = burst(engine, engine._program, [(p, GREEDY) for p in CODE], "run")  # noqa: SLF001
        stats = engine.stats()
    assert [len(t) for t in tokens] == [GREEDY.max_tokens] * len(CODE)
    assert stats.preemptions > 0
    assert (stats.snapshot_resumes if context_cache else stats.replays) > 0
    _check_consistent(stats, 3)
