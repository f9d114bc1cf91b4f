"""CUDA graphs of the decode-only forward, one per exact batch size (DESIGN.md section 7).

A decode step of B rows launches a few hundred small kernels; eagerly each costs host time (Python,
the Triton launcher, the CUDA driver) that is larger than its GPU time at small B. A captured graph
replays all of them with one launch.

Invariants:
- One graph per exact batch size ``B`` in ``1..max_batch``; nothing is padded, so a row's arithmetic is
  the eager path's (the kernels' partitions depend on a row's own inputs and on tensor *shapes*; the
  one shape that differs, the page-table width, is the static ``max_pages`` here, and the kernels'
  split policy makes a row's result independent of it, see ``ninfer.ops.triton.attention``).
- Tokens, positions, state slots (read and written), KV lengths, page tables and KV slot mappings are graph *inputs*
  (static buffers overwritten before each replay), never graph keys: any sequences, any pages.
- Capture runs the forward eagerly first (compiling kernels) and then records it. Both write KV and
  state: capture must happen while no sequence holds a state slot or a KV page (at Program
  construction), on slots ``0..B-1`` and KV page 0, whose contents are garbage afterwards (a slot is
  zeroed when allocated; a page is written before it is read).
- The returned logits live in graph-owned memory and are overwritten by the next replay of any
  graph: callers consume them (sample) before the next step.
- Only the thread that owns the Program replays (the engine worker); graphs share one memory pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeInputs:
    """The static input buffers of every graph (views ``[:B]`` are a graph's inputs)."""

    tokens: torch.Tensor        # int64 [max_batch]
    positions: torch.Tensor     # int64 [max_batch]
    slots: torch.Tensor         # int64 [max_batch]: the state slots read
    out_slots: torch.Tensor     # int64 [max_batch]: the state slots written (== slots, except lookahead)
    kv_lens: torch.Tensor       # int32 [max_batch]
    page_tables: torch.Tensor   # int32 [max_batch, max_pages]
    slot_mapping: torch.Tensor  # int64 [max_batch]


# forward(tokens, positions, slots, out_slots, kv_lens, page_tables, slot_mapping) -> fp32 logits [B, V]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                          torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """Captured decode graphs for batch sizes ``1..max_batch`` over ``forward`` (see the module docstring)."""

    def __init__(self, forward: DecodeForward, *, device: torch.device, max_batch: int, max_pages: int) -> None:
        if torch.device(device).type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if max_batch < 1 or max_pages < 1:
            raise ValueError(f"decode graphs need max_batch >= 1 and max_pages >= 1, got {max_batch}, {max_pages}")
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.max_pages = max_pages
        self._forward = forward
        z = dict(device=self.device)
        self.inputs = DecodeInputs(
            tokens=torch.zeros(max_batch, dtype=torch.int64, **z),
            positions=torch.zeros(max_batch, dtype=torch.int64, **z),
            slots=torch.zeros(max_batch, dtype=torch.int64, **z),
            out_slots=torch.zeros(max_batch, dtype=torch.int64, **z),
            kv_lens=torch.ones(max_batch, dtype=torch.int32, **z),
            page_tables=torch.zeros((max_batch, max_pages), dtype=torch.int32, **z),
            slot_mapping=torch.zeros(max_batch, dtype=torch.int64, **z))
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def _views(self, b: int) -> tuple[torch.Tensor, ...]:
        i = self.inputs
        return (i.tokens[:b], i.positions[:b], i.slots[:b], i.out_slots[:b], i.kv_lens[:b], i.page_tables[:b],
                i.slot_mapping[:b])

    def capture(self, batch_sizes: list[int] | None = None) -> None:
        """Capture every size (default ``1..max_batch``), largest first so smaller graphs reuse the pool."""
        sizes = sorted(set(batch_sizes or range(1, self.max_batch + 1)), reverse=True)
        if sizes and not 1 <= sizes[-1] <= sizes[0] <= self.max_batch:
            raise ValueError(f"batch sizes {sizes} are outside 1..{self.max_batch}")
        i = self.inputs
        # Distinct state slots and positions 0 (one KV token, page 0): valid inputs for any kernel.
        i.slots.copy_(torch.arange(self.max_batch, device=self.device))
        i.out_slots.copy_(i.slots)
        i.positions.zero_()
        i.kv_lens.fill_(1)
        i.page_tables.zero_()
        i.slot_mapping.zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in sizes:
                self._forward(*self._views(b))  # warm-up: compiles kernels, settles allocator blocks
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for b in sizes:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(*self._views(b))
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)

    def has(self, batch_size: int) -> bool:
        return batch_size in self._graphs

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, out_slots: torch.Tensor,
            kv_lens: torch.Tensor, page_tables: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Copy one step's inputs (``[B]`` / ``[B, w]`` with ``w <= max_pages``) into the static buffers and
        replay the size-B graph; returns its logits ``[B, V]`` (valid until the next replay)."""
        b, w = page_tables.shape
        graph, out = self._graphs[b]
        if w > self.max_pages:
            raise ValueError(f"a page table of width {w} exceeds the graphs' {self.max_pages} pages")
        i = self.inputs
        i.tokens[:b].copy_(tokens, non_blocking=True)
        i.positions[:b].copy_(positions, non_blocking=True)
        i.slots[:b].copy_(slots, non_blocking=True)
        i.out_slots[:b].copy_(out_slots, non_blocking=True)
        i.kv_lens[:b].copy_(kv_lens, non_blocking=True)
        # Entries past a row's own pages are never read (loads are masked by kv_len), so the rest of
        # the static table may keep older page ids.
        i.page_tables[:b, :w].copy_(page_tables, non_blocking=True)
        i.slot_mapping[:b].copy_(slot_mapping, non_blocking=True)
        graph.replay()
        return out

    def close(self) -> None:
        self._graphs.clear()
        self._pool = None
