"""CUDA graphs of steps that prefill: one graph per token bucket over the flat, padded layout
(:mod:`ninfer.program.flat_batch`; the plan is docs/dev/prefill-graphs.md).

A step with prefill chunks (and any decode rows beside them) runs its layers eagerly: hundreds of launches whose
host time, not the GPU's, sets the step's time at small sizes. Laid out flat (every row a varlen sequence, described
by device tensors only) and padded to a bucket of tokens, such a step is the same kernel sequence for any rows, so
one captured graph per bucket replays all of them.

Invariants:
- One graph per bucket of ``buckets`` (ascending token counts), each with fixed ``rows``, ``pages`` and
  ``logit_rows``; a step runs in the smallest bucket that holds it (:meth:`PrefillGraphs.bucket_for`), or eagerly
  when none does.
- Each graph's inputs are two static device buffers (int64 and int32) in :func:`~ninfer.program.flat_batch.
  flat_tensors`' layout; a replay is one pinned host-to-device copy of each and the graph launch.
- Padded tokens write KV slot -1 (the device KV writes drop it) and padded rows share ``pad_state_slot``, a StateImage
  slot the Program holds for this and no sequence ever gets.
- Capture runs each forward eagerly first (compiling kernels) over an all-padded input (no row: nothing of any
  sequence is read or written) and then records it; graphs share one memory pool, so the logits a replay returns are
  overwritten by the next replay of any graph: callers consume them first.
- Only the thread that owns the Program replays.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ninfer.contracts.program import ProgramError
from ninfer.program.batch import ForwardBatch, PackedBatch
from ninfer.program.flat_batch import FlatSizes, flat_needs, flat_tensors, flat_views

FlatForward = Callable[[PackedBatch], torch.Tensor]   # the Program's forward_packed: fp32 logits [logit_rows, V]


class PrefillGraphs:
    """Captured flat-step graphs for the token ``buckets`` over ``forward`` (module docstring)."""

    def __init__(self, forward: FlatForward, *, device: torch.device, buckets: tuple[int, ...], rows: int, pages: int,
                 pad_state_slot: int) -> None:
        if torch.device(device).type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or rows < 1 or pages < 1:
            raise ValueError(f"prefill graphs need ascending distinct token buckets >= 1 and rows, pages >= 1; got "
                             f"{buckets}, {rows}, {pages}")
        self.device = torch.device(device)
        self._forward = forward
        self.sizes = tuple(FlatSizes(tokens=n, rows=rows, pages=pages, logit_rows=rows, pad_kv_slot=-1,
                                     pad_state_slot=pad_state_slot) for n in buckets)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pool = None
        self.replays = 0

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(s.tokens for s in self.sizes)

    def _buffers(self, sizes: FlatSizes) -> tuple[torch.Tensor, torch.Tensor]:
        """The static inputs of one bucket, holding an all-padded step (no row)."""
        n, r = sizes.tokens, sizes.rows
        big = torch.zeros(3 * n + sizes.logit_rows + r, dtype=torch.int64, device=self.device)
        big[2 * n:3 * n] = sizes.pad_kv_slot
        big[3 * n + sizes.logit_rows:] = sizes.pad_state_slot
        small = torch.zeros(2 * r + 1 + r * sizes.pages, dtype=torch.int32, device=self.device)
        return big, small

    def capture(self) -> None:
        """Capture every bucket, the largest first (the pool then holds the largest step's blocks)."""
        for sizes in reversed(self.sizes):
            big, small = self._buffers(sizes)
            batch = flat_views(big, small, sizes)
            self._forward(batch)                      # eager: compiles every kernel variant first
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward(batch)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[sizes.tokens] = (graph, big, small, logits)
        torch.cuda.synchronize(self.device)

    def bucket_for(self, batch: ForwardBatch) -> FlatSizes | None:
        """The smallest captured bucket that holds ``batch`` laid out flat, or None (it runs eagerly)."""
        needs = flat_needs(batch)
        return next((s for s in self.sizes if s.tokens in self._graphs and s.holds(needs)), None)

    def run(self, batch: ForwardBatch, sizes: FlatSizes | None = None) -> torch.Tensor:
        """Replay bucket ``sizes`` (None: :meth:`bucket_for`) with ``batch``: fp32 logits ``[batch.num_logit_rows, V]``
        (graph-owned memory, valid until the next replay). ProgramError when it does not hold the step."""
        sizes = sizes or self.bucket_for(batch)
        if sizes is None:
            raise ProgramError("no prefill graph holds this step; run it eagerly")
        graph, big, small, logits = self._graphs[sizes.tokens]
        wide, narrow = flat_tensors(batch, sizes)
        big.copy_(wide.pin_memory(), non_blocking=True)
        small.copy_(narrow.pin_memory(), non_blocking=True)
        graph.replay()
        self.replays += 1
        return logits[:batch.num_logit_rows]

    def close(self) -> None:
        """Drop the graphs and their pool (the Program's close)."""
        self._graphs.clear()
        self._pool = None
