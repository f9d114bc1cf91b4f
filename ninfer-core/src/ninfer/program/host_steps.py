"""Host steps inside a captured forward: a CUDA graph in segments.

A forward that hands work to the host part-way through (a MoE layer whose routed experts live in host memory and
are computed there, docs/memory.md "Host experts") cannot be one CUDA graph: the host must read the device's
values in the middle. It can be a chain of them. :class:`SegmentedGraph` captures such a forward as graph 0 up to
its first host step, that step's host function, graph 1 up to the next step, and so on; :meth:`~SegmentedGraph.
replay` runs them in that order on the current stream. Everything between two host steps then costs one launch,
not one per kernel, which is most of a small decode step's time when it runs eagerly.

Invariants:
- A forward marks each such point with :func:`host_step`. Outside a capture that is just ``fn()``. During one it
  allocates the step's output (``shape``, ``dtype``, ``device``) in the graph pool, closes the current segment, records
  ``out.copy_(fn())`` to run between that segment's replay and the next one's, opens the next segment and returns
  ``out``. ``fn`` may read only tensors the forward computed before the point: its closure keeps them alive, so
  their pool blocks are never given to a later capture, and each replay rewrites them before the step reads them.
- A forward without host steps is one segment, captured as ``torch.cuda.graph`` captures (synchronize, release the
  allocator's cached blocks, record on a side stream into ``pool``).
- One capture at a time per device in a process (they share its capture stream); all segments share one memory
  pool (``pool`` or the first segment's) and are replayed in capture order, so a segment's freed temporaries may be
  reused by the next one's.
- Every capture on a device records on that device's one capture stream (:func:`capture_stream`), as
  ``torch.cuda.graph`` does: the caching allocator hands a freed block only to allocations on the stream that freed
  it, so graphs captured on streams of their own could not reuse each other's pool blocks, and a set of graphs
  sharing a pool would reserve the sum of their steps' temporaries instead of the largest.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

_local = threading.local()
_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def capture_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """The one stream every capture on ``device`` (None: the current one) records on (module docstring)."""
    index = device if isinstance(device, int) else getattr(device, "index", None)
    if index is None:
        index = torch.cuda.current_device()
    with _streams_lock:
        if index not in _streams:
            _streams[index] = torch.cuda.Stream(index)
        return _streams[index]


def host_step(fn: Callable[[], torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """``fn()`` (a ``shape`` tensor of ``dtype`` on ``device``), as a host step of the capture in progress on this
    thread if there is one (module docstring)."""
    capture: SegmentedGraph | None = getattr(_local, "capture", None)
    if capture is None:
        return fn()
    return capture._split(fn, torch.empty(shape, dtype=dtype, device=device))   # noqa: SLF001 (its own class)


class SegmentedGraph:
    """A captured forward as CUDA graph segments separated by host steps (module docstring)."""

    def __init__(self) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.steps: list[Callable[[], object]] = []
        self._pool = None

    def pool(self):
        """The memory pool the segments share (after :meth:`capture`)."""
        return self._pool

    def capture(self, record: Callable[[], object], pool=None, stream: torch.cuda.Stream | None = None) -> object:
        """Record ``record()`` (its kernels; host steps become segment boundaries) into ``pool`` (None: the first
        segment's new one) on ``stream`` (None: the current device's :func:`capture_stream`; another stream only to
        measure what sharing one saves); returns what ``record`` returned, whose tensors each replay rewrites."""
        if self.graphs:
            raise RuntimeError("a SegmentedGraph is captured once")
        self._pool = pool
        stream = capture_stream() if stream is None else stream
        torch.cuda.synchronize(stream.device)
        torch.cuda.empty_cache()
        with torch.cuda.stream(stream):
            self._begin()
            _local.capture = self
            try:
                out = record()
            except BaseException:
                _local.capture = None
                self._abort()
                raise
            _local.capture = None
            self._end()
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def replay(self) -> None:
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < len(self.steps):
                self.steps[i]()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self.graphs.append(graph)

    def _end(self) -> None:
        self.graphs[-1].capture_end()
        if self._pool is None:
            self._pool = self.graphs[-1].pool()

    def _abort(self) -> None:
        """End a capture that failed part-way, so the stream leaves capture mode; the error that stopped it is the
        one the caller sees."""
        with contextlib.suppress(RuntimeError):   # ending a broken capture may fail too; the first error counts
            self.graphs[-1].capture_end()
        self.graphs.clear()
        self.steps.clear()

    def _split(self, fn: Callable[[], torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``out`` (allocated in the pool) is kept alive by the step's closure."""
        self._end()
        self.steps.append(lambda: out.copy_(fn()))
        self._begin()
        return out
