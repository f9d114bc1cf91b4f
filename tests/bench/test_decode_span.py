"""The decode figure differences *decode spans* (last first token -> last result), so the prefill time of the batch,
however much it varies between runs, never enters the rate."""

from types import SimpleNamespace

import pytest
from ninfer.bench.workload import BenchError, BenchSettings, Workload, _run_batch
from ninfer.contracts.events import Timings, Usage


class _Handle:
    def __init__(self, result):
        self._result = result

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def result(self):
        return self._result


class _ScriptedEngine:
    """Every ``batch`` consecutive submits form one run: its prefill takes the next of ``prefills`` seconds (first
    tokens 1 ms apart within the batch), then each request decodes ``max_tokens - 1`` steps of ``step_s``."""

    options = SimpleNamespace(max_concurrency=8)
    max_context = 4096
    vocab_size = 100

    def __init__(self, batch, prefills, step_s=0.01):
        self.batch, self.prefills, self.step_s, self.submitted = batch, list(prefills), step_s, 0

    def submit(self, prompt, sampling):
        row = self.submitted % self.batch
        if row == 0:
            self.current = self.prefills.pop(0)
        self.submitted += 1
        n = sampling.max_tokens
        first = self.current + 0.001 * row
        return _Handle(SimpleNamespace(usage=Usage(len(prompt), n), finish_reason="length",
                                       timings=Timings(queue_s=0.0, ttft_s=first, total_s=first + (n - 1) * self.step_s)))


def test_span_is_last_result_minus_last_first_token():
    span, ttfts = _run_batch(_ScriptedEngine(3, [0.5]), [[1, 2]] * 3, 11)
    assert ttfts == pytest.approx([0.5, 0.501, 0.502])
    assert span == pytest.approx(10 * 0.01)


def test_decode_rate_ignores_prefill_variance():
    # Prefill times 400x apart between runs would wreck a wall-time difference; spans do not see them.
    engine = _ScriptedEngine(2, [0.001, 0.3, 0.002, 0.2, 0.05, 0.001, 0.09, 0.4], step_s=0.01)
    settings = BenchSettings(batches=(2,), prefill_lengths=(), decode_base_tokens=4, decode_steps=20, repeats=3,
                             warmup=1)
    r = Workload(engine, settings).decode(2)
    assert r.step_s == pytest.approx(0.01)
    assert r.tokens_per_s == pytest.approx(200.0)


def test_short_result_is_an_error():
    engine = _ScriptedEngine(1, [0.1])
    real = engine.submit

    def short(prompt, sampling):
        h = real(prompt, sampling)
        h._result.usage = Usage(len(prompt), sampling.max_tokens - 1)
        return h

    engine.submit = short
    with pytest.raises(BenchError, match="produced 2 tokens, not 3"):
        _run_batch(engine, [[1]], 3)
