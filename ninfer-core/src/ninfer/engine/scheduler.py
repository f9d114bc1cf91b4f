"""Scheduler: what the next unit runs, with every reservation it needs already held.

:meth:`Scheduler.schedule` is the scheduling policy of one engine step (docs/design.md section 5):

1. resume: the oldest paused request, when a running place is free and no other resume is
   protected, rebuilds its full ledger (a protected resume: its reservation covers the whole
   rebuild and is held until its first new token);
2. admission: waiting requests in FIFO order with a bounded bypass take the remaining running
   places, each opened from its longest usable context-cache checkpoint (:mod:`ninfer.engine.admission`);
3. reservations: every decode-ready resident reserves one token; a decode row that cannot get its
   KV page first reclaims context-cache entries, then preempts the youngest non-protected resident
   (possibly itself), and all rows reserve again. One chunk (the protected resume first, then
   rotation in ticket order) reserves its tokens, reclaiming cache entries first; a chunk that
   still does not fit is skipped while decode rows progress, and preempts the youngest otherwise.

Who decides what: the Scheduler decides order (:class:`RequestQueues` holds the queues and their
order rules), the ContextCache decides retention, the Program decides physical feasibility. The
Scheduler calls the Program for feasibility and reservations (``capacity``, ``computed``,
``reserve_units``), through :class:`SequenceTable` to open, pause and release sequences, and through
the ContextCache for the checkpoint moves placement and reclaiming need (restore, demote, drop, revoke
a Snapshot); it never runs or commits a unit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ninfer.contracts.errors import EngineFailure
from ninfer.contracts.program import DecodeRow, ExecutionUnit, PrefillChunk, Program, SeqId
from ninfer.engine.admission import Admission
from ninfer.engine.context_cache.cache import ContextCache
from ninfer.engine.context_cache.capture import CheckpointCapture
from ninfer.engine.queues import RequestQueues
from ninfer.engine.requests import RequestRecord, RequestState
from ninfer.engine.sequences import SequenceTable
from ninfer.engine.stats import EngineCounters

log = logging.getLogger("ninfer.engine")


@dataclass(frozen=True)
class ScheduledChunk:
    """A prefill or Replay chunk of ``tokens`` ledger tokens for ``rec``, its pages reserved."""

    rec: RequestRecord
    tokens: int
    samples: bool  # the chunk ends at the ledger's end: its last position samples the next token


@dataclass(frozen=True)
class ScheduledUnit:
    """One step's work, its reservations held: decode rows (one token each) and at most one chunk.
    Never empty. Rows sample in order: the decode rows, then the chunk when it samples."""

    decode: tuple[RequestRecord, ...]
    chunk: ScheduledChunk | None

    def execution_unit(self) -> ExecutionUnit:
        """The Program's unit. Reads each sampling row's parameters now: a constrained request's
        token mask follows its committed output."""
        chunk = None
        if self.chunk is not None:
            rec = self.chunk.rec
            assert rec.seq is not None
            chunk = PrefillChunk(rec.seq, self.chunk.tokens, rec.row_sampling() if self.chunk.samples else None)
        return ExecutionUnit(decode=tuple(DecodeRow(r.seq, r.row_sampling()) for r in self.decode), chunk=chunk)

    def sampling_seqs(self) -> list[SeqId | None]:
        """The sequences of the rows the unit samples, in PendingBatch row order."""
        chunk = [self.chunk.rec.seq] if self.chunk is not None and self.chunk.samples else []
        return [r.seq for r in self.decode] + chunk


class Scheduler:
    """The step's scheduling policy over :class:`RequestQueues`. ``on_admit`` is told of each fresh
    admission as it happens (the worker publishes its GenerationStart)."""

    def __init__(self, program: Program, queues: RequestQueues, sequences: SequenceTable,
                 cache: ContextCache | None, capture: CheckpointCapture, counters: EngineCounters, *,
                 prefill_chunk: int, on_admit: Callable[[RequestRecord], None]) -> None:
        self.program = program
        self.queues = queues
        self.sequences = sequences
        self.capture = capture
        self.counters = counters
        self.prefill_chunk = prefill_chunk
        self.on_admit = on_admit
        self.admission = Admission(program, cache, sequences, queues, counters)
        # Admissions, resumes and preemptions so far: a step that ran nothing but changed these
        # may have made room for more work, so the worker must not sleep after it.
        self.membership_changes = 0

    def schedule(self) -> ScheduledUnit | None:
        """Resume, admit, then reserve the step's unit (see the module docstring); None when
        nothing can run now."""
        self._resume_oldest_paused()
        self._admit_waiting(time.monotonic())
        return self._reserve_unit()

    # -- resume and admission ----------------------------------------------------------------------
    def _resume_oldest_paused(self) -> None:
        rec = self.queues.resume_candidate()
        if rec is not None and self.admission.resume(rec):
            self.queues.add_resident(rec)
            self.counters.resumes += 1
            self.membership_changes += 1

    def _admit_waiting(self, now: float) -> None:
        order = self.queues.admission_order()
        head_blocked = False
        for rec in order:
            if self.queues.full:
                break
            placement = self.admission.place(rec, rec.prompt, len(rec.prompt) + 1)
            if placement is None:
                head_blocked = head_blocked or rec is order[0]
                continue
            if not self.admission.open_fresh(rec, placement):
                break  # no free Program slot: later requests would not get one either
            self.queues.add_resident(rec)
            if head_blocked:
                self.queues.note_bypass()
            rec.admit_time = now
            rec.started = True
            self.counters.admitted += 1
            self.membership_changes += 1
            self.on_admit(rec)

    # -- reservations and preemption ---------------------------------------------------------------
    def _reserve_unit(self) -> ScheduledUnit | None:
        while True:
            decode = self.queues.decode_rows()
            reserved = self.program.reserve_units({r.seq: 1 for r in decode}) if decode else {}
            if any(not reserved[r.seq] for r in decode):
                # A decode row must progress: reclaim cache entries, else free the youngest
                # non-protected resident; then reserve again.
                if not self.admission.reclaim():
                    self._preempt("a decode row needs a KV page")
                continue
            candidates = self.queues.chunk_candidates()
            chunk = self._reserve_chunk(candidates)
            if chunk is None and candidates and not decode:
                # Nothing else would run and nothing would free pages: preempt the youngest.
                self._preempt("no prefill chunk fits")
                continue
            if chunk is None:
                return ScheduledUnit(tuple(decode), None) if decode else None
            self.queues.note_chunk(chunk.rec)
            if chunk.rec.state is RequestState.PREFILL and not chunk.rec.protected:
                self.counters.prefill_tokens += chunk.tokens
            else:
                self.counters.replay_tokens += chunk.tokens
            return ScheduledUnit(tuple(decode), chunk)

    def _reserve_chunk(self, candidates: list[RequestRecord]) -> ScheduledChunk | None:
        """The first candidate whose next chunk can reserve its pages (reclaiming cache entries
        first), or None."""
        for rec in candidates:
            assert rec.seq is not None
            computed = self.program.computed(rec.seq)
            n = min(self.prefill_chunk, rec.rebuild_target() - computed)
            if n < 1:
                raise EngineFailure(f"request {rec.request_id} is {rec.state.value} with nothing left to "
                                    f"compute")
            n = self.capture.chunk_tokens(rec, computed, n)
            ok = self.program.reserve_units({rec.seq: n})[rec.seq]
            while not ok and self.admission.reclaim():
                ok = self.program.reserve_units({rec.seq: n})[rec.seq]
            if ok:
                return ScheduledChunk(rec, n, samples=computed + n == rec.ledger_length)
            if rec.protected:
                raise EngineFailure(f"request {rec.request_id} lost its resume reservation")
        return None

    def _preempt(self, why: str) -> None:
        """Pause the youngest non-protected resident (a Snapshot when the context cache can keep
        one, else Replay later)."""
        victim = self.queues.victim()
        if victim is None:
            raise EngineFailure(f"{why} and no resident can be preempted (KV pool too small?)")
        victim.move(RequestState.PAUSING)
        victim.resume = self.sequences.pause(victim)
        self.queues.pause(victim)
        victim.move(RequestState.PAUSED)
        self.counters.preemptions += 1
        self.membership_changes += 1
        log.debug("paused request %s (%s)", victim.request_id, why)
