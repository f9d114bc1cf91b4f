"""SequenceTable: which request holds which Program sequence, and the calls that open, pause and release one.

The worker's request records and the Program's sequences meet here. Opening a sequence (from the
root or from a context-cache checkpoint), pausing it and releasing it are the only places that set
or clear ``RequestRecord.seq``; the commit path maps a PendingBatch row back to its request here.

Invariants:
- ``rec.seq`` is not None exactly while the table maps that sequence to ``rec``.
- A Program that hands out a sequence id that is still live is an engine failure.
- Opening from a checkpoint and pausing are context operations: each runs as one transaction of the
  engine's :class:`OperationSlot` (a pause with a context cache runs through ``ContextCache.pause``,
  which may first reclaim room for the Snapshot in transactions of its own).
"""

from __future__ import annotations

from ninfer.contracts.errors import EngineFailure
from ninfer.contracts.program import OutOfSlotsError, Program, ResumeState, SeqId
from ninfer.engine.context_cache.cache import CacheEntry, ContextCache
from ninfer.engine.context_cache.operation_slot import OperationSlot
from ninfer.engine.requests import RequestRecord


class SequenceTable:
    def __init__(self, program: Program, cache: ContextCache | None, ops: OperationSlot) -> None:
        self.program = program
        self.cache = cache
        self.ops = ops
        self._by_seq: dict[SeqId, RequestRecord] = {}

    def __getitem__(self, seq: SeqId) -> RequestRecord:
        """The request holding ``seq`` (a KeyError for a sequence no request holds)."""
        return self._by_seq[seq]

    def open(self, rec: RequestRecord, tokens: tuple[int, ...], prompt_length: int | None,
             source: CacheEntry | None = None) -> bool:
        """Open ``rec``'s sequence over ``tokens`` with ``rec.media`` (from ``source`` when given: the Program then
        starts at ``computed == source.covered``). False when the Program has no free slot."""
        # The request's media go with every open (fresh, Replay, Snapshot or checkpoint), passed only when there
        # are any (a text-only Program need not take the keyword).
        media = {"media": rec.media} if rec.media else {}
        try:
            if source is not None:
                with self.ops.transaction("bind", f"request {rec.request_id} from checkpoint {source.entry_id}"):
                    seq = self.program.open_sequence_from(source.handle, tokens, prompt_length, **media)
            elif prompt_length is None:
                seq = self.program.open_sequence(tokens, **media)
            else:
                seq = self.program.open_sequence(tokens, prompt_length=prompt_length, **media)
        except OutOfSlotsError:
            return False
        if seq in self._by_seq:
            raise EngineFailure(f"Program reused live sequence id {seq}")
        rec.seq = seq
        self._by_seq[seq] = rec
        return True

    def pause(self, rec: RequestRecord) -> ResumeState:
        """Pause ``rec``'s sequence and give it up; returns how ``rec`` resumes: a Snapshot when the
        context cache can keep one (covering exactly the tokens the sequence computed), else the
        Program's pause state."""
        seq = rec.seq
        assert seq is not None
        if self.cache is not None:
            computed = (rec.prompt + tuple(rec.output_tokens))[: self.program.computed(seq)]
            state = self.cache.pause(seq, rec.ticket, computed)
        else:
            with self.ops.transaction("pause", f"request {rec.request_id}"):
                state = self.program.pause(seq)
        del self._by_seq[seq]
        rec.seq = None
        return state

    def release(self, rec: RequestRecord) -> None:
        """Free ``rec``'s sequence, if it holds one."""
        if rec.seq is not None:
            seq, rec.seq = rec.seq, None
            del self._by_seq[seq]
            self.program.release(seq)

    def clear(self) -> None:
        """Forget every mapping without calling the Program (an engine failure: it is never called again)."""
        self._by_seq.clear()
