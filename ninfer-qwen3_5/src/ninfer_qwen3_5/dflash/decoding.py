"""The DFlash / DFlash2 drafter of the speculative Program step (:mod:`ninfer_qwen3_5.speculative_decode`).

Every target forward of a DFlash Program taps the drafter's target layers (``aux_layers``) and writes the context
K/V (:meth:`~ninfer_qwen3_5.dflash.drafter.DFlashDrafter.write_context`) of every token it computes, from those taps,
at the token's position and KV slot: one write of the whole forward, inside it (:meth:`DFlashDecoding.model_forward`),
so a verify CUDA graph (:mod:`ninfer_qwen3_5.verify_graphs`) records it with the forward and the eager forward runs
the same ops on the same shapes. Invariant, for every open sequence outside
:meth:`~ninfer_qwen3_5.speculative_decode.SpeculativeDecoding.run`: the drafter's pools hold the context K/V of
every position ``t < computed``, computed from the target's own hidden states at ``t``; they hold nothing else that
anything reads. How it is kept:

- positions a forward computes outside a verify (prefill chunks, plain decode rows, ``score_chunk``) are committed
  inputs when the forward returns;
- a verify row's inputs ``[computed, computed + n + 1)`` are all written by the verify forward, as the target
  writes its own KV there; the ``a`` accepted ones become context at commit, the rest stay at or past
  ``computed`` (provisional, like the target's KV there: a rejected draft's or an aborted verify's position is
  rewritten by whatever is committed there before anything reads it);
- a drafting row's block writes K/V at its positions ``[computed, computed + n + 1)``, at or past ``computed``:
  provisional, overwritten by the context K/V of whatever is committed there before anything reads it (the verify
  forward of the same step, at the latest);
- a sequence opened from a checkpoint (or resumed from a Snapshot) holds the pages of the sequence it came from,
  whose drafter pools held the context K/V of every position below the checkpoint; a Replay re-prefills.

So a decode-ready row can always draft: its block of ``[t_last, mask x n]`` at positions ``computed..computed+n``
attends over the context ``[0, computed)`` and itself. Drafts are greedy (DFlash: the argmax per position;
DFlash2: the selector's best path), except DFlash2 rows sampling at temperature > 0, which draw their path from
the selector's distribution and are accepted by rejection sampling against it (:mod:`.sampling`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from ninfer.contracts.program import DecodeRow, SeqId
from ninfer.program.batch import PackedBatch, to_device
from ninfer.program.draft_masks import MaskedDrafting, VerifyMasks

from ninfer_qwen3_5.dflash.drafter import BlockRow, DFlashDrafter
from ninfer_qwen3_5.dflash.graphs import DFlashGraphs
from ninfer_qwen3_5.dflash.propose import argmax_path, select_path
from ninfer_qwen3_5.dflash.sampling import sampled_acceptance
from ninfer_qwen3_5.speculative_decode import Drafts, Part, SpeculativeDecoding

_log = logging.getLogger(__name__)


class DFlashDecoding(SpeculativeDecoding):
    """Speculative decoding drafting up to ``k`` tokens per row with a DFlash / DFlash2 ``drafter`` (module
    docstring)."""

    #: The verify rows' taps were written in their forward: commit needs no copy of them.
    keeps_verify_taps = False

    def __init__(self, program, drafter: DFlashDrafter, k: int) -> None:
        super().__init__(program, k)
        self.drafter = drafter
        self.layers = drafter.cfg.target_layer_ids
        #: The block graphs (:mod:`.graphs`) of blocks of k + 1 tokens, when captured.
        self.block_graphs: DFlashGraphs | None = None

    def model_forward(self, packed: PackedBatch, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """The target forward, then the context K/V of all its tokens in one write (module docstring), on the
        forward's own device positions and KV slots: no host lists, and inside a verify graph's capture."""
        logits, aux = self.p.model.forward(packed.tokens, ctx, packed.logit_rows, aux_layers=self.layers)
        self.drafter.write_context(self.p.kv, aux, ctx.positions, ctx.slot_mapping)
        return logits, aux

    def plain_forward(self, packed: PackedBatch, ctx) -> torch.Tensor:
        """A forward outside :meth:`run` (``score_chunk``), its positions' context K/V written with it."""
        return self.model_forward(packed, ctx)[0]

    def may_draft(self, seq: SeqId) -> bool:
        return True

    def draft(self, verify: list[tuple[DecodeRow, int]], masks: Mapping[SeqId, VerifyMasks]) -> Drafts:
        """One block forward for every verify row, then each group of rows drafting the same count walks its
        positions (a constrained row's masks fill as it drafts). Rows the block graphs fit, none constrained and
        none sampling a DFlash2 path, replay one graph instead."""
        p, d = self.p, self.drafter
        rows = [BlockRow(row.seq, p.computed(row.seq), p._seqs[row.seq].ledger[-1], n + 1) for row, n in verify]
        g = self.block_graphs
        if (g is not None and g.fits(rows) and not any(row.seq in masks for row, _ in verify)
                and (d.cfg.generation == 1 or all(row.sampling.params.temperature <= 0 for row, _ in verify))):
            return Drafts(g.run(rows)[2].tolist())
        hidden = d.block_hidden(p.kv, rows)
        starts, at = [], 0
        for _, n in verify:
            starts.append(at)
            at += n
        tokens: list[list[int]] = [[] for _ in verify]
        q: dict[int, torch.Tensor] = {}
        for n in sorted({n for _, n in verify}):
            group = [r for r, (_, m) in enumerate(verify) if m == n]
            idx = to_device([i for r in group for i in range(starts[r], starts[r] + n)], torch.int64, p.device)
            h = hidden.index_select(0, idx).view(len(group), n, -1)
            masked = MaskedDrafting([(g, masks[verify[r][0].seq]) for g, r in enumerate(group)
                                     if verify[r][0].seq in masks])
            constrain = masked if masked.index else None
            logits = d.logits(h)
            if d.cfg.generation == 1:
                drafted, q_full = argmax_path(logits, constrain), None
            else:
                samp = [verify[r][0].sampling for r in group]
                drafted, q_full = select_path(
                    logits, p.ops.linear(h, d.selector_hidden),
                    to_device([rows[r].anchor for r in group], torch.int64, p.device),
                    d.selector_predecessor, d.selector_successor, d.cfg.selector_top_k,
                    [s.params.temperature for s in samp], [s.seed for s in samp], [s.step for s in samp], constrain)
            if masked.index:
                masked.finish(drafted)
            for g, (r, ds) in enumerate(zip(group, drafted.tolist(), strict=True)):
                tokens[r] = ds
                if q_full is not None and verify[r][0].sampling.params.temperature > 0:
                    q[r] = q_full[g]
        return Drafts(tokens, q or None)

    def capture_draft_graphs(self, max_rows: int, max_pages: int) -> None:
        """The block graphs (:mod:`.graphs`) for ``1..max_rows`` rows of full blocks (``k`` drafts); a row near its
        budget drafts fewer and runs eagerly. A capture that fails leaves drafting eager, with a warning naming the
        error (the graphs only save launch time; the drafts are the eager step's either way)."""
        g = DFlashGraphs(self.drafter, self.p.kv, max_rows=max_rows, length=self.k + 1, max_pages=max_pages)
        try:
            g.capture()
        except Exception as exc:   # noqa: BLE001 - any capture failure: eager drafting, said in the log
            g.close()
            _log.warning("DFlash block graphs could not be captured (%s: %s); drafting runs eagerly",
                         type(exc).__name__, exc)
            return
        self.block_graphs = g

    def close_draft_graphs(self) -> None:
        if self.block_graphs is not None:
            self.block_graphs.close()
            self.block_graphs = None

    def accept_sampled(self, processed, rows, ns, starts, drafts: Drafts, num) -> dict[int, list[int]]:
        return sampled_acceptance(processed, rows, ns, starts, drafts, num)

    def absorb(self, parts: list[Part]) -> None:
        """Nothing: :meth:`model_forward` wrote these positions' context."""

    def commit_row(self, seq: SeqId, start: int, taps: torch.Tensor | None, accepted: int) -> None:
        """Nothing: the verify forward wrote the row's accepted inputs' context (module docstring)."""
