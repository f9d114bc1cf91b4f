"""SequenceProgram: the architecture-independent Program (sequences, ledgers, reservations, run/commit).

:class:`SequenceProgram` implements the :class:`~ninfer.contracts.program.Program` and
:class:`~ninfer.contracts.program.CheckpointProgram` protocols except the model call, over a
:class:`PagedKVCache` and a :class:`StateImageStorage`. Its :meth:`SequenceProgram.forward`
receives a :class:`~ninfer.program.batch.ForwardBatch` (decode rows and chunks of other sequences,
already addressed into the KV pages and StateImage slots) and returns the logits of the rows that sample.
An architecture subclasses :class:`~ninfer.program.model.ModelProgram`, which implements that
forward from the architecture's model call; a test double may override ``forward`` itself.

Ledger rules (see the Program contract and :mod:`ninfer.program.ledger`): ``computed`` counts ledger
tokens whose effect is in the state and KV. :meth:`run` advances ``computed`` by what it processed;
the sampled tokens stay provisional in the :class:`PendingBatch` until :meth:`commit`. A row that
ends with no next input (its provisional token was aborted, or accepted 0) is *stale*: its state
covers the whole ledger, so the only legal operations left are :meth:`pause` (Replay rebuilds it)
and :meth:`release`.

Invariants enforced here (violations raise before anything is mutated):
- A sequence is in at most one unconsumed PendingBatch; pause/release/run wait for it to be consumed.
- A PendingBatch is consumed exactly once, with every member row named exactly once and
  ``0 <= accepted <= produced``; a sequence is at most one decode row or one chunk of a unit.
- KV pages for a token exist before the token is run (reserve_units), and are freed only by
  pause/release; a token is only written into a page its sequence holds alone (reserve_units
  copies a shared page first, run/score_chunk refuse otherwise).
- A forward that fails leaves every member of its unit *damaged* (stale, never checkpointed).

The rest lives beside it: checkpoints, the Host tier and the Snapshot pause in
:mod:`~ninfer.program.checkpoints`; lookahead decode in :mod:`~ninfer.program.lookahead` (nothing
committed changes until a lookahead step is adopted, so every rule above holds as if each unit ran
when asked); masks, penalties, the draw and logprobs in :mod:`~ninfer.program.sampling`.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import torch

from ninfer.contracts.media import MediaInput
from ninfer.contracts.program import (
    ExecutionUnit,
    ExpertCacheStats,
    ExpertRouting,
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
    SpeculationStats,
    TokenLogprob,
    WarmupLimits,
    WarmupSummary,
)
from ninfer.program.batch import ChunkRows, DecodeRows, ForwardBatch, HostTokens
from ninfer.program.checkpoints import Checkpoints
from ninfer.program.ledger import SequenceRecord, check_ledger, refuse_media
from ninfer.program.lookahead import LookaheadDecode
from ninfer.program.sampling import sample_rows
from ninfer.storage.kv_pool import PagedKVCache
from ninfer.storage.state_image import StateImageStorage


class SequenceProgram(Checkpoints, LookaheadDecode, ABC):
    """Program bookkeeping over a :class:`PagedKVCache` and a :class:`StateImageStorage`.

    Subclasses implement :meth:`forward`. ``ops`` must provide ``apply_penalties``, ``sample`` and
    ``greedy_tokens``. ``checkpoints``: the checkpoint StateImage slots (None: no context cache).
    ``lookahead_slots`` of the ``states`` slots are held as lookahead spares (outside ``capacity()``);
    the engine asks for them only for an architecture that declares ``ArchitectureSpec.lookahead``.
    ``dtype``: the activation dtype (None for a Program without one, e.g. a test double).
    """

    #: StateImage slots the Program holds for its own use for its whole life (never a sequence's): not capacity.
    held_state_slots = 0

    def __init__(self, *, vocab_size: int, kv: PagedKVCache, states: StateImageStorage, ops,
                 device: torch.device, max_context: int, checkpoints: StateImageStorage | None = None,
                 lookahead_slots: int = 0, dtype: torch.dtype | None = None) -> None:
        self.vocab_size = vocab_size
        self.page_size = kv.page_size
        self.kv = kv
        self.states = states
        self.ops = ops
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_context = max_context
        self._seqs: dict[SeqId, SequenceRecord] = {}
        self._ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._outstanding: dict[int, PendingBatch] = {}
        self._init_checkpoints(checkpoints)
        if not 0 <= lookahead_slots < states.num_slots:
            raise ProgramError(f"{lookahead_slots} lookahead slots leave no sequence slot of {states.num_slots}")
        self._init_lookahead(lookahead_slots)

    @property
    def speculation_stats(self) -> SpeculationStats:
        """Zero: this bookkeeping runs no speculative rows (a speculating architecture overrides it)."""
        return SpeculationStats()

    @property
    def expert_cache_stats(self) -> ExpertCacheStats:
        """Empty: no device cache of host experts (an architecture that keeps one overrides it)."""
        return ExpertCacheStats()

    def expert_routing(self) -> ExpertRouting:
        """Empty: no device cache of host experts."""
        return ExpertRouting()

    def warm_expert_caches(self, routing: ExpertRouting) -> None:
        if routing.counts:
            raise ProgramError(f"this Program has no device cache of host experts to warm with the routing of "
                               f"{len(routing.counts)} layers")

    # -- the model call (architecture) -----------------------------------------------------------
    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model over ``batch``, updating KV pools and state slots in place. Returns fp32
        logits ``[batch.num_logit_rows, vocab]``: decode rows in order, then the last token of each
        chunk that wants logits, in chunk order (every token of the one ``all_logits`` chunk, in order)."""

    def precomputed_greedy(self, logits: torch.Tensor) -> torch.Tensor | None:
        """``greedy_tokens(logits)`` when the forward that returned this very tensor already computed it
        (a decode graph does, in the same replay), else None. The result is valid as long as ``logits``
        is (until the next forward)."""
        return None

    def precomputed_host_tokens(self, tokens: torch.Tensor) -> HostTokens | None:
        """The host copy of ``tokens`` already on its way, when they are :meth:`precomputed_greedy`'s answer and
        the forward stored them into pinned memory itself (a decode graph does); else None (a copy is queued)."""
        return None

    def capture_decode_graphs(self, max_batch: int) -> tuple[int, ...]:
        """Capture decode CUDA graphs for batch sizes ``1..max_batch``; returns the sizes captured. This
        bookkeeping has no graph-capturable decode forward, so it captures none (``ModelProgram`` does)."""
        return ()

    def close_graphs(self) -> None:
        """Drop the decode graphs (and their memory pool); nothing to drop here."""

    def warm_up(self, limits: WarmupLimits) -> WarmupSummary:
        """Run the start-up warm-up (:mod:`ninfer.program.warmup`; the contract states its invariants). Only
        with no sequence open and no checkpoint held; afterwards no lookahead is outstanding and the lookahead
        counters read as before."""
        from ninfer.program.warmup import run_warm_up

        if self._seqs or self._checkpoints:
            raise ProgramError(f"warm-up needs an empty Program: {len(self._seqs)} sequences and "
                               f"{len(self._checkpoints)} checkpoints are held")
        stats = self.lookahead_stats
        counts = (stats.launched, stats.adopted, stats.dropped)
        try:
            return run_warm_up(self, limits)
        finally:
            self._drop_lookahead()
            stats.launched, stats.adopted, stats.dropped = counts

    # -- queries ---------------------------------------------------------------------------------
    def capacity(self) -> ProgramCapacity:
        return ProgramCapacity(
            total_pages=self.kv.num_pages, free_pages=self.kv.allocator.free_pages,
            total_state_slots=self.states.num_slots - self.lookahead_slots - self.held_state_slots,
            free_state_slots=self.states.free_slots,
            page_size=self.page_size)

    def ledger_length(self, seq: SeqId) -> int:
        return len(self._get(seq).ledger)

    def computed(self, seq: SeqId) -> int:
        return self._get(seq).computed

    def ledger(self, seq: SeqId) -> tuple[int, ...]:
        return tuple(self._get(seq).ledger)

    def state_slot(self, seq: SeqId) -> int:
        return self._get(seq).slot

    # -- media -----------------------------------------------------------------------------------
    def check_media(self, tokens: Sequence[int], prompt_length: int | None,
                    media: Sequence[MediaInput]) -> tuple[int, ...]:
        """No media here (an architecture with an encoder overrides this and :meth:`encode_work`)."""
        refuse_media(media)
        return ()

    def encode_work(self, seq: SeqId, end: int) -> tuple[tuple[int, int], ...]:
        self._get(seq)
        return ()

    # -- lifecycle -------------------------------------------------------------------------------
    def open_sequence(self, tokens: Sequence[int], prompt_length: int | None = None,
                      media: Sequence[MediaInput] = ()) -> SeqId:
        """Start a ledger. ``prompt_length`` (default: all of ``tokens``) separates prompt from
        output for the penalties; a Replay resume passes the original prompt length. ``media``: none here
        (an architecture with an encoder overrides this, checks its media, then calls it without)."""
        refuse_media(media)
        ledger, plen = check_ledger(tokens, prompt_length, vocab_size=self.vocab_size, max_context=self.max_context)
        slot = self.states.allocate()
        if slot is None:
            raise OutOfSlotsError(f"all {self.states.num_slots} state slots are taken")
        sid = self._new_id()
        self._seqs[sid] = SequenceRecord(ledger=ledger, prompt_length=plen, slot=slot)
        return sid

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
        s.check_not_pending(seq, "paused")
        self._forget_lookahead(seq)
        if snapshot:
            return self._snapshot_pause(seq, s)
        ledger = tuple(s.ledger)
        self._free(seq, s)
        return ReplayState(ledger=ledger)

    def release(self, seq: SeqId) -> None:
        s = self._get(seq)
        s.check_not_pending(seq, "released")
        self._forget_lookahead(seq)
        self._free(seq, s)

    # -- execution -------------------------------------------------------------------------------
    def run(self, unit: ExecutionUnit) -> PendingBatch:
        self._refuse_drafts(unit)
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
            if batch.num_logit_rows and logits.dtype != torch.float32:
                # Sampling, logprobs and greedy ties are defined on fp32 logits (the forward contract).
                raise ProgramError(f"forward returned {logits.dtype} logits; the contract is torch.float32")
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
        for c in unit.chunks:
            self._seqs[c.seq].computed += c.num_tokens
        if ahead:
            tokens, logprobs = self._finish_ahead(sampling, drawn)
        return self._new_pending(sampling, tokens, logprobs)

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
        self._commit_inputs(pending, accepted)
        for r in pending.rows:
            s = self._seqs[r.seq]
            a = accepted[r.seq]
            s.ledger.extend(r.tokens[:a])
            s.pending = None
            # The state advanced over every input token; with nothing accepted there is no next input.
            if s.computed != len(s.ledger) - 1:
                s.stale = True
        self._consume(pending)

    def _commit_inputs(self, pending: PendingBatch, accepted: Mapping[SeqId, int]) -> None:
        """Hook of :meth:`commit`, after its checks and before the ledgers grow: a Program whose rows did not
        advance ``computed`` in :meth:`run` (a speculative verify row) advances it here by the accepted
        inputs. Nothing to do here: every input of a plain unit was counted when it ran."""

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
            raise ProgramError(f"score chunk sequence {seq} has no KV reserved for tokens up to {end} "
                               f"(or a page there is shared)")
        chunk = self._chunk_rows(seq, s, end, want_logits=False, all_logits=logits)
        try:
            out = self.forward(ForwardBatch(decode=None, chunks=(chunk,)))
            if logits and (out is None or tuple(out.shape) != (num_tokens, self.vocab_size)):
                raise ProgramError(f"forward returned logits of shape {None if out is None else tuple(out.shape)}, "
                                   f"expected {(num_tokens, self.vocab_size)}")
            if logits and out.dtype != torch.float32:
                raise ProgramError(f"forward returned {out.dtype} logits; the contract is torch.float32")
        except Exception:
            s.stale = True
            s.damaged = True
            raise
        s.computed = end
        if end == len(s.ledger):
            s.stale = True
        return out.float() if logits else None

    # -- internals -------------------------------------------------------------------------------
    def _get(self, seq: SeqId) -> SequenceRecord:
        try:
            return self._seqs[seq]
        except (KeyError, TypeError):
            raise ProgramError(f"unknown or released sequence {seq!r}") from None

    def _new_id(self) -> SeqId:
        return next(self._ids)

    def _free(self, seq: SeqId, s: SequenceRecord) -> None:
        self.kv.release(seq)
        self.states.free(s.slot)
        del self._seqs[seq]

    def _ready(self, seq: SeqId, role: str) -> SequenceRecord:
        s = self._get(seq)
        s.check_ready(seq, role)
        return s

    def _check_outstanding(self, pending: PendingBatch) -> None:
        if pending.consumed:
            raise PendingBatchError(f"pending batch {pending.batch_id} was already consumed")
        if self._outstanding.get(pending.batch_id) is not pending:
            raise PendingBatchError(f"pending batch {pending.batch_id} was not produced by this program")

    def _consume(self, pending: PendingBatch) -> None:
        pending.consumed = True
        del self._outstanding[pending.batch_id]

    def _new_pending(self, sampling: list[tuple[SeqId, RowSampling]], tokens: list[int],
                     logprobs: list[TokenLogprob | None]) -> PendingBatch:
        return self._pending_of([
            PendingRow(seq=sid, tokens=(tok,), logprobs=None if lp is None else (lp,))
            for (sid, _), tok, lp in zip(sampling, tokens, logprobs, strict=True)])

    def _pending_of(self, rows: list[PendingRow]) -> PendingBatch:
        """A new outstanding PendingBatch of ``rows`` (each row's sequence marked pending on it)."""
        bid = next(self._batch_ids)
        for r in rows:
            self._seqs[r.seq].pending = bid
        pending = PendingBatch(batch_id=bid, rows=tuple(rows))
        self._outstanding[bid] = pending
        return pending

    @staticmethod
    def _refuse_drafts(unit: ExecutionUnit) -> None:
        """This bookkeeping runs plain decode steps only: a speculative row (``DecodeRow.drafts``) is refused
        before anything happens (an architecture that speculates overrides :meth:`run`)."""
        for row in unit.decode:
            if row.drafts != 0:
                raise ProgramError(f"decode row of sequence {row.seq} asks to verify {row.drafts!r} drafts, but "
                                   f"this Program does not speculate (ProgramOptions.speculative_tokens is 0)")

    def _damage(self, seqs: Sequence[SeqId]) -> None:
        for sid in seqs:
            self._seqs[sid].stale = True
            self._seqs[sid].damaged = True

    @staticmethod
    def _members(unit: ExecutionUnit) -> list[SeqId]:
        return [r.seq for r in unit.decode] + [c.seq for c in unit.chunks]

    def _prepare(self, unit: ExecutionUnit) -> tuple[ForwardBatch, list[tuple[SeqId, RowSampling]]]:
        """The unit's ForwardBatch and its sampling rows (decode rows, then each chunk that samples, in
        order), after checking every precondition (nothing is mutated)."""
        members = self._members(unit)
        if not members:
            raise ProgramError("an execution unit needs at least one decode row or a chunk")
        if len(set(members)) != len(members):
            raise ProgramError(f"a sequence appears twice in one execution unit: {members}")
        sampling: list[tuple[SeqId, RowSampling]] = []
        decode = None
        if unit.decode:
            seqs, toks, pos, slots = [], [], [], []
            for row in unit.decode:
                s = self._ready(row.seq, "decode")
                if s.computed != len(s.ledger) - 1:
                    raise ProgramError(f"decode sequence {row.seq} is not decode-ready "
                                       f"(computed {s.computed}, ledger {len(s.ledger)})")
                if not self.kv.writable(row.seq, s.computed, s.computed + 1):
                    raise ProgramError(f"decode sequence {row.seq} has no KV reserved for its next token "
                                       f"(or its page there is shared)")
                seqs.append(row.seq)
                toks.append(s.ledger[s.computed])
                pos.append(s.computed)
                slots.append(s.slot)
                sampling.append((row.seq, row.sampling))
            decode = DecodeRows(
                seqs=tuple(seqs), device=self.device, at=tuple(pos), state_slots=tuple(slots),
                state_out_slots=tuple(slots),
                kv_slots=tuple(self.kv.slot_mapping(sq, p, p + 1)[0] for sq, p in zip(seqs, pos, strict=True)),
                pages=tuple(self.kv.page_rows(seqs, [p + 1 for p in pos])), token_ids=tuple(toks))
        chunks = []
        for c in unit.chunks:
            s = self._ready(c.seq, "chunk")
            n = c.num_tokens
            end = s.computed + n if isinstance(n, int) and not isinstance(n, bool) else None
            if end is None or n < 1 or end > len(s.ledger):
                raise ProgramError(f"chunk of sequence {c.seq}: {n!r} tokens from {s.computed} exceed its "
                                   f"ledger of {len(s.ledger)}")
            reaches_end = end == len(s.ledger)
            if reaches_end != (c.sampling is not None):
                raise ProgramError(f"chunk of sequence {c.seq} ending at {end} of {len(s.ledger)}: sampling "
                                   f"must be given exactly when the chunk reaches the ledger's end")
            if not self.kv.writable(c.seq, s.computed, end):
                raise ProgramError(f"chunk sequence {c.seq} has no KV reserved for tokens up to {end} "
                                   f"(or a page there is shared)")
            if reaches_end:
                sampling.append((c.seq, c.sampling))
            chunks.append(self._chunk_rows(c.seq, s, end, want_logits=reaches_end))
        return ForwardBatch(decode=decode, chunks=tuple(chunks)), sampling

    def _chunk_rows(self, seq: SeqId, s: SequenceRecord, end: int, *, want_logits: bool,
                    all_logits: bool = False) -> ChunkRows:
        """Ledger tokens ``[computed, end)`` of ``seq``, described on the host."""
        return ChunkRows(
            seq=seq, device=self.device, slot=s.slot, start=s.computed, token_ids=tuple(s.ledger[s.computed:end]),
            kv_slots=tuple(self.kv.slot_mapping(seq, s.computed, end)),
            pages=tuple(self.kv.page_rows([seq], [end])[0]), want_logits=want_logits, all_logits=all_logits)

    def _sample(self, logits: torch.Tensor, rows: list[tuple[SeqId, RowSampling]]
                ) -> tuple[list[int], list[TokenLogprob | None]]:
        """The rows' tokens and asked logprobs on the host (:func:`~ninfer.program.sampling.sample_rows`)."""
        return sample_rows(logits, rows, ops=self.ops, vocab_size=self.vocab_size, history=self._history,
                           precomputed_greedy=self.precomputed_greedy,
                           precomputed_host_tokens=self.precomputed_host_tokens)

    def _history(self, seq: SeqId) -> tuple[list[int], int]:
        s = self._seqs[seq]
        return s.ledger, s.prompt_length
