"""EngineCore: the worker thread that owns requests, the Scheduler and the Program.

Only the worker thread mutates request records, the Scheduler and the Program (and it is the only
caller of the Program and of every OutputSession after submit). Other threads talk to it through
``inbox`` (a ``queue.SimpleQueue`` of submissions, wake-ups and the close request), the per-request
cancellation flag, and response channels.

One worker cycle (docs/design.md section 5):
1. take inbox messages; settle cancelled, expired (deadline) and timed-out (queue) requests;
2. try the oldest paused request's full resume (one protected resume at a time);
3. fresh admission with the remaining lanes (FIFO, bounded bypass);
4. unit permits: every decode-ready resident reserves one token; a decode row that cannot get KV
   pauses the youngest non-protected resident (possibly itself); one chunk (the protected resume
   first, then rotation) reserves its tokens, skipped when it does not fit while decode progresses;
5. run one unit (a compact decode batch of the actual B plus at most one chunk) and consume its
   PendingBatch: Frontend preview -> Program.commit -> accounting -> OutputSession.commit -> publish.

Context cache (``EngineOptions.context_cache``; docs/context-cache.md): admission binds a request
that takes part to the ContextCache's longest checkpoint that is an exact proper prefix of its
prompt (the Program opens the sequence from it with ``computed == covered``); its prefill chunks
stop at multiples of the checkpoint interval, where (and at the prompt's end) a checkpoint is
published right after the unit ran; a request finishing with stop/length publishes its final state.
Whenever KV pages or a slot are short, cache entries are reclaimed (demoted to the Host tier when
it can take them, else dropped) before any request is paused; a hit on an entry with Host content
restores it first. A paused request keeps a Snapshot (its checkpoint, demoted to Host) when the
Host tier can hold it and resumes from it without recomputing anything; a revoked Snapshot falls
back to Replay, which also binds the longest checkpoint of its ledger (it then replays only the rest).
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
from ninfer.contracts.program import (
    CheckpointUsage,
    DecodeRow,
    ExecutionUnit,
    OutOfSlotsError,
    PendingBatch,
    PrefillChunk,
    Program,
    ProgramCapacity,
    ReplayState,
    SeqId,
    SnapshotState,
)
from ninfer.engine.context_cache.cache import CacheEntry, ContextCache
from ninfer.engine.context_cache.operation_slot import OperationSlot
from ninfer.engine.options import EngineOptions
from ninfer.engine.requests import RequestRecord, RequestState
from ninfer.engine.row_commit import decide_row
from ninfer.engine.scheduler import Scheduler
from ninfer.engine.stats import EngineCounters, EngineStatus, counter_values

log = logging.getLogger("ninfer.engine")

S = RequestState
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
    def __init__(self, program: Program, options: EngineOptions) -> None:
        self.program = program
        self.options = options
        self.max_context = options.max_context
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Held by submitters while they check ``status`` and enqueue, and by the worker when it stops
        # accepting: a submission is therefore either seen by the worker or refused, never lost.
        self.submit_lock = threading.Lock()
        self.status: EngineStatus = "running"
        self.failure: EngineFailure | None = None
        self.scheduler = Scheduler(options.max_concurrency, options.admission_bypass)
        self.records: dict[int, RequestRecord] = {}
        self.by_seq: dict[SeqId, RequestRecord] = {}
        self.counters = EngineCounters()
        self.ops = OperationSlot()
        self.cache: ContextCache | None = (
            ContextCache(program, block_size=program.capacity().page_size, slot=self.ops)
            if options.context_cache else None)
        self.checkpoint_interval = options.checkpoint_interval
        self._close_drain: bool | None = None  # None: no close asked; else whether to drain first
        cap = program.capacity()
        self.page_size = cap.page_size
        self.snapshot = CoreSnapshot("running", 0, 0, 0, cap, counter_values(self.counters))
        self.thread = threading.Thread(target=self._run, name="ninfer-engine-worker", daemon=True)

    # -- thread entry ------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        progressed = True
        try:
            while True:
                self._take_messages(block=not progressed)
                if self._close_drain is not None and (not self._close_drain or not self.records):
                    break
                progressed = self._cycle()
                self._publish_snapshot()
            self._shutdown()
        except BaseException as exc:  # noqa: BLE001 - every worker crash must reach the consumers
            self._fail(exc)

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
            self.scheduler.enqueue(rec)
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
            if qt is not None and rec.state is S.WAITING:
                soonest = min(soonest, rec.submit_time + qt)
        return None if soonest == math.inf else max(0.0, soonest - now)

    # -- one cycle ---------------------------------------------------------------------------------
    def _cycle(self) -> bool:
        """Run one worker cycle; True when anything changed (so the next one should not sleep)."""
        now = time.monotonic()
        progressed = self._settle_interrupted(now)
        progressed |= self._resume()
        progressed |= self._admit(now)
        decode, chunk, changed = self._grant_permits()
        if not decode and chunk is None:
            return progressed or changed
        self._execute(decode, chunk)
        return True

    def _settle_interrupted(self, now: float) -> bool:
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
            elif qt is not None and rec.state is S.WAITING and now - rec.submit_time >= qt:
                self.counters.rejected += 1
                self._reject(rec, QueueTimeoutError(
                    f"request {rec.request_id} waited {now - rec.submit_time:.3f}s in the queue "
                    f"(queue_timeout_s={qt})"))
            else:
                continue
            changed = True
        return changed

    # -- admission and resume ----------------------------------------------------------------------
    def _fits(self, tokens: int) -> bool:
        """Soft admission check: a free slot, and pages for ``tokens`` beyond one page of headroom
        per resident (each may cross a page boundary on its next step). Reservation stays with
        reserve_units; this only avoids admitting work that would be preempted at once."""
        cap = self.program.capacity()
        pages = -(-tokens // self.page_size)
        return cap.free_state_slots > 0 and pages <= cap.free_pages - len(self.scheduler.residents)

    def _fits_reclaiming(self, tokens: int) -> bool:
        """:meth:`_fits`, reclaiming context-cache entries (least recently used first) until it does."""
        while not self._fits(tokens):
            if self.cache is None or not self._reclaim():
                return False
        return True

    def _reclaim(self, protect: CacheEntry | None = None) -> bool:
        """One step of freeing device pages held only by the context cache (see ContextCache.reclaim)."""
        if self.cache is None:
            return False
        return self.cache.reclaim("pages", protect=() if protect is None else (protect.entry_id,))

    def _open(self, rec: RequestRecord, tokens: tuple[int, ...], prompt_length: int | None,
              source: CacheEntry | None = None) -> bool:
        try:
            if source is not None:
                with self.ops.transaction("bind", f"request {rec.request_id} from checkpoint {source.entry_id}"):
                    seq = self.program.open_sequence_from(source.handle, tokens, prompt_length)
            elif prompt_length is None:
                seq = self.program.open_sequence(tokens)
            else:
                seq = self.program.open_sequence(tokens, prompt_length=prompt_length)
        except OutOfSlotsError:
            return False
        if seq in self.by_seq:
            raise EngineFailure(f"Program reused live sequence id {seq}")
        rec.seq = seq
        self.by_seq[seq] = rec
        return True

    def _resume(self) -> bool:
        rec = self.scheduler.resume_candidate()
        if rec is None:
            return False
        state = rec.resume
        assert state is not None
        ledger = tuple(state.ledger)
        if ledger != rec.prompt + tuple(rec.output_tokens):
            raise EngineFailure(f"request {rec.request_id}: the resume ledger does not match its prompt and "
                                f"published output")
        # The complete permit: rebuild to the old frontier plus the first real new token, held
        # across chunks (reserve_units only ever extends a sequence's pages).
        need = len(ledger)
        snapshot = self.cache.snapshot_of(rec.ticket) if self.cache is not None else None
        if isinstance(state, SnapshotState) and (snapshot is None or snapshot.handle != state.checkpoint):
            if snapshot is not None:
                raise EngineFailure(f"request {rec.request_id}: its Snapshot is not the one it was paused with")
            rec.resume = state = state.as_replay()  # revoked under pressure: Replay the same tokens
        source: CacheEntry | None = None
        if snapshot is not None:
            if self._fits_from(snapshot, need):
                source = snapshot
            elif self.scheduler.residents:
                return False  # residents will free capacity; keep the Snapshot meanwhile
            else:  # nothing else can free anything: the Snapshot itself is in the way
                self.cache.revoke_snapshot(rec.ticket)
                rec.resume = state = state.as_replay()
        if source is None:
            fits, source = self._place(rec, ledger, need)
            if not fits:
                return False
        rec.move(S.MATERIALIZING)
        if not self._open(rec, ledger, len(rec.prompt), source):
            rec.move(S.PAUSED)
            return False
        assert rec.seq is not None
        if source is not None and source is snapshot:
            if self.program.computed(rec.seq) != snapshot.covered:
                raise EngineFailure(f"request {rec.request_id} opened from its Snapshot of {snapshot.covered} tokens "
                                    f"but the Program computed {self.program.computed(rec.seq)}")
            # The sequence now holds what it needs; the Snapshot goes (before reserving, so its
            # partial tail page is private again and needs no copy).
            self.cache.resumed_from_snapshot(rec.ticket)
        elif source is not None:  # the rebuild starts at the checkpoint (fewer Replay tokens)
            self._note_bound(rec, source)
        if not self.program.reserve_units({rec.seq: need - self.program.computed(rec.seq)})[rec.seq]:
            if source is not None and source is snapshot:
                raise EngineFailure(f"request {rec.request_id} lost its Snapshot resume permit")
            self._release_seq(rec)
            rec.move(S.PAUSED)
            return False
        if isinstance(rec.resume, ReplayState):
            self.counters.replays += 1
        rec.resume = None
        rec.protected = True
        rec.move(S.REPLAY if rec.output_tokens else S.PREFILL)
        if rec.state is S.REPLAY and self.program.computed(rec.seq) == rec.rebuild_target():
            rec.move(S.DECODE_READY)  # the checkpoint covers the whole rebuild
        self.scheduler.add_resident(rec)
        self.counters.resumes += 1
        return True

    def _fits_from(self, source: CacheEntry, need: int) -> bool:
        """Whether a sequence needing pages for ``need`` tokens fits when opened from ``source``:
        restores it to Device and reclaims other cache content (never ``source``) as needed."""
        assert self.cache is not None
        if not self.cache.ensure_on_device(source):
            return False
        shared = source.covered // self.page_size * self.page_size
        while not self._fits(need - shared):
            if not self._reclaim(protect=source):
                return False
        return True

    def _admit(self, now: float) -> bool:
        changed = False
        order = self.scheduler.admission_order()
        head_blocked = False
        for rec in order:
            if self.scheduler.free_lanes == 0:
                break
            fits, source = self._place(rec, rec.prompt, len(rec.prompt) + 1)
            if not fits:
                head_blocked = head_blocked or rec is order[0]
                continue
            rec.move(S.MATERIALIZING)
            if not self._open(rec, rec.prompt, None, source):
                rec.move(S.WAITING)
                break
            if source is not None:
                self._note_bound(rec, source)
                self.counters.cache_saved_prefill_tokens += source.covered
            rec.move(S.PREFILL)
            self.scheduler.add_resident(rec)
            if head_blocked:
                self.scheduler.note_bypass()
            rec.admit_time = now
            rec.started = True
            self.counters.admitted += 1
            self._push(rec, GenerationStart(rec.request_id, len(rec.prompt)))
            changed = True
        return changed

    def _note_bound(self, rec: RequestRecord, source: CacheEntry) -> None:
        assert self.cache is not None and rec.seq is not None
        if self.program.computed(rec.seq) != source.covered:
            raise EngineFailure(f"request {rec.request_id} opened from a checkpoint of {source.covered} "
                                f"tokens but the Program computed {self.program.computed(rec.seq)}")
        self.cache.note_bound(source)
        self.counters.cache_hits += 1
        self.counters.cache_hit_tokens += source.covered

    def _place(self, rec: RequestRecord, tokens: tuple[int, ...], need: int) -> tuple[bool, CacheEntry | None]:
        """Whether ``rec`` (to open with ``tokens``, needing pages for ``need`` tokens from the root)
        fits now, and the cache entry it opens from (None: from the root). The longest exact entry is
        restored to Device if it has Host content and other cache content is reclaimed until the
        pages still needed fit; an entry that cannot be made to fit is passed over for the next
        longest (each at most once, so the search ends), down to the root."""
        if self.cache is None:
            return self._fits(need), None
        if not rec.cache:
            return self._fits_reclaiming(need), None
        self.counters.cache_lookups += 1
        passed: set[int] = set()
        while True:
            source = self.cache.lookup(tokens, session=rec.session_key, exclude=passed)
            if source is None:
                return self._fits_reclaiming(need), None
            if self._fits_from(source, need):
                return True, source
            passed.add(source.entry_id)

    # -- permits and preemption --------------------------------------------------------------------
    def _grant_permits(self) -> tuple[list[RequestRecord], tuple[RequestRecord, int] | None, bool]:
        """Reserve this cycle's unit. Returns (decode rows, (chunk record, tokens) or None, whether
        anything was preempted)."""
        changed = False
        while True:
            decode = self.scheduler.decode_rows()
            granted = self.program.reserve_units({r.seq: 1 for r in decode}) if decode else {}
            if any(not granted[r.seq] for r in decode):
                # A decode row must progress: reclaim cache entries, else free the youngest
                # non-protected resident; retry.
                if self._reclaim():
                    changed = True
                    continue
                self._pause_victim("a decode row needs a KV page")
                changed = True
                continue
            chunk = None
            candidates = self.scheduler.chunk_candidates()
            for rec in candidates:
                computed = self.program.computed(rec.seq)
                n = min(self.options.prefill_chunk, rec.rebuild_target() - computed)
                if n < 1:
                    raise EngineFailure(f"request {rec.request_id} is {rec.state.value} with nothing left to "
                                        f"compute")
                if self._captures_boundaries(rec):
                    n = min(n, self._next_capture_point(rec, computed) - computed)
                ok = self.program.reserve_units({rec.seq: n})[rec.seq]
                while not ok and self._reclaim():
                    changed = True
                    ok = self.program.reserve_units({rec.seq: n})[rec.seq]
                if ok:
                    chunk = (rec, n)
                    break
                if rec.protected:
                    raise EngineFailure(f"request {rec.request_id} lost its resume permit")
            if chunk is None and candidates and not decode:
                # Nothing else would run and nothing would free pages: preempt the youngest.
                self._pause_victim("no prefill chunk fits")
                changed = True
                continue
            return decode, chunk, changed

    def _next_capture_point(self, rec: RequestRecord, computed: int) -> int:
        """The next prefill position past ``computed`` to checkpoint at: an interval boundary or one
        of the prompt's cache points, whichever comes first."""
        k = self.checkpoint_interval
        nxt = (computed // k + 1) * k
        return min([nxt] + [p for p in rec.cache_points if p > computed])

    def _captures_boundaries(self, rec: RequestRecord) -> bool:
        return self.cache is not None and rec.cache and rec.state is S.PREFILL and not rec.protected

    def _publish_checkpoint(self, rec: RequestRecord, kind) -> None:
        """Checkpoint ``rec``'s sequence at the Program's frontier; the ContextCache checks that
        it covers exactly the request's ledger up to there."""
        assert self.cache is not None and rec.seq is not None
        computed = self.program.computed(rec.seq)
        ledger = rec.prompt + tuple(rec.output_tokens)
        session = rec.session_key if kind in ("prompt_end", "response_end") else None
        self.cache.publish(rec.seq, ledger[:computed], kind, order=rec.ticket, session=session)

    def _pause_victim(self, why: str) -> None:
        victim = self.scheduler.victim()
        if victim is None:
            raise EngineFailure(f"{why} and no resident can be preempted (KV pool too small?)")
        victim.move(S.PAUSING)
        assert victim.seq is not None
        seq = victim.seq
        if self.cache is not None:
            computed = (victim.prompt + tuple(victim.output_tokens))[: self.program.computed(seq)]
            victim.resume = self.cache.pause(seq, victim.ticket, computed)
        else:
            with self.ops.transaction("pause", f"request {victim.request_id}"):
                victim.resume = self.program.pause(seq)
        del self.by_seq[seq]
        victim.seq = None
        self.scheduler.pause(victim)
        victim.move(S.PAUSED)
        self.counters.preemptions += 1
        log.debug("paused request %s (%s)", victim.request_id, why)

    # -- execution and commit ----------------------------------------------------------------------
    def _execute(self, decode: list[RequestRecord], chunk: tuple[RequestRecord, int] | None) -> None:
        chunk_rec, chunk_samples, unit_chunk = None, False, None
        if chunk is not None:
            chunk_rec, n = chunk
            assert chunk_rec.seq is not None
            chunk_samples = self.program.computed(chunk_rec.seq) + n == chunk_rec.ledger_length
            unit_chunk = PrefillChunk(chunk_rec.seq, n, chunk_rec.row_sampling() if chunk_samples else None)
            self.scheduler.note_chunk(chunk_rec)
            if chunk_rec.state is S.PREFILL and not chunk_rec.protected:
                self.counters.prefill_tokens += n
            else:
                self.counters.replay_tokens += n
        unit = ExecutionUnit(decode=tuple(DecodeRow(r.seq, r.row_sampling()) for r in decode), chunk=unit_chunk)
        pending = self.program.run(unit)
        if chunk_rec is not None and self._captures_boundaries(chunk_rec):
            # Before the commit, so a request finishing on this unit is still checkpointed; the
            # provisional token is not part of the state.
            c = self.program.computed(chunk_rec.seq)
            if c == len(chunk_rec.prompt):
                self._publish_checkpoint(chunk_rec, "prompt_end")
            elif c in chunk_rec.cache_points:
                self._publish_checkpoint(chunk_rec, "message_boundary")
            elif c % self.checkpoint_interval == 0:
                self._publish_checkpoint(chunk_rec, "prefill_boundary")
        self.counters.units += 1
        self.counters.decode_tokens += len(decode)
        expected = [r.seq for r in decode] + ([chunk_rec.seq] if chunk_samples and chunk_rec else [])
        if [row.seq for row in pending.rows] != expected:
            self._abort(pending)
            raise EngineFailure(f"PendingBatch {pending.batch_id} rows {[r.seq for r in pending.rows]} do not "
                                f"match the unit's sampling rows {expected}")
        self._consume(pending)
        if chunk_rec is not None and chunk_rec.state is S.REPLAY and chunk_rec.seq is not None:
            if self.program.computed(chunk_rec.seq) == chunk_rec.rebuild_target():
                chunk_rec.move(S.DECODE_READY)

    def _abort(self, pending: PendingBatch) -> None:
        try:
            self.program.abort_pending(pending)
        except Exception:  # already failing: keep the original error, log this one
            log.exception("abort_pending failed while handling an engine failure")

    def _consume(self, pending: PendingBatch) -> None:
        try:
            decisions = [decide_row(self.by_seq[row.seq], row, self.max_context) for row in pending.rows]
        except BaseException:
            self._abort(pending)
            raise
        try:
            self.program.commit(pending, {d.row.seq: d.accepted for d in decisions})
        except Exception as exc:
            raise EngineFailure(f"Program.commit of batch {pending.batch_id} failed: {exc}") from exc
        now = time.monotonic()
        # Budget and scheduling accounting, before any output is committed or published.
        for d in decisions:
            if d.accepted == 0:
                continue
            d.rec.output_tokens.extend(d.tokens)
            self.counters.completion_tokens += d.accepted
            if d.rec.first_token_time is None:
                d.rec.first_token_time = now
            d.rec.protected = False  # real new progress ends a protected resume
            if d.rec.state is S.PREFILL:
                d.rec.move(S.DECODE_READY)
            if d.finish is not None:
                d.rec.move(S.MODEL_FINISHED)
        for d in decisions:
            if d.preview is None:
                continue
            d.rec.session.commit(d.preview)
            want_lp = d.rec.params.logprobs or d.rec.params.top_logprobs > 0
            lps = d.row.logprobs[: d.accepted] if want_lp and d.row.logprobs is not None else None
            self._push(d.rec, GenerationDelta(d.rec.request_id, d.tokens,
                                              tuple(d.preview.deltas), lps))
        for d in decisions:
            if d.finish == "cancelled":
                self.counters.cancelled += 1
                self._finish(d.rec, "cancelled")
            elif d.finish is not None:
                self.counters.finished += 1
                self._finish(d.rec, d.finish, d.preview.stop_reason if d.preview else None)

    # -- settlement --------------------------------------------------------------------------------
    def _release_seq(self, rec: RequestRecord) -> None:
        if rec.seq is not None:
            seq, rec.seq = rec.seq, None
            del self.by_seq[seq]
            self.program.release(seq)

    def _finish(self, rec: RequestRecord, reason: str, stop_reason: str | int | None = None) -> None:
        """Terminal success: free the lane and the Program sequence, flush the session, publish."""
        if (self.cache is not None and rec.cache and rec.seq is not None and reason in ("stop", "length")
                and self.program.computed(rec.seq) > len(rec.prompt)):
            self._publish_checkpoint(rec, "response_end")
        self._release_seq(rec)
        final = rec.session.finish(reason)
        if final.deltas and rec.started:
            self._push(rec, GenerationDelta(rec.request_id, (), tuple(final.deltas)))
        now = time.monotonic()
        result = GenerationResult(
            request_id=rec.request_id, finish_reason=reason, token_ids=tuple(rec.output_tokens), output=final,
            usage=Usage(len(rec.prompt), len(rec.output_tokens)),
            timings=Timings(
                queue_s=None if rec.admit_time is None else rec.admit_time - rec.submit_time,
                ttft_s=None if rec.first_token_time is None else rec.first_token_time - rec.submit_time,
                total_s=now - rec.submit_time),
            stop_reason=stop_reason)
        self._settle(rec, result)

    def _reject(self, rec: RequestRecord, error: Exception) -> None:
        self._release_seq(rec)
        self._settle(rec, GenerationError(rec.request_id, error))

    def _settle(self, rec: RequestRecord, event: GenerationEvent) -> None:
        if self.cache is not None:
            self.cache.forget_owner(rec.ticket)  # a request settled while paused leaves no Snapshot
        rec.resume = None
        self.scheduler.remove(rec)
        rec.move(S.SETTLED)
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
        self.by_seq.clear()
        snap = self.snapshot
        self.snapshot = CoreSnapshot("failed", 0, 0, 0, snap.capacity, counter_values(self.counters),
                                     snap.checkpoints)

    def _publish_snapshot(self) -> None:
        la = getattr(self.program, "lookahead_stats", None)  # only a SequenceProgram keeps them
        if la is not None:
            n = self.counters
            n.lookahead_launched, n.lookahead_adopted, n.lookahead_dropped = la.launched, la.adopted, la.dropped
        if self.cache is not None:
            c, n = self.cache.counters(), self.counters
            n.cache_captures, n.cache_evictions, n.cache_host_evictions = c.captures, c.evictions, c.host_evictions
            n.cache_demotions, n.cache_restores = c.demotions, c.restores
            n.snapshot_pauses, n.snapshot_resumes, n.snapshot_revocations = (
                c.snapshot_pauses, c.snapshot_resumes, c.snapshot_revocations)
        sch = self.scheduler
        status: EngineStatus = self.status if self.status != "running" or self._close_drain is None else "closing"
        usage = self.program.checkpoint_usage() if self.cache is not None else self.snapshot.checkpoints
        self.snapshot = CoreSnapshot(status, len(sch.waiting), len(sch.residents), len(sch.paused),
                                     self.program.capacity(), counter_values(self.counters), usage)
