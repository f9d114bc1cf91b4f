"""CUDA graphs of the MTP drafter's autoregressive steps, one per exact count of drafting rows.

:meth:`~ninfer_qwen3_5.mtp.head.Qwen35MTPHead.draft` runs ``k`` MTP steps. Step 1 takes each row's pending
positions (a variable count per row: the tokens the last verify committed), so it stays eager. Steps ``2..k`` are
one decode row per sequence at positions ``p + 1 .. p + k - 1`` (``p`` the row's last pending position), the same
shapes every time: this module records those ``k - 1`` steps and their greedy argmaxes as one graph per row count
``B = 1..max_rows``. Eagerly each step costs a host-built context (several small copies) and a few dozen launches,
more host time than the GPU spends on one MTP layer and the LM head at small ``B``.

Invariants:
- Static inputs, rewritten before each replay: the first draft token and the normed output of step 1 (device
  copies), and per step ``i`` the rows' positions ``p + i``, KV slots and KV lengths ``p + i + 1``, and the rows'
  page tables (``max_pages`` wide), all computed on the host from ``p`` and the sequence's pages (two host-to-device
  copies). A replay runs what the eager steps run for the same rows: the same ops on the same shapes but the page
  table's width, which does not change a row's result (:mod:`ninfer.ops.triton.attention`).
- The graph writes the MTP pool's K/V of positions ``p + 1 .. p + k - 1``: provisional slots, as the eager steps
  write them (the head's ``draft`` docstring says why they are never read before being rewritten).
- Its output, int64 ``[B, k - 1]`` (drafts ``d_2..d_k``), lives in graph memory until the next replay of any of
  these graphs; the caller copies it first. No logits come out (a greedy drafter needs none).
- Capture (at Program construction, while no sequence exists) runs each size eagerly first, then records it, on
  positions ``1..k-1`` of the first pages: MTP K/V written there is garbage afterwards (written before read).
- Without CUDA (the CPU) ``run`` executes the static-input steps eagerly; tests use that to check the static inputs
  against the eager draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from ninfer.contracts.program import ProgramError
from ninfer.program.graphs import StaticGraphs
from ninfer.storage.kv_pool import PagedKVCache

from ninfer_qwen3_5.layers.context import StepContext


class DraftGraphs(StaticGraphs):
    """Steps ``2..k`` of ``head``'s draft for ``1..max_rows`` rows over the paged cache ``kv`` (module docstring)."""

    what = "draft graph"

    def __init__(self, head, kv: PagedKVCache, *, max_rows: int, k: int, max_pages: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if k < 2 or max_rows < 1 or max_pages < 1:
            raise ProgramError(f"draft graphs need k >= 2 (steps 2..k), rows >= 1 and pages >= 1; got k={k}, "
                               f"rows={max_rows}, pages={max_pages}")
        super().__init__(device, max_rows)
        self.head, self.kv, self.k, self.max_pages = head, kv, k, max_pages
        s = k - 1
        # int64: positions [s, max_rows], KV slots [s, max_rows]; int32: KV lengths [s, max_rows], then page tables
        # (graph B's: its B rows, max_pages apart).
        self.i64 = torch.zeros(2 * s * max_rows, dtype=torch.int64, device=self.device)
        self.i32 = torch.zeros(s * max_rows + max_rows * max_pages, dtype=torch.int32, device=self.device)
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        self.hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=self.device)

    def fits(self, rows: int, k: int) -> bool:
        """Whether a draft of ``rows`` rows and ``k`` steps can take its steps ``2..k`` from these graphs."""
        return k == self.k and rows in self._graphs

    # -- the static-input steps --------------------------------------------------------------------
    def _views(self, b: int, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step ``i``'s (0-based: draft step ``i + 2``) positions, KV slots, KV lengths; and graph b's page tables."""
        s, m = self.k - 1, self.max_rows
        tables = self.i32[s * m: s * m + b * self.max_pages].view(b, self.max_pages)
        return (self.i64[i * m: i * m + b], self.i64[(s + i) * m: (s + i) * m + b], self.i32[i * m: i * m + b],
                tables)

    def _run_static(self, b: int) -> torch.Tensor:
        tok, h = self.tokens[:b], self.hidden[:b]
        out = []
        for i in range(self.k - 1):
            positions, slots, kv_lens, tables = self._views(b, i)
            ctx = StepContext(num_decode=b, num_chunk=0, positions=positions, cos=None, sin=None, slot_mapping=slots,
                              decode_slots=None, decode_out_slots=None, decode_kv_lens=kv_lens,
                              decode_page_tables=tables, chunk_slots=(), chunk_lens=(), chunk_cu_q=None,
                              chunk_kv_lens=None, chunk_page_tables=None, kv=self.kv, states=None)
            step = self.head.forward(tok, h, ctx, None)
            tok, h = self.head.ops.greedy_tokens(step.logits), step.hidden
            out.append(tok)
        return torch.stack(out, dim=1)

    # -- capture -----------------------------------------------------------------------------------
    def _valid_inputs(self, b: int) -> None:
        """Every row at positions ``1..k-1`` of the first pages (an identity page table): valid for every kernel."""
        for i in range(self.k - 1):
            positions, slots, kv_lens, tables = self._views(b, i)
            positions.fill_(i + 1)
            slots.fill_(i + 1)
            kv_lens.fill_(i + 2)
        tables.copy_(torch.arange(self.max_pages, dtype=torch.int32, device=self.device).clamp_max(
            self.kv.num_pages - 1).expand(b, -1))
        self.tokens.zero_()
        self.hidden.zero_()

    def capture(self, batch_sizes: Sequence[int] | None = None) -> None:
        if self.kv.num_pages * self.kv.page_size < self.k:
            raise ProgramError(f"draft graphs of {self.k} steps need {self.k} KV slots to capture on")
        super().capture(batch_sizes)

    # -- replay ------------------------------------------------------------------------------------
    def run(self, seqs: Sequence[object], last: Sequence[int], first_tokens: torch.Tensor,
            first_hidden: torch.Tensor) -> torch.Tensor:
        """Drafts ``d_2..d_k`` (int64 ``[B, k - 1]``, valid until the next replay) of rows ``seqs`` whose last pending
        position is ``last[r]``, given step 1's greedy tokens ``first_tokens`` ``[B]`` and normed output
        ``first_hidden`` ``[B, H]``. Each sequence's pages must cover ``last[r] + k`` tokens."""
        b, s, m, ps = len(seqs), self.k - 1, self.max_rows, self.kv.page_size
        self.check_rows(b)
        pages = self.kv.page_rows(seqs, [p + self.k for p in last])
        width = max(len(row) for row in pages)
        if width > self.max_pages:
            raise ProgramError(f"a page table of width {width} exceeds the draft graphs' {self.max_pages} pages")
        h64 = torch.empty(2 * s * m, dtype=torch.int64, pin_memory=self._replay)
        h32 = torch.empty(s * m + (b - 1) * self.max_pages + width, dtype=torch.int32, pin_memory=self._replay)
        a64, a32 = h64.numpy(), h32.numpy()
        for r, (p, row) in enumerate(zip(last, pages, strict=True)):
            if len(row) * ps < p + self.k:
                raise ProgramError(f"sequence {seqs[r]!r}: a draft from position {p} needs pages for "
                                   f"{p + self.k} tokens, it has {len(row) * ps}")
            for i in range(s):
                t = p + i + 1
                a64[i * m + r] = t
                a64[(s + i) * m + r] = row[t // ps] * ps + t % ps
                a32[i * m + r] = t + 1
            at = s * m + r * self.max_pages
            a32[at: at + len(row)] = row
        self.i64.copy_(h64, non_blocking=True)
        self.i32[: h32.shape[0]].copy_(h32, non_blocking=True)
        self.tokens[:b].copy_(first_tokens)
        self.hidden[:b].copy_(first_hidden)
        return self.replay(b)


__all__ = ["DraftGraphs"]
