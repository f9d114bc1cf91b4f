"""Checkpoints (the context cache), their Host tier, and the Snapshot pause: the
:class:`~ninfer.contracts.program.CheckpointProgram` half of :class:`~ninfer.program.base.SequenceProgram`.

With a checkpoint :class:`StateImageStorage`, :meth:`Checkpoints.capture_checkpoint` copies a
sequence's image into a checkpoint slot and shares its KV prefix; each record keeps the covered
count, the tokens and the prefix ref, which must agree whenever the checkpoint is used (else
:class:`CheckpointIntegrityError`). A damaged sequence is never captured.

Host tier (:meth:`Checkpoints.configure_host_tier`): :meth:`demote_checkpoint` moves a checkpoint's
image and the KV pages only it holds into a :class:`HostCopy` (the pages it shares stay on the
device, referenced); :meth:`restore_checkpoint` brings them back into a checkpoint slot and fresh
pages. A checkpoint is opened from only when wholly on Device. ``pause(seq, snapshot=True)`` is the
Snapshot pause: capture, free the sequence, demote (:meth:`Checkpoints._snapshot_pause`).

Invariant of a record (:class:`CheckpointRecord`): its image is in exactly one place (a Device
checkpoint slot, or its Host copy), and its Host copy holds exactly the KV prefix's Host pages.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ninfer.contracts.program import (
    CheckpointFootprint,
    CheckpointHandle,
    CheckpointIntegrityError,
    CheckpointUsage,
    OutOfSlotsError,
    ProgramError,
    ReplayState,
    ResumeState,
    SeqId,
    SnapshotState,
)
from ninfer.program.ledger import SequenceRecord, check_ledger, refuse_media
from ninfer.storage.host_tier import HostCopy, HostTier
from ninfer.storage.kv_pool import KVPrefixRef, PagedKVCache
from ninfer.storage.state_image import StateImageStorage

if TYPE_CHECKING:
    from ninfer.contracts.media import MediaInput


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint's physical records; they must agree on the covered token count. On Device the
    image is in checkpoint slot ``slot`` and ``host`` is None; once demoted ``slot`` is None and the
    image is in ``host``; ``host.positions`` are exactly the prefix's :data:`ON_HOST` entries."""

    handle: CheckpointHandle
    slot: int | None
    prefix: KVPrefixRef
    host: HostCopy | None = None


class Checkpoints:
    """Mixin of :class:`~ninfer.program.base.SequenceProgram`: checkpoint capture, open, drop, usage,
    the Host tier and the Snapshot pause. The host class provides the attributes annotated here and
    ``_get(seq)``, ``_free(seq, record)`` and ``_new_id()``, and calls :meth:`_init_checkpoints` once."""

    kv: PagedKVCache
    states: StateImageStorage
    device: torch.device
    vocab_size: int
    max_context: int
    _seqs: dict[SeqId, SequenceRecord]

    def _init_checkpoints(self, checkpoints: StateImageStorage | None) -> None:
        self.checkpoint_states = checkpoints
        self._checkpoints: dict[int, CheckpointRecord] = {}
        self._checkpoint_ids = itertools.count(1)
        self.host: HostTier | None = None

    def configure_host_tier(self, budget_bytes: int) -> None:
        """Give the checkpoints a Host tier of ``budget_bytes`` (0: none). Pinned memory on CUDA.
        Only while no checkpoint has Host content."""
        if self.checkpoint_states is None:
            raise ProgramError("this Program was built without checkpoint slots: it has no Host tier")
        if self.host is not None and self.host.count:
            raise ProgramError("the Host tier cannot be reconfigured while it holds checkpoints")
        self.host = HostTier(budget_bytes, pin=self.device.type == "cuda") if budget_bytes > 0 else None

    def capture_checkpoint(self, seq: SeqId) -> CheckpointHandle | None:
        """Checkpoint ``seq`` at its real frontier ``computed`` (see the module docstring). Allowed
        with an unconsumed PendingBatch (provisional tokens are not part of the state)."""
        s = self._get(seq)
        if self.checkpoint_states is None:
            raise ProgramError("this Program was built without checkpoint slots")
        if s.damaged:
            raise ProgramError(f"sequence {seq} failed midway: its state cannot be checkpointed")
        if s.computed < 1:
            raise ProgramError(f"sequence {seq} has computed nothing: there is nothing to checkpoint")
        slot = self.checkpoint_states.allocate()
        if slot is None:
            return None
        self.states.copy_image_to(s.slot, self.checkpoint_states, slot)
        prefix = self.kv.share_prefix(seq, s.computed)
        handle = CheckpointHandle(next(self._checkpoint_ids), s.computed, tuple(s.ledger[: s.computed]))
        self._checkpoints[handle.checkpoint_id] = CheckpointRecord(handle, slot, prefix)
        return handle

    def open_sequence_from(self, checkpoint: CheckpointHandle, tokens: Sequence[int],
                           prompt_length: int | None = None, media: Sequence[MediaInput] = ()) -> SeqId:
        """Open a sequence whose first ``checkpoint.covered`` tokens are already computed: its state
        is a copy of the checkpoint's image and its KV history starts as the shared prefix. ``media``: none
        here (see ``SequenceProgram.open_sequence``)."""
        refuse_media(media)
        rec = self._checkpoint(checkpoint)
        if rec.slot is None or rec.host is not None:
            raise ProgramError(f"checkpoint {checkpoint.checkpoint_id} is on Host: restore it before opening from it")
        ledger, plen = check_ledger(tokens, prompt_length, vocab_size=self.vocab_size, max_context=self.max_context)
        n = rec.handle.covered
        if not n < len(ledger) or tuple(ledger[:n]) != rec.handle.tokens:
            raise ProgramError(f"checkpoint {checkpoint.checkpoint_id} ({n} tokens) is not a proper prefix of "
                               f"the {len(ledger)} tokens to open")
        slot = self.states.allocate()
        if slot is None:
            raise OutOfSlotsError(f"all {self.states.num_slots} state slots are taken")
        self.checkpoint_states.copy_image_to(rec.slot, self.states, slot)
        sid = self._new_id()
        self.kv.adopt_prefix(sid, rec.prefix)
        self._seqs[sid] = SequenceRecord(ledger=ledger, prompt_length=plen, slot=slot, computed=n)
        return sid

    def drop_checkpoint(self, checkpoint: CheckpointHandle) -> None:
        rec = self._checkpoint(checkpoint)
        del self._checkpoints[checkpoint.checkpoint_id]
        self.kv.release_prefix(rec.prefix)
        if rec.slot is not None:
            self.checkpoint_states.free(rec.slot)
        if rec.host is not None:
            self.host.release(rec.host)

    def checkpoint_usage(self) -> CheckpointUsage:
        cs = self.checkpoint_states
        if cs is None:
            return CheckpointUsage(count=0, total_slots=0, free_slots=0, device_bytes=0)
        n = len(self._checkpoints)
        on_slots = sum(1 for r in self._checkpoints.values() if r.slot is not None)
        host = self.host
        return CheckpointUsage(
            count=n, total_slots=cs.num_slots, free_slots=cs.free_slots,
            device_bytes=on_slots * cs.image_bytes + self.kv.pages_only_in_prefixes() * self.kv.page_bytes,
            host_bytes=0 if host is None else host.used_bytes,
            host_count=sum(1 for r in self._checkpoints.values() if r.host is not None),
            host_budget_bytes=0 if host is None else host.budget_bytes)

    def checkpoint_footprint(self, checkpoint: CheckpointHandle) -> CheckpointFootprint:
        rec = self._checkpoint(checkpoint)
        private = len(self.kv.private_indices(rec.prefix))
        image = self.checkpoint_states.image_bytes if rec.slot is not None else 0
        return CheckpointFootprint(
            on_device=rec.slot is not None and rec.host is None, device_slot=rec.slot is not None,
            private_pages=private, cache_only_pages=len(self.kv.cache_only_indices(rec.prefix)),
            host_pages=len(rec.prefix.host_indices), host_bytes=0 if rec.host is None else rec.host.nbytes,
            demote_bytes=image + private * self.kv.page_bytes)

    def demote_checkpoint(self, checkpoint: CheckpointHandle) -> bool:
        rec = self._checkpoint(checkpoint)
        if self.host is None:
            return False
        private = self.kv.private_indices(rec.prefix)
        image = None if rec.slot is None else self.checkpoint_states.image(rec.slot)
        if image is None and not private:
            return True  # nothing on the device that a demotion would free
        data = self.kv.read_pages([rec.prefix.pages[i] for i in private]) if private else []
        copy = (self.host.store(image, private, data) if rec.host is None
                else self.host.extend(rec.host, image, private, data))
        if copy is None:
            return False
        prefix = self.kv.detach_pages(rec.prefix, private) if private else rec.prefix
        if rec.slot is not None:
            self.checkpoint_states.free(rec.slot)
        self._checkpoints[checkpoint.checkpoint_id] = CheckpointRecord(rec.handle, None, prefix, copy)
        return True

    def restore_checkpoint(self, checkpoint: CheckpointHandle) -> bool:
        rec = self._checkpoint(checkpoint)
        if rec.host is None:
            return True
        cs = self.checkpoint_states
        positions = rec.host.positions
        if (rec.slot is None and cs.free_slots == 0) or len(positions) > self.kv.allocator.free_pages:
            return False
        slot = rec.slot
        if slot is None:
            slot = cs.allocate()
            cs.load_image(slot, rec.host.image)
        prefix = rec.prefix
        if positions:
            attached = self.kv.attach_pages(prefix)
            assert attached is not None  # free pages were checked above
            prefix, _ = attached
            self.kv.write_pages([prefix.pages[i] for i in positions], rec.host.pages)
        self.host.release(rec.host)
        self._checkpoints[checkpoint.checkpoint_id] = CheckpointRecord(rec.handle, slot, prefix, None)
        return True

    def snapshot_host_bytes(self, seq: SeqId) -> int:
        s = self._get(seq)
        table = self.kv.table(seq)[: self.kv.pages_for(s.computed)]
        private = sum(1 for p in table if self.kv.allocator.refcount(p) == 1)
        return self.checkpoint_states.image_bytes + private * self.kv.page_bytes if self.checkpoint_states else 0

    def _snapshot_pause(self, seq: SeqId, s: SequenceRecord) -> ResumeState:
        """Free ``seq`` (no pending batch, no lookahead row left) keeping a Snapshot of it on Host; its
        Replay state when there is no Host tier, no free checkpoint slot, too little Host budget or nothing
        restorable (nothing computed, a damaged state, or a state covering the whole ledger)."""
        ledger = tuple(s.ledger)
        handle = None
        if self.host is not None and not s.damaged and 1 <= s.computed < len(s.ledger):
            handle = self.capture_checkpoint(seq)
        self._free(seq, s)
        if handle is None:
            return ReplayState(ledger=ledger)
        # Demoted only now: with the sequence freed, the pages only the snapshot holds are private.
        if self.demote_checkpoint(handle):
            return SnapshotState(ledger=ledger, checkpoint=handle)
        self.drop_checkpoint(handle)
        return ReplayState(ledger=ledger)

    def _checkpoint(self, checkpoint: CheckpointHandle) -> CheckpointRecord:
        rec = self._checkpoints.get(getattr(checkpoint, "checkpoint_id", None))
        if rec is None:
            raise ProgramError(f"unknown or dropped checkpoint {checkpoint!r}")
        h = rec.handle
        if (rec.handle != checkpoint or h.covered != len(h.tokens) or rec.prefix.num_tokens != h.covered
                or len(rec.prefix.pages) != self.kv.pages_for(h.covered)):
            raise CheckpointIntegrityError(
                f"checkpoint {h.checkpoint_id} is inconsistent: covered {h.covered}, {len(h.tokens)} tokens, KV prefix "
                f"of {rec.prefix.num_tokens} tokens in {len(rec.prefix.pages)} pages")
        self._check_host_record(rec)
        return rec

    def _check_host_record(self, rec: CheckpointRecord) -> None:
        """The image is in exactly one place, and the Host copy holds exactly the prefix's Host pages."""
        h, host = rec.handle, rec.host
        on_host = rec.prefix.host_indices
        problem = None
        if (rec.slot is None) != (host is not None and host.image is not None):
            problem = "its image is in neither or both of a Device slot and a Host copy"
        elif host is None and on_host:
            problem = f"KV pages {list(on_host)} are on Host but it has no Host copy"
        elif host is not None:
            if sorted(host.positions) != list(on_host) or len(set(host.positions)) != len(host.positions):
                problem = f"its Host copy holds pages {list(host.positions)}, the KV prefix has {list(on_host)} on Host"
            elif host.image is not None and tuple(host.image.shape) != (self.checkpoint_states.image_bytes,):
                problem = f"its Host image has shape {tuple(host.image.shape)}"
            elif any(k.shape[0] != len(host.positions) or v.shape != k.shape for k, v in host.pages) or (
                    host.positions and len(host.pages) != self.kv.num_pools):
                problem = "its Host KV copy does not hold one page per Host position in every pool"
        if problem is not None:
            raise CheckpointIntegrityError(f"checkpoint {h.checkpoint_id} ({h.covered} tokens) is inconsistent: {problem}")
