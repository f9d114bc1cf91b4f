"""The MTP drafter of the speculative Program step (:mod:`ninfer_qwen3_5.speculative_decode`).

A drafting row drafts ``n`` tokens with the MTP head (:mod:`ninfer_qwen3_5.mtp`, greedy); every forward returns
the target's final-normed hidden states (the taps), which feed the MTP head.

MTP bookkeeping, per sequence (:class:`Frontier`): ``done``, the MTP pool's final positions ``[0, done)``,
and ``hidden``, the target's hidden states of positions ``[done, computed)`` not yet fed to the MTP layer.
Invariant: ``done <= computed``, and the MTP K/V of position ``t < done`` was computed from the target's
hidden state at ``t`` and the committed token ``x_{t+1}`` (a sequence opened from a checkpoint starts at
``done = computed``: the checkpoint's MTP K/V below it are whatever its origin wrote, which only changes
how many drafts are accepted, never which tokens are committed).

- A prefill chunk appends its positions' hidden states, then the MTP layer runs at once over every
  position whose next token is in the ledger (all of a non-final chunk; all but the last of a final one).
- A plain decode row appends its one hidden state (its next token is still provisional).
- A drafting row first feeds the MTP layer positions ``[done, computed)`` (their next tokens are all in the
  ledger now), whose last output drafts ``d_1``; it needs ``done < computed`` (a row without a pending hidden
  state, right after a checkpoint open, decodes plainly that step). Its frontier is settled at commit: with
  ``a >= 1`` accepted tokens, ``done = computed_before`` and ``hidden`` = the verify's hidden states of its
  first ``a`` inputs (``t_last, d_1..d_{a-1}``, the committed ones); with ``a = 0`` (or an abort) it is left
  as it was, so the next draft recomputes the same positions. The MTP K/V past ``done`` written by a draft
  are provisional and are overwritten before anything reads them.
- The MTP pool shares the target's page tables, so MTP K/V of a position below ``computed`` may be written
  into a page a checkpoint shares; the target's pools are never written there, and the MTP entries only move
  the acceptance rate of a sequence later opened from that checkpoint, never its tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from ninfer.contracts.program import DecodeRow, ProgramError, SeqId
from ninfer.program.batch import to_device
from ninfer.program.draft_masks import MaskedDrafting, VerifyMasks

from ninfer_qwen3_5.mtp.context import mtp_step_context
from ninfer_qwen3_5.mtp.draft_graphs import DraftGraphs
from ninfer_qwen3_5.mtp.head import DraftRow, Qwen35MTPHead
from ninfer_qwen3_5.speculative_decode import Drafts, Part, SpeculativeDecoding

_log = logging.getLogger(__name__)


@dataclass
class Frontier:
    """A sequence's MTP progress (module docstring): MTP positions ``[0, done)`` are final; ``hidden``
    ``[computed - done, H]`` holds the target's hidden states of positions ``[done, computed)`` (None: none)."""

    done: int
    hidden: torch.Tensor | None = None

    def pending(self) -> int:
        return 0 if self.hidden is None else int(self.hidden.shape[0])

    def append(self, h: torch.Tensor) -> None:
        # Copies, never views: a view of one forward's [N, H] hidden states would keep all of it alive.
        self.hidden = h.clone() if self.hidden is None else torch.cat((self.hidden, h))

    def consume(self, n: int) -> None:
        self.done += n
        self.hidden = None if n >= self.pending() else self.hidden[n:].clone()


class MTPDecoding(SpeculativeDecoding):
    """Speculative decoding drafting up to ``k`` tokens per row with the MTP ``head`` (module docstring)."""

    def __init__(self, program, head: Qwen35MTPHead, k: int) -> None:
        super().__init__(program, k)
        self.head = head
        self.frontiers: dict[SeqId, Frontier] = {}

    def model_forward(self, packed, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        return self.p.model.forward(packed.tokens, ctx, packed.logit_rows, return_hidden="all")

    def may_draft(self, seq: SeqId) -> bool:
        return self.frontiers[seq].pending() > 0

    def touch(self, seq: SeqId) -> None:
        if seq not in self.frontiers:
            self.frontiers[seq] = Frontier(done=self.p.computed(seq))

    def draft(self, verify: list[tuple[DecodeRow, int]], masks: Mapping[SeqId, VerifyMasks]) -> Drafts:
        """Each verify row's drafts (host lists), one MTP draft call per distinct draft count; a constrained
        row's drafts follow its grammar (``masks`` fills as they are drafted)."""
        p = self.p
        out: dict[SeqId, list[int]] = {}
        for n in sorted({n for _, n in verify}):
            group = [row.seq for row, m in verify if m == n]
            masked = MaskedDrafting([(r, masks[sid]) for r, sid in enumerate(group) if sid in masks])
            rows, toks, hid = [], [], []
            for sid in group:
                f, s = self.frontiers[sid], p._seqs[sid]
                if f.done + f.pending() != s.computed:
                    raise ProgramError(f"sequence {sid}: MTP frontier at {f.done} with {f.pending()} hidden states "
                                       f"does not reach computed {s.computed}")
                rows.append(DraftRow(sid, f.done, f.pending()))
                toks.extend(s.ledger[f.done + 1:s.computed + 1])
                hid.append(f.hidden)
            d = self.head.draft(p.kv, rows, to_device(toks, torch.int64, p.device),
                                torch.cat(hid), n, constrain=masked if masked.index else None)
            if masked.index:
                masked.finish(d.tokens)
            for sid, ds in zip(group, d.tokens.tolist(), strict=True):
                out[sid] = ds
        return Drafts([out[row.seq] for row, _ in verify])

    def absorb(self, parts: list[Part]) -> None:
        for part in parts:
            self.frontiers[part.seq].append(part.taps)
        self._catch_up([part.seq for part in parts if part.chunk])

    def _catch_up(self, seqs: list[SeqId]) -> None:
        """Feed the MTP layer every position of ``seqs`` whose next token is in the ledger (one call)."""
        p = self.p
        parts = []
        for sid in seqs:
            f, s = self.frontiers[sid], p._seqs[sid]
            n = min(s.computed, len(s.ledger) - 1) - f.done
            if n > 0:
                parts.append((sid, f, n))
        if not parts:
            return
        toks = [t for sid, f, n in parts for t in p._seqs[sid].ledger[f.done + 1:f.done + n + 1]]
        hidden = torch.cat([f.hidden[:n] for _, f, n in parts])
        ctx = mtp_step_context(p.kv, chunks=[(sid, f.done, n) for sid, f, n in parts], device=p.device)
        self.head.forward(to_device(toks, torch.int64, p.device), hidden, ctx,
                          torch.zeros(0, dtype=torch.int64, device=p.device))
        for _, f, n in parts:
            f.consume(n)

    def commit_row(self, seq: SeqId, start: int, taps: torch.Tensor, accepted: int) -> None:
        f = self.frontiers[seq]
        f.done, f.hidden = start, taps

    def forget_seq(self, seq: SeqId) -> None:
        """A later run starts the sequence afresh at ``done = computed``."""
        self.frontiers.pop(seq, None)

    def capture_draft_graphs(self, max_rows: int, max_pages: int) -> None:
        """Drafts as CUDA graphs (:mod:`ninfer_qwen3_5.mtp.draft_graphs`): whole drafts whose rows all have ``n``
        pending positions, for each ``n`` in ``1..k+1`` (the counts a verify leaves), and steps 2..k of any other
        draft (none for k = 1).

        A capture that fails leaves drafting eager, with a warning naming the error: the graphs only save launch
        time (the drafts are the eager steps' either way), so a device or op that cannot be captured must not stop
        the engine from starting."""
        p = self.p

        def graphs(pending: int) -> DraftGraphs:
            return DraftGraphs(self.head, p.kv, max_rows=max_rows, k=self.k, max_pages=max_pages,
                               hidden_size=self.head.cfg.hidden_size, dtype=p.dtype, device=p.device,
                               pending=pending)

        made: list[DraftGraphs] = []
        try:
            # Largest inputs first; every set captures into the first one's pool (drafts replay one at a time).
            for n in (*range(self.k + 1, 0, -1), *((0,) if self.k >= 2 else ())):
                g = graphs(n)
                if made:
                    g.share_pool(made[0])
                made.append(g)
                g.capture()
        except Exception as exc:   # noqa: BLE001 - any capture failure: eager drafting, said in the log
            for g in made:
                g.close()
            _log.warning("MTP draft graphs could not be captured (%s: %s); drafting runs eagerly",
                         type(exc).__name__, exc)
            return
        self.head.whole_graphs = {g.pending: g for g in made if g.pending}
        self.head.graphs = next((g for g in made if not g.pending), None)

    def close_draft_graphs(self) -> None:
        for g in (*self.head.whole_graphs.values(), self.head.graphs):
            if g is not None:
                g.close()
        self.head.graphs, self.head.whole_graphs = None, {}
