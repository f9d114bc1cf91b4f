"""Lookahead decode: the next decode step is launched before this step's tokens reach the host.

Why: the host part of a decode step (the engine's commit, Frontend preview and scheduling, then
preparing the next inputs) is serial with the GPU when each step waits for the previous one's
tokens, a sizeable share of a small-batch decode step. With lookahead, ``SequenceProgram.run``
launches step n+1 for the same rows from step n's tokens *on the device* and only then waits for
step n's tokens, so the engine commits step n while the GPU computes step n+1. The engine's contract
does not change: the Program *adopts* the lookahead when the engine's next unit asks for exactly
that work, and drops it otherwise.

Invariants (enforced by :class:`LookaheadDecode`, a mixin of SequenceProgram):
- A lookahead never changes what the Program has committed. It reads each row's StateImage slot and
  writes the new state into a *spare* slot (``DecodeRows.out_slots``); it writes the KV of position
  ``computed`` (the row's next token) into a page the row holds alone; ``computed`` and the ledger are
  untouched. Dropping it costs only its GPU time.
- Adoption (in ``run``) requires a decode-only unit (no chunk) whose rows are the lookahead's rows or an
  in-order subset of them, and per row: not pending, stale or damaged; the last ledger token is the one the
  lookahead consumed at the same position (the accepted token of the previous batch); the row's KV
  page there is still its own; its RowSampling equals the predicted one (same params and seed,
  step + 1, no mask). Adopting swaps the row's slot with its spare and advances ``computed`` by one:
  what running the unit would have done, with the same kernels on the same inputs (a subset was
  computed in the lookahead's larger batch: equal as far as the kernels are batch-invariant, as for
  any change of batch composition).
- A row whose token drawn now is its last (its ``max_tokens``, or max_context) is left out of the
  lookahead: nothing would adopt its next step.
- Only rows whose next token is decided on the device are eligible (:func:`lookahead_eligible`): no
  allowed-token mask (the grammar matcher advances on the host), no penalties (their counts come from
  the host ledger). Logprobs are fine: a step's log-softmax rows are computed on the device before the
  next step is queued (which overwrites the graph's logits) and come back with the tokens.
- Spare slots: the Program holds ``lookahead_slots`` StateImage slots outside ``capacity()``; a
  lookahead takes one per row and gives one back per row when adopted (the row's old slot) or dropped.
- Everything runs on one CUDA stream, so a slot or page freed after a lookahead was queued is only
  rewritten by work queued after it. Inputs reach the device through pinned, non-blocking copies and
  tokens come back through one (:class:`DeviceTokens`) or, for a decode graph's greedy tokens, through
  pinned memory the graph writes itself, so the host never waits for the stream while a lookahead is
  queued except for the tokens it needs.
- One declaration opts an architecture in: ``ArchitectureSpec.lookahead``. The engine then gives its
  Program ``ProgramOptions.lookahead_slots``, and only then; the architecture's decode forward must
  honour ``out_slots`` and rewrite every StateImage field of the out slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.contracts.program import (
    ExecutionUnit,
    LookaheadStats,
    PendingBatch,
    RowSampling,
    SeqId,
    TokenLogprob,
)
from ninfer.program.batch import DecodeRows, ForwardBatch, HostTokens, to_device
from ninfer.program.ledger import SequenceRecord
from ninfer.program.sampling import draw, token_logprobs, wants_logprobs
from ninfer.storage.kv_pool import PagedKVCache
from ninfer.storage.state_image import StateImageStorage


def lookahead_eligible(sampling: RowSampling) -> bool:
    """Whether a row's next token can be drawn on the device alone (see the module docstring)."""
    p = sampling.params
    return (sampling.mask is None and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0)


def predicted(sampling: RowSampling) -> RowSampling:
    """The RowSampling the engine will send for the row's next token (one more token sampled)."""
    return RowSampling(sampling.params, sampling.seed, sampling.step + 1)


class DeviceTokens:
    """A step's drawn tokens (device int64 [B]) and, for the rows that asked, their log-softmax rows
    (device fp32 [len(want), V], row i for row ``want[i]``) on their way to the host: the copies are
    queued at construction (behind whatever the stream holds) and :meth:`tolist` / :meth:`logprobs`
    wait for those copies only, not for work queued later. ``host``: the tokens are already on their way
    (a decode graph stores its greedy tokens into pinned memory itself,
    :class:`~ninfer.program.batch.HostTokens`), so no token copy is queued."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor | None = None,
                 want: Sequence[int] = (), host: HostTokens | None = None) -> None:
        self.device = tokens
        self.want = list(want)
        self._ready: torch.cuda.Event | None = None
        self._graph_host = host
        if tokens.device.type == "cuda":
            self._host = None if host is not None else _pinned_copy(tokens)
            self._lp = None if logprobs is None else _pinned_copy(logprobs)
            if self._host is not None or self._lp is not None:
                self._ready = torch.cuda.Event()
                self._ready.record()
        else:
            self._host, self._lp = tokens, logprobs

    def tolist(self) -> list[int]:
        if self._graph_host is not None:
            return self._graph_host.values()
        if self._ready is not None:
            self._ready.synchronize()
        return [int(t) for t in self._host.tolist()]

    def logprobs(self) -> torch.Tensor | None:
        """The host fp32 log-softmax rows of ``want`` (None when no row asked)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._lp


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class Lookahead:
    """One launched lookahead step (owned by the Program; see the module docstring). Row ``j`` read
    slot ``slots[j]`` at position ``positions[j]`` and wrote ``spares[j]``; ``seqs[j]`` is None once
    the row was released or paused (its spare is then already back in the pool)."""

    seqs: list[SeqId | None]
    positions: list[int]
    spares: list[int | None]
    sampling: list[RowSampling]     # predicted for the next unit's rows
    tokens: DeviceTokens            # the tokens it sampled
    inputs: list[int] | None = None  # the tokens it consumed, once the previous batch's copy landed

    def forget(self, seq: SeqId) -> int | None:
        """Take ``seq``'s row out; returns its spare slot (None if the row is not here)."""
        for j, s in enumerate(self.seqs):
            if s == seq:
                spare, self.seqs[j], self.spares[j] = self.spares[j], None, None
                return spare
        return None

    def live_spares(self) -> list[int]:
        return [s for s in self.spares if s is not None]


class LookaheadDecode:
    """Mixin of :class:`~ninfer.program.base.SequenceProgram`: launching, adopting and dropping lookahead
    steps (see the module docstring). The host class provides the attributes annotated here and
    ``forward(batch)``, ``precomputed_greedy``, ``precomputed_host_tokens``, ``_new_pending(rows, tokens,
    logprobs)`` and ``_damage(seqs)``, and calls :meth:`_init_lookahead` once."""

    kv: PagedKVCache
    states: StateImageStorage
    ops: object
    vocab_size: int
    device: torch.device
    max_context: int
    _seqs: dict[SeqId, SequenceRecord]

    def _init_lookahead(self, lookahead_slots: int) -> None:
        self.lookahead_slots = lookahead_slots
        self._spares: list[int] = [self.states.allocate() for _ in range(lookahead_slots)]
        self._lookahead: Lookahead | None = None
        self.lookahead_stats = LookaheadStats()

    def _draw_on_device(self, logits: torch.Tensor, rows: list[tuple[SeqId, RowSampling]]) -> DeviceTokens:
        """Tokens (and the log-softmax rows of the rows that want logprobs) drawn on the device, their
        copies to the host queued: nothing here waits for the stream."""
        raw = logits.float()
        want = [b for b, (_, rs) in enumerate(rows) if wants_logprobs(rs)]
        lp = None
        if want:
            picked = raw if len(want) == len(rows) else raw.index_select(0, to_device(want, torch.int64, raw.device))
            lp = torch.log_softmax(picked, dim=-1)
        tokens = draw(raw, rows, self.ops, self.vocab_size, self.precomputed_greedy)
        return DeviceTokens(tokens, lp, want, host=self.precomputed_host_tokens(tokens))

    def _may_look_ahead(self, unit: ExecutionUnit) -> bool:
        # A speculative row (drafts > 0) commits a variable number of tokens: nothing to run ahead of.
        return (bool(unit.decode) and not unit.chunks and len(unit.decode) <= len(self._spares)
                and all(r.drafts == 0 and lookahead_eligible(r.sampling) for r in unit.decode))

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
            logits = self.forward(ForwardBatch(decode=rows))
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
        anything else (see the module docstring for the rule)."""
        if la.inputs is None or unit.chunks or not unit.decode:
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
        logprobs = token_logprobs(lp, want, sampling, tokens_now)
        self._note_lookahead_inputs(sampling, tokens_now)
        return self._new_pending(sampling, tokens_now, logprobs)

    def _finish_ahead(self, sampling: list[tuple[SeqId, RowSampling]], drawn: DeviceTokens
                      ) -> tuple[list[int], list[TokenLogprob | None]]:
        """After a unit drew ``drawn`` on the device (its rows' ``computed`` already advanced): launch the
        next step of its rows, then wait for this step's tokens and logprobs."""
        self._launch_lookahead(sampling, drawn.device)
        tokens = drawn.tolist()
        logprobs = token_logprobs(drawn.logprobs(), drawn.want, sampling, tokens)
        self._note_lookahead_inputs(sampling, tokens)
        return tokens, logprobs

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
