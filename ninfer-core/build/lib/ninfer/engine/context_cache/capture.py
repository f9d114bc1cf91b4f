"""CheckpointCapture: when a request's state is published to the ContextCache (docs/context-cache.md).

A request that takes part in the context cache is checkpointed
- during its fresh prefill (not a resume) at every multiple of the checkpoint interval and at each of
  its prompt's cache points (``message_boundary``): the Scheduler cuts its chunks there
  (:meth:`CheckpointCapture.chunk_tokens`) and the worker publishes right after the unit ran
  (:meth:`CheckpointCapture.after_chunk`), before the commit, so a request that finishes on that
  unit is still checkpointed and the provisional token is not part of the state;
- at the prompt's end (``prompt_end``), the same way;
- when it finishes with stop or length (``response_end``): prompt plus output except the last sampled
  token, which was never run (:meth:`CheckpointCapture.at_finish`).

With no context cache every method is a no-op (chunks are not cut).
"""

from __future__ import annotations

from ninfer.contracts.program import Program
from ninfer.engine.context_cache.cache import ContextCache, EntryKind
from ninfer.engine.requests import RequestRecord, RequestState


class CheckpointCapture:
    def __init__(self, program: Program, cache: ContextCache | None, interval: int) -> None:
        self.program = program
        self.cache = cache
        self.interval = interval

    def at_boundaries(self, rec: RequestRecord) -> bool:
        """Whether ``rec``'s chunks stop at capture points (a fresh prefill that takes part)."""
        return self.cache is not None and rec.cache and rec.state is RequestState.PREFILL and not rec.protected

    def chunk_tokens(self, rec: RequestRecord, computed: int, tokens: int) -> int:
        """``tokens`` (a chunk starting at ``computed``) cut to end at the next capture point: an
        interval boundary or one of the prompt's cache points, whichever comes first."""
        if not self.at_boundaries(rec):
            return tokens
        nxt = (computed // self.interval + 1) * self.interval
        return min(tokens, min([nxt] + [p for p in rec.cache_points if p > computed]) - computed)

    def after_chunk(self, rec: RequestRecord) -> None:
        """``rec``'s chunk ran: checkpoint it when the chunk ended at a capture point."""
        if not self.at_boundaries(rec):
            return
        assert rec.seq is not None
        c = self.program.computed(rec.seq)
        if c == len(rec.prompt):
            self._publish(rec, "prompt_end")
        elif c in rec.cache_points:
            self._publish(rec, "message_boundary")
        elif c % self.interval == 0:
            self._publish(rec, "prefill_boundary")

    def at_finish(self, rec: RequestRecord, reason: str) -> None:
        """``rec`` is finishing with ``reason``: publish its response end (stop or length, with output
        computed past the prompt) before its sequence is released."""
        if (self.cache is not None and rec.cache and rec.seq is not None and reason in ("stop", "length")
                and self.program.computed(rec.seq) > len(rec.prompt)):
            self._publish(rec, "response_end")

    def _publish(self, rec: RequestRecord, kind: EntryKind) -> None:
        """Checkpoint ``rec``'s sequence at the Program's frontier; the ContextCache checks that it
        covers exactly the request's ledger up to there."""
        assert self.cache is not None and rec.seq is not None
        computed = self.program.computed(rec.seq)
        ledger = rec.prompt + tuple(rec.output_tokens)
        session = rec.session_key if kind in ("prompt_end", "response_end") else None
        self.cache.publish(rec.seq, ledger[:computed], kind, order=rec.ticket, session=session, media=rec.media)
