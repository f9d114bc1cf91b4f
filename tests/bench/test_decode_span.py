"""The decode figure differences *decode spans* (last first token -> last result), so the prefill time of the batch,
however much it varies between runs, never enters the rate; rates count committed tokens, and engine steps come
from the requests' token events (one per step), so a step committing several tokens per request (speculation)
is one step."""

from types import SimpleNamespace

import pytest
from ninfer.bench.workload import BenchError, BenchSettings, Workload, _run_batch
from ninfer.contracts.events import GenerationDelta, GenerationStart, Timings, Usage


class _Handle:
    def __init__(self, result, events):
        self._result, self._events = result, events

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __iter__(self):
        return iter([*self._events, self._result])

    def result(self):
        return self._result


class _ScriptedEngine:
    """Every ``batch`` consecutive submits form one run: its prefill takes the next of ``prefills`` seconds (first
    tokens 1 ms apart within the batch), then each request decodes its ``max_tokens - 1`` other tokens in steps of
    ``step_s``, each committing ``per_step`` tokens (the last step what is left)."""

    options = SimpleNamespace(max_concurrency=8)
    max_context = 4096
    vocab_size = 100

    def __init__(self, batch, prefills, step_s=0.01, per_step=1):
        self.batch, self.prefills, self.step_s, self.submitted = batch, list(prefills), step_s, 0
        self.per_step = per_step

    def submit(self, prompt, sampling):
        row = self.submitted % self.batch
        if row == 0:
            self.current = self.prefills.pop(0)
        self.submitted += 1
        n = sampling.max_tokens
        first = self.current + 0.001 * row
        sizes = [1] + [min(self.per_step, n - 1 - i) for i in range(0, n - 1, self.per_step)]
        events = [GenerationStart("r", len(prompt))] + [GenerationDelta("r", (7,) * k) for k in sizes]
        steps = len(sizes) - 1
        return _Handle(SimpleNamespace(usage=Usage(len(prompt), n), finish_reason="length",
                                       timings=Timings(queue_s=0.0, ttft_s=first, total_s=first + steps * self.step_s)),
                       events)


def test_span_is_last_result_minus_last_first_token():
    run = _run_batch(_ScriptedEngine(3, [0.5]), [[1, 2]] * 3, 11)
    assert run.ttfts == pytest.approx([0.5, 0.501, 0.502])
    assert run.span_s == pytest.approx(10 * 0.01)
    assert run.row_steps == 3 * 10


def test_decode_rate_ignores_prefill_variance():
    # Prefill times 400x apart between runs would wreck a wall-time difference; spans do not see them.
    engine = _ScriptedEngine(2, [0.001, 0.3, 0.002, 0.2, 0.05, 0.001, 0.09, 0.4], step_s=0.01)
    settings = BenchSettings(batches=(2,), prefill_lengths=(), decode_base_tokens=4, decode_steps=20, repeats=3,
                             warmup=1)
    r = Workload(engine, settings).decode(2)
    assert r.step_s == pytest.approx(0.01) and r.token_s == pytest.approx(0.01)
    assert r.engine_steps == 20 and r.tokens_per_step == 1
    assert r.tokens_per_s == pytest.approx(200.0)


def test_steps_committing_several_tokens_count_as_one_step():
    # Each step commits 2 tokens per request: 4 tokens take 1 + 2 steps, 24 take 1 + 12; the 20 measured
    # tokens per request take 10 steps of 10 ms, so a token costs 5 ms and the batch commits 400 tokens/s.
    engine = _ScriptedEngine(2, [0.1] * 8, step_s=0.01, per_step=2)
    settings = BenchSettings(batches=(2,), prefill_lengths=(), decode_base_tokens=4, decode_steps=20, repeats=3,
                             warmup=1)
    r = Workload(engine, settings).decode(2)
    assert r.long_row_steps == (2 * 12,) * 3 and r.short_row_steps == (2 * 2,) * 3
    assert r.engine_steps == 10 and r.tokens_per_step == 2
    assert r.step_s == pytest.approx(0.01) and r.token_s == pytest.approx(0.005)
    assert r.tokens_per_s == pytest.approx(400.0)


def test_no_more_engine_steps_in_the_long_runs_is_an_error():
    # Spans that grow with the tokens but row steps that do not: every request commits its decode tokens in one step.
    engine = _ScriptedEngine(1, [0.1] * 2, step_s=0.01)
    real = engine.submit

    def one_step(prompt, sampling):
        h = real(prompt, sampling)
        h._events = [GenerationDelta("r", (7,)), GenerationDelta("r", (7,) * (sampling.max_tokens - 1))]
        return h

    engine.submit = one_step
    settings = BenchSettings(batches=(1,), prefill_lengths=(), decode_base_tokens=4, decode_steps=20, repeats=1,
                             warmup=0)
    with pytest.raises(BenchError, match="took no more engine steps"):
        Workload(engine, settings).decode(1)


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
