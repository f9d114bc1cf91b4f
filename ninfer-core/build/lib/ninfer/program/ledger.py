"""One sequence's record in the Program: its token ledger, how much of it is computed, its slot, its flags.

Ledger rules (see the Program contract, :mod:`ninfer.contracts.program`): ``ledger`` holds the
prompt, then every accepted output token; ``computed`` counts the ledger tokens whose effect is in
the sequence's StateImage slot and KV pages, so ``0 <= computed <= len(ledger)``. A record is

- *pending* while an unconsumed PendingBatch holds its provisional tokens (``pending`` is that
  batch's id): nothing but commit or abort_pending may touch it;
- *stale* when its state covers the whole ledger (no next input exists): only pause (Replay
  rebuilds it) and release remain;
- *damaged* when a forward failed midway: its state and KV are garbage (it is stale too) and it can
  never be checkpointed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ninfer.contracts.program import ProgramError, SeqId


@dataclass
class SequenceRecord:
    ledger: list[int]
    prompt_length: int
    slot: int                    # its StateImage slot
    computed: int = 0
    pending: int | None = None   # id of the unconsumed PendingBatch holding this row's provisional tokens
    stale: bool = False          # state covers the whole ledger; no next input exists
    damaged: bool = False        # a forward failed midway: state and KV are garbage until rebuilt

    def check_ready(self, seq: SeqId, role: str) -> None:
        """Raise unless the record may take part in a unit (or scoring) as ``role``."""
        if self.pending is not None:
            raise ProgramError(f"{role} sequence {seq} has unconsumed pending batch {self.pending}")
        if self.stale:
            raise ProgramError(f"{role} sequence {seq} has no next input (its provisional token was "
                               f"dropped): pause it for Replay or release it")

    def check_not_pending(self, seq: SeqId, what: str) -> None:
        if self.pending is not None:
            raise ProgramError(f"sequence {seq} cannot be {what} while pending batch {self.pending} is unconsumed")


def check_ledger(tokens: Sequence[int], prompt_length: int | None, *, vocab_size: int, max_context: int
                 ) -> tuple[list[int], int]:
    """A new ledger and its prompt length (default: all of it): at least one token, every id in the
    vocabulary, no more than ``max_context`` tokens, ``1 <= prompt_length <= len(ledger)``."""
    ledger = [int(t) for t in tokens]
    if not ledger:
        raise ProgramError("a sequence needs at least one token")
    bad = [t for t in ledger if not 0 <= t < vocab_size]
    if bad:
        raise ProgramError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(ledger) > max_context:
        raise ProgramError(f"{len(ledger)} tokens exceed the context limit {max_context}")
    plen = len(ledger) if prompt_length is None else int(prompt_length)
    if not 1 <= plen <= len(ledger):
        raise ProgramError(f"prompt_length {prompt_length} is outside [1, {len(ledger)}]")
    return ledger, plen


def refuse_media(media: Sequence[object]) -> None:
    """The bookkeeping's answer to a prompt with media: a ProgramError (an architecture with an encoder takes
    them itself, before it opens the sequence without them)."""
    if media:
        raise ProgramError(f"this Program takes no media (got {len(media)}): its model has no encoder for images "
                           f"or videos, or it was started without it")
