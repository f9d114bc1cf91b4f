"""Decode-graph capture at engine start: when it is planned (``planning.resolution.graph_batches``), what
``model_construction._capture_graphs`` does with that, and that a failing capture is a ModelConstructionError
naming the way out. Runs on the CPU with a fake CUDA device decision; the real capture is covered on the GPU by
tests/engine/test_decode_graphs_gpu.py."""

from __future__ import annotations

import pytest
import torch
from ninfer import EngineOptions
from ninfer.engine import model_construction as mc
from ninfer.planning import resolution


class Program:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.asked: list[int] = []

    def capture_decode_graphs(self, max_batch: int):
        self.asked.append(max_batch)
        if self.fail:
            raise RuntimeError("out of memory")
        return tuple(range(1, max_batch + 1))


def test_graphs_are_planned_on_cuda_for_generation_unless_turned_off(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(resolution.GRAPHS_ENV, raising=False)
    assert resolution.graph_batches(cuda, EngineOptions(max_concurrency=3)) == 3
    assert resolution.graph_batches(cpu, EngineOptions(max_concurrency=3)) == 0
    assert resolution.graph_batches(cuda, EngineOptions(purpose="causal_scoring")) == 0
    monkeypatch.setenv(resolution.GRAPHS_ENV, "0")
    assert resolution.graph_batches(cuda, EngineOptions()) == 0


def test_no_capture_when_none_is_planned():
    p = Program()
    assert mc._capture_graphs(p, 0, torch.device("cuda")) == ((), 0)
    assert p.asked == []


def test_a_failing_capture_names_the_switch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)
    with pytest.raises(mc.ModelConstructionError, match="NINFER_CUDA_GRAPHS=0 starts without them") as e:
        mc._capture_graphs(Program(fail=True), 3, torch.device("cuda"))
    assert "batch sizes 1..3" in str(e.value) and "out of memory" in str(e.value)
    p = Program()
    assert mc._capture_graphs(p, 3, torch.device("cuda")) == ((1, 2, 3), 0)
    assert p.asked == [3]


def test_prefill_graph_buckets_are_planned_by_default_where_they_run(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(resolution.GRAPHS_ENV, raising=False)
    on = EngineOptions(prefill_graphs=True)
    everything = (16, 32, 64, 128, 256)   # up to the default step budget
    assert resolution.prefill_graph_tokens(cuda, EngineOptions()) == everything   # on by default
    assert resolution.prefill_graph_tokens(cuda, on) == everything
    assert resolution.prefill_graph_tokens(cuda, EngineOptions(max_step_tokens=2048)) \
        == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert resolution.prefill_graph_tokens(cuda, EngineOptions(prefill_graphs=False)) == ()
    # An architecture that declares no flat steps (ArchitectureSpec.flat_steps) gets none planned.
    assert resolution.prefill_graph_tokens(cuda, on, supported=False) == ()
    # Up to the first power of two that holds a step while streams decode (at most the prefill chunk).
    assert resolution.prefill_graph_tokens(cuda, EngineOptions(prefill_graphs=True, max_step_tokens=300)) \
        == (16, 32, 64, 128, 256, 512)
    assert resolution.prefill_graph_tokens(cuda, EngineOptions(prefill_graphs=True, prefill_chunk_size=100)) \
        == (16, 32, 64, 128)
    for off in (EngineOptions(prefill_graphs=True, host_experts=True),
                EngineOptions(prefill_graphs=True, speculative="mtp"),
                EngineOptions(prefill_graphs=True, vision=True),
                EngineOptions(prefill_graphs=True, purpose="causal_scoring")):
        assert resolution.prefill_graph_tokens(cuda, off) == ()
    assert resolution.prefill_graph_tokens(cpu, on) == ()
    monkeypatch.setenv(resolution.GRAPHS_ENV, "0")
    assert resolution.prefill_graph_tokens(cuda, on) == ()


def test_the_prefill_graph_option_is_checked():
    from ninfer.contracts.options import InvalidEngineOptions

    with pytest.raises(InvalidEngineOptions, match="prefill_graphs"):
        EngineOptions(prefill_graphs="yes").validate()


def test_prefill_graphs_need_a_cuda_device_and_sane_buckets():
    from ninfer.program.prefill_graphs import PrefillGraphs

    with pytest.raises(ValueError, match="CUDA"):
        PrefillGraphs(lambda batch: batch, device=torch.device("cpu"), buckets=(16,), rows=2, pages=2,
                      pad_state_slot=0)
