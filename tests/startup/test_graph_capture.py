"""Decode-graph capture at engine start (ninfer.engine.model_construction._capture_graphs): when it is
attempted, and that a failing capture is a ModelConstructionError naming the way out. Runs on the CPU with a
fake CUDA device decision; the real capture is covered on the GPU by tests/engine/test_decode_graphs_gpu.py."""

from __future__ import annotations

import pytest
import torch
from ninfer import EngineOptions
from ninfer.engine import model_construction as mc


class Program:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.asked: list[int] = []

    def capture_decode_graphs(self, max_batch: int):
        self.asked.append(max_batch)
        if self.fail:
            raise RuntimeError("out of memory")
        return tuple(range(1, max_batch + 1))


def test_no_capture_off_cuda_for_scoring_or_when_turned_off(monkeypatch):
    p = Program()
    assert mc._capture_graphs(p, EngineOptions(), torch.device("cpu")) == ((), 0)
    assert mc._capture_graphs(p, EngineOptions(purpose="causal_scoring"), torch.device("cuda")) == ((), 0)
    monkeypatch.setenv(mc.GRAPHS_ENV, "0")
    assert mc._capture_graphs(p, EngineOptions(), torch.device("cuda")) == ((), 0)
    assert mc._capture_graphs(object(), EngineOptions(), torch.device("cpu")) == ((), 0)  # no capture method
    assert p.asked == []


def test_a_failing_capture_names_the_switch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)
    with pytest.raises(mc.ModelConstructionError, match="NINFER_CUDA_GRAPHS=0 starts without them") as e:
        mc._capture_graphs(Program(fail=True), EngineOptions(max_concurrency=3), torch.device("cuda"))
    assert "batch sizes 1..3" in str(e.value) and "out of memory" in str(e.value)
    p = Program()
    assert mc._capture_graphs(p, EngineOptions(max_concurrency=3), torch.device("cuda")) == ((1, 2, 3), 0)
    assert p.asked == [3]
