"""Grammar masks inside speculative verification: one allowed-token mask per verified position.

A constrained row (its ``RowSampling.mask`` a :class:`~ninfer.contracts.program.DraftMaskProvider`) that
verifies drafts ``d_1..d_n`` must be sampled at verify position ``i`` (0..n) exactly as plain decoding samples
the token after its committed output and ``d_1..d_i``: with the constraint's mask after that prefix.
:class:`VerifyMasks` holds those ``n + 1`` masks of one row, filled as its drafts become known;
:class:`MaskedDrafting` masks a greedy drafter's steps with the same masks, so the drafts follow the
constraint too (a draft the constraint bans could never be accepted) and no mask is computed twice.

Invariants of :class:`VerifyMasks`:

- ``words[i]`` for ``i <= valid`` is the provider's mask after ``d_1..d_i`` (``words[0]``: after the committed
  output, what plain decoding uses); ``valid`` counts the leading drafts the constraint accepts without
  ending. Rows past ``valid`` allow every token.
- The acceptance verifies only the first ``valid`` drafts of the row, so no mask past ``valid`` decides a
  committed token: a draft the constraint rejects could not pass anyway (the previous position's mask bans
  it), and a stop token that ends the constraint can only be committed as the token drawn at its position,
  which ends the row's tokens there.
- The provider is only asked (``fill_bitmask``, ``fill_bitmask_after``), never advanced: it stays at the
  committed output, and the engine advances it over the committed tokens alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.contracts.program import DraftMaskProvider, ProgramError, RowSampling, TokenMaskProvider
from ninfer.program.sampling import mask_rows
from ninfer.program.token_bitmask import words_per_row


def may_verify(sampling: RowSampling) -> bool:
    """Whether a row sampled with ``sampling`` can verify drafts: unconstrained, or its mask provider can look
    past drafted tokens."""
    return sampling.mask is None or isinstance(sampling.mask, DraftMaskProvider)


class VerifyMasks:
    """The masks of one constrained verify row of at most ``drafts`` drafts (module docstring)."""

    def __init__(self, provider: TokenMaskProvider, drafts: int, vocab_size: int) -> None:
        if not isinstance(provider, DraftMaskProvider):
            raise ProgramError(f"a constrained row can verify drafts only with a DraftMaskProvider mask, got "
                               f"{type(provider).__name__}")
        self.provider = provider
        self.drafts: list[int] = []
        self.words = torch.full((drafts + 1, words_per_row(vocab_size)), -1, dtype=torch.int32)
        self.words[0].zero_()   # a provider that writes nothing bans everything (token_bitmask)
        provider.fill_bitmask(self.words[0])
        self.valid = 0

    def push(self, token: int) -> None:
        """Record the next draft and fill the mask after it (while the constraint still accepts the drafts)."""
        if len(self.drafts) + 1 >= self.words.shape[0]:
            raise ProgramError(f"a verify row of {self.words.shape[0] - 1} drafts got another one")
        self.drafts.append(int(token))
        i = len(self.drafts)
        if self.valid == i - 1:
            row = self.words[i]
            row.zero_()
            if self.provider.fill_bitmask_after(self.drafts, row):
                self.valid = i
            else:
                row.fill_(-1)


class MaskedDrafting:
    """Masks the constrained rows of one greedy draft call: ``rows`` pairs a row's index in the call with its
    :class:`VerifyMasks` (empty ``drafts`` yet). Called before each draft step with the drafts so far
    (int64 ``[R, i]``, on the device) and that step's logits ``[R, V]``, it records the constrained rows'
    newest drafts (one device-to-host copy of their tokens) and returns the logits with mask ``i`` applied to
    their rows; :meth:`finish` records the last drafts, after which every row holds its ``n + 1`` masks."""

    def __init__(self, rows: Sequence[tuple[int, VerifyMasks]]) -> None:
        self.index = [r for r, _ in rows]
        self.masks = [m for _, m in rows]

    def _record(self, drafted: torch.Tensor) -> None:
        i = drafted.shape[1]
        if not i:
            return
        idx = torch.tensor(self.index, dtype=torch.int64, device=drafted.device)
        for m, row in zip(self.masks, drafted.index_select(0, idx).tolist(), strict=True):
            if len(m.drafts) != i - 1:
                raise ProgramError(f"masked drafting out of step: {len(m.drafts)} drafts recorded, {i} made")
            m.push(row[-1])

    def __call__(self, drafted: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        self._record(drafted)
        i = drafted.shape[1]
        return mask_rows(logits, self.index, torch.stack([m.words[i] for m in self.masks]))

    def finish(self, drafted: torch.Tensor) -> None:
        self._record(drafted)


__all__ = ["MaskedDrafting", "VerifyMasks", "may_verify"]
