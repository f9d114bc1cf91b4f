"""Architecture-independent Program bookkeeping: sequences, ledgers, reservations, PendingBatch, sampling.

:class:`SequenceProgram` implements the :class:`~ninfer.contracts.program.Program` protocol
except the model call. An architecture subclasses it and implements :meth:`SequenceProgram.forward`,
which receives a :class:`ForwardBatch` (decode rows and at most one chunk, already addressed into
the paged KV pools and StateImage slots) and returns the logits of the rows that sample.

Ledger rules (see the Program contract): ``computed`` counts ledger tokens whose effect is in the
state and KV. :meth:`run` advances ``computed`` by what it processed; the sampled tokens stay
provisional in the :class:`PendingBatch` until :meth:`commit`. A row that ends with no next input
(its provisional token was aborted, or accepted 0) is *stale*: its state covers the whole ledger, so
the only legal operations left are :meth:`pause` (Replay rebuilds it) and :meth:`release`.

Invariants enforced here (violations raise before anything is mutated):
- A sequence is in at most one unconsumed PendingBatch; pause/release/run wait for it to be consumed.
- A PendingBatch is consumed exactly once, with every member row named exactly once and
  ``0 <= accepted <= produced``; a row may not be both a decode row and the chunk of one unit.
- KV pages for a token exist before the token is run (reserve_units), and are freed only by
  pause/release; a token is only written into a page its sequence holds alone (reserve_units
  copies a shared page first, run/score_chunk refuse otherwise).

Checkpoints (the context cache, :class:`~ninfer.contracts.program.CheckpointProgram`):
with a checkpoint :class:`StateImageStorage`, :meth:`capture_checkpoint` copies a sequence's image
into a checkpoint slot and shares its KV prefix; each record keeps the covered count, the tokens and
the prefix ref, which must agree whenever the checkpoint is used. A sequence whose forward failed is
*damaged* and can never be captured.

Lookahead decode (``lookahead_slots`` > 0, an architecture with ``supports_lookahead``; see
:mod:`ninfer.program.lookahead`): a decode-only unit whose rows all draw their tokens on the device
also launches the next step of the same rows before waiting for its own tokens; the next ``run``
adopts it when the unit asks for exactly that work, else it is dropped. Nothing committed changes
until adoption, so every rule above holds as if each unit ran when asked.

Host tier (:meth:`SequenceProgram.configure_host_tier`): :meth:`demote_checkpoint` moves a
checkpoint's image and the KV pages only it holds into a :class:`HostCopy` (the pages it shares stay
on the device, referenced); :meth:`restore_checkpoint` brings them back into a checkpoint slot and
fresh pages. A checkpoint is opened from only when wholly on Device. ``pause(seq, snapshot=True)``
is the Snapshot pause: capture, free the sequence, demote.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ninfer.contracts.program import (
    CheckpointFootprint,
    CheckpointHandle,
    CheckpointIntegrityError,
    CheckpointUsage,
    ExecutionUnit,
    OutOfSlotsError,
    PendingBatch,
    PendingBatchError,
    PendingRow,
    ProgramCapacity,
    ProgramError,
    ReplayState,
    ResumeState,
    RowSampling,
    SeqId,
    SnapshotState,
    TokenLogprob,
)
from ninfer.program.graphs import HostTokens
from ninfer.program.lookahead import (
    DeviceTokens,
    Lookahead,
    LookaheadStats,
    lookahead_eligible,
    predicted,
    to_device,
    wants_logprobs,
)
from ninfer.program.token_bitmask import apply_bitmask, fill_bitmasks
from ninfer.storage.host_tier import HostCopy, HostTier
from ninfer.storage.kv_pool import KVPrefixRef, PagedKVCache
from ninfer.storage.state_image import StateImageStorage


@dataclass
class _Sequence:
    ledger: list[int]
    prompt_length: int
    slot: int
    computed: int = 0
    pending: int | None = None   # id of the unconsumed PendingBatch holding this row's provisional tokens
    stale: bool = False          # state covers the whole ledger; no next input exists
    damaged: bool = False        # a forward failed midway: state and KV are garbage until rebuilt


@dataclass(frozen=True)
class _Checkpoint:
    """A checkpoint's physical records; they must agree on the covered token count. On Device the
    image is in checkpoint slot ``slot`` and ``host`` is None; once demoted ``slot`` is None and the
    image is in ``host``; ``host.positions`` are exactly the prefix's :data:`ON_HOST` entries."""

    handle: CheckpointHandle
    slot: int | None
    prefix: KVPrefixRef
    host: HostCopy | None = None


@dataclass(frozen=True)
class DecodeRows:
    """B decode rows, one token each (the last ledger token), described on the host.

    ``at[b]`` is the row's computed count (its token's position; its kv length is ``at[b] + 1``);
    ``state_slots`` the StateImage slots the rows read and ``state_out_slots`` those their new state
    is written to (the same, except in a lookahead step, which writes spare slots); ``kv_slots[b]``
    the flat KV slot of the row's token; ``pages[b]`` the row's pages covering ``at[b] + 1`` tokens.
    The tokens are on the host (``token_ids``) or already on the device (``device_tokens``, int64
    [B], drawn there): exactly one of the two.

    The device tensors (``tokens``, ``positions``, ``slots``, ``out_slots``, ``kv_lens``,
    ``page_tables``, ``slot_mapping``) are made on first use, from the host description, in
    non-blocking pinned copies. A decode graph reads the host description instead and copies it
    straight into its static inputs (:meth:`~ninfer.program.graphs.DecodeGraphs.run`), so a
    graphed step makes none of them."""

    seqs: tuple[SeqId, ...]
    device: torch.device
    at: tuple[int, ...]
    state_slots: tuple[int, ...]
    state_out_slots: tuple[int, ...]
    kv_slots: tuple[int, ...]
    pages: tuple[Sequence[int], ...]
    token_ids: tuple[int, ...] | None = None
    device_tokens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b = len(self.seqs)
        if not all(len(f) == b for f in (self.at, self.state_slots, self.state_out_slots, self.kv_slots,
                                          self.pages)):
            raise ProgramError(f"decode rows of {b} sequences need one position, slot, out slot, KV slot and "
                               f"page list per row")
        if (self.token_ids is None) == (self.device_tokens is None):
            raise ProgramError("decode rows take their tokens from the host or from the device: exactly one")
        n = len(self.token_ids) if self.token_ids is not None else int(self.device_tokens.shape[0])
        if n != b:
            raise ProgramError(f"decode rows of {b} sequences got {n} tokens")

    @cached_property
    def tokens(self) -> torch.Tensor:   # int64 [B]
        if self.device_tokens is not None:
            return self.device_tokens
        return to_device(list(self.token_ids), torch.int64, self.device)

    @cached_property
    def _meta(self) -> torch.Tensor:    # int64 [4, B]: positions, slots, out slots, KV slots
        return to_device([list(self.at), list(self.state_slots), list(self.state_out_slots), list(self.kv_slots)],
                         torch.int64, self.device)

    @cached_property
    def _tables(self) -> torch.Tensor:  # int32 [B + B * width]: kv lengths, then the page table's rows
        width = max(1, max((len(p) for p in self.pages), default=1))
        flat = [a + 1 for a in self.at]
        for p in self.pages:
            flat.extend(p)
            flat.extend([0] * (width - len(p)))   # never read: kernels stop at the row's kv length
        return to_device(flat, torch.int32, self.device)

    @property
    def positions(self) -> torch.Tensor:     # int64 [B]
        return self._meta[0]

    @property
    def slots(self) -> torch.Tensor:         # int64 [B]
        return self._meta[1]

    @property
    def out_slots(self) -> torch.Tensor:     # int64 [B]
        return self._meta[2]

    @property
    def slot_mapping(self) -> torch.Tensor:  # int64 [B]
        return self._meta[3]

    @property
    def kv_lens(self) -> torch.Tensor:       # int32 [B]
        return self._tables[: len(self.seqs)]

    @property
    def page_tables(self) -> torch.Tensor:   # int32 [B, width]
        b = len(self.seqs)
        return self._tables[b:].view(b, -1)


@dataclass(frozen=True)
class ChunkRows:
    """Ledger tokens ``[start, start + T)`` of one sequence. ``want_logits``: the chunk samples, so
    the forward must return the logits of its last token. ``all_logits`` (causal scoring, see
    :meth:`SequenceProgram.score_chunk`): the forward returns the logits of every chunk token, in
    order, instead (it implies the last token's)."""

    seq: SeqId
    tokens: torch.Tensor        # int64 [T]
    positions: torch.Tensor     # int64 [T]
    slot: int
    start: int
    kv_len: int                 # start + T
    page_table: torch.Tensor    # int32 [1, maxp]
    slot_mapping: torch.Tensor  # int64 [T]
    want_logits: bool
    all_logits: bool = False


@dataclass(frozen=True)
class ForwardBatch:
    decode: DecodeRows | None
    chunk: ChunkRows | None

    @property
    def num_logit_rows(self) -> int:
        b = len(self.decode.seqs) if self.decode is not None else 0
        if self.chunk is not None and self.chunk.all_logits:
            return b + int(self.chunk.tokens.shape[0])
        return b + (1 if self.chunk is not None and self.chunk.want_logits else 0)


class SequenceProgram(ABC):
    """Program bookkeeping over a :class:`PagedKVCache` and a :class:`StateImageStorage`.

    Subclasses implement :meth:`forward`. ``ops`` must provide ``apply_penalties``, ``sample`` and
    ``greedy_tokens``.
    ``lookahead_slots`` of the ``states`` slots are held as lookahead spares (outside ``capacity()``);
    only a subclass with ``supports_lookahead`` may ask for them.
    """

    #: The decode forward honours ``DecodeRows.out_slots`` and rewrites every StateImage field there.
    supports_lookahead: bool = False

    def __init__(self, *, vocab_size: int, kv: PagedKVCache, states: StateImageStorage, ops,
                 device: torch.device, max_context: int, checkpoints: StateImageStorage | None = None,
                 lookahead_slots: int = 0) -> None:
        self.vocab_size = vocab_size
        self.page_size = kv.page_size
        self.kv = kv
        self.states = states
        self.ops = ops
        self.device = torch.device(device)
        self.max_context = max_context
        self._seqs: dict[SeqId, _Sequence] = {}
        self._ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._outstanding: dict[int, PendingBatch] = {}
        self.checkpoint_states = checkpoints
        self._checkpoints: dict[int, _Checkpoint] = {}
        self._checkpoint_ids = itertools.count(1)
        self.host: HostTier | None = None
        if lookahead_slots and not self.supports_lookahead:
            raise ProgramError(f"{type(self).__name__} does not support lookahead decode")
        if not 0 <= lookahead_slots < states.num_slots:
            raise ProgramError(f"{lookahead_slots} lookahead slots leave no sequence slot of {states.num_slots}")
        self.lookahead_slots = lookahead_slots
        self._spares: list[int] = [states.allocate() for _ in range(lookahead_slots)]
        self._lookahead: Lookahead | None = None
        self.lookahead_stats = LookaheadStats()

    def configure_host_tier(self, budget_bytes: int) -> None:
        """Give the checkpoints a Host tier of ``budget_bytes`` (0: none). Pinned memory on CUDA.
        Only while no checkpoint has Host content."""
        if self.checkpoint_states is None:
            raise ProgramError("this Program was built without checkpoint slots: it has no Host tier")
        if self.host is not None and self.host.count:
            raise ProgramError("the Host tier cannot be reconfigured while it holds checkpoints")
        self.host = HostTier(budget_bytes, pin=self.device.type == "cuda") if budget_bytes > 0 else None

    # -- the model call (architecture) -----------------------------------------------------------
    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model over ``batch``, updating KV pools and state slots in place. Returns fp32
        logits ``[batch.num_logit_rows, vocab]``: decode rows in order, then the chunk's last token
        (every chunk token, in order, when ``chunk.all_logits``)."""

    def precomputed_greedy(self, logits: torch.Tensor) -> torch.Tensor | None:
        """``greedy_tokens(logits)`` when the forward that returned this very tensor already computed it
        (a decode graph does, in the same replay), else None. The result is valid as long as ``logits``
        is (until the next forward)."""
        return None

    def precomputed_host_tokens(self, tokens: torch.Tensor) -> HostTokens | None:
        """The host copy of ``tokens`` already on its way, when they are :meth:`precomputed_greedy`'s answer and
        the forward stored them into pinned memory itself (a decode graph does); else None (a copy is queued)."""
        return None

    # -- queries ---------------------------------------------------------------------------------
    def capacity(self) -> ProgramCapacity:
        return ProgramCapacity(
            total_pages=self.kv.num_pages, free_pages=self.kv.allocator.free_pages,
            total_state_slots=self.states.num_slots - self.lookahead_slots, free_state_slots=self.states.free_slots,
            page_size=self.page_size)

    def ledger_length(self, seq: SeqId) -> int:
        return len(self._get(seq).ledger)

    def computed(self, seq: SeqId) -> int:
        return self._get(seq).computed

    def ledger(self, seq: SeqId) -> tuple[int, ...]:
        return tuple(self._get(seq).ledger)

    def state_slot(self, seq: SeqId) -> int:
        return self._get(seq).slot

    # -- lifecycle -------------------------------------------------------------------------------
    def open_sequence(self, tokens: Sequence[int], prompt_length: int | None = None) -> SeqId:
        """Start a ledger. ``prompt_length`` (default: all of ``tokens``) separates prompt from
        output for the penalties; a Replay resume passes the original prompt length."""
        ledger, plen = self._check_ledger(tokens, prompt_length)
        slot = self.states.allocate()
        if slot is None:
            raise OutOfSlotsError(f"all {self.states.num_slots} state slots are taken")
        sid = next(self._ids)
        self._seqs[sid] = _Sequence(ledger=ledger, prompt_length=plen, slot=slot)
        return sid

    def _check_ledger(self, tokens: Sequence[int], prompt_length: int | None) -> tuple[list[int], int]:
        ledger = [int(t) for t in tokens]
        if not ledger:
            raise ProgramError("a sequence needs at least one token")
        bad = [t for t in ledger if not 0 <= t < self.vocab_size]
        if bad:
            raise ProgramError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(ledger) > self.max_context:
            raise ProgramError(f"{len(ledger)} tokens exceed the context limit {self.max_context}")
        plen = len(ledger) if prompt_length is None else int(prompt_length)
        if not 1 <= plen <= len(ledger):
            raise ProgramError(f"prompt_length {prompt_length} is outside [1, {len(ledger)}]")
        return ledger, plen

    # -- checkpoints (context cache) -------------------------------------------------------------
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
        self._checkpoints[handle.checkpoint_id] = _Checkpoint(handle, slot, prefix)
        return handle

    def open_sequence_from(self, checkpoint: CheckpointHandle, tokens: Sequence[int],
                           prompt_length: int | None = None) -> SeqId:
        """Open a sequence whose first ``checkpoint.covered`` tokens are already computed: its state
        is a copy of the checkpoint's image and its KV history starts as the shared prefix."""
        rec = self._checkpoint(checkpoint)
        if rec.slot is None or rec.host is not None:
            raise ProgramError(f"checkpoint {checkpoint.checkpoint_id} is on Host: restore it before opening from it")
        ledger, plen = self._check_ledger(tokens, prompt_length)
        n = rec.handle.covered
        if not n < len(ledger) or tuple(ledger[:n]) != rec.handle.tokens:
            raise ProgramError(f"checkpoint {checkpoint.checkpoint_id} ({n} tokens) is not a proper prefix of "
                               f"the {len(ledger)} tokens to open")
        slot = self.states.allocate()
        if slot is None:
            raise OutOfSlotsError(f"all {self.states.num_slots} state slots are taken")
        self.checkpoint_states.copy_image_to(rec.slot, self.states, slot)
        sid = next(self._ids)
        self.kv.adopt_prefix(sid, rec.prefix)
        self._seqs[sid] = _Sequence(ledger=ledger, prompt_length=plen, slot=slot, computed=n)
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
        self._checkpoints[checkpoint.checkpoint_id] = _Checkpoint(rec.handle, None, prefix, copy)
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
        self._checkpoints[checkpoint.checkpoint_id] = _Checkpoint(rec.handle, slot, prefix, None)
        return True

    def snapshot_host_bytes(self, seq: SeqId) -> int:
        s = self._get(seq)
        table = self.kv.table(seq)[: self.kv.pages_for(s.computed)]
        private = sum(1 for p in table if self.kv.allocator.refcount(p) == 1)
        return self.checkpoint_states.image_bytes + private * self.kv.page_bytes if self.checkpoint_states else 0

    def _checkpoint(self, checkpoint: CheckpointHandle) -> _Checkpoint:
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

    def _check_host_record(self, rec: _Checkpoint) -> None:
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

    def reserve_units(self, demands: Mapping[SeqId, int]) -> dict[SeqId, bool]:
        for sid, n in demands.items():
            self._get(sid)
            if not isinstance(n, int) or n < 0:
                raise ProgramError(f"reserve demand of sequence {sid} must be an int >= 0, got {n!r}")
        out: dict[SeqId, bool] = {}
        for sid, n in demands.items():
            computed = self._seqs[sid].computed
            target = computed + n
            out[sid] = target <= self.max_context and self.kv.ensure(sid, target, write_from=computed)
        return out

    def pause(self, seq: SeqId, *, snapshot: bool = False) -> ResumeState:
        s = self._get(seq)
        self._check_not_pending(seq, s, "paused")
        self._forget_lookahead(seq)
        ledger = tuple(s.ledger)
        handle = None
        if snapshot and self.host is not None and not s.damaged and 1 <= s.computed < len(s.ledger):
            handle = self.capture_checkpoint(seq)
        self._free(seq, s)
        if handle is None:
            return ReplayState(ledger=ledger)
        # Demoted only now: with the sequence freed, the pages only the snapshot holds are private.
        if self.demote_checkpoint(handle):
            return SnapshotState(ledger=ledger, checkpoint=handle)
        self.drop_checkpoint(handle)
        return ReplayState(ledger=ledger)

    def release(self, seq: SeqId) -> None:
        s = self._get(seq)
        self._check_not_pending(seq, s, "released")
        self._forget_lookahead(seq)
        self._free(seq, s)

    # -- execution -------------------------------------------------------------------------------
    def run(self, unit: ExecutionUnit) -> PendingBatch:
        la, self._lookahead = self._lookahead, None
        if la is not None:
            keep = self._adoptable(la, unit)
            if keep is not None:
                return self._adopt(la, unit, keep)
            self._drop_lookahead(la)
        batch, sampling = self._prepare(unit)
        ahead = self._may_look_ahead(unit)
        try:
            logits = self.forward(batch)
            if batch.num_logit_rows and (logits is None or tuple(logits.shape) != (batch.num_logit_rows,
                                                                                    self.vocab_size)):
                raise ProgramError(f"forward returned logits of shape "
                                   f"{None if logits is None else tuple(logits.shape)}, expected "
                                   f"{(batch.num_logit_rows, self.vocab_size)}")
            if ahead:
                drawn = self._draw_on_device(logits, sampling)
            else:
                tokens, logprobs = self._sample(logits, sampling) if sampling else ([], [])
        except Exception:
            # The state and KV of every member may be half-updated: they can only be rebuilt.
            self._damage(self._members(unit))
            raise
        for row in unit.decode:
            self._seqs[row.seq].computed += 1
        if unit.chunk is not None:
            self._seqs[unit.chunk.seq].computed += unit.chunk.num_tokens
        if ahead:
            self._launch_lookahead(sampling, drawn.device)
            tokens = drawn.tolist()
            logprobs = self._token_logprobs(drawn.logprobs(), drawn.want, sampling, tokens)
            self._note_lookahead_inputs(sampling, tokens)
        return self._new_pending(sampling, tokens, logprobs)

    def _draw_on_device(self, logits: torch.Tensor, rows: list[tuple[SeqId, RowSampling]]) -> DeviceTokens:
        """Tokens (and the log-softmax rows of the rows that want logprobs) drawn on the device, their
        copies to the host queued: nothing here waits for the stream."""
        raw = logits.float()
        want = [b for b, (_, rs) in enumerate(rows) if wants_logprobs(rs)]
        lp = None
        if want:
            picked = raw if len(want) == len(rows) else raw.index_select(0, to_device(want, torch.int64, raw.device))
            lp = torch.log_softmax(picked, dim=-1)
        tokens = self._draw(raw, rows)
        return DeviceTokens(tokens, lp, want, host=self.precomputed_host_tokens(tokens))

    def _new_pending(self, sampling: list[tuple[SeqId, RowSampling]], tokens: list[int],
                     logprobs: list[TokenLogprob | None]) -> PendingBatch:
        bid = next(self._batch_ids)
        rows = []
        for (sid, _), tok, lp in zip(sampling, tokens, logprobs, strict=True):
            self._seqs[sid].pending = bid
            rows.append(PendingRow(seq=sid, tokens=(tok,), logprobs=None if lp is None else (lp,)))
        pending = PendingBatch(batch_id=bid, rows=tuple(rows))
        self._outstanding[bid] = pending
        return pending

    def _damage(self, seqs: Sequence[SeqId]) -> None:
        for sid in seqs:
            self._seqs[sid].stale = True
            self._seqs[sid].damaged = True

    # -- lookahead decode (ninfer.program.lookahead) ----------------------------------------------
    def _may_look_ahead(self, unit: ExecutionUnit) -> bool:
        return (bool(unit.decode) and unit.chunk is None and len(unit.decode) <= len(self._spares)
                and all(lookahead_eligible(r.sampling) for r in unit.decode))

    def _launch_lookahead(self, sampling: list[tuple[SeqId, RowSampling]], tokens: torch.Tensor) -> None:
        """Queue the next decode step of these rows (their ``computed`` already counts the step that
        drew ``tokens``), into spare slots. A row whose token drawn now is its last (its ``max_tokens``,
        or max_context) is left out: nothing would adopt its next step. Skipped when a row's next KV page
        cannot be had; a failing forward damages the rows (their PendingBatch is never made)."""
        keep = [i for i, (sid, rs) in enumerate(sampling)
                if rs.step + 1 < rs.params.max_tokens and self._seqs[sid].computed + 2 <= self.max_context]
        if not keep:
            return
        if len(keep) < len(sampling):
            tokens = tokens.index_select(0, to_device(keep, torch.int64, tokens.device))
            sampling = [sampling[i] for i in keep]
        seqs = [sid for sid, _ in sampling]
        positions = [self._seqs[sid].computed for sid in seqs]
        for sid, m in zip(seqs, positions, strict=True):
            # The page reserve_units would give the row's next token; the row keeps it either way.
            if not self.kv.ensure(sid, m + 1, write_from=m):
                return
        spares = [self._spares.pop() for _ in seqs]
        try:
            rows = DecodeRows(
                seqs=tuple(seqs), device=self.device, at=tuple(positions),
                state_slots=tuple(self._seqs[sid].slot for sid in seqs), state_out_slots=tuple(spares),
                kv_slots=tuple(self.kv.slot_mapping(sid, m, m + 1)[0] for sid, m in zip(seqs, positions, strict=True)),
                pages=tuple(self.kv.page_rows(seqs, [m + 1 for m in positions])), device_tokens=tokens)
            logits = self.forward(ForwardBatch(decode=rows, chunk=None))
            nxt = [(sid, predicted(rs)) for sid, rs in sampling]
            drawn = self._draw_on_device(logits, nxt)
        except Exception:
            self._spares.extend(spares)
            self._damage(seqs)
            raise
        self._lookahead = Lookahead(seqs=list(seqs), positions=positions, spares=spares,
                                    sampling=[rs for _, rs in nxt], tokens=drawn)
        self.lookahead_stats.launched += 1

    def _adoptable(self, la: Lookahead, unit: ExecutionUnit) -> list[int] | None:
        """The lookahead rows (indices, in order) that ``unit`` asks for, or None when it asks for
        anything else (see :mod:`ninfer.program.lookahead` for the rule)."""
        if la.inputs is None or unit.chunk is not None or not unit.decode:
            return None
        index = {sid: j for j, sid in enumerate(la.seqs) if sid is not None}
        keep: list[int] = []
        for row in unit.decode:
            j = index.get(row.seq)
            s = self._seqs.get(row.seq)
            if (j is None or (keep and j <= keep[-1]) or s is None or s.pending is not None or s.stale
                    or s.damaged or s.computed != la.positions[j] or len(s.ledger) != s.computed + 1
                    or s.ledger[-1] != la.inputs[j] or row.sampling.mask is not None
                    or row.sampling != la.sampling[j] or not self.kv.writable(row.seq, s.computed, s.computed + 1)):
                return None
            keep.append(j)
        return keep

    def _adopt(self, la: Lookahead, unit: ExecutionUnit, keep: list[int]) -> PendingBatch:
        """Make the lookahead's rows ``keep`` this unit's result: their new state is in the spares."""
        kept = set(keep)
        self._spares.extend(sp for j, sp in enumerate(la.spares) if j not in kept and sp is not None)
        sampling = []
        for row, j in zip(unit.decode, keep, strict=True):
            s = self._seqs[row.seq]
            self._spares.append(s.slot)
            s.slot = la.spares[j]
            s.computed += 1
            sampling.append((row.seq, row.sampling))
        self.lookahead_stats.adopted += 1
        if self._may_look_ahead(unit):
            tokens = la.tokens.device
            if len(keep) != len(la.seqs):
                tokens = tokens.index_select(0, to_device(keep, torch.int64, tokens.device))
            self._launch_lookahead(sampling, tokens)
        drawn = la.tokens.tolist()
        tokens_now = [drawn[j] for j in keep]
        lp_all = la.tokens.logprobs()
        lp_row = {j: i for i, j in enumerate(la.tokens.want)}  # lookahead row -> its log-softmax row
        want = [b for b, j in enumerate(keep) if j in lp_row]
        lp = None if not want else lp_all[[lp_row[keep[b]] for b in want]]
        logprobs = self._token_logprobs(lp, want, sampling, tokens_now)
        self._note_lookahead_inputs(sampling, tokens_now)
        return self._new_pending(sampling, tokens_now, logprobs)

    def _note_lookahead_inputs(self, sampling: list[tuple[SeqId, RowSampling]], tokens: list[int]) -> None:
        """Record the tokens the just-launched lookahead consumed (those of its rows, which may be a
        subset of ``sampling``), now that they reached the host."""
        if self._lookahead is not None:
            by_seq = {sid: tok for (sid, _), tok in zip(sampling, tokens, strict=True)}
            self._lookahead.inputs = [by_seq[sid] for sid in self._lookahead.seqs]

    def _drop_lookahead(self, la: Lookahead | None = None) -> None:
        """Drop a lookahead (default: the outstanding one): its spares go back, nothing else changes."""
        if la is None:
            la, self._lookahead = self._lookahead, None
            if la is None:
                return
        self._spares.extend(la.live_spares())
        self.lookahead_stats.dropped += 1

    def _forget_lookahead(self, seq: SeqId) -> None:
        """``seq`` leaves (pause, release) or changes outside run (scoring): take its row out of the
        outstanding lookahead, returning its spare."""
        if self._lookahead is not None:
            spare = self._lookahead.forget(seq)
            if spare is not None:
                self._spares.append(spare)

    def commit(self, pending: PendingBatch, accepted: Mapping[SeqId, int]) -> None:
        self._check_outstanding(pending)
        members = [r.seq for r in pending.rows]
        missing = [s for s in members if s not in accepted]
        extra = [s for s in accepted if s not in members]
        if missing or extra:
            raise PendingBatchError(f"commit of batch {pending.batch_id} must name every row exactly once: "
                                    f"missing {missing}, not members {extra}")
        for r in pending.rows:
            a = accepted[r.seq]
            if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a <= len(r.tokens):
                raise PendingBatchError(f"sequence {r.seq} accepted {a!r} of {len(r.tokens)} produced tokens "
                                        f"in batch {pending.batch_id}; must be an int in [0, produced]")
        for r in pending.rows:
            s = self._seqs[r.seq]
            a = accepted[r.seq]
            s.ledger.extend(r.tokens[:a])
            s.pending = None
            # The state advanced over every input token; with nothing accepted there is no next input.
            if s.computed != len(s.ledger) - 1:
                s.stale = True
        self._consume(pending)

    def abort_pending(self, pending: PendingBatch) -> None:
        self._check_outstanding(pending)
        self._drop_lookahead()  # its rows are about to be stale: nothing can adopt it
        for r in pending.rows:
            s = self._seqs[r.seq]
            s.pending = None
            s.stale = True
        self._consume(pending)

    def score_chunk(self, seq: SeqId, num_tokens: int, *, logits: bool = True) -> torch.Tensor | None:
        """Causal scoring: run the next ``num_tokens`` ledger tokens of ``seq`` outside the commit
        protocol (no sampling, no PendingBatch) and advance ``computed`` by them.

        Returns fp32 logits ``[num_tokens, vocab]`` on the Program's device, row ``j`` being the
        distribution of the ledger token after ``computed + j``; with ``logits=False`` the LM head
        is skipped and None is returned (context the caller does not score). Requires the same as a
        prefill chunk (no unconsumed PendingBatch, not stale, KV reserved up to the chunk's end), but
        the chunk may reach the ledger's end without sampling; the state then covers the whole
        ledger, so only pause/release remain. A failing forward leaves the sequence stale.
        """
        s = self._ready(seq, "scoring")
        self._forget_lookahead(seq)
        end = s.computed + num_tokens if isinstance(num_tokens, int) else None
        if isinstance(num_tokens, bool) or end is None or num_tokens < 1 or end > len(s.ledger):
            raise ProgramError(f"score chunk of sequence {seq}: {num_tokens!r} tokens from {s.computed} exceed "
                               f"its ledger of {len(s.ledger)}")
        if not self.kv.writable(seq, s.computed, end):
            raise ProgramError(f"score chunk sequence {seq} has no KV reserved for tokens up to {end} (or a page there is shared)")
        dev = self.device
        chunk = ChunkRows(
            seq=seq, tokens=torch.tensor(s.ledger[s.computed:end], dtype=torch.int64).to(dev),
            positions=torch.arange(s.computed, end, dtype=torch.int64).to(dev),
            slot=s.slot, start=s.computed, kv_len=end, page_table=self.kv.page_table_tensor([seq], [end]),
            slot_mapping=torch.tensor(self.kv.slot_mapping(seq, s.computed, end), dtype=torch.int64).to(dev),
            want_logits=False, all_logits=logits)
        try:
            out = self.forward(ForwardBatch(decode=None, chunk=chunk))
            if logits and (out is None or tuple(out.shape) != (num_tokens, self.vocab_size)):
                raise ProgramError(f"forward returned logits of shape {None if out is None else tuple(out.shape)}, "
                                   f"expected {(num_tokens, self.vocab_size)}")
        except Exception:
            s.stale = True
            s.damaged = True
            raise
        s.computed = end
        if end == len(s.ledger):
            s.stale = True
        return out.float() if logits else None

    # -- internals -------------------------------------------------------------------------------
    def _get(self, seq: SeqId) -> _Sequence:
        try:
            return self._seqs[seq]
        except (KeyError, TypeError):
            raise ProgramError(f"unknown or released sequence {seq!r}") from None

    def _check_not_pending(self, seq: SeqId, s: _Sequence, what: str) -> None:
        if s.pending is not None:
            raise ProgramError(f"sequence {seq} cannot be {what} while pending batch {s.pending} is unconsumed")

    def _free(self, seq: SeqId, s: _Sequence) -> None:
        self.kv.release(seq)
        self.states.free(s.slot)
        del self._seqs[seq]

    def _check_outstanding(self, pending: PendingBatch) -> None:
        if pending.consumed:
            raise PendingBatchError(f"pending batch {pending.batch_id} was already consumed")
        if self._outstanding.get(pending.batch_id) is not pending:
            raise PendingBatchError(f"pending batch {pending.batch_id} was not produced by this program")

    def _consume(self, pending: PendingBatch) -> None:
        pending.consumed = True
        del self._outstanding[pending.batch_id]

    @staticmethod
    def _members(unit: ExecutionUnit) -> list[SeqId]:
        return [r.seq for r in unit.decode] + ([unit.chunk.seq] if unit.chunk is not None else [])

    def _ready(self, sid: SeqId, role: str) -> _Sequence:
        s = self._get(sid)
        if s.pending is not None:
            raise ProgramError(f"{role} sequence {sid} has unconsumed pending batch {s.pending}")
        if s.stale:
            raise ProgramError(f"{role} sequence {sid} has no next input (its provisional token was "
                               f"dropped): pause it for Replay or release it")
        return s

    def _prepare(self, unit: ExecutionUnit) -> tuple[ForwardBatch, list[tuple[SeqId, RowSampling]]]:
        members = self._members(unit)
        if not members:
            raise ProgramError("an execution unit needs at least one decode row or a chunk")
        if len(set(members)) != len(members):
            raise ProgramError(f"a sequence appears twice in one execution unit: {members}")
        sampling: list[tuple[SeqId, RowSampling]] = []
        dev = self.device
        decode = None
        if unit.decode:
            seqs, toks, pos, slots = [], [], [], []
            for row in unit.decode:
                s = self._ready(row.seq, "decode")
                if s.computed != len(s.ledger) - 1:
                    raise ProgramError(f"decode sequence {row.seq} is not decode-ready "
                                       f"(computed {s.computed}, ledger {len(s.ledger)})")
                if not self.kv.writable(row.seq, s.computed, s.computed + 1):
                    raise ProgramError(f"decode sequence {row.seq} has no KV reserved for its next token (or its page there is shared)")
                seqs.append(row.seq)
                toks.append(s.ledger[s.computed])
                pos.append(s.computed)
                slots.append(s.slot)
                sampling.append((row.seq, row.sampling))
            decode = DecodeRows(
                seqs=tuple(seqs), device=dev, at=tuple(pos), state_slots=tuple(slots), state_out_slots=tuple(slots),
                kv_slots=tuple(self.kv.slot_mapping(sq, p, p + 1)[0] for sq, p in zip(seqs, pos, strict=True)),
                pages=tuple(self.kv.page_rows(seqs, [p + 1 for p in pos])), token_ids=tuple(toks))
        chunk = None
        if unit.chunk is not None:
            c = unit.chunk
            s = self._ready(c.seq, "chunk")
            n = c.num_tokens
            end = s.computed + n
            if not isinstance(n, int) or n < 1 or end > len(s.ledger):
                raise ProgramError(f"chunk of sequence {c.seq}: {n!r} tokens from {s.computed} exceed its "
                                   f"ledger of {len(s.ledger)}")
            reaches_end = end == len(s.ledger)
            if reaches_end != (c.sampling is not None):
                raise ProgramError(f"chunk of sequence {c.seq} ending at {end} of {len(s.ledger)}: sampling "
                                   f"must be given exactly when the chunk reaches the ledger's end")
            if not self.kv.writable(c.seq, s.computed, end):
                raise ProgramError(f"chunk sequence {c.seq} has no KV reserved for tokens up to {end} (or a page there is shared)")
            if reaches_end:
                sampling.append((c.seq, c.sampling))
            chunk = ChunkRows(
                seq=c.seq,
                tokens=torch.tensor(s.ledger[s.computed:end], dtype=torch.int64).to(dev),
                positions=torch.arange(s.computed, end, dtype=torch.int64).to(dev),
                slot=s.slot, start=s.computed, kv_len=end,
                page_table=self.kv.page_table_tensor([c.seq], [end]),
                slot_mapping=torch.tensor(self.kv.slot_mapping(c.seq, s.computed, end), dtype=torch.int64).to(dev),
                want_logits=reaches_end)
        return ForwardBatch(decode=decode, chunk=chunk), sampling

    # -- sampling --------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, rows: list[tuple[SeqId, RowSampling]]
                ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Allowed-token masks (constrained rows only), penalties (only when a row asks for them), then
        the ``sample`` op. Logprobs are those of the model's raw distribution (before masks, penalties
        and temperature), like vLLM's default."""
        raw = logits.float()
        params = [rs.params for _, rs in rows]
        dev = raw.device
        processed = raw
        constrained = [b for b, (_, rs) in enumerate(rows) if rs.mask is not None]
        if constrained:
            # Banned tokens become -inf before anything else, so penalties keep them -inf and greedy,
            # top-k/top-p/min-p and the Gumbel draw all work over the allowed set only. Unconstrained
            # rows of a mixed batch are untouched (no all-ones mask).
            words = fill_bitmasks([rows[b][1].mask for b in constrained], self.vocab_size)
            idx = torch.tensor(constrained, dtype=torch.int64, device=dev)
            processed = raw.clone()
            processed[idx] = apply_bitmask(processed[idx], words)
        if any(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
               for p in params):
            counts = torch.zeros((len(rows), self.vocab_size), dtype=torch.int32)
            prompt = torch.zeros((len(rows), self.vocab_size), dtype=torch.bool)
            for b, (sid, _) in enumerate(rows):
                s = self._seqs[sid]
                prompt[b, torch.tensor(s.ledger[: s.prompt_length], dtype=torch.int64)] = True
                out = s.ledger[s.prompt_length:]
                if out:
                    counts[b] = torch.bincount(torch.tensor(out, dtype=torch.int64),
                                               minlength=self.vocab_size).to(torch.int32)
            processed = self.ops.apply_penalties(
                processed, counts.to(dev), prompt.to(dev),
                torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev),
                torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev),
                torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev))
        tokens = self._draw(processed, rows)
        host = self.precomputed_host_tokens(tokens)   # a decode graph's greedy tokens: already on their way
        token_list = host.values() if host is not None else [int(t) for t in tokens.tolist()]
        want = [b for b, (_, rs) in enumerate(rows) if wants_logprobs(rs)]
        lp = torch.log_softmax(raw[want], dim=-1).cpu() if want else None
        return token_list, self._token_logprobs(lp, want, rows, token_list)

    @staticmethod
    def _token_logprobs(lp: torch.Tensor | None, want: list[int], rows: list[tuple[SeqId, RowSampling]],
                        tokens: list[int]) -> list[TokenLogprob | None]:
        """Row ``want[i]``'s TokenLogprob from host log-softmax row ``lp[i]``; None for the other rows."""
        out: list[TokenLogprob | None] = [None] * len(rows)
        for i, b in enumerate(want):
            k = rows[b][1].params.top_logprobs
            top = ()
            if k > 0:
                vals, ids = torch.topk(lp[i], k)
                top = tuple((int(t), float(v)) for t, v in zip(ids.tolist(), vals.tolist(), strict=True))
            out[b] = TokenLogprob(token=tokens[b], logprob=float(lp[i, tokens[b]]), top=top)
        return out

    def _draw(self, processed: torch.Tensor, rows: list[tuple[SeqId, RowSampling]]) -> torch.Tensor:
        """The ``sample`` op's tokens (int64 [B], on the device) from fp32 logits already masked and
        penalised; never waits for the stream (lookahead decode draws this way too)."""
        params = [rs.params for _, rs in rows]
        if all(p.temperature <= 0 for p in params):
            # Every row greedy: the sampler's result is the lowest-id maximum after NaN -> -inf, which
            # is greedy_tokens' (skipping the filter saves its full-vocab sort, ~1 ms per step on the
            # 248k vocabulary); a decode graph computed it already when these are its logits.
            pre = self.precomputed_greedy(processed)
            return pre if pre is not None else self.ops.greedy_tokens(processed)
        # Two host->device copies for the six per-row parameters.
        dev = processed.device
        fparams = to_device([[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
                            torch.float32, dev)
        # top_k >= vocab keeps every token, as vocab does: clamped, so any valid top_k fits the int32 the sampler
        # takes (an unclamped 2**63 failed the whole worker converting to int64).
        iparams = to_device([[min(p.top_k, self.vocab_size) for p in params], [rs.seed for _, rs in rows],
                             [rs.step for _, rs in rows]], torch.int64, dev)
        return self.ops.sample(processed, fparams[0], iparams[0].to(torch.int32), fparams[1], fparams[2],
                               iparams[1], iparams[2]).to(torch.int64)
