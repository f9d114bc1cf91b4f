"""Lookahead decode on the Qwen3.5 Program (CPU, fp32 reference ops; ninfer.program.lookahead).

A Program with lookahead spares must produce exactly the tokens and the StateImages of one without,
whatever the engine asks next: the same rows (adopted), a subset after a release (adopted), a unit
with a chunk or another row order (dropped), a pause, a checkpoint capture while a lookahead is
outstanding. Spares never show in ``capacity()`` and all come back.
"""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.architecture import ProgramInit, ProgramOptions
from ninfer.contracts.program import DecodeRow, ExecutionUnit, ProgramError, RowSampling
from ninfer.contracts.sampling import SamplingParams
from ninfer.ops import resolve_ops
from ninfer.plugins import get_registry

from .harness import Runner, make_program, prompt

GREEDY = SamplingParams(temperature=0.0)
HOT = SamplingParams(temperature=0.8, top_p=0.9)


@pytest.fixture(scope="module")
def dense(qwen_case):
    return qwen_case("dense")


class Driver(Runner):
    """Drives a Program like the engine: a RowSampling whose step counts the row's sampled tokens (so
    the lookahead's prediction can match), a reservation before every unit, every row committed whole."""

    def __init__(self, program) -> None:
        super().__init__(program, record=False)  # a lookahead's forward is not the unit's: record nothing
        self.params: dict[int, SamplingParams] = {}
        self.steps: dict[int, int] = {}

    def open(self, tokens, params=GREEDY) -> int:
        seq = self.p.open_sequence(list(tokens))
        self.params[seq], self.steps[seq] = params, 0
        return seq

    def sampling(self, seq: int) -> RowSampling:
        return RowSampling(self.params[seq], seed=seq, step=self.steps[seq])

    def row_sampling(self, seq: int, overrides: dict) -> RowSampling:
        return self.sampling(seq)

    def committed(self, pending) -> None:
        for r in pending.rows:
            self.steps[r.seq] += 1

    def image(self, seq: int) -> torch.Tensor:
        return self.p.states.image(self.p.state_slot(seq)).clone()


def pair(dense, **kw):
    """The same scenario on a Program without and one with lookahead spares."""
    return Driver(make_program(dense, **kw)), Driver(make_program(dense, lookahead_slots=4, **kw))


def script(d: Driver, steps: list) -> list[dict[int, int]]:
    return [step(d) for step in steps]


def test_same_rows_are_adopted_and_equal_no_lookahead(dense):
    off, on = pair(dense)
    for d in (off, on):
        a, b = d.open(prompt(1, 7)), d.open(prompt(2, 5), HOT)
        d.unit(chunk=(a, 7))
        d.unit(chunk=(b, 5))
        d.out = [d.unit(decode=[a, b]) for _ in range(6)]
        d.images = (d.image(a), d.image(b))
    assert on.out == off.out
    assert all(torch.equal(x, y) for x, y in zip(on.images, off.images, strict=True))
    stats = on.p.lookahead_stats
    assert (stats.launched, stats.adopted, stats.dropped) == (6, 5, 0)
    assert off.p.lookahead_stats.launched == 0


def test_subset_after_a_release_is_adopted(dense):
    """After b is released, a and c adopt their step from the lookahead of [a, b, c]: it was computed in a
    batch of three where the unit asks for two. Tokens must be equal; the states are equal to the extent
    the GEMM library is batch-invariant (bitwise on some CPUs, to fp32 rounding on others), as for any
    change of batch composition."""
    off, on = pair(dense)
    for d in (off, on):
        a, b, c = d.open(prompt(3, 6)), d.open(prompt(4, 9)), d.open(prompt(5, 4))
        for s, n in ((a, 6), (b, 9), (c, 4)):
            d.unit(chunk=(s, n))
        d.out = [d.unit(decode=[a, b, c]) for _ in range(3)]
        d.p.release(b)
        d.out += [d.unit(decode=[a, c]) for _ in range(3)]
        d.images = (d.image(a), d.image(c))
    assert on.out == off.out
    # fp32 fields only in this fp32 Program. The recurrent state carries six steps of sum-order differences: seen
    # at 1.43e-6 absolute (3.5e-5 relative) on a 2-core Xeon whose BLAS blocks 2 and 3 rows differently.
    for x, y in zip(on.images, off.images, strict=True):
        torch.testing.assert_close(x.view(torch.float32), y.view(torch.float32), rtol=1e-4, atol=1e-5)
    assert on.p.lookahead_stats.adopted == 5 and on.p.lookahead_stats.dropped == 0


def test_other_work_drops_it_and_changes_nothing(dense):
    off, on = pair(dense)
    for d in (off, on):
        a, b = d.open(prompt(6, 5)), d.open(prompt(7, 8))
        d.unit(chunk=(a, 5))
        d.out = [d.unit(decode=[a])]
        d.out.append(d.unit(decode=[a], chunk=(b, 8)))   # a chunk joins: dropped
        d.out.append(d.unit(decode=[a, b]))
        d.out.append(d.unit(decode=[b, a]))              # another row order: dropped
        d.out.append(d.unit(decode=[b, a]))
        d.images = (d.image(a), d.image(b))
    assert on.out == off.out
    assert all(torch.equal(x, y) for x, y in zip(on.images, off.images, strict=True))
    assert on.p.lookahead_stats.dropped == 2


def test_pause_and_checkpoint_while_a_lookahead_is_outstanding(dense):
    off, on = pair(dense, checkpoint_slots=2)
    for d in (off, on):
        a, b = d.open(prompt(8, 6)), d.open(prompt(9, 7))
        d.unit(chunk=(a, 6))
        d.unit(chunk=(b, 7))
        d.out = [d.unit(decode=[a, b]) for _ in range(2)]
        handle = d.p.capture_checkpoint(a)                # a lookahead of a and b is outstanding
        d.ckpt = d.p.checkpoint_states.image(0).clone()
        d.covered = handle.covered
        d.p.pause(b)                                      # b leaves; a's row is still adoptable
        d.out += [d.unit(decode=[a]) for _ in range(2)]
        c = d.p.open_sequence_from(handle, d.p.ledger(a)[: handle.covered + 1])
        d.params[c], d.steps[c] = GREEDY, 0
        d.out.append(d.unit(decode=[c]))
        d.out.append(d.unit(decode=[a, c]))
    assert on.covered == off.covered and torch.equal(on.ckpt, off.ckpt)
    assert on.out == off.out



def test_ineligible_rows_launch_nothing(dense):
    prog = make_program(dense, lookahead_slots=4)
    d = Driver(prog)
    a = d.open(prompt(10, 5), SamplingParams(temperature=0.0, presence_penalty=0.5))
    b = d.open(prompt(11, 5), SamplingParams(temperature=0.0, logprobs=True))  # eligible, but a is not
    d.unit(chunk=(a, 5))
    d.unit(chunk=(b, 5))
    for _ in range(3):
        d.unit(decode=[a, b])
    assert prog.lookahead_stats.launched == 0


def test_spares_stay_outside_capacity_and_all_come_back(dense):
    prog = make_program(dense, max_sequences=3, lookahead_slots=3)
    cap = prog.capacity()
    assert (cap.total_state_slots, cap.free_state_slots) == (3, 3)
    d = Driver(prog)
    seqs = [d.open(prompt(20 + i, 4)) for i in range(3)]
    for s in seqs:
        d.unit(chunk=(s, 4))
    for _ in range(3):
        d.unit(decode=seqs)
    assert prog.capacity().free_state_slots == 0 and prog._lookahead is not None
    for s in seqs:
        prog.release(s)
    assert prog.capacity().free_state_slots == 3 and sorted(prog._spares) == sorted(set(prog._spares))
    assert len(prog._spares) == 3
    cap = prog.capacity()
    assert cap.free_pages == cap.total_pages


def test_abort_drops_it(dense):
    prog = make_program(dense, lookahead_slots=2)
    d = Driver(prog)
    a = d.open(prompt(30, 5))
    d.unit(chunk=(a, 5))
    prog.reserve_units({a: 1})
    pending = prog.run(ExecutionUnit(decode=(DecodeRow(a, d.sampling(a)),)))
    assert prog._lookahead is not None
    prog.abort_pending(pending)
    assert prog._lookahead is None and len(prog._spares) == 2
    with pytest.raises(ProgramError, match="no next input"):
        prog.run(ExecutionUnit(decode=(DecodeRow(a, d.sampling(a)),)))


def test_lookahead_is_declared_once_by_the_architecture(dense):
    """The ArchitectureSpec is the one declaration: startup sizes spares from it (and refuses a forced
    lookahead without it); the Program takes the spares it is given, outside capacity()."""
    from ninfer import EngineOptions
    from ninfer.contracts.options import InvalidEngineOptions
    from ninfer.planning.resolution import lookahead_slots
    from ninfer_qwen3_5.program import Qwen35Program

    assert dense.spec.lookahead is True
    cpu, forced = torch.device("cpu"), EngineOptions(max_concurrency=2, lookahead=True)
    assert lookahead_slots(cpu, forced, dense.spec.lookahead) == 2
    with pytest.raises(InvalidEngineOptions, match="does not support lookahead"):
        lookahead_slots(cpu, forced, False)
    assert lookahead_slots(cpu, EngineOptions(max_concurrency=2), False) == 0
    assert Qwen35Program(base_init(dense, lookahead_slots=1)).capacity().total_state_slots == 2


def base_init(dense, **kw):
    ops = resolve_ops(get_registry().ops, "cpu", torch.float32, force="reference")
    options = ProgramOptions(device=torch.device("cpu"), dtype=torch.float32, max_sequences=2, page_size=4,
                             num_pages=16, max_context=64, **kw)
    return ProgramInit(config=dense.config, weights=dense.weights, ops=ops, options=options)


def test_a_changed_sampling_drops_it(dense):
    """The lookahead drew its token with the predicted sampling; a unit asking for another (here the
    parameters change, as when a constrained answer starts after the reasoning) must not adopt it."""
    off, on = pair(dense)
    for d in (off, on):
        a = d.open(prompt(40, 6))
        d.unit(chunk=(a, 6))
        d.out = [d.unit(decode=[a]) for _ in range(2)]
        d.params[a] = HOT
        d.out += [d.unit(decode=[a]) for _ in range(3)]
    assert on.out == off.out
    assert on.p.lookahead_stats.dropped == 1 and on.p.lookahead_stats.adopted == 3


def test_a_row_drawing_its_last_token_is_left_out(dense):
    """a's third token is its last (max_tokens 3); c reaches max_context 12 after its step: the lookahead
    launched with them carries only b, and the unit that follows their release adopts it whole."""
    off, on = pair(dense, max_context=12)
    for d in (off, on):
        a = d.open(prompt(50, 4), SamplingParams(temperature=0.0, max_tokens=3))
        b = d.open(prompt(51, 5))
        c = d.open(prompt(52, 9))
        for s, n in ((a, 4), (b, 5), (c, 9)):
            d.unit(chunk=(s, n))
        d.out = [d.unit(decode=[a, b, c])]     # a: token 2, c: ledger 11 -> the lookahead takes all three
        d.out.append(d.unit(decode=[a, b, c]))  # a draws its last, c fills its context: lookahead of [b] only
        d.p.release(a)
        d.p.release(c)
        d.out += [d.unit(decode=[b]) for _ in range(2)]
    assert on.out == off.out
    s = on.p.lookahead_stats
    assert (s.launched, s.adopted, s.dropped) == (4, 3, 0)


def test_logprobs_rows_look_ahead_with_the_same_logprobs(dense):
    """Rows asking for logprobs (and top logprobs) draw on the device too: their log-softmax rows are
    computed before the next step is queued and equal those of the Program without lookahead."""
    def run(d: Driver):
        a = d.open(prompt(60, 5), SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3))
        b = d.open(prompt(61, 6))
        c = d.open(prompt(62, 4), SamplingParams(temperature=0.7, top_p=0.9, logprobs=True))
        for s, n in ((a, 5), (b, 6), (c, 4)):
            d.unit(chunk=(s, n))
        out = []
        for _ in range(4):
            for s in (a, b, c):
                d.p.reserve_units({s: 1})
            pending = d.p.run(ExecutionUnit(decode=tuple(DecodeRow(s, d.sampling(s)) for s in (a, b, c))))
            out.append([(r.tokens, r.logprobs) for r in pending.rows])
            d.p.commit(pending, {r.seq: 1 for r in pending.rows})
            d.committed(pending)
        return out

    off, on = pair(dense)
    expected, got = run(off), run(on)
    assert got == expected
    assert all(rows[0][1][0].top and rows[1][1] is None and rows[2][1] is not None for rows in got)
    assert on.p.lookahead_stats.adopted == 3
