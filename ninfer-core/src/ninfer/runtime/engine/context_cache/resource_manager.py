"""ResourceManager: which checkpoints the context cache keeps, and which one a new request binds.

The ResourceManager is logical only (DESIGN.md section 4): it indexes the checkpoints it asked the
Program to capture, orders them for retention and picks a source for a new sequence. Every physical
fact (slots, pages, bytes, references) is asked from the Program; this module keeps no second
ledger of occupancy. Only the engine worker calls it.

Entries. Each entry is one Program checkpoint, of one kind:
- ``prefill_boundary``: taken during a prompt's prefill at a multiple of the checkpoint interval (so a
  later prompt that shares the history up to a re-rendered point still finds a recent exact state);
- ``prompt_end``: the state after the whole prompt;
- ``response_end``: the state when the request finished: prompt + output except the last sampled
  token (which was never run).
Each carries the ``publication_order`` of the request that published it (its ticket, monotone) and
the optional session key it was published under. A session hint maps a key to the newest
publication; an older request finishing later cannot overwrite a newer binding.

Retention: least recently used (publication or adoption) is reclaimed first, both when the
checkpoint slots run out at capture time and when the engine needs KV pages for requests (the cache
is reclaimed before any request is preempted).

Invariants:
- An entry exists exactly while its Program checkpoint is live; ``clear`` drops them all.
- A published checkpoint covers exactly the tokens the engine expected (the request's ledger up to
  the Program's ``computed``); a disagreement is an engine failure, never a silent miss.
- ``lookup`` only returns entries whose tokens are an exact prefix of the prompt, shorter than it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ninfer.runtime.contract.errors import EngineFailure
from ninfer.runtime.contract.program import CheckpointHandle, CheckpointProgram, SeqId
from ninfer.runtime.engine.context_cache.prefix_index import PrefixIndex

EntryKind = Literal["prefill_boundary", "prompt_end", "response_end"]


@dataclass(frozen=True)
class CacheEntry:
    handle: CheckpointHandle
    kind: EntryKind
    publication_order: int
    session: str | None = None

    @property
    def covered(self) -> int:
        return self.handle.covered


@dataclass(frozen=True)
class CacheCounters:
    lookups: int
    hits: int
    hit_tokens: int
    captures: int
    evictions: int


class ResourceManager:
    def __init__(self, program: CheckpointProgram, *, block_size: int) -> None:
        self.program = program
        self.index = PrefixIndex(block_size)
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()  # LRU order: oldest first
        self._sessions: dict[str, tuple[int, int]] = {}               # key -> (publication_order, entry)
        self._lookups = self._hits = self._hit_tokens = self._captures = self._evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def counters(self) -> CacheCounters:
        return CacheCounters(self._lookups, self._hits, self._hit_tokens, self._captures, self._evictions)

    def entries(self) -> tuple[CacheEntry, ...]:
        return tuple(self._entries.values())

    # -- binding -----------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], *, session: str | None = None) -> CacheEntry | None:
        """The longest entry whose tokens are an exact proper prefix of ``tokens`` (the last token
        must still run to sample). Among equally long candidates the session's binding wins. The
        entry becomes most recently used. Counting a hit is left to :meth:`note_bound`."""
        self._lookups += 1
        found = self.index.prefixes_of(tokens, len(tokens) - 1)
        if not found:
            return None
        best_len = found[0][0]
        ids = [eid for n, eid in found if n == best_len]
        bound = self._sessions.get(session)[1] if session in self._sessions else None
        eid = bound if bound in ids else ids[0]
        self._entries.move_to_end(eid)
        return self._entries[eid]

    def note_bound(self, entry: CacheEntry) -> None:
        """A sequence was opened from ``entry``."""
        self._hits += 1
        self._hit_tokens += entry.covered

    def session_entry(self, session: str) -> CacheEntry | None:
        got = self._sessions.get(session)
        return None if got is None else self._entries.get(got[1])

    # -- publication -------------------------------------------------------------------------------
    def publish(self, seq: SeqId, expected: Sequence[int], kind: EntryKind, *, order: int,
                session: str | None = None) -> CacheEntry | None:
        """Checkpoint ``seq``, which must cover exactly ``expected`` (the engine's view of its ledger
        up to ``computed``). An entry with the same tokens is refreshed instead. Reclaims the least
        recently used entries when no checkpoint slot is free; None when nothing could be kept."""
        expected = tuple(expected)
        same = self.index.find(expected)
        if same is not None:
            self._entries.move_to_end(same)
            entry = self._entries[same]
        else:
            handle = self.program.capture_checkpoint(seq)
            while handle is None and self.reclaim():
                handle = self.program.capture_checkpoint(seq)
            if handle is None:
                return None
            if handle.tokens != expected or handle.covered != len(expected):
                self.program.drop_checkpoint(handle)
                raise EngineFailure(f"checkpoint of sequence {seq} covers {handle.covered} tokens, but the engine "
                                    f"expected {len(expected)} tokens of its ledger")
            entry = CacheEntry(handle, kind, order, session)
            self._entries[handle.checkpoint_id] = entry
            self.index.insert(handle.checkpoint_id, handle.tokens)
            self._captures += 1
        if session is not None:
            old = self._sessions.get(session)
            if old is None or old[0] <= order:
                self._sessions[session] = (order, entry.handle.checkpoint_id)
        return entry

    # -- reclaim -----------------------------------------------------------------------------------
    def reclaim(self) -> bool:
        """Drop the least recently used entry; False when the cache is empty."""
        if not self._entries:
            return False
        eid = next(iter(self._entries))
        self._drop(eid)
        self._evictions += 1
        return True

    def clear(self) -> None:
        for eid in list(self._entries):
            self._drop(eid)

    def _drop(self, eid: int) -> None:
        entry = self._entries.pop(eid)
        if eid in self.index:
            self.index.remove(eid)
        for key, (_, bound) in list(self._sessions.items()):
            if bound == eid:
                del self._sessions[key]
        self.program.drop_checkpoint(entry.handle)
