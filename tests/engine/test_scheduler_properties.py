"""Property tests of the scheduler's admission, reservation and preemption decisions, on random traffic.

The engine's worker core (:class:`~ninfer.engine.worker.EngineCore`) is stepped by hand, without its thread,
over the toy Program (real page allocator, page tables, state slots and checkpoints; ``doubles.py``), so a run is
deterministic. Requests with random prompts (sharing prefixes, for context-cache hits), budgets and arrival steps
meet random engine settings, pools down to one request's worth of pages (preemption, Replay, Snapshots),
context cache on or off. The invariants, as the scheduler's, queues' and admission's docstrings state them:

- a unit only runs with its reservations held: every decode row's and chunk's KV pages cover the tokens it
  computes and are private; every decode-ready resident is a decode row of the step (a decode row always
  progresses: pages are reclaimed or someone is preempted first); each request at most once; the chunks fit the
  step's token budget (``prefill_chunk``, and with decode rows ``max_step_tokens`` less the decode rows' tokens,
  but at least 1);
- at most ``max_concurrency`` residents and one protected resume at a time;
- admission is FIFO with a bounded bypass: later requests overtake a waiting head at most ``admission_bypass``
  times, and no fresh admission happens while a request is paused (paused ones resume first);
- the preemption victim is the youngest resident that is not protected;
- no starvation: every request finishes within a bound on the steps, and, when pages always fit, a prefill
  candidate waits at most ``max_concurrency - 1`` steps between chunks (the rotation);
- and the point of it all: every request's tokens are exactly those it gets alone (``reference_tokens``),
  whatever was preempted, replayed, restored or shared; at the end every page and state slot is free again.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from ninfer.contracts.events import GenerationResult  # noqa: E402
from ninfer.contracts.frontend import OutputOptions  # noqa: E402
from ninfer.contracts.options import EngineOptions  # noqa: E402
from ninfer.contracts.sampling import SamplingParams  # noqa: E402
from ninfer.engine.handle import RequestControl  # noqa: E402
from ninfer.engine.requests import RequestRecord, RequestState  # noqa: E402
from ninfer.engine.worker import EngineCore  # noqa: E402

from .doubles import ToyFrontend, ToyProgram, reference_tokens  # noqa: E402

VOCAB = 48
MAX_CONTEXT = 32


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Setup:
    page_size: int
    pool_contexts: float  # the KV pool in requests at the longest context (1: one such request at a time)
    max_concurrency: int
    prefill_chunk: int
    step_tokens: int
    bypass: int
    cache: bool
    host_mib: float | None

    @property
    def num_pages(self) -> int:
        return max(1, round(self.pool_contexts * MAX_CONTEXT / self.page_size))

    @property
    def roomy(self) -> bool:
        """Pages for every running place at the longest context: reservations never fail."""
        return self.num_pages * self.page_size >= self.max_concurrency * (MAX_CONTEXT + self.page_size)


# Mostly tight pools and several running places: preemption, Replay, Snapshots and reclaiming are the point.
SETUPS = st.builds(
    Setup, page_size=st.sampled_from([2, 4]), pool_contexts=st.sampled_from([1, 1, 1.25, 1.5, 2, 5]),
    max_concurrency=st.sampled_from([1, 2, 3, 4, 4]), prefill_chunk=st.integers(1, 12),
    step_tokens=st.integers(1, 16), bypass=st.integers(0, 2), cache=st.booleans(),
    host_mib=st.sampled_from([None, 1.0]))


def _params(draw) -> SamplingParams:
    return SamplingParams(temperature=draw(st.sampled_from([0.0, 0.9])), max_tokens=draw(st.integers(1, 24)),
                          seed=draw(st.integers(0, 2**31)), ignore_eos=draw(st.booleans())).validate(VOCAB)


def _tokens(draw, min_size: int, max_size: int) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(2, VOCAB - 1), min_size=min_size, max_size=max_size)))


@st.composite
def traffic(draw):
    """Either a random mix of long and short prompts (sharing prefixes: context-cache hits) arriving over a few
    steps, or head-of-line blocking: a long request running, a long head waiting, short ones behind it that fit
    (the bypass allowance)."""
    arrivals = []
    if draw(st.booleans()):
        base = _tokens(draw, 4, 24)
        for _ in range(draw(st.integers(2, 6))):
            shared = draw(st.sampled_from([0, len(base) // 2, len(base)]))
            prompt = (base[:shared] + _tokens(draw, 0, 6))[:MAX_CONTEXT - 1] or (2,)
            arrivals.append(Arrival(draw(st.sampled_from([0, 0, 1, 3, 6])), prompt, _params(draw)))
    else:
        for i in range(draw(st.integers(3, 6))):
            long = i < 2
            prompt = _tokens(draw, 14, 24) if long else _tokens(draw, 1, 3)
            arrivals.append(Arrival(0 if i == 0 else 1, prompt, _params(draw)))
    return sorted(arrivals, key=lambda a: a.step)


class Checked:
    """An EngineCore with the scheduler's decisions checked as they are made."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        # At least one request at the longest context must fit (the Engine refuses smaller pools).
        pages = max(setup.num_pages, -(-MAX_CONTEXT // setup.page_size))
        self.program = ToyProgram(vocab_size=VOCAB, num_pages=pages, page_size=setup.page_size, max_sequences=4,
                                  max_context=MAX_CONTEXT, checkpoint_slots=8 if setup.cache else 0)
        self.options = EngineOptions(
            max_concurrency=setup.max_concurrency, max_context=MAX_CONTEXT, page_size=setup.page_size,
            prefill_chunk_size=setup.prefill_chunk, max_step_tokens=setup.step_tokens,
            admission_bypass=setup.bypass, context_cache=setup.cache, cache_host_mib=setup.host_mib,
            queue_capacity=64).validate().for_purpose()
        if setup.cache:
            self.program.configure_host_tier(self.options.host_budget_bytes)
        self.core = EngineCore(self.program, self.options)  # never started: stepped by hand
        self.frontend = ToyFrontend(VOCAB)
        self.records: list[RequestRecord] = []
        self.bypassed: Counter[int] = Counter()  # head ticket -> later requests admitted ahead of it
        self.misses: Counter[int] = Counter()    # ticket -> steps in a row as a chunk candidate without a chunk
        self.preempted = 0
        sched = self.core.scheduler
        schedule, admitted, pause = sched.schedule, sched.on_admit, self.core.sequences.pause

        def checked_schedule():
            unit = schedule()
            if unit is not None:
                self._check_unit(unit)
            return unit

        def checked_admit(rec):
            self._check_admission(rec)
            admitted(rec)

        def checked_pause(rec):
            self._check_victim(rec)
            return pause(rec)

        sched.schedule, sched.on_admit, self.core.sequences.pause = checked_schedule, checked_admit, checked_pause

    # -- traffic -------------------------------------------------------------------------------------------
    def submit(self, arrival: Arrival) -> None:
        ticket = len(self.records)
        rid = f"r{ticket}"
        rec = RequestRecord(ticket=ticket, request_id=rid, prompt=arrival.prompt, params=arrival.params,
                            session=self.frontend.open_session(OutputOptions(ignore_eos=arrival.params.ignore_eos)),
                            control=RequestControl(rid, wake=lambda: None, on_release=lambda: None),
                            submit_time=time.monotonic(), deadline=None, cache=self.setup.cache)
        self.records.append(rec)
        self.core._handle(("submit", rec))

    # -- the checks ------------------------------------------------------------------------------------------
    def _check_admission(self, rec: RequestRecord) -> None:
        q = self.core.queues
        assert not q.paused, f"{rec.request_id} admitted while {[r.request_id for r in q.paused]} are paused"
        older = [w.ticket for w in q.waiting if w.ticket < rec.ticket]
        if older:
            head = min(older)
            self.bypassed[head] += 1
            assert self.bypassed[head] <= self.setup.bypass, f"head r{head} overtaken {self.bypassed[head]} times"

    def _check_victim(self, rec: RequestRecord) -> None:
        unprotected = [r.ticket for r in self.core.queues.residents if not r.protected]
        assert rec in self.core.queues.residents and not rec.protected
        assert rec.ticket == max(unprotected), f"preempted r{rec.ticket}, not the youngest of {unprotected}"
        self.preempted += 1

    def _check_unit(self, unit) -> None:
        kv, program = self.program.kv, self.program
        rows = [r.ticket for r in unit.decode] + [c.rec.ticket for c in unit.chunks]
        assert len(rows) == len(set(rows)), "a request twice in one unit"
        residents = self.core.queues.residents
        ready = {r.ticket for r in residents if r.state is RequestState.DECODE_READY}
        assert {r.ticket for r in unit.decode} == ready, "a decode-ready resident left out of the step"
        for r, drafts in zip(unit.decode, unit.row_drafts(), strict=True):
            c = program.computed(r.seq)
            assert kv.writable(r.seq, c, c + drafts + 1), f"decode row {r.request_id} runs without its page"
        for chunk in unit.chunks:
            c = program.computed(chunk.rec.seq)
            assert chunk.tokens >= 1 and kv.writable(chunk.rec.seq, c, c + chunk.tokens), \
                f"chunk of {chunk.rec.request_id} runs without its pages"
        budget = self.options.prefill_chunk
        decode_tokens = len(unit.decode) + sum(unit.row_drafts())
        if decode_tokens:
            budget = max(1, min(budget, self.options.step_tokens - decode_tokens))
        assert sum(c.tokens for c in unit.chunks) <= budget
        if self.setup.roomy:
            chunked = {c.rec.ticket for c in unit.chunks}
            for r in residents:
                if r.state in (RequestState.PREFILL, RequestState.REPLAY):
                    self.misses[r.ticket] = 0 if r.ticket in chunked else self.misses[r.ticket] + 1
                    assert self.misses[r.ticket] < self.setup.max_concurrency, f"{r.request_id} starves for chunks"

    def check_step(self) -> None:
        q = self.core.queues
        assert len(q.residents) <= self.options.max_concurrency
        assert sum(r.protected for r in q.residents) <= 1

    def settled(self) -> bool:
        return all(r.state is RequestState.SETTLED for r in self.records)


@settings(max_examples=max(150, settings.default.max_examples))  # a few ms each: more than the profile's
@given(setup=SETUPS, arrivals=traffic())
def test_scheduler_decisions_keep_their_invariants(setup, arrivals):
    run = Checked(setup)
    work = sum(len(a.prompt) + a.params.max_tokens for a in arrivals)
    bound = arrivals[-1].step + 20 * work + 50  # generous: a livelock (pause/resume ping-pong) never ends
    pending, step = list(arrivals), 0
    while pending or not run.settled():
        while pending and pending[0].step <= step:
            run.submit(pending.pop(0))
        run.core.step()
        run.check_step()
        step += 1
        assert step <= bound, f"not finished after {step} steps: starvation or livelock"
    n = run.core.counters
    event(f"preempted: {run.preempted > 0}")
    event(f"replayed: {n.replays > 0}")
    event(f"snapshot pauses: {run.core.cache is not None and run.core.cache.counters().snapshot_pauses > 0}")
    event(f"cache hits: {n.cache_hits > 0}")
    event(f"bypassed: {sum(run.bypassed.values()) > 0}")
    for rec, arrival in zip(run.records, arrivals, strict=True):
        result = rec.control.channel.terminal
        assert isinstance(result, GenerationResult) and result.finish_reason in ("stop", "length"), result
        stop_ids = () if arrival.params.ignore_eos else (1,)
        want = reference_tokens(arrival.prompt, arrival.params, vocab_size=VOCAB, stop_ids=stop_ids,
                                max_context=MAX_CONTEXT)
        assert list(result.token_ids) == want, rec.request_id
    core = run.core
    assert not core.records and not core.queues.residents and not core.queues.paused and not core.queues.waiting
    if core.cache is not None:
        core.cache.clear()
    cap = run.program.capacity()
    assert cap.free_pages == cap.total_pages and cap.free_state_slots == cap.total_state_slots
