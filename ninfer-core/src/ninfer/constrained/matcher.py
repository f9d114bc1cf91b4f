"""One request's grammar matcher, with the preview/commit discipline of its OutputSession.

State: ``committed`` tokens (advanced by committed previews) and ``provisional`` tokens (advanced by
the last preview, not yet committed). Invariants:

- :meth:`fill_bitmask` (the round's :class:`~ninfer.contracts.program.TokenMaskProvider`),
  :meth:`advance` and :meth:`drop_provisional` first roll back any provisional tokens, so the mask
  and every preview follow the committed output only: an uncommitted preview changes nothing.
- :meth:`commit` makes the provisional tokens committed; nothing else does. The matcher is owned by
  the request's session, not by the Program, so pause and Replay leave it as committed (Replay
  re-feeds only the model and never previews).
- Stop tokens are allowed exactly where the grammar may end; accepting one terminates the matcher.
- :meth:`fill_bitmask_after` (the :class:`~ninfer.contracts.program.DraftMaskProvider` side, for speculative
  verification) walks the drafted tokens and rolls them back before it returns: it leaves the matcher in
  the committed state, like :meth:`fill_bitmask`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Advance:
    """What :meth:`ConstraintMatcher.advance` did: ``accepted`` tokens taken (a rejected token stops
    it early); ``terminated``: the last accepted token was a stop token the grammar allowed."""

    accepted: int
    terminated: bool
    rejected: int | None = None  # the first token the grammar did not allow


class ConstraintMatcher:
    """Implements ``DraftMaskProvider`` (a ``TokenMaskProvider``). Used by the engine worker only (after
    construction)."""

    def __init__(self, compiled, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled, override_stop_tokens=[int(t) for t in stop_token_ids])
        #: The tokens that end the grammar (and so the output) where it may end.
        self.stop_token_ids = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        self._provisional = 0
        self.committed = 0

    @property
    def terminated(self) -> bool:
        self.drop_provisional()
        return self._m.is_terminated()

    def drop_provisional(self) -> None:
        if self._provisional:
            self._m.rollback(self._provisional)
            self._provisional = 0

    def fill_bitmask(self, words: torch.Tensor) -> None:
        """Allowed tokens of the next token after the committed output, into one int32 CPU row."""
        self.drop_provisional()
        self._m.fill_next_token_bitmask(words.view(1, -1), 0)

    def fill_bitmask_after(self, tokens: Sequence[int], words: torch.Tensor) -> bool:
        """Allowed tokens after the committed output and ``tokens``, into one int32 CPU row; False when the
        grammar rejects one of ``tokens`` or has ended (a stop token) at or before the last one. The walk is
        rolled back: the matcher stays at the committed output."""
        self.drop_provisional()
        taken = 0
        try:
            for token in tokens:
                if self._m.is_terminated() or not self._m.accept_token(int(token)):
                    return False
                taken += 1
            if self._m.is_terminated():
                return False
            self._m.fill_next_token_bitmask(words.view(1, -1), 0)
            return True
        finally:
            if taken:
                self._m.rollback(taken)

    def allows_any(self, vocab_size: int) -> bool:
        """Whether any token is allowed next (a grammar whose language is empty allows none)."""
        row = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
        self.fill_bitmask(row)
        return bool(row.any())

    def advance(self, tokens: Sequence[int]) -> Advance:
        """Provisionally accept ``tokens`` in order, up to a rejected token or a stop token."""
        self.drop_provisional()
        for i, token in enumerate(tokens):
            if not self._m.accept_token(int(token)):
                return Advance(i, False, int(token))
            self._provisional += 1
            if self._m.is_terminated():
                return Advance(i + 1, True)
        return Advance(len(tokens), False)

    def keep(self, n: int) -> None:
        """Keep only the first ``n`` provisional tokens (the session stopped earlier, e.g. on a stop
        string)."""
        extra = self._provisional - n
        if extra > 0:
            self._m.rollback(extra)
            self._provisional = n

    def commit(self) -> None:
        self.committed += self._provisional
        self._provisional = 0


__all__ = ["Advance", "ConstraintMatcher"]
