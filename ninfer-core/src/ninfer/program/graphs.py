"""CUDA graphs of the decode-only forward, one per exact batch size (docs/design.md section 7).

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
- All inputs live in one static int64 buffer (:class:`_Layout`), so a step's inputs reach the device in *one*
  host-to-device copy from the rows' host description (:class:`~ninfer.program.batch.DecodeRows`),
  not a copy per tensor: every stream operation between two replays costs GPU time that matters at small B.
- With a ``greedy`` op, each graph also computes ``greedy_tokens`` of its logits into the static token input
  itself, so the next step of the same rows, if greedy, finds its tokens already in place. Rows that sample
  otherwise ignore it (one small kernel).
- When that op is ``host_capturable``, the graph also stores its greedy tokens into row ``k`` of a pinned host
  ring of :data:`RING_ROWS` rows, ``k`` a graph input (the replay count modulo the rows): the tokens reach the
  host when the replay completes (:class:`~ninfer.program.batch.HostTokens`, an event recorded after the replay),
  and a greedy decode step queues one input copy and the replay, no copy back (tools/gpu_step_overhead.py
  measures what that saves). A ring row is read into host memory (:meth:`HostTokens.keep`) before a later
  replay may rewrite it, so a reader never sees a later step's tokens, however late it reads.
- Capture runs the forward eagerly first (compiling kernels) and then records it. Both write KV and
  state: capture must happen while no sequence holds a state slot or a KV page (at Program
  construction), on slots ``0..B-1`` and KV page 0, whose contents are garbage afterwards (a slot is
  zeroed when allocated; a page is written before it is read).
- The returned logits and greedy tokens live in graph-owned memory and are overwritten by the next replay of
  any graph: callers consume them (sample, queue their copies) before the next step.
- Only the thread that owns the Program replays (the engine worker); graphs share one memory pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ninfer.contracts.program import ProgramError
from ninfer.program.batch import DecodeRows, HostTokens
from ninfer.program.host_steps import SegmentedGraph, capture_stream

# forward(tokens, positions, slots, out_slots, kv_lens, page_tables, slot_mapping) -> fp32 logits [B, V]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                          torch.Tensor], torch.Tensor]
# greedy_tokens(logits [B, V], out=[B] int64) -> out
GreedyOp = Callable[..., torch.Tensor]

# Above this many int32 entries a copy of the page table's whole span (rows max_pages apart) gives way to one
# copy per row (long contexts with several rows).
_SPAN_LIMIT = 1 << 16
# Rows of the pinned host ring the graphs store their greedy tokens into. A lookahead step's tokens are read one
# replay later, so two rows would do; the rest is slack (a row is kept before reuse whatever the count).
RING_ROWS = 4


@dataclass(frozen=True)
class _Layout:
    """Where graph B's inputs sit in the static int64 buffer (offsets in int64 elements, the int32 ones in int32).

    ``[0, max_batch)``: the tokens (graph B reads the first B); at ``max_batch``: the host ring row of the
    replay's greedy tokens; from ``max_batch + 1``: positions, state slots, out slots, KV slots (B each); then,
    as int32, the B kv lengths and, from a 16-byte boundary, B page-table rows ``max_pages`` apart."""

    b: int
    max_batch: int
    max_pages: int

    @property
    def ring(self) -> int:
        return self.max_batch

    @property
    def meta(self) -> int:
        return self.max_batch + 1

    @property
    def kv_lens32(self) -> int:
        return 2 * (self.meta + 4 * self.b)

    @property
    def table32(self) -> int:
        return -(-(self.kv_lens32 + self.b) // 4) * 4

    @staticmethod
    def size(max_batch: int, max_pages: int) -> int:
        last = _Layout(max_batch, max_batch, max_pages)
        return -(-(last.table32 + max_batch * max_pages) // 2)


class DecodeGraphs:
    """Captured decode graphs for batch sizes ``1..max_batch`` over ``forward`` (see the module docstring)."""

    def __init__(self, forward: DecodeForward, *, device: torch.device, max_batch: int, max_pages: int,
                 greedy: GreedyOp | None = None) -> None:
        if torch.device(device).type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if max_batch < 1 or max_pages < 1:
            raise ValueError(f"decode graphs need max_batch >= 1 and max_pages >= 1, got {max_batch}, {max_pages}")
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.max_pages = max_pages
        self._forward = forward
        self._greedy = greedy
        self.packed = torch.zeros(_Layout.size(max_batch, max_pages), dtype=torch.int64, device=self.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        # (logits, greedy tokens, their HostTokens or None) of the last replay
        self._last: tuple[torch.Tensor, torch.Tensor, HostTokens | None] | None = None
        # The pinned ring the graphs store greedy tokens into, when the greedy op can do so inside a graph.
        self.ring = (torch.zeros((RING_ROWS, max_batch), dtype=torch.int64, pin_memory=True)
                     if greedy is not None and getattr(greedy, "host_capturable", False) else None)
        self._ring_readers: list[HostTokens | None] = [None] * RING_ROWS
        self._replays = 0

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def _views(self, b: int) -> tuple[torch.Tensor, ...]:
        return input_views(self.packed, b, self.max_batch, self.max_pages)

    def _record(self, b: int) -> torch.Tensor:
        views = self._views(b)
        logits = self._forward(*views)
        if self._greedy is not None:
            lay = _Layout(b, self.max_batch, self.max_pages)
            host = None if self.ring is None else (self.ring, self.packed[lay.ring: lay.ring + 1])
            self._greedy(logits, out=views[0], **({} if host is None else {"host": host}))
        return logits

    def capture(self, batch_sizes: list[int] | None = None) -> None:
        """Capture every size (default ``1..max_batch``), largest first so smaller graphs reuse the pool."""
        sizes = sorted(set(batch_sizes or range(1, self.max_batch + 1)), reverse=True)
        if sizes and not 1 <= sizes[-1] <= sizes[0] <= self.max_batch:
            raise ValueError(f"batch sizes {sizes} are outside 1..{self.max_batch}")
        self._keep_ring_readers()   # the warm-up and capture write ring row 0
        graphs, self._pool = capture_sizes(self.device, sizes, self._valid_inputs, self._record, self._pool)
        self._graphs.update(graphs)

    def _valid_inputs(self, b: int) -> None:
        """Distinct state slots and position 0 (one KV token, page 0): valid inputs for any kernel."""
        tokens, positions, slots, out_slots, kv_lens, tables, slot_mapping = self._views(b)
        self.packed[_Layout(b, self.max_batch, self.max_pages).ring].zero_()
        tokens.zero_()
        positions.zero_()
        slots.copy_(torch.arange(b, device=self.device))
        out_slots.copy_(slots)
        kv_lens.fill_(1)
        tables.zero_()
        slot_mapping.zero_()

    def has(self, batch_size: int) -> bool:
        return batch_size in self._graphs

    def run(self, rows: DecodeRows) -> torch.Tensor:
        """Copy the rows' inputs into graph B's static inputs and replay it; returns its logits ``[B, V]``
        (valid until the next replay; :meth:`greedy_for` gives their greedy tokens)."""
        b = len(rows.seqs)
        graph, out = self._graphs[b]
        tokens = self.packed[:b]
        if rows.token_ids is None and not _same_view(rows.device_tokens, tokens):
            tokens.copy_(rows.device_tokens, non_blocking=True)
        row = self._replays % RING_ROWS
        if self.ring is not None and self._ring_readers[row] is not None:
            self._ring_readers[row].keep()   # an earlier replay's tokens leave the row before it is rewritten
            self._ring_readers[row] = None
        start, host, per_row = stage_inputs(rows, self.max_batch, self.max_pages, pin=True, ring_row=row)
        self.packed[start: start + host.shape[0]].copy_(host, non_blocking=True)
        if per_row:
            # Entries past a row's own pages are never read (loads are masked by kv_len): only its pages are copied.
            tables = self._views(b)[5]
            for r, pages in enumerate(rows.pages):
                if pages:
                    tables[r, : len(pages)].copy_(torch.tensor(pages, dtype=torch.int32).pin_memory(), non_blocking=True)
        graph.replay()
        self._replays += 1
        host_tokens = None
        if self.ring is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            host_tokens = self._ring_readers[row] = HostTokens(self.ring[row, :b], ready)
        self._last = (out, tokens, host_tokens)
        return out

    def greedy_for(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The greedy tokens (int64 [B], a view of the static token input) the last replay computed, when
        ``logits`` is that replay's output; else None (or when the graphs compute none)."""
        if self._greedy is None or self._last is None or logits is not self._last[0]:
            return None
        return self._last[1]

    def host_tokens_for(self, tokens: torch.Tensor) -> HostTokens | None:
        """The host copy of the last replay's greedy tokens, when ``tokens`` is :meth:`greedy_for`'s answer for
        it and the graphs store into the ring; else None (the caller copies the tokens itself)."""
        if self._last is None or tokens is not self._last[1]:
            return None
        return self._last[2]

    def _keep_ring_readers(self) -> None:
        for reader in self._ring_readers:
            if reader is not None:
                reader.keep()
        self._ring_readers = [None] * RING_ROWS

    def close(self) -> None:
        self._keep_ring_readers()
        self._graphs.clear()
        self._pool = None
        self._last = None


def capture_sizes(device: torch.device, sizes: list[int], prepare: Callable[[int], None],
                  record: Callable[[int], object], pool=None) -> tuple[dict[int, tuple[SegmentedGraph, object]], object]:
    """Capture ``record(b)`` for every size in ``sizes`` (largest first, so smaller graphs reuse the pool's blocks),
    each after ``prepare(b)`` wrote valid static inputs. Every size first runs eagerly on a side stream (compiling
    kernels, settling allocator blocks), then is recorded into one shared memory pool. Returns ``{b: (graph,
    outputs)}`` and the pool (``pool`` if given, else the first graph's). The eager runs use the capture stream
    too (:func:`~ninfer.program.host_steps.capture_stream`): a stream made per call could leave per-stream state
    behind each time (cuBLAS keeps a workspace per stream, which emptying the cache does not return)."""
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for b in sizes:
            prepare(b)
            record(b)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graphs = {}
    for b in sizes:
        prepare(b)
        graph = SegmentedGraph()   # one segment unless the forward takes host steps (ninfer.program.host_steps)
        out = graph.capture(lambda: record(b), pool, stream)   # noqa: B023 (called here, before b changes)
        pool = graph.pool()
        graphs[b] = (graph, out)
    torch.cuda.synchronize(device)
    return graphs, pool


class StaticGraphs(ABC):
    """One CUDA graph per row count ``1..max_rows`` of a static-input step: the base of a plugin's graph sets
    (its verify and draft graphs). A subclass writes valid inputs for ``b`` rows in ``_valid_inputs(b)``, runs the
    step on its static input buffers in ``_run_static(b)`` (returning the outputs), rewrites those buffers before
    :meth:`replay`, and names one graph in ``what`` (for errors).

    Invariants: graphs of all sizes share one memory pool and are replayed one at a time, so a replay's outputs
    are valid until the next replay of any of them; without CUDA, :meth:`capture` records only the sizes and
    :meth:`replay` runs ``_run_static`` eagerly (what tests use to check the static inputs on the CPU)."""

    what = "graph"

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.device, self.max_rows = torch.device(device), max_rows
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, object]] = {}
        self._pool = None
        self._replay = self.device.type == "cuda"

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def has(self, rows: int) -> bool:
        return rows in self._graphs

    @abstractmethod
    def _valid_inputs(self, b: int) -> None:
        """Write inputs valid for every kernel of the step into the static buffers of ``b`` rows."""

    @abstractmethod
    def _run_static(self, b: int) -> object:
        """Run the step for ``b`` rows on the static buffers; its outputs."""

    def share_pool(self, other: StaticGraphs) -> None:
        """Capture into ``other``'s memory pool (call before :meth:`capture`, after ``other`` captured): the two
        sets' graphs must then be replayed one at a time, a replay's outputs valid until the next of either set."""
        self._pool = other._pool

    def capture(self, batch_sizes=None) -> None:
        """Capture every size (default ``1..max_rows``), largest first so smaller graphs reuse the pool; without
        CUDA only the sizes are recorded."""
        sizes = sorted(set(batch_sizes or range(1, self.max_rows + 1)), reverse=True)
        if sizes and not 1 <= sizes[-1] <= sizes[0] <= self.max_rows:
            raise ProgramError(f"{self.what} sizes {sizes} are outside 1..{self.max_rows}")
        if not self._replay:
            self._graphs.update((b, (None, None)) for b in sizes)
            return
        graphs, self._pool = capture_sizes(self.device, sizes, self._valid_inputs, self._run_static, self._pool)
        self._graphs.update(graphs)

    def replay(self, b: int) -> object:
        """Graph ``b``'s outputs after a replay on the static inputs as they are now (eagerly without CUDA)."""
        graph, out = self._graphs[b]
        if graph is None:
            return self._run_static(b)
        graph.replay()
        return out

    def check_rows(self, b: int) -> None:
        if b not in self._graphs:
            raise ProgramError(f"no {self.what} for {b} rows (captured: {self.batch_sizes})")

    def close(self) -> None:
        self._graphs.clear()
        self._pool = None


def input_views(packed: torch.Tensor, b: int, max_batch: int, max_pages: int) -> tuple[torch.Tensor, ...]:
    """Graph b's inputs in ``packed`` (see :class:`_Layout`), in the forward's order: tokens, positions, slots,
    out_slots, kv_lens, page_tables, slot_mapping."""
    lay = _Layout(b, max_batch, max_pages)
    meta = packed[lay.meta: lay.meta + 4 * b].view(4, b)
    i32 = packed.view(torch.int32)
    kv_lens = i32[lay.kv_lens32: lay.kv_lens32 + b]
    tables = i32[lay.table32: lay.table32 + b * max_pages].view(b, max_pages)
    return packed[:b], meta[0], meta[1], meta[2], kv_lens, tables, meta[3]


def stage_inputs(rows: DecodeRows, max_batch: int, max_pages: int, *, pin: bool = False, ring_row: int = 0
                 ) -> tuple[int, torch.Tensor, bool]:
    """The host image of graph B's inputs for ``rows``: ``(start, host, per_row)``, ``host`` (int64) to be copied
    to ``packed[start:]`` in one copy. It starts at the tokens when they are on the host, else at the ring row (the
    device tokens stay in place). ``per_row``: the page table's span (rows ``max_pages`` apart) is too long, so it
    is left out and each row's pages are copied on their own."""
    b = len(rows.seqs)
    w = max(1, max((len(p) for p in rows.pages), default=1))
    if w > max_pages:
        raise ValueError(f"a page table of width {w} exceeds the graphs' {max_pages} pages")
    lay = _Layout(b, max_batch, max_pages)
    start = 0 if rows.token_ids is not None else lay.ring
    span = (b - 1) * max_pages + w
    per_row = span > _SPAN_LIMIT
    end32 = lay.table32 + (0 if per_row else span)
    end = max(lay.meta + 4 * b, -(-end32 // 2))
    host = torch.empty(end - start, dtype=torch.int64, pin_memory=pin)
    h64 = host.numpy()
    h32 = h64.view("int32")
    if rows.token_ids is not None:
        h64[:b] = rows.token_ids
    h64[lay.ring - start] = ring_row
    m = lay.meta - start
    h64[m: m + 4 * b] = (*rows.at, *rows.state_slots, *rows.state_out_slots, *rows.kv_slots)
    k = lay.kv_lens32 - 2 * start
    h32[k: k + b] = [a + 1 for a in rows.at]
    if not per_row:
        t = lay.table32 - 2 * start
        for r, pages in enumerate(rows.pages):
            h32[t + r * max_pages: t + r * max_pages + len(pages)] = pages
    return start, host, per_row


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
