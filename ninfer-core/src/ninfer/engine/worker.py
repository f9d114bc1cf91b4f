"""EngineCore: the worker thread that owns requests, the Scheduler and the Program.

Only the worker thread mutates request records, the Scheduler and the Program (and it is the only
caller of the Program and of every OutputSession after submit). Other threads talk to it through
``inbox`` (a ``queue.SimpleQueue`` of submissions, wake-ups, cache clears and the close request),
the per-request cancellation flag, and response channels.

One engine step (:meth:`EngineCore.step`, docs/design.md section 5): settle cancelled, expired
(deadline) and timed-out (queue) requests; ``Scheduler.schedule`` resumes, admits and reserves the
unit (:mod:`ninfer.engine.scheduler`); ``Program.run`` runs it (a compact decode batch of the actual
B plus the chunks that fit the step's token budget); the ContextCache checkpoints each chunk that ended
at a capture point
(:mod:`ninfer.engine.context_cache.capture`); :func:`~ninfer.engine.commit.commit_unit` commits the
PendingBatch and publishes the output; finished requests are settled. After each step the worker
publishes a :class:`CoreSnapshot` for ``Engine.stats()``; it sleeps only after a step that changed
nothing, until the next message or timer.

Every physical context operation (bind, capture, demote, pause, drop) goes through ``self.ops``,
the one :class:`OperationSlot`.

Any broken invariant or Program/Frontend exception is an engine failure: every in-flight request
receives it, the engine stops accepting, the worker exits. Request-level problems never are.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass

from ninfer.contracts.errors import (
    DeadlineExceededError,
    EngineClosedError,
    EngineFailure,
    QueueTimeoutError,
)
from ninfer.contracts.events import (
    GenerationDelta,
    GenerationError,
    GenerationEvent,
    GenerationResult,
    GenerationStart,
    Timings,
    Usage,
)
from ninfer.contracts.options import EngineOptions
from ninfer.contracts.program import CheckpointUsage, Program, ProgramCapacity
from ninfer.engine.commit import RowCommit, commit_unit
from ninfer.engine.context_cache.cache import ContextCache
from ninfer.engine.context_cache.capture import CheckpointCapture
from ninfer.engine.context_cache.operation_slot import OperationSlot
from ninfer.engine.expert_routing import RoutingRecorder
from ninfer.engine.queues import RequestQueues
from ninfer.engine.requests import RequestRecord, RequestState
from ninfer.engine.scheduler import Scheduler
from ninfer.engine.sequences import SequenceTable
from ninfer.engine.stats import EngineCounters, EngineStatus, counter_values

log = logging.getLogger("ninfer.engine")

WAKE = ("wake",)


@dataclass(frozen=True)
class CoreSnapshot:
    """What the worker last published for ``Engine.stats()``."""

    status: EngineStatus
    queue_depth: int
    running: int
    paused: int
    capacity: ProgramCapacity
    counters: dict[str, int]
    checkpoints: CheckpointUsage = CheckpointUsage(count=0, total_slots=0, free_slots=0, device_bytes=0)


class EngineCore:
    def __init__(self, program: Program, options: EngineOptions, routing: RoutingRecorder | None = None) -> None:
        from ninfer.planning.resolution import speculative_tokens  # imports torch: not at module import

        self.program = program
        self.options = options
        self.routing = routing   # the expert routing file, written at close (engine/expert_routing.py)
        self.max_context = options.max_context
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Held by submitters while they check ``status`` and enqueue, and by the worker when it stops
        # accepting: a submission is therefore either seen by the worker or refused, never lost.
        self.submit_lock = threading.Lock()
        self.status: EngineStatus = "running"
        self.failure: EngineFailure | None = None
        self.records: dict[int, RequestRecord] = {}
        self.counters = EngineCounters()
        self.ops = OperationSlot()
        cap = program.capacity()
        self.cache: ContextCache | None = (
            ContextCache(program, block_size=cap.page_size, slot=self.ops) if options.context_cache else None)
        self.capture = CheckpointCapture(program, self.cache, options.checkpoint_interval)
        self.sequences = SequenceTable(program, self.cache, self.ops)
        self.queues = RequestQueues(options.max_concurrency, options.admission_bypass)
        self.scheduler = Scheduler(program, self.queues, self.sequences, self.cache, self.capture, self.counters,
                                   prefill_chunk=options.prefill_chunk, step_tokens=options.step_tokens,
                                   on_admit=self._started, speculative_tokens=speculative_tokens(options),
                                   max_context=options.max_context, encode_rows=options.encode_rows)
        self._close_drain: bool | None = None  # None: no close asked; else whether to drain first
        self.snapshot = CoreSnapshot("running", 0, 0, 0, cap, counter_values(self.counters))
        self.thread = threading.Thread(target=self._run, name="ninfer-engine-worker", daemon=True)

    # -- the worker loop ---------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        progressed = True
        try:
            while True:
                self._take_messages(block=not progressed)
                if self._close_drain is not None and (not self._close_drain or not self.records):
                    break
                progressed = self.step()
                self._publish_snapshot()
            self._shutdown()
        except BaseException as exc:  # noqa: BLE001 - every worker crash must reach the consumers
            self._fail(exc)

    def step(self) -> bool:
        """One engine step: settle, schedule, run, commit, publish. True when anything changed
        (the loop then takes the next step without sleeping)."""
        settled = self._settle_interrupted(time.monotonic())
        changes = self.scheduler.membership_changes
        unit = self.scheduler.schedule()
        if unit is None:
            return settled or self.scheduler.membership_changes != changes
        pending = self.program.run(unit.execution_unit())
        for chunk in unit.chunks:  # before the commit, so a request finishing on this unit is checkpointed
            self.capture.after_chunk(chunk.rec)
        finished = commit_unit(unit, pending, self.program, self.sequences, self.counters, self.max_context)
        self._settle_finished(finished)
        return True

    # -- the inbox ---------------------------------------------------------------------------------
    def _take_messages(self, *, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=self._next_timer()) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        self._handle(msg)
        while True:
            try:
                self._handle(self.inbox.get_nowait())
            except queue.Empty:
                return

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            rec: RequestRecord = msg[1]
            self.records[rec.ticket] = rec
            self.queues.enqueue(rec)
        elif kind == "clear_cache":
            if self.cache is not None:
                self.cache.clear()
                self._publish_snapshot()
            msg[1].set()
        elif kind == "close":
            drain = bool(msg[1])
            # A later non-draining close overrides an earlier draining one, never the reverse.
            self._close_drain = drain if self._close_drain is None else (self._close_drain and drain)

    def _next_timer(self) -> float | None:
        """Seconds until the next deadline or queue timeout (None: sleep until a message)."""
        now = time.monotonic()
        soonest = math.inf
        qt = self.options.queue_timeout_s
        for rec in self.records.values():
            if rec.deadline is not None:
                soonest = min(soonest, rec.deadline)
            if qt is not None and rec.state is RequestState.WAITING:
                soonest = min(soonest, rec.submit_time + qt)
        return None if soonest == math.inf else max(0.0, soonest - now)

    def _started(self, rec: RequestRecord) -> None:
        """The Scheduler admitted ``rec`` (it never publishes): announce it."""
        self._push(rec, GenerationStart(rec.request_id, len(rec.prompt)))

    # -- settlement --------------------------------------------------------------------------------
    def _settle_interrupted(self, now: float) -> bool:
        """Settle cancelled, expired (deadline) and timed-out (queue) requests; True if any."""
        changed = False
        qt = self.options.queue_timeout_s
        for rec in list(self.records.values()):
            if rec.control.cancel_requested:
                self.counters.cancelled += 1
                self._finish(rec, "cancelled")
            elif rec.deadline is not None and now >= rec.deadline:
                self.counters.deadline += 1
                if rec.started:
                    self._finish(rec, "deadline")
                else:
                    self._reject(rec, DeadlineExceededError(
                        f"request {rec.request_id} reached its deadline before it was admitted"))
            elif qt is not None and rec.state is RequestState.WAITING and now - rec.submit_time >= qt:
                self.counters.rejected += 1
                self._reject(rec, QueueTimeoutError(
                    f"request {rec.request_id} waited {now - rec.submit_time:.3f}s in the queue "
                    f"(queue_timeout_s={qt})"))
            else:
                continue
            changed = True
        return changed

    def _settle_finished(self, rows: list[RowCommit]) -> None:
        """Settle the rows that finished on the unit just committed (cancelled or stop/length)."""
        for row in rows:
            if row.finish == "cancelled":
                self.counters.cancelled += 1
                self._finish(row.rec, "cancelled")
            else:
                assert row.finish is not None
                self.counters.finished += 1
                self._finish(row.rec, row.finish, row.preview.stop_reason if row.preview else None)

    def _finish(self, rec: RequestRecord, reason: str, stop_reason: str | int | None = None) -> None:
        """Terminal success: free the running place and the Program sequence, flush the session, publish."""
        self.capture.at_finish(rec, reason)
        self.sequences.release(rec)
        final = rec.session.finish(reason)
        if final.deltas and rec.started:
            self._push(rec, GenerationDelta(rec.request_id, (), tuple(final.deltas)))
        now = time.monotonic()
        result = GenerationResult(
            request_id=rec.request_id, finish_reason=reason, token_ids=tuple(rec.output_tokens), output=final,
            usage=Usage(len(rec.prompt), len(rec.output_tokens), rec.cached_tokens),
            timings=Timings(
                queue_s=None if rec.admit_time is None else rec.admit_time - rec.submit_time,
                ttft_s=None if rec.first_token_time is None else rec.first_token_time - rec.submit_time,
                total_s=now - rec.submit_time),
            stop_reason=stop_reason)
        self._settle(rec, result)

    def _reject(self, rec: RequestRecord, error: Exception) -> None:
        self.sequences.release(rec)
        self._settle(rec, GenerationError(rec.request_id, error))

    def _settle(self, rec: RequestRecord, event: GenerationEvent) -> None:
        if self.cache is not None:
            self.cache.forget_owner(rec.ticket)  # a request settled while paused leaves no Snapshot
        rec.resume = None
        self.queues.remove(rec)
        rec.move(RequestState.SETTLED)
        del self.records[rec.ticket]
        self._push(rec, event)
        rec.control.response_done()

    def _push(self, rec: RequestRecord, event: GenerationEvent) -> None:
        rec.control.channel.push(event)

    # -- stopping ----------------------------------------------------------------------------------
    def _stop_accepting(self, status: EngineStatus) -> None:
        with self.submit_lock:
            self.status = status
        # Submissions that won the race with the lock are in the inbox: adopt them to answer them.
        while True:
            try:
                self._handle(self.inbox.get_nowait())
            except queue.Empty:
                return

    def _shutdown(self) -> None:
        """Close: every unfinished request ends with EngineClosedError; all Program sequences freed."""
        self._stop_accepting("closed")
        for rec in sorted(self.records.values(), key=lambda r: r.ticket):
            self.counters.rejected += 1
            self._reject(rec, EngineClosedError(f"the engine closed before request {rec.request_id} finished"))
        if self.cache is not None:
            self.cache.clear()
        if self.routing is not None:
            try:
                self.routing.save(self.program)
            except OSError as exc:   # the engine still closes cleanly; the file keeps its old counts
                log.error("could not write the expert routing file %s: %s", self.routing.path, exc)
        self._publish_snapshot()

    def _fail(self, exc: BaseException) -> None:
        """Engine failure: answer every in-flight request with it; never call the Program again."""
        if isinstance(exc, EngineFailure):
            failure = exc
        else:
            failure = EngineFailure(f"the engine worker failed: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc
        log.error("engine failure: %s", failure, exc_info=exc)
        self.failure = failure
        try:
            self._stop_accepting("failed")
        except BaseException:  # noqa: BLE001 - the inbox is a SimpleQueue; nothing here should raise
            log.exception("while stopping after an engine failure")
        for rec in list(self.records.values()):
            if rec.control.channel.terminal is None:
                rec.control.channel.push(GenerationError(rec.request_id, failure))
                rec.control.response_done()
        self.records.clear()
        self.sequences.clear()
        snap = self.snapshot
        self.snapshot = CoreSnapshot("failed", 0, 0, 0, snap.capacity, counter_values(self.counters),
                                     snap.checkpoints)

    def _publish_snapshot(self) -> None:
        la, n = self.program.lookahead_stats, self.counters
        n.lookahead_launched, n.lookahead_adopted, n.lookahead_dropped = la.launched, la.adopted, la.dropped
        sp = self.program.speculation_stats
        n.spec_verifies, n.spec_drafted, n.spec_accepted = sp.verifies, sp.drafted, sp.accepted
        ec = self.program.expert_cache_stats
        n.expert_cache_hits, n.expert_cache_misses = list(ec.hits), list(ec.misses)
        if self.cache is not None:
            c, n = self.cache.counters(), self.counters
            n.cache_captures, n.cache_evictions, n.cache_host_evictions = c.captures, c.evictions, c.host_evictions
            n.cache_demotions, n.cache_restores = c.demotions, c.restores
            n.snapshot_pauses, n.snapshot_resumes, n.snapshot_revocations = (
                c.snapshot_pauses, c.snapshot_resumes, c.snapshot_revocations)
        q = self.queues
        status: EngineStatus = self.status if self.status != "running" or self._close_drain is None else "closing"
        usage = self.program.checkpoint_usage() if self.cache is not None else self.snapshot.checkpoints
        self.snapshot = CoreSnapshot(status, len(q.waiting), len(q.residents), len(q.paused),
                                     self.program.capacity(), counter_values(self.counters), usage)
