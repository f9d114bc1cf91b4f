"""PendingBatch commit rules and Program call contracts (SequenceProgram bookkeeping on a Qwen Program).

Every violation raises before anything is mutated: after a refused commit the same batch can still
be committed correctly and generation continues exactly as without the refused call.
"""

from __future__ import annotations

import pytest
from ninfer.contracts.program import (
    DecodeRow,
    ExecutionUnit,
    OutOfSlotsError,
    PendingBatch,
    PendingBatchError,
    PrefillChunk,
    Program,
    ProgramError,
)

from .harness import GREEDY, Runner, make_program, prompt


@pytest.fixture(scope="module")
def dense(qwen_case):
    return qwen_case("dense")


@pytest.fixture
def two_rows(dense):
    """A program with two decode-ready sequences and the pending batch of one decode step of both."""
    prog = make_program(dense)
    run = Runner(prog)
    a, b = run.open(prompt(3, 5)), run.open(prompt(4, 6))
    run.prefill(a)
    run.prefill(b)
    prog.reserve_units({a: 1, b: 1})
    pending = prog.run(ExecutionUnit(decode=(DecodeRow(a, GREEDY), DecodeRow(b, GREEDY))))
    return prog, a, b, pending


def test_the_program_satisfies_the_protocol(dense):
    assert isinstance(make_program(dense), Program)


@pytest.mark.parametrize("accepted", [
    "missing_row", "extra_row", "too_many", "negative", "bool", "float",
])
def test_bad_accepted_counts_are_refused_without_effect(two_rows, accepted):
    prog, a, b, pending = two_rows
    before = (prog.ledger(a), prog.ledger(b))
    bad = {"missing_row": {a: 1}, "extra_row": {a: 1, b: 1, 999: 1}, "too_many": {a: 2, b: 1},
           "negative": {a: -1, b: 1}, "bool": {a: True, b: 1}, "float": {a: 1.0, b: 1}}[accepted]
    with pytest.raises(PendingBatchError):
        prog.commit(pending, bad)
    assert (prog.ledger(a), prog.ledger(b)) == before and not pending.consumed
    prog.commit(pending, {a: 1, b: 1})                  # the batch is still whole
    assert prog.ledger(a)[-1] == pending.row(a).tokens[0]


def test_a_batch_is_consumed_exactly_once(two_rows):
    prog, a, b, pending = two_rows
    prog.commit(pending, {a: 1, b: 1})
    with pytest.raises(PendingBatchError):
        prog.commit(pending, {a: 1, b: 1})
    with pytest.raises(PendingBatchError):
        prog.abort_pending(pending)


def test_a_foreign_or_forged_batch_is_refused(two_rows, dense):
    prog, a, b, pending = two_rows
    forged = PendingBatch(batch_id=pending.batch_id, rows=pending.rows)
    with pytest.raises(PendingBatchError):
        prog.commit(forged, {a: 1, b: 1})
    other = make_program(dense)
    with pytest.raises(PendingBatchError):
        other.commit(pending, {a: 1, b: 1})
    with pytest.raises(PendingBatchError):
        pending.row(12345)


def test_rows_of_an_unconsumed_batch_cannot_run_pause_or_release(two_rows):
    prog, a, b, pending = two_rows
    with pytest.raises(ProgramError):
        prog.run(ExecutionUnit(decode=(DecodeRow(a, GREEDY),)))
    with pytest.raises(ProgramError):
        prog.pause(a)
    with pytest.raises(ProgramError):
        prog.release(b)
    prog.commit(pending, {a: 1, b: 1})
    prog.release(b)
    with pytest.raises(ProgramError):
        prog.release(b)                                 # released ids are unknown


def test_aborted_or_cancelled_rows_can_only_be_replayed_or_released(two_rows):
    prog, a, b, pending = two_rows
    prog.commit(pending, {a: 0, b: 1})                  # a cancelled: accepts nothing
    prog.reserve_units({a: 1, b: 1})
    with pytest.raises(ProgramError, match="no next input"):
        prog.run(ExecutionUnit(decode=(DecodeRow(a, GREEDY),)))
    pending = prog.run(ExecutionUnit(decode=(DecodeRow(b, GREEDY),)))
    prog.abort_pending(pending)
    assert pending.consumed
    with pytest.raises(ProgramError, match="no next input"):
        prog.run(ExecutionUnit(decode=(DecodeRow(b, GREEDY),)))
    state = prog.pause(b)                               # Replay is the way back
    assert len(state.ledger) == 6 + 2                   # prompt, prefill token, committed step
    prog.release(a)


def test_unit_shape_violations(dense):
    prog = make_program(dense, max_sequences=2)
    run = Runner(prog)
    s = run.open(prompt(1, 6))
    with pytest.raises(ProgramError, match="reserved"):
        prog.run(ExecutionUnit(chunks=(PrefillChunk(s, 6, GREEDY),)))          # no KV reserved
    prog.reserve_units({s: 6})
    with pytest.raises(ProgramError, match="sampling"):
        prog.run(ExecutionUnit(chunks=(PrefillChunk(s, 3, GREEDY),)))          # sampling before the end
    with pytest.raises(ProgramError, match="sampling"):
        prog.run(ExecutionUnit(chunks=(PrefillChunk(s, 6),)))                  # no sampling at the end
    with pytest.raises(ProgramError, match="exceed"):
        prog.run(ExecutionUnit(chunks=(PrefillChunk(s, 7, GREEDY),)))
    with pytest.raises(ProgramError, match="decode-ready"):
        prog.run(ExecutionUnit(decode=(DecodeRow(s, GREEDY),)))
    with pytest.raises(ProgramError, match="twice"):
        prog.run(ExecutionUnit(decode=(DecodeRow(s, GREEDY),), chunks=(PrefillChunk(s, 6, GREEDY),)))
    with pytest.raises(ProgramError):
        prog.run(ExecutionUnit())
    assert prog.computed(s) == 0                        # nothing ran
    with pytest.raises(ProgramError, match="vocabulary"):
        prog.open_sequence([0, 512])
    with pytest.raises(ProgramError):
        prog.open_sequence([])
    run.open(prompt(2, 3))
    with pytest.raises(OutOfSlotsError):
        prog.open_sequence([1])
    with pytest.raises(ProgramError):
        prog.reserve_units({s: -1})
    assert prog.reserve_units({s: 2000}) == {s: False}  # beyond max_context
