"""The Program side of speculative decoding as a mixin for a ModelProgram whose layers follow
:mod:`ninfer_qwen3_5.speculative_state` (verify chunks stepped into per-position StateImage snapshots).

A Program mixing in :class:`SpeculativeProgram` sets ``self.speculation`` (a
:class:`~ninfer_qwen3_5.speculative_decode.SpeculativeDecoding`, or None: no speculation, every hook falls back to
the base) and calls :meth:`SpeculativeProgram.configure_speculation` once; its model call builds its
:class:`~ninfer_qwen3_5.layers.context.StepContext` with :meth:`SpeculativeProgram.step_context`, which stages each
verify row's live image into its first snapshot and attaches the verify plan. Every unit then runs through the
speculation (verify-only units replay the verify graphs when captured, the rest eagerly: no decode graphs), and
commit, abort, scoring, warm-up and release keep its bookkeeping.

Used by the Qwen3.5 Program (which adds vision and DFlash around them) and the Qwen4-Exp Program (ninfer-qwen4exp).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from ninfer.contracts.program import (
    ExecutionUnit,
    PendingBatch,
    ProgramError,
    SeqId,
    SpeculationStats,
    WarmupLimits,
    WarmupSummary,
)
from ninfer.program.batch import PackedBatch

from ninfer_qwen3_5.layers.context import StepContext
from ninfer_qwen3_5.speculative_decode import SpeculativeDecoding
from ninfer_qwen3_5.speculative_state import SpeculativeSnapshots, verify_plan
from ninfer_qwen3_5.verify_graphs import VerifyGraphs


class SpeculativeProgram:
    """Mixin (before the ModelProgram base in the bases): the speculative hooks of a Program (module docstring)."""

    speculation: SpeculativeDecoding | None = None
    snapshots: SpeculativeSnapshots | None = None

    @property
    def speculation_stats(self) -> SpeculationStats:
        m = self.speculation
        if m is None:
            return SpeculationStats()
        return SpeculationStats(verifies=m.verified, drafted=m.drafted, accepted=m.accepted)

    def run(self, unit: ExecutionUnit) -> PendingBatch:
        if self.speculation is None:
            return super().run(unit)
        return self.speculation.run(unit)

    def _commit_inputs(self, pending: PendingBatch, accepted: Mapping[SeqId, int]) -> None:
        if self.speculation is not None:
            self.speculation.commit_inputs(pending, accepted)

    def abort_pending(self, pending: PendingBatch) -> None:
        self._check_outstanding(pending)
        if self.speculation is not None:
            self.speculation.abort(pending)
        super().abort_pending(pending)

    def score_chunk(self, seq: SeqId, num_tokens: int, *, logits: bool = True) -> torch.Tensor | None:
        if self.speculation is not None:
            self.speculation.forget(seq)   # scoring keeps no drafter state: the drafter restarts after it
        return super().score_chunk(seq, num_tokens, logits=logits)

    def warm_up(self, limits: WarmupLimits) -> WarmupSummary:
        """The base warm-up; the speculative counters read afterwards as before (its rows are no serving)."""
        m = self.speculation
        counts = None if m is None else (m.verified, m.drafted, m.accepted)
        try:
            return super().warm_up(limits)
        finally:
            if m is not None:
                m.verified, m.drafted, m.accepted = counts

    def capture_decode_graphs(self, max_batch: int) -> tuple[int, ...]:
        """Without speculation, the decode graphs. With it, the verify graphs instead
        (:mod:`ninfer_qwen3_5.verify_graphs`: units of verify rows only, each of the full k drafts) and the drafter's
        own (:meth:`SpeculativeDecoding.capture_draft_graphs`); every other unit runs eagerly (a plain decode row needs the drafter's taps, which the decode graphs do not return)."""
        m = self.speculation
        if m is None:
            return super().capture_decode_graphs(max_batch)
        if self._seqs:
            raise ProgramError("verify graphs must be captured before any sequence is opened")
        rows = min(max_batch, self.snapshots.max_rows, self.states.num_slots)
        graphs = VerifyGraphs(self, m.model_forward, max_rows=rows, inputs=m.k + 1,
                              max_pages=self.kv.pages_for(self.max_context))
        with torch.inference_mode():
            graphs.capture()
            m.capture_draft_graphs(rows, self.kv.pages_for(self.max_context))
        m.graphs = graphs
        return graphs.batch_sizes

    def close_graphs(self) -> None:
        if self.speculation is not None:
            self.speculation.close_draft_graphs()
        if self.speculation is not None and self.speculation.graphs is not None:
            self.speculation.graphs.close()
            self.speculation.graphs = None
        super().close_graphs()

    def _free(self, seq: SeqId, s) -> None:
        if self.speculation is not None:
            self.speculation.forget(seq)
        super()._free(seq, s)

    def configure_speculation(self, max_rows: int, max_inputs: int) -> SpeculativeSnapshots:
        """Allocate the verify snapshots: up to ``max_rows`` speculating rows of up to ``max_inputs`` (k + 1)
        inputs each, in this Program's StateImage layout."""
        if self.snapshots is not None:
            raise ProgramError("speculation is configured already")
        self.snapshots = SpeculativeSnapshots(self.layout.state, max_rows, max_inputs, self.device)
        return self.snapshots

    def select_snapshot(self, row_slot: int, num_inputs: int) -> None:
        """Commit ``num_inputs`` accepted inputs of the verify row whose live StateImage slot is ``row_slot``."""
        if self.snapshots is None:
            raise ProgramError("speculation is not configured")
        self.snapshots.select(self.states, row_slot, num_inputs)

    def step_context(self, batch: PackedBatch) -> StepContext:
        """What every layer sees of ``batch`` (rotary tables not yet built); a batch with verify chunks first
        stages each verify row's live image into its first snapshot where the model's layers read it there
        (``model.stages_verify_snapshots``)."""
        verify = None
        if batch.has_verify:
            snaps = self.snapshots
            if snaps is None:
                raise ProgramError("a verify chunk needs speculation configured (configure_speculation)")
            # Per-token steps and staging only for models with a layer that verifies token by token.
            staged = self.model.stages_verify_snapshots
            verify = verify_plan(batch, snaps.storage.num_slots, self.device, steps=staged)
            if staged:
                for slot, snapshot_slots in zip(batch.chunk_slots, batch.chunk_snapshots, strict=True):
                    if snapshot_slots is not None:
                        snaps.stage(self.states, slot, snapshot_slots[0])
        return StepContext(
            num_decode=batch.num_decode, num_chunk=batch.num_chunk, positions=batch.positions, cos=None, sin=None,
            slot_mapping=batch.slot_mapping, decode_slots=batch.decode_slots, decode_out_slots=batch.decode_out_slots,
            decode_kv_lens=batch.decode_kv_lens, decode_page_tables=batch.decode_page_tables,
            chunk_slots=batch.chunk_slots, chunk_lens=batch.chunk_lens, chunk_cu_q=batch.chunk_cu_q,
            chunk_kv_lens=batch.chunk_kv_lens, chunk_page_tables=batch.chunk_page_tables, kv=self.kv,
            states=self.states, verify=verify, snapshots=None if verify is None else self.snapshots.storage,
            chunk_state_slots=batch.chunk_state_slots, token_valid=_token_valid(batch) if batch.padded else None)


def _token_valid(batch: PackedBatch) -> torch.Tensor:
    """The tokens of a padded flat call that belong to a row (those before the last offset), as a device mask."""
    n = batch.tokens.shape[0]
    valid = torch.arange(n, device=batch.tokens.device) < batch.chunk_cu_q[-1]
    return valid.view(n, 1, 1)
