"""Request lifecycle through the engine: cancellation from every state, rejections, outstanding
capacity, deadlines, close. Each test ends with every page and state slot free.

Nothing here depends on how fast the machine is. The toy Program's gate holds the worker inside a chosen
forward (``hold_at``) while the test acts, and deadlines and queue timeouts expire by moving the worker's
clock (:func:`worker_clock`), never by sleeping past them; every timeout is a hang guard."""

from __future__ import annotations

import gc
import threading
import time
from types import SimpleNamespace

import pytest
from ninfer.contracts.errors import (
    DeadlineExceededError,
    EngineClosedError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    QueueTimeoutError,
)
from ninfer.contracts.events import GenerationError, GenerationResult, GenerationStart
from ninfer.contracts.options import InvalidEngineOptions
from ninfer.contracts.request import GenerationRequest
from ninfer.contracts.sampling import InvalidSamplingParams, SamplingParams

from .conftest import worker_threads
from .streams import check_stream

LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, seed=0)
HANG_GUARD_S = 300.0  # only stops a hung engine from hanging the suite; never a speed requirement


def assert_all_free(engine, program):
    engine.close(timeout=HANG_GUARD_S)
    assert not worker_threads()
    cap = program.capacity()
    assert cap.free_pages == cap.total_pages, "KV pages leaked"
    assert cap.free_state_slots == cap.total_state_slots, "state slots leaked"


def wait_for(predicate, timeout=HANG_GUARD_S):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def reached(event: threading.Event) -> None:
    assert event.wait(HANG_GUARD_S), "the worker never got there"


class WorkerClock:
    """The worker's ``time.monotonic``: the real clock plus ``offset``, which only :meth:`advance` moves.
    Submit-side times (``timeout_s``, ``submit_time``) stay on the real clock, so advancing past a deadline
    expires it for the worker at once, and nothing expires before the test says so."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def worker_clock(monkeypatch) -> WorkerClock:
    from ninfer.engine import worker

    clock = WorkerClock()
    monkeypatch.setattr(worker, "time", SimpleNamespace(monotonic=clock.monotonic))
    return clock


def test_cancel_while_waiting(make_toy_engine):
    engine, program, _ = make_toy_engine(max_concurrency=1)
    program.gate.clear()
    busy = engine.submit([2, 3], sampling=LONG)
    reached(program.entered)
    queued = engine.submit([4, 5], sampling=LONG)
    queued.cancel()
    program.gate.set()
    events = list(queued)
    result = check_stream(events, started=False)
    assert isinstance(result, GenerationResult) and result.finish_reason == "cancelled" and result.token_ids == ()
    assert busy.result(HANG_GUARD_S).finish_reason == "length"
    assert_all_free(engine, program)


def test_cancel_during_prefill_accepts_nothing(make_toy_engine):
    engine, program, _ = make_toy_engine(max_concurrency=2, prefill_chunk_size=2)
    program.gate.clear()
    h = engine.submit(list(range(2, 30)), sampling=LONG)
    reached(program.entered)  # the first prefill chunk is running
    h.cancel()
    program.gate.set()
    result = check_stream(list(h), started=True)
    assert result.finish_reason == "cancelled" and result.token_ids == ()
    assert_all_free(engine, program)


def test_cancel_during_decode_keeps_published_tokens_only(make_toy_engine):
    engine, program, _ = make_toy_engine(max_concurrency=2)
    program.hold_at = 5  # forward 1 prefills and samples token 1, forwards 2-4 decode tokens 2-4; 5 is held
    h = engine.submit([2, 3, 4], sampling=LONG)
    reached(program.held)
    # The worker is inside the unit of token 5: cancel now, and that row's provisional token is dropped.
    h.cancel()
    program.gate.set()
    result = check_stream(list(h), started=True)
    assert result.finish_reason == "cancelled"
    assert len(result.token_ids) == 4
    assert_all_free(engine, program)


def test_cancel_while_paused(make_toy_engine):
    # Two long requests in a 16-page pool (64 tokens): the younger one is preempted.
    engine, program, _ = make_toy_engine(max_concurrency=2, max_context=64, prefill_chunk_size=8,
                                         program_kwargs=dict(num_pages=16, page_size=4))
    program.hold_at = 1
    old = engine.submit(list(range(2, 26)), sampling=LONG)
    reached(program.held)  # old's first prefill chunk: young arrives long before old could finish alone
    young = engine.submit(list(range(3, 27)), sampling=LONG)
    program.close_gate_on_pause = True
    program.gate.set()
    # The worker holds in the first forward after pausing `young` (the youngest resident).
    wait_for(lambda: program.paused_seqs and not program.gate.is_set() and program.entered.is_set())
    young.cancel()
    program.gate.set()
    y = check_stream(list(young), started=True)
    assert y.finish_reason == "cancelled"
    o = check_stream(list(old), started=True)
    assert o.finish_reason == "length" and len(o.token_ids) == 40
    stats = engine.stats()
    assert stats.preemptions >= 1
    assert_all_free(engine, program)


def test_queue_full_and_outstanding_release(make_toy_engine):
    engine, program, _ = make_toy_engine(max_concurrency=1, queue_capacity=1)
    program.gate.clear()
    a = engine.submit([2], sampling=LONG)
    b = engine.submit([3], sampling=LONG)
    with pytest.raises(QueueFullError):
        engine.submit([4], sampling=LONG)
    b.cancel()
    program.gate.set()
    assert b.result(HANG_GUARD_S).finish_reason == "cancelled"  # reading the end releases b's slot
    c = engine.submit([4], sampling=SamplingParams(temperature=0.0, max_tokens=2, seed=0))
    assert c.result(HANG_GUARD_S).token_ids
    a.result(HANG_GUARD_S)
    # A finished request whose handle is still held keeps its slot...
    held = [engine.submit([t], sampling=SamplingParams(temperature=0.0, max_tokens=1, seed=0)) for t in (5, 6)]
    wait_for(lambda: all(h.done for h in held))
    with pytest.raises(QueueFullError):
        engine.submit([7], sampling=LONG)
    # ...until it is released explicitly or dropped.
    held[0].release()
    held.pop()
    gc.collect()
    f = engine.submit([7], sampling=SamplingParams(temperature=0.0, max_tokens=1, seed=0))
    g = engine.submit([8], sampling=SamplingParams(temperature=0.0, max_tokens=1, seed=0))
    f.result(HANG_GUARD_S), g.result(HANG_GUARD_S)
    assert engine.stats().outstanding == 0
    assert_all_free(engine, program)


def test_abandoned_handle_is_cancelled(make_toy_engine):
    engine, program, _ = make_toy_engine(max_concurrency=1)
    program.hold_at = 1
    h = engine.submit([2, 3], sampling=SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True, seed=0))
    reached(program.held)  # its prefill is running
    del h
    gc.collect()
    program.gate.set()
    wait_for(lambda: engine.stats().cancelled == 1 and engine.stats().outstanding == 0)
    assert engine.stats().completion_tokens == 0  # the prefill's token was dropped: nobody holds the handle
    assert_all_free(engine, program)


def test_queue_timeout_rejects_a_waiting_request(make_toy_engine, worker_clock):
    engine, program, _ = make_toy_engine(max_concurrency=1, queue_timeout_s=60.0)
    program.hold_at = 2  # busy is decoding, waiting is queued behind it
    busy = engine.submit([2], sampling=LONG)
    waiting = engine.submit([3], sampling=LONG)
    reached(program.held)
    worker_clock.advance(61.0)
    program.gate.set()
    events = list(waiting)
    err = check_stream(events, started=False)
    assert isinstance(err, GenerationError) and isinstance(err.error, QueueTimeoutError)
    assert "queue_timeout_s=60.0" in str(err.error)
    with pytest.raises(QueueTimeoutError):
        waiting.result()
    assert busy.result(HANG_GUARD_S).finish_reason == "length"
    assert engine.stats().rejected == 1
    assert_all_free(engine, program)


def test_deadlines_before_and_after_admission(make_toy_engine, worker_clock):
    engine, program, _ = make_toy_engine(max_concurrency=1)
    program.hold_at = 3  # running has committed tokens 1 and 2 and computes token 3; waiting is queued
    running = engine.submit([2], sampling=LONG, timeout_s=60.0)
    waiting = engine.submit([3], sampling=LONG, deadline=time.monotonic() + 30.0)
    reached(program.held)
    worker_clock.advance(61.0)  # both deadlines pass while the worker is inside forward 3
    program.gate.set()
    err = check_stream(list(waiting), started=False)
    assert isinstance(err, GenerationError) and isinstance(err.error, DeadlineExceededError)
    res = check_stream(list(running), started=True)
    # Forward 3's token is committed (the unit was running); the next step settles both requests.
    assert res.finish_reason == "deadline" and len(res.token_ids) == 3
    assert engine.stats().deadline == 2
    assert_all_free(engine, program)


def test_synchronous_rejections(make_toy_engine):
    engine, program, _ = make_toy_engine(max_context=16)
    with pytest.raises(PromptTooLongError):
        engine.submit(list(range(2, 18)))
    with pytest.raises(InvalidRequestError):
        engine.submit([])
    with pytest.raises(InvalidRequestError):
        engine.submit([2, program.vocab_size])
    with pytest.raises(InvalidSamplingParams):
        engine.submit([2], sampling=SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidSamplingParams):
        engine.submit([2], sampling=SamplingParams(stop_token_ids=(10_000,)))
    with pytest.raises(TypeError):
        engine.submit(GenerationRequest(prompt=[2]), sampling=SamplingParams())
    assert engine.stats().submitted == 0
    assert engine.generate(GenerationRequest(prompt=[2], sampling=SamplingParams(max_tokens=1, seed=3))).token_ids


def test_engine_options_are_checked_against_the_program(make_toy_engine):
    with pytest.raises(InvalidEngineOptions, match="max_concurrency"):
        make_toy_engine(max_concurrency=9)
    with pytest.raises(InvalidEngineOptions, match="state slots"):
        make_toy_engine(program_kwargs=dict(max_sequences=2), max_concurrency=3)
    with pytest.raises(InvalidEngineOptions, match="one request must always fit"):
        make_toy_engine(program_kwargs=dict(num_pages=4, page_size=4), max_context=64)
    assert not worker_threads()


def test_close_with_requests_in_flight(make_toy_engine):
    engine, program, _ = make_toy_engine(max_concurrency=2, queue_capacity=8)
    program.hold_at = 1
    handles = [engine.submit([2 + i], sampling=LONG) for i in range(6)]
    reached(program.held)  # the first unit is running: nothing can finish before the close is seen
    first = handles[0].next_event(timeout=HANG_GUARD_S)
    assert isinstance(first, GenerationStart)
    engine.close(timeout=0)  # asks; the worker reads it after this unit
    program.gate.set()
    engine.close(timeout=HANG_GUARD_S)
    assert not worker_threads()
    for i, h in enumerate(handles):
        terminal = check_stream(([first] if i == 0 else []) + list(h))
        assert isinstance(terminal, GenerationError) and isinstance(terminal.error, EngineClosedError)
    with pytest.raises(EngineClosedError):
        engine.submit([2])
    assert engine.stats().status == "closed"
    cap = program.capacity()
    assert cap.free_pages == cap.total_pages and cap.free_state_slots == cap.total_state_slots
    engine.close()  # idempotent


def test_close_with_drain_finishes_everything(make_toy_engine):
    engine, program, _ = make_toy_engine(max_concurrency=2, queue_capacity=8)
    handles = [engine.submit([2 + i], sampling=SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                              seed=0)) for i in range(5)]
    engine.close(drain=True, timeout=HANG_GUARD_S)
    assert not worker_threads()
    for h in handles:
        assert h.result().finish_reason == "length"
    assert_all_free(engine, program)


def test_start_is_published_once_and_submit_is_thread_safe(make_toy_engine):
    engine, program, _ = make_toy_engine(max_concurrency=3, queue_capacity=64,
                                         program_kwargs=dict(num_pages=16, page_size=4))
    handles, lock = [], threading.Lock()

    def submitter(k):
        for i in range(8):
            h = engine.submit([2 + k, 3 + i], sampling=SamplingParams(temperature=0.5, max_tokens=20, seed=k * 8 + i))
            with lock:
                handles.append(h)

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h in handles:
        events = list(h)
        check_stream(events, started=True)
        assert sum(isinstance(e, GenerationStart) for e in events) == 1
    assert engine.stats().submitted == 32
    assert_all_free(engine, program)


def test_admission_bypass_is_bounded(make_toy_engine):
    # 16 pages x 4 tokens. A resident holds 8 pages, so the 50-token head B cannot fit; two small
    # later requests may bypass it (admission_bypass=2), the third must wait for B.
    engine, program, _ = make_toy_engine(max_concurrency=4, max_context=64, prefill_chunk_size=64,
                                         admission_bypass=2, program_kwargs=dict(num_pages=16, page_size=4))
    short = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, seed=0)
    program.gate.clear()
    a = engine.submit([10] + [2] * 29, sampling=short)
    reached(program.entered)  # A's prefill is running; everything below queues behind it
    b = engine.submit([11] + [2] * 49, sampling=short)
    c, d, e = (engine.submit([t, 2], sampling=short) for t in (12, 13, 14))
    program.gate.set()
    for h in (a, b, c, d, e):
        assert h.result(HANG_GUARD_S).finish_reason == "length"
    fresh = [ledger[0] for ledger in program.opened if len(ledger) in (30, 50, 2)]
    assert fresh == [10, 12, 13, 11, 14]
    assert_all_free(engine, program)
