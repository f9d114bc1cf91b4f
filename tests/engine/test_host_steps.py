"""Host steps inside a captured forward (ninfer.program.host_steps): a CUDA graph in segments.

- outside a capture a host step is its function's call;
- on CUDA, a forward with host steps is captured as one more segment than steps, the host function runs at each
  replay (not at capture), reads what the segment before it computed that replay, and the segment after it reads
  its answer; a forward without host steps is one segment; a capture that fails part-way leaves the stream usable.
"""

from __future__ import annotations

import pytest
import torch
from ninfer.program.host_steps import SegmentedGraph, host_step


def test_outside_a_capture_a_host_step_is_its_call():
    x = torch.arange(4.0)
    assert torch.equal(host_step(lambda: x * 2, (4,), torch.float32, x.device), x * 2)


@pytest.mark.gpu
def test_a_forward_with_host_steps_replays_as_it_runs_eagerly():
    dev = torch.device("cuda")
    a = torch.randn(64, device=dev)
    calls = []

    def host(t: torch.Tensor) -> torch.Tensor:   # reads the device's values on the host; has host state
        calls.append(1)
        return (t.cpu() * 2 + len(calls)).to(dev)

    def forward() -> torch.Tensor:
        y = a * 3
        z = host_step(lambda: host(y), y.shape, y.dtype, dev)
        w = host_step(lambda: host(z + 1), z.shape, z.dtype, dev)
        return w - 1

    forward()   # eager: compiles nothing here, but is what capture_sizes does first
    calls.clear()
    graph = SegmentedGraph()
    out = graph.capture(forward)
    assert len(graph.graphs) == 3 and len(graph.steps) == 2 and not calls
    for i in range(3):
        a.copy_(torch.randn(64, device=dev))
        graph.replay()
        torch.cuda.synchronize()
        first = ((a * 3).cpu() * 2 + (2 * i + 1)).to(dev)
        want = ((first + 1).cpu() * 2 + (2 * i + 2)).to(dev) - 1
        assert torch.equal(out, want)
    assert len(calls) == 6


@pytest.mark.gpu
def test_without_host_steps_one_segment_and_a_failed_capture_is_undone():
    dev = torch.device("cuda")
    a = torch.randn(8, device=dev)
    graph = SegmentedGraph()
    out = graph.capture(lambda: a + 1)
    assert len(graph.graphs) == 1 and not graph.steps
    a.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(a, 3.0))

    def broken():
        host_step(lambda: a, a.shape, a.dtype, dev)
        raise ValueError("the forward failed")

    with pytest.raises(ValueError, match="the forward failed"):
        SegmentedGraph().capture(broken)
    assert torch.equal((a * 2).cpu(), torch.full((8,), 4.0))   # the stream is out of capture mode


def _captured_growth(stream_for) -> tuple[int, int]:
    """Reserved bytes that capturing a host-step forward for sizes 8..1 into one pool adds, each size's graph
    captured on ``stream_for(b)`` (None: the shared capture stream), and one size-8 step's temporary bytes."""
    dev = torch.device("cuda")
    unit = 1 << 20   # floats a row: a 4 MiB temporary per row, freed inside the step
    a = torch.randn(8 * unit, device=dev)

    def forward(b: int) -> torch.Tensor:
        t = a[: b * unit] * 2
        total = t.sum().reshape(1)   # the host step reads only this; ``t`` is freed before it
        del t
        scale = host_step(lambda: total.cpu().to(dev), (1,), total.dtype, dev)
        return (a[: b * unit] * scale).sum()

    graphs = []
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    pool = None
    for b in range(8, 0, -1):
        graph = SegmentedGraph()
        graph.capture(lambda: forward(b), pool, stream_for(b))   # noqa: B023 (called here)
        pool = graph.pool()
        graphs.append(graph)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_reserved() - before
    graphs.clear()
    return grown, 8 * unit * 4


@pytest.mark.gpu
def test_graphs_sharing_a_pool_reuse_its_blocks_across_sizes():
    # Every capture records on the device's one capture stream, so the smaller sizes' temporaries reuse the
    # largest's freed blocks: the pool holds about one size-8 step, not the sum over sizes (36 rows' worth).
    shared, step = _captured_growth(lambda b: None)
    assert shared <= 2 * step, f"{shared / 2**20:.1f} MiB reserved for graphs whose largest step is {step / 2**20} MiB"
    # The measurement's power: a stream of each graph's own (what captures did before) cannot reuse them.
    own, _ = _captured_growth(lambda b: torch.cuda.Stream())
    assert own > 3 * step, f"{own / 2**20:.1f} MiB"
