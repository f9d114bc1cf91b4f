"""Admission: whether a request fits now, where its sequence opens from, and making it resident.

The Scheduler decides who is tried and in what order; this module answers for one request and does
the work (docs/design.md sections 5 and 6). The ContextCache decides what it retains, the Program
what physically fits; nothing here keeps a ledger of its own.

- Fits. A soft check: a free state slot, and pages for the tokens beyond one page of headroom per
  resident (each may cross a page boundary on its next step). Reservation stays with
  ``Program.reserve_units``; this only avoids admitting work that would be preempted at once.
  Context-cache entries are reclaimed (least recently used first) before a request is refused.
- Placement. A request that takes part in the context cache opens from the longest checkpoint
  that is an exact proper prefix of its tokens (restored to Device first when it has Host content;
  other cache content is reclaimed, never that entry, until the pages still needed fit). A
  checkpoint that cannot be made to fit is passed over for the next longest, each at most once,
  down to the root.
- Fresh admission opens the sequence over the prompt, bound to its checkpoint if any (the Program
  then starts at ``computed == covered``).
- Resume rebuilds a paused request to its old frontier: from its Snapshot when it still has one and
  that fits (nothing is recomputed), else by Replay of its ledger (itself placed like a prompt, so
  it replays only what its checkpoint does not cover). It reserves the whole rebuild plus the
  first new token at once (a protected resume, held across chunks: ``reserve_units`` only ever
  extends a sequence's pages).
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer.contracts.errors import EngineFailure
from ninfer.contracts.program import Program, ReplayState, SnapshotState
from ninfer.engine.context_cache.cache import CacheEntry, ContextCache
from ninfer.engine.queues import RequestQueues
from ninfer.engine.requests import RequestRecord, RequestState
from ninfer.engine.sequences import SequenceTable
from ninfer.engine.stats import EngineCounters


@dataclass(frozen=True)
class Placement:
    """Where a request that fits now opens its sequence: from ``source`` (a cache entry on Device
    whose tokens are an exact prefix of the request's), or from the root when None."""

    source: CacheEntry | None = None


class Admission:
    def __init__(self, program: Program, cache: ContextCache | None, sequences: SequenceTable,
                 queues: RequestQueues, counters: EngineCounters) -> None:
        self.program = program
        self.cache = cache
        self.sequences = sequences
        self.queues = queues
        self.counters = counters
        self.page_size = program.capacity().page_size

    # -- fits and placement ------------------------------------------------------------------------
    def fits(self, tokens: int) -> bool:
        """A free state slot, and pages for ``tokens`` beyond one page of headroom per resident."""
        cap = self.program.capacity()
        pages = -(-tokens // self.page_size)
        return cap.free_state_slots > 0 and pages <= cap.free_pages - len(self.queues.residents)

    def reclaim(self, protect: CacheEntry | None = None) -> bool:
        """One step of freeing device pages held only by the context cache (see ContextCache.reclaim);
        False when there is nothing left to reclaim (or no context cache)."""
        if self.cache is None:
            return False
        return self.cache.reclaim("pages", protect=() if protect is None else (protect.entry_id,))

    def _fits_reclaiming(self, tokens: int) -> bool:
        while not self.fits(tokens):
            if not self.reclaim():
                return False
        return True

    def _fits_from(self, source: CacheEntry, need: int) -> bool:
        """Whether a sequence needing pages for ``need`` tokens fits when opened from ``source``:
        restores it to Device and reclaims other cache content (never ``source``) as needed."""
        assert self.cache is not None
        if not self.cache.ensure_on_device(source):
            return False
        shared = source.covered // self.page_size * self.page_size
        while not self.fits(need - shared):
            if not self.reclaim(protect=source):
                return False
        return True

    def place(self, rec: RequestRecord, tokens: tuple[int, ...], need: int) -> Placement | None:
        """Where ``rec`` (to open with ``tokens``, needing pages for ``need`` tokens from the root)
        opens now; None when it does not fit."""
        if self.cache is None:
            return Placement() if self.fits(need) else None
        if not rec.cache:
            return Placement() if self._fits_reclaiming(need) else None
        self.counters.cache_lookups += 1
        passed: set[int] = set()
        while True:
            source = self.cache.lookup(tokens, session=rec.session_key, exclude=passed, media=rec.media)
            if source is None:
                return Placement() if self._fits_reclaiming(need) else None
            if self._fits_from(source, need):
                return Placement(source)
            passed.add(source.entry_id)

    def _note_bound(self, rec: RequestRecord, source: CacheEntry) -> None:
        assert self.cache is not None and rec.seq is not None
        if self.program.computed(rec.seq) != source.covered:
            raise EngineFailure(f"request {rec.request_id} opened from a checkpoint of {source.covered} "
                                f"tokens but the Program computed {self.program.computed(rec.seq)}")
        self.cache.note_bound(source)
        self.counters.cache_hits += 1
        self.counters.cache_hit_tokens += source.covered

    # -- making a request resident -------------------------------------------------------------------
    def open_fresh(self, rec: RequestRecord, placement: Placement) -> bool:
        """Open a waiting request's sequence over its prompt (WAITING -> PREFILL); False, with the
        request waiting again, when the Program has no free slot."""
        rec.move(RequestState.MATERIALIZING)
        if not self.sequences.open(rec, rec.prompt, None, placement.source):
            rec.move(RequestState.WAITING)
            return False
        if placement.source is not None:
            self._note_bound(rec, placement.source)
            rec.cached_tokens = min(placement.source.covered, len(rec.prompt))
            self.counters.cache_saved_prefill_tokens += placement.source.covered
        rec.move(RequestState.PREFILL)
        return True

    def resume(self, rec: RequestRecord) -> bool:
        """Rebuild a paused request's sequence and reserve its whole rebuild (PAUSED -> REPLAY, or
        PREFILL when it had no output yet, or DECODE_READY when a checkpoint covers the rebuild);
        the request is then protected. False, with the request still paused, when it does not fit."""
        state = rec.resume
        assert state is not None
        ledger = tuple(state.ledger)
        if ledger != rec.prompt + tuple(rec.output_tokens):
            raise EngineFailure(f"request {rec.request_id}: the resume ledger does not match its prompt and "
                                f"published output")
        need = len(ledger)  # the old frontier plus the first real new token
        snapshot = self.cache.snapshot_of(rec.ticket) if self.cache is not None else None
        if isinstance(state, SnapshotState) and (snapshot is None or snapshot.handle != state.checkpoint):
            if snapshot is not None:
                raise EngineFailure(f"request {rec.request_id}: its Snapshot is not the one it was paused with")
            rec.resume = state = state.as_replay()  # revoked under pressure: Replay the same tokens
        source: CacheEntry | None = None
        if snapshot is not None:
            assert self.cache is not None
            if self._fits_from(snapshot, need):
                source = snapshot
            elif self.queues.residents:
                return False  # residents will free capacity; keep the Snapshot meanwhile
            else:  # nothing else can free anything: the Snapshot itself is in the way
                self.cache.revoke_snapshot(rec.ticket)
                rec.resume = state = state.as_replay()
        if source is None:
            placement = self.place(rec, ledger, need)
            if placement is None:
                return False
            source = placement.source
        rec.move(RequestState.MATERIALIZING)
        if not self.sequences.open(rec, ledger, len(rec.prompt), source):
            rec.move(RequestState.PAUSED)
            return False
        assert rec.seq is not None
        from_snapshot = source is not None and source is snapshot
        if from_snapshot:
            assert self.cache is not None and snapshot is not None
            if self.program.computed(rec.seq) != snapshot.covered:
                raise EngineFailure(f"request {rec.request_id} opened from its Snapshot of {snapshot.covered} tokens "
                                    f"but the Program computed {self.program.computed(rec.seq)}")
            # The sequence now holds what it needs; the Snapshot goes (before reserving, so its
            # partial tail page is private again and needs no copy).
            self.cache.resumed_from_snapshot(rec.ticket)
        elif source is not None:  # the rebuild starts at the checkpoint (fewer Replay tokens)
            self._note_bound(rec, source)
        if not self.program.reserve_units({rec.seq: need - self.program.computed(rec.seq)})[rec.seq]:
            if from_snapshot:
                raise EngineFailure(f"request {rec.request_id} lost its Snapshot resume reservation")
            self.sequences.release(rec)
            rec.move(RequestState.PAUSED)
            return False
        if isinstance(rec.resume, ReplayState):
            self.counters.replays += 1
        rec.resume = None
        rec.protected = True
        rec.move(RequestState.REPLAY if rec.output_tokens else RequestState.PREFILL)
        if rec.state is RequestState.REPLAY and self.program.computed(rec.seq) == rec.rebuild_target():
            rec.move(RequestState.DECODE_READY)  # the checkpoint covers the whole rebuild
        return True
