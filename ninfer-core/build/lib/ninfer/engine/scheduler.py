"""Scheduler: what the next unit runs, with every reservation it needs already held.

:meth:`Scheduler.schedule` is the scheduling policy of one engine step (docs/design.md section 5):

1. resume: the oldest paused request, when a running place is free and no other resume is
   protected, rebuilds its full ledger (a protected resume: its reservation covers the whole
   rebuild and is held until its first new token);
2. admission: waiting requests in FIFO order with a bounded bypass take the remaining running
   places, each opened from its longest usable context-cache checkpoint (:mod:`ninfer.engine.admission`);
3. reservations: every decode-ready resident reserves one token, or ``drafts + 1`` when the engine
   speculates (``speculative_tokens = k > 0``) and the row may: ``drafts = min(k, remaining budget - 1)``
   (max_tokens and max_context); 0 for a constrained row whose mask provider cannot follow drafts (not a
   ``DraftMaskProvider``). A speculating row that
   cannot get its ``drafts + 1`` falls back to one token (drafts 0); a decode row that cannot get its
   KV page first reclaims context-cache entries, then preempts the youngest non-protected resident
   (possibly itself), and all rows reserve again;
4. chunks, within the step's chunk budget: ``prefill_chunk`` tokens, and with decode rows at most
   ``max_step_tokens`` less the decode rows' tokens (``drafts + 1`` each; but at least 1, so prefill
   never stops). Chunk
   candidates are taken in order (the protected resume first, then the others least recently served
   first, :meth:`RequestQueues.chunk_candidates`), each getting ``min(budget left, what it has left
   to compute)`` tokens cut at its next checkpoint boundary (so at least one token), until the budget
   is spent or the candidates run out. A candidate reserves its pages, reclaiming cache entries first;
   one that still does not fit is skipped while anything else runs, and when nothing would run the
   youngest resident is preempted. A chunk of a request with media is also cut before the first encode unit
   (an image, a video's temporal patch: ``Program.encode_work``) that would take the step's encoder work past
   ``encode_rows`` input rows, so a step encodes at most that much (media are encoded inside the step, before
   its model call, batched across the step's chunks); a unit larger than the budget (the engine refuses those
   at submit) would run alone in a step. Apart from the steps a protected resume's rebuild fills, the rotation
   gives every candidate whose pages fit a chunk within ``max_concurrency`` steps, so no request
   starves; a long prompt is chunked across steps.

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
from ninfer.contracts.program import DecodeRow, DraftMaskProvider, ExecutionUnit, PrefillChunk, Program, SeqId
from ninfer.engine.admission import Admission
from ninfer.engine.context_cache.cache import ContextCache
from ninfer.engine.context_cache.capture import CheckpointCapture
from ninfer.engine.queues import RequestQueues
from ninfer.engine.requests import RequestRecord, RequestState
from ninfer.engine.sequences import SequenceTable
from ninfer.engine.stats import EngineCounters
from ninfer.program.draft_masks import may_verify

log = logging.getLogger("ninfer.engine")


@dataclass(frozen=True)
class ScheduledChunk:
    """A prefill or Replay chunk of ``tokens`` ledger tokens for ``rec``, its pages reserved."""

    rec: RequestRecord
    tokens: int
    samples: bool  # the chunk ends at the ledger's end: its last position samples the next token
    encode_units: int = 0  # media encode units the Program encodes for this chunk
    encode_rows: int = 0   # their encoder input rows


@dataclass(frozen=True)
class ScheduledUnit:
    """One step's work, its reservations held: decode rows and chunks of other requests (each request
    at most once). Never empty. Rows sample in order: the decode rows, then each chunk that samples, in
    ``chunks`` order. ``drafts`` (empty: none) gives each decode row's speculative drafts, in ``decode``
    order; a row is reserved for ``drafts + 1`` tokens."""

    decode: tuple[RequestRecord, ...]
    chunks: tuple[ScheduledChunk, ...] = ()
    drafts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.drafts and len(self.drafts) != len(self.decode):
            raise ValueError(f"{len(self.drafts)} draft counts for {len(self.decode)} decode rows")

    def row_drafts(self) -> tuple[int, ...]:
        return self.drafts or (0,) * len(self.decode)

    @property
    def tokens(self) -> int:
        """The tokens the unit computes: ``drafts + 1`` per decode row plus every chunk's."""
        return len(self.decode) + sum(self.drafts) + sum(c.tokens for c in self.chunks)

    def execution_unit(self) -> ExecutionUnit:
        """The Program's unit. Reads each sampling row's parameters now: a constrained request's
        token mask follows its committed output."""
        chunks = []
        for c in self.chunks:
            assert c.rec.seq is not None
            chunks.append(PrefillChunk(c.rec.seq, c.tokens, c.rec.row_sampling() if c.samples else None))
        rows = []
        for r, d in zip(self.decode, self.row_drafts(), strict=True):
            sampling = r.row_sampling()
            rows.append(DecodeRow(r.seq, sampling, d if may_verify(sampling) else 0))
        return ExecutionUnit(decode=tuple(rows), chunks=tuple(chunks))

    def sampling_seqs(self) -> list[SeqId | None]:
        """The sequences of the rows the unit samples, in PendingBatch row order."""
        return [r.seq for r in self.decode] + [c.rec.seq for c in self.chunks if c.samples]


class Scheduler:
    """The step's scheduling policy over :class:`RequestQueues`. ``on_admit`` is told of each fresh
    admission as it happens (the worker publishes its GenerationStart)."""

    def __init__(self, program: Program, queues: RequestQueues, sequences: SequenceTable,
                 cache: ContextCache | None, capture: CheckpointCapture, counters: EngineCounters, *,
                 prefill_chunk: int, step_tokens: int, on_admit: Callable[[RequestRecord], None],
                 speculative_tokens: int = 0, max_context: int | None = None,
                 encode_rows: int | None = None) -> None:
        self.program = program
        self.queues = queues
        self.sequences = sequences
        self.capture = capture
        self.counters = counters
        self.prefill_chunk = prefill_chunk
        self.step_tokens = step_tokens  # the step budget while decode rows run (EngineOptions.step_tokens)
        self.on_admit = on_admit
        if speculative_tokens and max_context is None:
            raise ValueError("a speculating Scheduler needs max_context (the drafts' room)")
        self.speculative_tokens = speculative_tokens  # the most drafts per decode row (0: no speculation)
        self.max_context = max_context
        self.encode_rows = encode_rows  # the most encoder input rows a step encodes (None: no bound)
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
        # The order is re-read after every admission: once the head is admitted the next request is the
        # head, so a burst is admitted whole in one step while the bypass allowance still bounds how many
        # later requests may pass a head that does not fit. A request that did not fit is not tried again
        # in this step.
        blocked: set[int] = set()
        while not self.queues.full:
            order = self.queues.admission_order()
            head_blocked = bool(order) and order[0].ticket in blocked
            for rec in order:
                if rec.ticket in blocked:
                    continue
                placement = self.admission.place(rec, rec.prompt, len(rec.prompt) + 1)
                if placement is None:
                    blocked.add(rec.ticket)
                    head_blocked = head_blocked or rec is order[0]
                    continue
                if not self.admission.open_fresh(rec, placement):
                    return  # no free Program slot: later requests would not get one either
                self.queues.add_resident(rec)
                if head_blocked:
                    self.queues.note_bypass()
                rec.admit_time = now
                rec.started = True
                self.counters.admitted += 1
                self.membership_changes += 1
                self.on_admit(rec)
                break
            else:
                return  # nobody in the allowed order fits

    # -- reservations and preemption ---------------------------------------------------------------
    def _reserve_unit(self) -> ScheduledUnit | None:
        while True:
            decode = self.queues.decode_rows()
            drafts = {r.seq: self._drafts(r) for r in decode}
            reserved = self.program.reserve_units({r.seq: drafts[r.seq] + 1 for r in decode}) if decode else {}
            fallback = [r.seq for r in decode if not reserved[r.seq] and drafts[r.seq]]
            if fallback:  # speculating rows that did not fit try one token before anything is reclaimed
                for seq in fallback:
                    drafts[seq] = 0
                reserved.update(self.program.reserve_units({seq: 1 for seq in fallback}))
            if any(not reserved[r.seq] for r in decode):
                # A decode row must progress: reclaim cache entries, else free the youngest
                # non-protected resident; then reserve again.
                if not self.admission.reclaim():
                    self._preempt("a decode row needs a KV page")
                continue
            candidates = self.queues.chunk_candidates()
            chunks = self._reserve_chunks(candidates, sum(drafts.values()) + len(decode))
            if not chunks and candidates and not decode:
                # Nothing else would run and nothing would free pages: preempt the youngest.
                self._preempt("no prefill chunk fits")
                continue
            if not chunks and not decode:
                return None
            for c in chunks:
                if c.rec.state is RequestState.PREFILL and not c.rec.protected:
                    self.counters.prefill_tokens += c.tokens
                else:
                    self.counters.replay_tokens += c.tokens
            step_rows = sum(c.encode_rows for c in chunks)
            self.counters.encode_units += sum(c.encode_units for c in chunks)
            self.counters.encode_rows += step_rows
            self.counters.max_step_encode_rows = max(self.counters.max_step_encode_rows, step_rows)
            self.counters.chunks += len(chunks)
            self.counters.max_unit_chunks = max(self.counters.max_unit_chunks, len(chunks))
            row_drafts = tuple(drafts[r.seq] for r in decode)
            return ScheduledUnit(tuple(decode), tuple(chunks), row_drafts if any(row_drafts) else ())

    def _drafts(self, rec: RequestRecord) -> int:
        """The drafts ``rec``'s next decode row may verify (module docstring, step 3)."""
        k = self.speculative_tokens
        if not k:
            return 0
        assert self.max_context is not None
        room = rec.remaining(self.max_context) - 1   # the verify commits up to drafts + 1 tokens
        mask = rec.session.token_mask()
        if room < 1 or (mask is not None and not isinstance(mask, DraftMaskProvider)):
            return 0
        return min(k, room)

    def _reserve_chunks(self, candidates: list[RequestRecord], decode_tokens: int) -> list[ScheduledChunk]:
        """The chunks of the candidates, in order, that fit the step's token budget and can reserve
        their pages (reclaiming cache entries first); see the module docstring."""
        budget = self.prefill_chunk
        if decode_tokens:  # the decode rows wait for the whole step: bound it, but prefill never stops
            budget = max(1, min(budget, self.step_tokens - decode_tokens))
        chosen: list[ScheduledChunk] = []
        encoded = 0   # encoder input rows the chosen chunks encode
        for rec in candidates:
            if budget < 1:
                break
            assert rec.seq is not None
            computed = self.program.computed(rec.seq)
            left = rec.rebuild_target() - computed
            if left < 1:
                raise EngineFailure(f"request {rec.request_id} is {rec.state.value} with nothing left to "
                                    f"compute")
            n = self.capture.chunk_tokens(rec, computed, min(budget, left))
            n, units, rows = self._encode_cut(rec, computed, n, encoded)
            if n < 1:
                continue  # its next encode unit does not fit this step's encoder budget
            ok = self.program.reserve_units({rec.seq: n})[rec.seq]
            while not ok and self.admission.reclaim():
                ok = self.program.reserve_units({rec.seq: n})[rec.seq]
            if ok:
                chosen.append(ScheduledChunk(rec, n, samples=computed + n == rec.ledger_length, encode_units=units,
                                             encode_rows=rows))
                self.queues.note_chunk(rec)
                budget -= n
                encoded += rows
            elif rec.protected:
                raise EngineFailure(f"request {rec.request_id} lost its resume reservation")
        return chosen

    def _encode_cut(self, rec: RequestRecord, computed: int, n: int, encoded: int) -> tuple[int, int, int]:
        """``(tokens, units, rows)``: the chunk of ``n`` tokens from ``computed`` cut before the first encode unit
        that would take the step past ``encode_rows`` encoder rows, ``encoded`` being spent already by earlier
        chunks; a unit alone in an empty budget always fits (progress), and so may leave 0 tokens."""
        if not rec.media:
            return n, 0, 0
        assert rec.seq is not None
        units = rows = 0
        for at, unit_rows in self.program.encode_work(rec.seq, computed + n):
            if self.encode_rows is not None and encoded + rows + unit_rows > self.encode_rows and encoded + rows:
                return at - computed, units, rows
            units += 1
            rows += unit_rows
        return n, units, rows

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
