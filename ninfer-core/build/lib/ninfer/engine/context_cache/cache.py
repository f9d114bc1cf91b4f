"""ContextCache: which checkpoints the context cache keeps, where, and which one a request binds.

The ContextCache is logical only (docs/design.md section 4): it indexes the checkpoints it asked the
Program to capture, orders them for retention, decides what to demote, restore, evict or revoke,
and picks a source for a new sequence. Every physical fact (slots, pages, Host bytes, references,
where a checkpoint lives) is asked from the Program (``checkpoint_footprint``/``checkpoint_usage``);
this module keeps no second ledger of occupancy. Only the engine worker calls it, and every physical
action goes through the engine's :class:`OperationSlot`.

Entries. Shared entries are in the exact prefix index, each one Program checkpoint of one kind:
- ``prefill_boundary``: taken during a prompt's prefill at a multiple of the checkpoint interval (so a
  later prompt that shares the history up to a re-rendered point still finds a recent exact state);
- ``message_boundary``: taken during prefill at one of the prompt's cache points (the Frontend's
  stable message boundaries, ``PreparedPrompt.cache_points``);
- ``prompt_end``: the state after the whole prompt;
- ``response_end``: the state when the request finished: prompt + output except the last sampled
  token (which was never run).
Private continuation owners: a paused request (by ticket) may own one ``pause_snapshot`` entry, its
resume point; it is not indexed (only its owner resumes from it, whatever its cache opt-out) and is
dropped when the owner resumes from it or settles.

Each entry carries the ``publication_order`` of the request that published it (its ticket,
monotone) and the optional session key. A session hint maps a key to the newest publication; an
older request finishing later cannot overwrite a newer binding. The bound entry is retained with
priority and wins lookups among equally long candidates.

Tiers and pressure. A checkpoint is on Device (image in a checkpoint slot, all KV pages on the
device) or partly on Host (image and the pages only it held copied to the Host tier). Retention
order, first reclaimed first: ordinary shared entries (least recently used), then session-bound
shared entries (LRU), then pause snapshots (youngest ticket first). Under Device pressure an entry
is *demoted* to Host when the Host budget can take it (making room by evicting Host content that is
reclaimed earlier in that order; a snapshot may also revoke younger snapshots), else dropped. A
hit on an entry with Host content *restores* it to Device (Bind) before the sequence opens from it.

Invariants:
- An entry exists exactly while its Program checkpoint is live; ``clear`` drops them all.
- A published checkpoint covers exactly the tokens the engine expected (the request's ledger up to
  the Program's ``computed``); a disagreement is an engine failure, never a silent miss.
- ``lookup`` only returns shared entries whose tokens are an exact prefix of the prompt, shorter
  than it, with the same media (by digest) over every image or video placeholder they cover.
- Each reclaim step frees Device resources held only by the cache (a checkpoint slot, or device
  pages no live sequence holds) or returns False; so a loop of reclaims always ends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from ninfer.contracts.errors import EngineFailure
from ninfer.contracts.media import MediaInput
from ninfer.contracts.program import (
    CheckpointHandle,
    CheckpointProgram,
    ResumeState,
    SeqId,
    SnapshotState,
)
from ninfer.engine.context_cache.operation_slot import OperationSlot
from ninfer.engine.context_cache.prefix_index import PrefixIndex, prefix_keys

EntryKind = Literal["prefill_boundary", "message_boundary", "prompt_end", "response_end", "pause_snapshot"]
Pressure = Literal["pages", "slot"]


@dataclass(frozen=True)
class CacheEntry:
    handle: CheckpointHandle
    kind: EntryKind
    publication_order: int
    session: str | None = None

    @property
    def covered(self) -> int:
        return self.handle.covered

    @property
    def entry_id(self) -> int:
        return self.handle.checkpoint_id


@dataclass(frozen=True)
class CacheCounters:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    captures: int = 0
    evictions: int = 0          # shared entries dropped under pressure (Device or Host)
    host_evictions: int = 0     # of which dropped from Host to make room under the Host budget
    demotions: int = 0          # checkpoints (shared or snapshots) moved Device -> Host
    restores: int = 0           # checkpoints moved Host -> Device for a bind
    snapshot_pauses: int = 0    # pauses that kept a Snapshot
    snapshot_resumes: int = 0   # resumes that opened from their Snapshot
    snapshot_revocations: int = 0  # Snapshots dropped before their owner resumed (it replays)


class ContextCache:
    def __init__(self, program: CheckpointProgram, *, block_size: int, slot: OperationSlot | None = None) -> None:
        self.program = program
        self.slot = slot if slot is not None else OperationSlot()
        self.index = PrefixIndex(block_size)
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()  # shared, LRU order: oldest first
        self._snapshots: dict[int, CacheEntry] = {}                  # owner ticket -> its pause snapshot
        self._sessions: dict[str, tuple[int, int]] = {}               # key -> (publication_order, entry)
        self._n = dict.fromkeys(CacheCounters.__dataclass_fields__, 0)
        # Fixed for the ContextCache's life: the Program's Host tier is configured before it is made.
        self._host_tier = program.checkpoint_usage().host_budget_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def counters(self) -> CacheCounters:
        return CacheCounters(**self._n)

    def entries(self) -> tuple[CacheEntry, ...]:
        return tuple(self._entries.values())

    def snapshots(self) -> dict[int, CacheEntry]:
        return dict(self._snapshots)

    @property
    def host_tier(self) -> bool:
        return self._host_tier

    # -- binding -----------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], *, session: str | None = None, exclude: Collection[int] = (),
               media: Sequence[MediaInput] = ()) -> CacheEntry | None:
        """The longest shared entry whose tokens are an exact proper prefix of ``tokens`` (the last
        token must still run to sample), skipping ``exclude`` (entry ids); ``media`` (the prompt's images and
        videos) must be the same media as the entry's over every placeholder it covers (their digests).
        Among equally long candidates the session's binding wins. The entry becomes most recently used. Counting a
        hit is left to :meth:`note_bound`; the entry may have Host content (see :meth:`ensure_on_device`)."""
        self._n["lookups"] += 1
        keys = prefix_keys(tokens, media)
        found = [(n, eid) for n, eid in self.index.prefixes_of(keys, len(keys) - 1) if eid not in exclude]
        if not found:
            return None
        best_len = found[0][0]
        ids = [eid for n, eid in found if n == best_len]
        bound = self._sessions.get(session)[1] if session in self._sessions else None
        eid = bound if bound in ids else ids[0]
        self._entries.move_to_end(eid)
        return self._entries[eid]

    def note_bound(self, entry: CacheEntry) -> None:
        """A sequence was opened from shared ``entry``."""
        self._n["hits"] += 1
        self._n["hit_tokens"] += entry.covered

    def session_entry(self, session: str) -> CacheEntry | None:
        got = self._sessions.get(session)
        return None if got is None else self._entries.get(got[1])

    def ensure_on_device(self, entry: CacheEntry) -> bool:
        """Restore ``entry``'s Host content to Device (a Bind step), reclaiming other cache content
        for the slot and pages it needs. False when it cannot be made to fit (it stays as it was)."""
        program = self.program
        while True:
            fp = program.checkpoint_footprint(entry.handle)
            if fp.on_device:
                return True
            with self.slot.transaction("bind", f"restore of checkpoint {entry.entry_id}"):
                restored = program.restore_checkpoint(entry.handle)
            if restored:
                self._n["restores"] += 1
                return True
            need_slot = not fp.device_slot and program.checkpoint_usage().free_slots == 0
            if not self.reclaim("slot" if need_slot else "pages", protect=(entry.entry_id,)):
                return False

    # -- publication -------------------------------------------------------------------------------
    def publish(self, seq: SeqId, expected: Sequence[int], kind: EntryKind, *, order: int,
                session: str | None = None, media: Sequence[MediaInput] = ()) -> CacheEntry | None:
        """Checkpoint ``seq``, which must cover exactly ``expected`` (the engine's view of its ledger
        up to ``computed``), indexed with ``media`` (its prompt's images and videos, :func:`prefix_keys`). An
        entry with the same tokens and media is refreshed instead. Reclaims (demotes or drops) other entries when
        no checkpoint slot is free; None when nothing could be kept."""
        expected = tuple(expected)
        keys = prefix_keys(expected, media)
        same = self.index.find(keys)
        if same is not None:
            self._entries.move_to_end(same)
            entry = self._entries[same]
        else:
            while True:
                with self.slot.transaction("capture", f"sequence {seq}"):
                    handle = self.program.capture_checkpoint(seq)
                if handle is not None or not self.reclaim("slot"):
                    break
            if handle is None:
                return None
            self._check_covers(handle, expected, f"checkpoint of sequence {seq}")
            entry = CacheEntry(handle, kind, order, session)
            self._entries[handle.checkpoint_id] = entry
            self.index.insert(handle.checkpoint_id, keys)
            self._n["captures"] += 1
        if session is not None:
            old = self._sessions.get(session)
            if old is None or old[0] <= order:
                self._sessions[session] = (order, entry.entry_id)
        return entry

    def _check_covers(self, handle: CheckpointHandle, expected: tuple[int, ...], what: str) -> None:
        if handle.tokens != expected or handle.covered != len(expected):
            with self.slot.transaction("drop", f"checkpoint {handle.checkpoint_id}"):
                self.program.drop_checkpoint(handle)
            raise EngineFailure(f"{what} covers {handle.covered} tokens, but the engine expected "
                                f"{len(expected)} tokens of its ledger")

    # -- pause snapshots (private resume points) ---------------------------------------------------
    def pause(self, seq: SeqId, owner: int, computed: Sequence[int]) -> ResumeState:
        """Pause ``seq`` for request ``owner``: a Snapshot (kept on Host) when the Host tier, a
        checkpoint slot and the Host budget allow it, else Replay. ``computed`` is the engine's view
        of the sequence's computed tokens; the snapshot must cover exactly them."""
        program = self.program
        snapshot = self.host_tier and len(computed) > 0
        if snapshot:
            # Make room first (separate transactions): a slot for the capture, Host bytes for the demotion.
            while program.checkpoint_usage().free_slots == 0 and self.reclaim("slot", owner=owner):
                pass
            snapshot = (program.checkpoint_usage().free_slots > 0
                        and self._make_host_room(program.snapshot_host_bytes(seq), protect=(), owner=owner))
        with self.slot.transaction("pause", f"sequence {seq}"):
            state = program.pause(seq, snapshot=snapshot)
        if isinstance(state, SnapshotState):
            self._check_covers(state.checkpoint, tuple(computed), f"snapshot of sequence {seq}")
            self._snapshots[owner] = CacheEntry(state.checkpoint, "pause_snapshot", owner)
            self._n["snapshot_pauses"] += 1
            self._n["demotions"] += 1
        return state

    def snapshot_of(self, owner: int) -> CacheEntry | None:
        return self._snapshots.get(owner)

    def resumed_from_snapshot(self, owner: int) -> None:
        """``owner`` opened its sequence from its snapshot: the snapshot is dropped (the sequence
        holds the pages it needs)."""
        entry = self._snapshots.pop(owner)
        self._drop_handle(entry)
        self._n["snapshot_resumes"] += 1

    def revoke_snapshot(self, owner: int) -> None:
        """Drop ``owner``'s snapshot before it resumed from it (it will replay)."""
        entry = self._snapshots.pop(owner, None)
        if entry is not None:
            self._drop_handle(entry)
            self._n["snapshot_revocations"] += 1

    def forget_owner(self, owner: int) -> None:
        """``owner`` settled: drop its snapshot if it still has one (no revocation: it never resumes)."""
        entry = self._snapshots.pop(owner, None)
        if entry is not None:
            self._drop_handle(entry)

    # -- reclaim -----------------------------------------------------------------------------------
    def _ordered_shared(self) -> list[CacheEntry]:
        """Shared entries, first reclaimed first: unbound LRU, then session-bound LRU."""
        bound = {eid for _, eid in self._sessions.values()}
        entries = list(self._entries.values())
        return [e for e in entries if e.entry_id not in bound] + [e for e in entries if e.entry_id in bound]

    def _ordered_snapshots(self, owner: int | None) -> list[CacheEntry]:
        """Snapshots that may be reclaimed, youngest owner first; for a snapshot of ``owner`` only
        younger owners' ones."""
        return [self._snapshots[t] for t in sorted(self._snapshots, reverse=True) if owner is None or t > owner]

    def reclaim(self, pressure: Pressure = "pages", *, protect: Collection[int] = (), owner: int | None = None) -> bool:
        """One step of freeing Device resources held only by the cache: a checkpoint slot
        (``slot``) or device pages no live sequence holds (``pages``). Shared entries first (demoted
        to Host when it can take them, else evicted), then pause snapshots (demoted, else revoked);
        ``owner`` (a request pausing) limits the snapshots touched to younger owners'. Entries in
        ``protect`` are left alone. False when nothing is left to reclaim."""
        fp = self.program.checkpoint_footprint
        shared = [e for e in self._ordered_shared() if e.entry_id not in protect]
        snaps = [e for e in self._ordered_snapshots(owner) if e.entry_id not in protect]
        if pressure == "slot":
            for e in shared + snaps:
                if fp(e.handle).device_slot:
                    self._demote_or_drop(e)
                    return True
            return False
        for group in (shared, snaps):
            for e in group:  # demoting frees its private pages (and its slot)
                if fp(e.handle).private_pages > 0:
                    self._demote_or_drop(e)
                    return True
            for e in group:  # pages shared only among checkpoints: dropping one makes them private to another
                if fp(e.handle).cache_only_pages > 0:
                    self._drop(e, "pressure")
                    return True
        return False

    def _demote_or_drop(self, entry: CacheEntry) -> None:
        snapshot = entry.kind == "pause_snapshot"
        need = self.program.checkpoint_footprint(entry.handle).demote_bytes
        if self.host_tier and self._make_host_room(need, protect=(entry.entry_id,),
                                                   owner=entry.publication_order if snapshot else None,
                                                   before=None if snapshot else entry):
            with self.slot.transaction("demote", f"checkpoint {entry.entry_id}"):
                demoted = self.program.demote_checkpoint(entry.handle)
            if demoted:
                self._n["demotions"] += 1
                return
        self._drop(entry, "pressure")

    def _make_host_room(self, need: int, *, protect: Collection[int], owner: int | None = None,
                        before: CacheEntry | None = None) -> bool:
        """Drop Host content until ``need`` bytes are free in the Host budget: shared entries with
        Host content that are reclaimed before ``before`` (all of them when None), then, for a
        snapshot of ``owner``, younger owners' snapshots. False (having dropped what it could) when
        the room cannot be made."""
        usage = self.program.checkpoint_usage
        if need > usage().host_budget_bytes:
            return False
        order = self._ordered_shared()
        if before is not None:
            order = order[: [e.entry_id for e in order].index(before.entry_id)]
        victims = [e for e in order if e.entry_id not in protect]
        if owner is not None:
            victims += [e for e in self._ordered_snapshots(owner) if e.entry_id not in protect]
        for e in victims:
            u = usage()
            if u.host_budget_bytes - u.host_bytes >= need:
                return True
            if self.program.checkpoint_footprint(e.handle).host_bytes > 0:
                self._drop(e, "host")
        u = usage()
        return u.host_budget_bytes - u.host_bytes >= need

    def _drop(self, entry: CacheEntry, why: Literal["pressure", "host"]) -> None:
        if entry.kind == "pause_snapshot":
            self.revoke_snapshot(entry.publication_order)
            return
        self._remove_shared(entry.entry_id)
        self._n["evictions"] += 1
        if why == "host":
            self._n["host_evictions"] += 1

    def clear(self) -> None:
        """Drop every shared entry and every snapshot (their owners will replay)."""
        for eid in list(self._entries):
            self._remove_shared(eid)
        for owner in list(self._snapshots):
            self.revoke_snapshot(owner)

    def _remove_shared(self, eid: int) -> None:
        entry = self._entries.pop(eid)
        if eid in self.index:
            self.index.remove(eid)
        for key, (_, bound) in list(self._sessions.items()):
            if bound == eid:
                del self._sessions[key]
        self._drop_handle(entry)

    def _drop_handle(self, entry: CacheEntry) -> None:
        with self.slot.transaction("drop", f"checkpoint {entry.entry_id}"):
            self.program.drop_checkpoint(entry.handle)


__all__ = ["CacheCounters", "CacheEntry", "ContextCache"]
