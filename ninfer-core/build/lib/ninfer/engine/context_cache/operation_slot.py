"""OperationSlot: the one gate every context resource transaction goes through (docs/design.md section 6).

Bind (restore a Host checkpoint, open a sequence from a checkpoint), Capture, Demote, Pause and Drop
change physical context resources (StateImage slots, KV page references, Host copies). Each runs as
one transaction: the caller has chosen the operation and its source; inside the slot the Program
takes the destination, copies and publishes the complete result, and the Engine/ContextCache
adopt it after the slot is free again.

Invariants:
- At most one transaction is open at a time; opening a second one while one is open (re-entry, a
  nested reclaim) is an engine failure, never a silent interleaving.
- Copies are synchronous (CPU; CUDA copies to and from pinned Host memory complete before the
  Program call returns), so a transaction is complete when its ``with`` block ends; mappings a GPU
  unit uses therefore never change under it (units run outside any transaction).
- A transaction that raises leaves the slot free and is not counted as completed: the exception
  (a broken checkpoint, a Program contract error) fails the engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from ninfer.contracts.errors import EngineFailure

OperationKind = Literal["bind", "capture", "demote", "pause", "drop"]
KINDS: tuple[OperationKind, ...] = ("bind", "capture", "demote", "pause", "drop")


class OperationSlot:
    def __init__(self) -> None:
        self._current: tuple[OperationKind, str] | None = None
        self.completed: Counter[str] = Counter()

    @property
    def busy(self) -> bool:
        return self._current is not None

    @contextmanager
    def transaction(self, kind: OperationKind, subject: str) -> Iterator[None]:
        """Run one ``kind`` transaction on ``subject`` (for messages), alone."""
        if kind not in KINDS:
            raise EngineFailure(f"unknown context operation {kind!r}")
        if self._current is not None:
            raise EngineFailure(f"context operation {kind} on {subject} started while {self._current[0]} on "
                                f"{self._current[1]} is still in flight")
        self._current = (kind, subject)
        try:
            yield
        finally:
            self._current = None
        self.completed[kind] += 1
