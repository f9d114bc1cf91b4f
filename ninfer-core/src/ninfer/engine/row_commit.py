"""The accepted-token rules: how many of a PendingBatch row's provisional tokens a request accepts.

:func:`decide_row` runs before ``Program.commit`` and has no side effect except the Frontend
preview (which is pure by contract). Rules (docs/design.md section 5), a violation is an EngineFailure:

- a cancelled request accepts 0 tokens (and is not previewed);
- otherwise the provisional tokens are first cut to the request's remaining budget (max_tokens and
  max_context), then previewed; ``1 <= accepted <= len(previewed)``;
- a row that does not finish accepts every previewed token; a row finishes with the preview's
  reason (a stop) or with ``"length"`` when it accepted its whole remaining budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer.contracts.errors import EngineFailure
from ninfer.contracts.frontend import OutputPreview
from ninfer.contracts.program import PendingRow
from ninfer.engine.requests import RequestRecord


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
