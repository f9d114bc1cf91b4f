"""Start-up on a thread of its own (``ninfer.engine.start_thread``): the engine's load and warm-up run on a thread
that has ended when ``Engine.start`` returns, so the OpenMP pools they created end with it; results and errors
reach the caller unchanged."""

from __future__ import annotations

import threading

import pytest
import torch
from ninfer import Engine
from ninfer.engine import model_construction
from ninfer.engine.start_thread import on_start_thread


def test_the_result_and_the_error_come_back_and_the_thread_has_ended():
    seen = []

    def work():
        seen.append(threading.current_thread())
        return 42

    assert on_start_thread(work) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive() and seen[0].daemon

    class Boom(Exception):
        """A failure the caller must see as it was raised."""

    def fail():
        raise Boom("named")

    with pytest.raises(Boom, match="named"):
        on_start_thread(fail)


def test_engine_start_builds_and_warms_up_on_a_thread_that_has_ended(default_artifact, monkeypatch):
    real = model_construction.build_model
    builders = []

    def build_model(*a, **k):
        builders.append(threading.current_thread())
        torch.ones(1 << 17).mul_(2.0)   # a parallel region, as loading runs them
        return real(*a, **k)

    monkeypatch.setattr(model_construction, "build_model", build_model)
    with Engine.start(default_artifact, device="cpu", max_concurrency=1, max_context=256) as engine:
        assert builders and builders[0] is not threading.current_thread() and not builders[0].is_alive()
        out = engine.generate(list(range(10, 20)), sampling=engine.sampling_params(temperature=0.0, max_tokens=3))
        assert out.usage.completion_tokens == 3
