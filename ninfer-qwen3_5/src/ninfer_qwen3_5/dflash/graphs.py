"""CUDA graphs of the DFlash / DFlash2 draft step: one block forward and its greedy drafts per count of rows.

A DFlash draft is one block forward of ``[anchor, mask x (L - 1)]`` per row through every drafter layer, the draft
logits and the path walk: eagerly a few hundred small launches, whose host cost exceeds the GPU's at small row
counts. A :class:`DFlashGraphs` records, for a fixed block length ``L`` and each row count ``B = 1..max_rows``, the
embedding, the layers (block K/V written into the drafter's paged pools, attention over the paged context and the
block), the final norm, :meth:`~ninfer_qwen3_5.dflash.drafter.DFlashDrafter.logits` and the greedy path
(:func:`~ninfer_qwen3_5.dflash.propose.argmax_path`; DFlash2: :func:`~ninfer_qwen3_5.dflash.propose.select_path`
with every row greedy), as one graph.

Invariants:
- The static forward is :meth:`DFlashDrafter.block_forward`, the eager block's own code, on
  :class:`~ninfer_qwen3_5.dflash.drafter.BlockInputs` made from static buffers; the path walks are the eager ones
  on the same shapes. The one shape that differs is the page table's width (the static ``max_pages``), which does
  not change a row's result (:mod:`ninfer.ops.triton.attention`). So a replay drafts what the eager step drafts.
- Inputs live in one static int64 buffer filled by one host-to-device copy per replay: per token (row after row)
  its token, position and KV slot, as int32 its KV length seen by non-causal and by causal layers, then one page
  table row per block row (``max_pages`` wide). Each token's page table row is gathered from its block row's inside
  the graph (constant owners); chunk offsets, kept tokens and DFlash2's conv sources are constants of graph ``B``.
- A graph covers only blocks no sliding window cuts (every row's block ends at or before the smallest window): there
  a window drops no key, and the eager step's attention is the same paged attention. A cut window, a row of another
  length, a constrained row (grammar masks walk with the drafts) or a DFlash2 row sampling its path runs the eager
  step; :meth:`DFlashGraphs.fits` and the caller decide per step.
- The graph writes the drafter's K/V at the block positions, provisional slots as the eager block writes them.
- Its outputs (the normed block outputs ``[B * (L - 1), H]``, the fp32 logits ``[B, L - 1, V]`` and the drafts
  int64 ``[B, L - 1]``) live in graph memory until the next replay of any graph of the set.
- Capture (at Program construction, while no sequence exists) runs each size eagerly first, then records it, on the
  first positions of the first pages (an identity page table): drafter K/V there is garbage afterwards.
- Without CUDA (the CPU) :meth:`run` executes the static forward eagerly; tests use that to check the static
  inputs against the eager step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from ninfer.contracts.program import ProgramError
from ninfer.program.graphs import StaticGraphs
from ninfer.storage.kv_pool import PagedKVCache

from ninfer_qwen3_5.dflash.drafter import BlockInputs, BlockRow, DFlashDrafter, conv_sources
from ninfer_qwen3_5.dflash.propose import argmax_path, select_path


class _PagedAttention:
    """Attention of a block none of whose windows cut: token ``i`` attends ``[0, kv_len[i])`` of its row's pages,
    ``kv_len`` the block's end (non-causal layers) or its own position + 1 (causal layers)."""

    def __init__(self, drafter: DFlashDrafter, kv: PagedKVCache, cu: torch.Tensor, lens: torch.Tensor,
                 causal_lens: torch.Tensor, tables: torch.Tensor) -> None:
        self.d, self.kv, self.cu, self.lens, self.causal_lens, self.tables = drafter, kv, cu, lens, causal_lens, tables

    def __call__(self, q: torch.Tensor, layer) -> torch.Tensor:
        k_pool, v_pool = self.kv.pools(layer.kv_layer)
        lens = self.causal_lens if layer.causal else self.lens
        return self.d.ops.paged_attention(q, k_pool, v_pool, self.cu, lens, self.tables, self.d.scale)


class DFlashGraphs(StaticGraphs):
    """Block forwards and greedy drafts of ``drafter`` for ``1..max_rows`` rows of ``length`` block tokens over the
    paged cache ``kv`` (module docstring)."""

    what = "DFlash block graph"

    def __init__(self, drafter: DFlashDrafter, kv: PagedKVCache, *, max_rows: int, length: int,
                 max_pages: int) -> None:
        if max_rows < 1 or length < 2 or max_pages < 1:
            raise ProgramError(f"DFlash block graphs need rows >= 1, a block of >= 2 tokens and pages >= 1; got "
                               f"rows={max_rows}, length={length}, pages={max_pages}")
        super().__init__(drafter.device, max_rows)
        self.d, self.kv, self.length, self.max_pages = drafter, kv, length, max_pages
        windows = [w for w in drafter.cfg.sliding_window if w is not None]
        self.window = min(windows) if windows else None   # blocks ending past it run eagerly
        m = max_rows * length
        # int64: tokens [0, m), positions [m, 2m), KV slots [2m, 3m); int32 from 6m: KV lengths (non-causal) [m],
        # KV lengths (causal) [m], then the rows' page tables (graph B's: B rows, max_pages apart).
        self._m = m
        self.packed = torch.zeros(-(-(8 * m + max_rows * max_pages) // 2), dtype=torch.int64, device=self.device)
        self._consts: dict[int, tuple] = {}

    def fits(self, rows: Sequence[BlockRow]) -> bool:
        """Whether these graphs draft ``rows``: a captured row count, every row of the graphs' length, no window
        cutting a row's block, and every row's pages within ``max_pages``."""
        if not self.has(len(rows)) or any(r.length != self.length for r in rows):
            return False
        end = max(r.start for r in rows) + self.length
        return (self.window is None or end <= self.window) and self.kv.pages_for(end) <= self.max_pages

    # -- the static forward ------------------------------------------------------------------------
    def _views(self, b: int) -> tuple[torch.Tensor, ...]:
        """Graph b's tokens, positions, KV slots, KV lengths (non-causal, causal) and rows' page tables."""
        t, m = b * self.length, self._m
        i32 = self.packed.view(torch.int32)
        tables = i32[8 * m: 8 * m + b * self.max_pages].view(b, self.max_pages)
        return (self.packed[:t], self.packed[m: m + t], self.packed[2 * m: 2 * m + t], i32[6 * m: 6 * m + t],
                i32[7 * m: 7 * m + t], tables)

    def _constants(self, b: int) -> tuple:
        """Graph b's token owners, per-token chunk offsets, kept (mask) tokens and DFlash2's conv sources."""
        if b not in self._consts:
            n, dev = self.length, self.device
            owner = torch.arange(b, dtype=torch.int64, device=dev).repeat_interleave(n)
            cu = torch.arange(b * n + 1, dtype=torch.int32, device=dev)
            keep = torch.arange(b * n, dtype=torch.int64, device=dev).view(b, n)[:, 1:].reshape(-1)
            shifts = conv_sources([n] * b, self.d.cfg.conv_kernel_size, dev) if self.d.cfg.generation == 2 else None
            self._consts[b] = (owner, cu, keep, shifts)
        return self._consts[b]

    def _run_static(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d, n = self.d, self.length - 1
        tokens, positions, slots, lens, causal_lens, tables = self._views(b)
        owner, cu, keep, shifts = self._constants(b)
        attention = _PagedAttention(d, self.kv, cu, lens, causal_lens, tables.index_select(0, owner))
        hidden = d.block_forward(self.kv, BlockInputs(tokens, positions, slots, attention, shifts, keep))
        h = hidden.view(b, n, -1)
        logits = d.logits(h)
        if d.cfg.generation == 1:
            drafts = argmax_path(logits)
        else:
            zeros = [0] * b
            drafts, _ = select_path(logits, d.ops.linear(h, d.selector_hidden), tokens.view(b, n + 1)[:, 0],
                                    d.selector_predecessor, d.selector_successor, d.cfg.selector_top_k,
                                    [0.0] * b, zeros, zeros)
        return hidden, logits, drafts

    # -- capture -----------------------------------------------------------------------------------
    def _valid_inputs(self, b: int) -> None:
        """Every row at positions ``0..L-1`` of the first pages (an identity page table): valid for every kernel."""
        tokens, positions, slots, lens, causal_lens, tables = self._views(b)
        pos = torch.arange(self.length, dtype=torch.int64, device=self.device).repeat(b)
        tokens.fill_(self.d.cfg.mask_token_id)
        positions.copy_(pos)
        slots.copy_(pos)
        lens.fill_(self.length)
        causal_lens.copy_(pos + 1)
        tables.copy_(torch.arange(self.max_pages, dtype=torch.int32, device=self.device).clamp_max(
            self.kv.num_pages - 1).expand(b, -1))

    def capture(self, batch_sizes: Sequence[int] | None = None) -> None:
        if self.kv.num_pages * self.kv.page_size < self.length:
            raise ProgramError(f"DFlash block graphs of {self.length} tokens need as many KV slots to capture on")
        super().capture(batch_sizes)

    # -- replay ------------------------------------------------------------------------------------
    def run(self, rows: Sequence[BlockRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block forward of ``rows`` (:meth:`fits` them) and its greedy drafts: ``(normed outputs [B * (L - 1),
        H], logits [B, L - 1, V], drafts int64 [B, L - 1])``, valid until the next replay."""
        b, n, m, ps, mp = len(rows), self.length, self._m, self.kv.page_size, self.max_pages
        self.check_rows(b)
        pages = self.kv.page_rows([r.seq for r in rows], [r.start + n for r in rows])
        width = max(len(p) for p in pages)
        if width > mp:
            raise ProgramError(f"a page table of width {width} exceeds the DFlash graphs' {mp} pages")
        host = torch.empty(-(-(8 * m + (b - 1) * mp + width) // 2), dtype=torch.int64, pin_memory=self._replay)
        a64 = host.numpy()
        a32 = a64.view("int32")
        mask = self.d.cfg.mask_token_id
        for r, (row, pg) in enumerate(zip(rows, pages, strict=True)):
            s, at = row.start, r * n
            if row.length != n or len(pg) * ps < s + n:
                raise ProgramError(f"block row {row!r} does not fit graph {b}: {n} tokens, pages for "
                                   f"{len(pg) * ps}")
            a64[at] = row.anchor
            a64[at + 1: at + n] = mask
            a64[m + at: m + at + n] = range(s, s + n)
            a64[2 * m + at: 2 * m + at + n] = [pg[t // ps] * ps + t % ps for t in range(s, s + n)]
            a32[6 * m + at: 6 * m + at + n] = s + n
            a32[7 * m + at: 7 * m + at + n] = range(s + 1, s + n + 1)
            a32[8 * m + r * mp: 8 * m + r * mp + len(pg)] = pg
        self.packed[: host.shape[0]].copy_(host, non_blocking=True)
        return self.replay(b)

    def close(self) -> None:
        super().close()
        self._consts.clear()


__all__ = ["DFlashGraphs"]
