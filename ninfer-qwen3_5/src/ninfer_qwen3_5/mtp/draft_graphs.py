"""CUDA graphs of the MTP drafter's autoregressive steps, one per exact count of drafting rows.

:meth:`~ninfer_qwen3_5.mtp.head.Qwen35MTPHead.draft` runs ``k`` MTP steps. Step 1 takes each row's pending
positions (a count per row from 1 to k + 1: the tokens the last verify committed). Steps ``2..k`` are one decode
row per sequence at positions ``p + 1 .. p + k - 1`` (``p`` the row's last pending position), the same shapes every
time. A :class:`DraftGraphs` records, as one graph per row count ``B = 1..max_rows``, either those ``k - 1`` steps
and their greedy argmaxes (``pending=0``: any draft; step 1 runs eagerly), or all ``k`` steps of a draft in which
every row has ``pending`` positions (step 1 as ``B`` decode rows for one position, else as ``B`` chunks of
``pending``). The drafter holds one of the first kind and one of the second per pending count. Eagerly each step
costs a host-built context (several small copies) and a few dozen launches, more host time than the GPU spends on
one MTP layer and the LM head at small ``B``.

Invariants:
- Static inputs, rewritten before each replay: the first draft token and the normed output of step 1 (device
  copies; with ``pending``: step 1's next tokens and target hidden states, and its positions, KV slots and KV
  lengths), and per step ``i`` the rows' positions ``p + i``, KV slots and KV lengths ``p + i + 1``, and the rows'
  page tables (``max_pages`` wide, shared by every step), all computed on the host from ``p`` and the sequence's
  pages (two host-to-device copies). A replay runs what the eager steps run for the same rows: the same ops on the same shapes but the page
  table's width, which does not change a row's result (:mod:`ninfer.ops.triton.attention`).
- The graph writes the MTP pool's K/V of positions ``p + 1 .. p + k - 1``: provisional slots, as the eager steps
  write them (the head's ``draft`` docstring says why they are never read before being rewritten).
- Its output, int64 ``[B, k - 1]`` (drafts ``d_2..d_k``; with ``pending``: ``[B, k]``, ``d_1..d_k``), lives in
  graph memory until the next replay of any graph of the set; the caller copies it first. No logits come out (a
  greedy drafter needs none).
- Capture (at Program construction, while no sequence exists) runs each size eagerly first, then records it, on
  the first positions of the first pages: MTP K/V written there is garbage afterwards (written before read).
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
                 dtype: torch.dtype, device: torch.device, pending: int = 0) -> None:
        if (k < 2 and not pending) or k < 1 or pending < 0 or max_rows < 1 or max_pages < 1:
            raise ProgramError(f"draft graphs need k >= 2 (steps 2..k) or pending >= 1 (steps 1..k), rows >= 1 and "
                               f"pages >= 1; got k={k}, pending={pending}, rows={max_rows}, pages={max_pages}")
        super().__init__(device, max_rows)
        self.head, self.kv, self.k, self.max_pages, self.pending = head, kv, k, max_pages, pending
        s, n, m = k - 1, pending, max_rows
        # int64: positions [s, max_rows], KV slots [s, max_rows], then step 1's positions and KV slots [max_rows * n]
        # each; int32: KV lengths [s, max_rows], step 1's KV lengths [max_rows] (with pending), then page tables
        # (graph B's: its B rows, max_pages apart).
        self._first = (2 * s * m, s * m + (m if n else 0))   # where step 1's int64 and int32 parts start
        self.i64 = torch.zeros(2 * s * m + 2 * m * n, dtype=torch.int64, device=self.device)
        self.i32 = torch.zeros(self._first[1] + m * max_pages, dtype=torch.int32, device=self.device)
        self.tokens = torch.zeros(m * max(n, 1), dtype=torch.int64, device=self.device)
        self.hidden = torch.zeros(m * max(n, 1), hidden_size, dtype=dtype, device=self.device)
        self._consts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def fits(self, rows: int, k: int) -> bool:
        """Whether a draft of ``rows`` rows and ``k`` steps can take its steps from these graphs (steps ``2..k``;
        with ``pending``, every step of a draft whose rows all have ``pending`` positions)."""
        return k == self.k and rows in self._graphs

    # -- the static-input steps --------------------------------------------------------------------
    def _views(self, b: int, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step ``i``'s (0-based: draft step ``i + 2``) positions, KV slots, KV lengths; and graph b's page tables."""
        s, m = self.k - 1, self.max_rows
        at = self._first[1]
        tables = self.i32[at: at + b * self.max_pages].view(b, self.max_pages)
        return (self.i64[i * m: i * m + b], self.i64[(s + i) * m: (s + i) * m + b], self.i32[i * m: i * m + b],
                tables)

    def _first_views(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step 1's positions and KV slots (``[b * pending]``, row after row) and KV lengths ``[b]``."""
        n, m, (a64, a32) = self.pending, self.max_rows, self._first
        return self.i64[a64: a64 + b * n], self.i64[a64 + m * n: a64 + m * n + b * n], self.i32[a32 - m: a32 - m + b]

    def _step_one(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1 of a whole draft on the static inputs: ``(d_1 [b], normed output [b, H])``."""
        n = self.pending
        positions, slots, kv_lens = self._first_views(b)
        tables = self._views(b, 0)[3]
        if b not in self._consts:   # the chunks' offsets and each row's last position, constant per graph
            rows = torch.arange(b + 1, dtype=torch.int32, device=self.device)
            self._consts[b] = (rows * n, (rows[1:].to(torch.int64) * n - 1))
        cu, last = self._consts[b]
        if n == 1:
            ctx = StepContext(num_decode=b, num_chunk=0, positions=positions, cos=None, sin=None, slot_mapping=slots,
                              decode_slots=None, decode_out_slots=None, decode_kv_lens=kv_lens,
                              decode_page_tables=tables, chunk_slots=(), chunk_lens=(), chunk_cu_q=None,
                              chunk_kv_lens=None, chunk_page_tables=None, kv=self.kv, states=None)
        else:
            ctx = StepContext(num_decode=0, num_chunk=b * n, positions=positions, cos=None, sin=None,
                              slot_mapping=slots, decode_slots=None, decode_out_slots=None, decode_kv_lens=None,
                              decode_page_tables=None, chunk_slots=(), chunk_lens=(), chunk_cu_q=cu,
                              chunk_kv_lens=kv_lens, chunk_page_tables=tables, kv=self.kv, states=None)
        step = self.head.forward(self.tokens[:b * n], self.hidden[:b * n], ctx, None if n == 1 else last)
        return self.head.ops.greedy_tokens(step.logits), step.hidden

    def _run_static(self, b: int) -> torch.Tensor:
        if self.pending:
            tok, h = self._step_one(b)
            out = [tok]
        else:
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
        """Every row at the first positions of the first pages (an identity page table): step 1 (with pending) at
        ``0..pending-1``, the later steps after it. Valid for every kernel."""
        n = self.pending
        p = max(n - 1, 0)   # the last pending position (steps 2..k only: position 0)
        if n:
            positions, slots, kv_lens = self._first_views(b)
            positions.copy_(torch.arange(n, dtype=torch.int64, device=self.device).repeat(b))
            slots.copy_(positions)
            kv_lens.fill_(n)
        tables = self._views(b, 0)[3]
        for i in range(self.k - 1):
            positions, slots, kv_lens, _ = self._views(b, i)
            positions.fill_(p + i + 1)
            slots.fill_(p + i + 1)
            kv_lens.fill_(p + i + 2)
        tables.copy_(torch.arange(self.max_pages, dtype=torch.int32, device=self.device).clamp_max(
            self.kv.num_pages - 1).expand(b, -1))
        self.tokens.zero_()
        self.hidden.zero_()

    def capture(self, batch_sizes: Sequence[int] | None = None) -> None:
        need = max(self.pending - 1, 0) + self.k
        if self.kv.num_pages * self.kv.page_size < need:
            raise ProgramError(f"draft graphs of {self.k} steps need {need} KV slots to capture on")
        super().capture(batch_sizes)

    # -- replay ------------------------------------------------------------------------------------
    def run(self, seqs: Sequence[object], last: Sequence[int], first_tokens: torch.Tensor,
            first_hidden: torch.Tensor) -> torch.Tensor:
        """Drafts ``d_2..d_k`` (int64 ``[B, k - 1]``, valid until the next replay) of rows ``seqs`` whose last pending
        position is ``last[r]``, given step 1's greedy tokens ``first_tokens`` ``[B]`` and normed output
        ``first_hidden`` ``[B, H]``. Each sequence's pages must cover ``last[r] + k`` tokens."""
        if self.pending:
            raise ProgramError("these draft graphs run whole drafts (run_whole)")
        return self._replay_with(seqs, last, first_tokens, first_hidden)

    def run_whole(self, seqs: Sequence[object], starts: Sequence[int], tokens_next: torch.Tensor,
                  hidden: torch.Tensor) -> torch.Tensor:
        """Drafts ``d_1..d_k`` (int64 ``[B, k]``, valid until the next replay) of rows ``seqs`` whose ``pending``
        positions start at ``starts[r]``, given their next tokens ``[B * pending]`` and the target's hidden states
        ``[B * pending, H]``, row after row (what the eager step 1 takes). Each sequence's pages must cover
        ``starts[r] + pending - 1 + k`` tokens."""
        if not self.pending:
            raise ProgramError("these draft graphs run steps 2..k (run)")
        n = self.pending
        return self._replay_with(seqs, [s + n - 1 for s in starts], tokens_next, hidden)

    def _replay_with(self, seqs: Sequence[object], last: Sequence[int], tokens: torch.Tensor,
                     hidden: torch.Tensor) -> torch.Tensor:
        b, s, m, ps, n = len(seqs), self.k - 1, self.max_rows, self.kv.page_size, self.pending
        self.check_rows(b)
        if tokens.shape[0] != b * max(n, 1) or hidden.shape[0] != tokens.shape[0]:
            raise ProgramError(f"{b} draft rows of {max(n, 1)} inputs need {b * max(n, 1)} tokens and hidden states, "
                               f"got {tokens.shape[0]} and {hidden.shape[0]}")
        pages = self.kv.page_rows(seqs, [p + self.k for p in last])
        width = max(len(row) for row in pages)
        if width > self.max_pages:
            raise ProgramError(f"a page table of width {width} exceeds the draft graphs' {self.max_pages} pages")
        a64_first, a32_first = self._first
        h64 = torch.empty(self.i64.shape[0], dtype=torch.int64, pin_memory=self._replay)
        h32 = torch.empty(a32_first + (b - 1) * self.max_pages + width, dtype=torch.int32, pin_memory=self._replay)
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
            for j in range(n):   # step 1's positions p - n + 1 .. p
                t = p - n + 1 + j
                a64[a64_first + r * n + j] = t
                a64[a64_first + m * n + r * n + j] = row[t // ps] * ps + t % ps
            if n:
                a32[a32_first - m + r] = p + 1
            at = a32_first + r * self.max_pages
            a32[at: at + len(row)] = row
        self.i64.copy_(h64, non_blocking=True)
        self.i32[: h32.shape[0]].copy_(h32, non_blocking=True)
        self.tokens[:tokens.shape[0]].copy_(tokens)
        self.hidden[:hidden.shape[0]].copy_(hidden)
        return self.replay(b)


__all__ = ["DraftGraphs"]
