"""Committing a unit that ran: which provisional tokens each row accepts, then commit, account, publish.

Order after ``Program.run`` (docs/design.md section 5), all on the worker thread:

1. the PendingBatch's rows must be the unit's sampling rows, in order (else it is aborted and the
   engine fails);
2. each verify row's acceptance per draft position is counted as the Program made the row
   (:func:`~ninfer.engine.stats.count_verify`), then :func:`decide_row` decides each row (the Frontend
   preview is its only side effect, pure by contract); a failure here aborts the PendingBatch;
3. ``Program.commit`` with every row's accepted count;
4. accounting, before any output is committed or published: output tokens, budgets, state moves;
5. each row's OutputSession commits its preview and the GenerationDelta is published;
6. the rows that finished are returned for the worker to settle, in row order.

Accepted-token rules, a violation is an EngineFailure:
- a cancelled request accepts 0 tokens (and is not previewed);
- otherwise the provisional tokens are first cut to the request's remaining budget (max_tokens and
  max_context), then previewed; ``1 <= accepted <= len(previewed)``;
- a row that does not finish accepts every previewed token; a row finishes with the preview's
  reason (a stop) or with ``"length"`` when it accepted its whole remaining budget;
- a row holds at most ``drafted + 1`` tokens, and only a decode row scheduled for ``n`` drafts may have
  verified ``1..n`` of them (``PendingRow.drafted``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ninfer.contracts.errors import EngineFailure
from ninfer.contracts.events import GenerationDelta
from ninfer.contracts.frontend import OutputPreview
from ninfer.contracts.program import PendingBatch, PendingRow, Program
from ninfer.engine.requests import RequestRecord, RequestState
from ninfer.engine.scheduler import ScheduledUnit
from ninfer.engine.sequences import SequenceTable
from ninfer.engine.stats import EngineCounters, count_verify

log = logging.getLogger("ninfer.engine")


@dataclass(frozen=True)
class RowCommit:
    """One row's decision, made before Program.commit and applied after it."""

    rec: RequestRecord
    row: PendingRow
    accepted: int
    preview: OutputPreview | None  # None for a cancelled row
    finish: str | None

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self.row.tokens[: self.accepted])


def decide_row(rec: RequestRecord, row: PendingRow, max_context: int) -> RowCommit:
    if rec.control.cancel_requested:
        return RowCommit(rec, row, 0, None, "cancelled")
    if not row.tokens:
        raise EngineFailure(f"PendingBatch row of sequence {row.seq} produced no token")
    limit = rec.remaining(max_context)
    if limit < 1:
        raise EngineFailure(f"request {rec.request_id} ran with no remaining budget")
    tokens = row.tokens[:limit]
    preview = rec.session.preview(tokens)
    accepted = preview.accepted
    if isinstance(accepted, bool) or not isinstance(accepted, int) or not 1 <= accepted <= len(tokens):
        raise EngineFailure(f"OutputSession of request {rec.request_id} accepted {accepted!r} of "
                            f"{len(tokens)} tokens; must be in [1, {len(tokens)}]")
    finish = preview.finish_reason
    if finish is None and accepted != len(tokens):
        raise EngineFailure(f"OutputSession of request {rec.request_id} accepted {accepted} of "
                            f"{len(tokens)} tokens without finishing; a nonterminal row accepts all")
    if finish is None and accepted == limit:
        finish = "length"
    return RowCommit(rec, row, accepted, preview, finish)


def commit_unit(unit: ScheduledUnit, pending: PendingBatch, program: Program, sequences: SequenceTable,
                counters: EngineCounters, max_context: int) -> list[RowCommit]:
    """Commit ``pending`` (what ``unit`` ran) and publish its output; returns the rows that finished."""
    counters.units += 1
    counters.decode_tokens += len(unit.decode)
    expected = unit.sampling_seqs()
    if [row.seq for row in pending.rows] != expected:
        _abort(program, pending)
        raise EngineFailure(f"PendingBatch {pending.batch_id} rows {[r.seq for r in pending.rows]} do not "
                            f"match the unit's sampling rows {expected}")
    try:
        _count_verifies(unit, pending, counters)
        decisions = [decide_row(sequences[row.seq], row, max_context) for row in pending.rows]
    except BaseException:
        _abort(program, pending)
        raise
    try:
        program.commit(pending, {d.row.seq: d.accepted for d in decisions})
    except Exception as exc:
        raise EngineFailure(f"Program.commit of batch {pending.batch_id} failed: {exc}") from exc
    now = time.monotonic()
    for d in decisions:
        if d.accepted == 0:
            continue
        d.rec.output_tokens.extend(d.tokens)
        counters.completion_tokens += d.accepted
        if d.rec.first_token_time is None:
            d.rec.first_token_time = now
        d.rec.protected = False  # real new progress ends a protected resume
        if d.rec.state is RequestState.PREFILL:
            d.rec.move(RequestState.DECODE_READY)
        if d.finish is not None:
            d.rec.move(RequestState.MODEL_FINISHED)
    for d in decisions:
        if d.preview is None:
            continue
        d.rec.session.commit(d.preview)
        want_lp = d.rec.params.logprobs or d.rec.params.top_logprobs > 0
        lps = d.row.logprobs[: d.accepted] if want_lp and d.row.logprobs is not None else None
        d.rec.control.channel.push(GenerationDelta(d.rec.request_id, d.tokens, tuple(d.preview.deltas), lps))
    for chunk in unit.chunks:
        rec = chunk.rec
        if rec.state is RequestState.REPLAY and rec.seq is not None:
            # A Replay chunk never samples: the rebuild is done when it reached all but the last token.
            if program.computed(rec.seq) == rec.rebuild_target():
                rec.move(RequestState.DECODE_READY)
    return [d for d in decisions if d.finish is not None]


def _count_verifies(unit: ScheduledUnit, pending: PendingBatch, counters: EngineCounters) -> None:
    """Count each verify row's acceptance per draft position (the acceptance rule's, before any cut), after
    checking it against the unit: rows are in ``sampling_seqs`` order, the decode rows first."""
    allowed = unit.row_drafts()
    for i, row in enumerate(pending.rows):
        most = allowed[i] if i < len(allowed) else 0
        if isinstance(row.drafted, bool) or not 0 <= row.drafted <= most or len(row.tokens) > row.drafted + 1:
            raise EngineFailure(f"PendingBatch row of sequence {row.seq} verified {row.drafted!r} drafts with "
                                f"{len(row.tokens)} tokens; the unit allowed 0..{most} drafts and a row holds at "
                                f"most drafted + 1 tokens")
        if row.drafted and row.tokens:
            count_verify(counters, row.drafted, len(row.tokens) - 1)


def _abort(program: Program, pending: PendingBatch) -> None:
    try:
        program.abort_pending(pending)
    except Exception:  # already failing: keep the original error, log this one
        log.exception("abort_pending failed while handling an engine failure")
