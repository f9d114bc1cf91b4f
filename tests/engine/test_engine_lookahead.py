"""Lookahead decode through the public Engine (tiny Qwen3.5, CPU fp32, ``lookahead=True`` forced).

Every request's tokens (and logprobs) must be those of the same engine without lookahead, with
admissions, finishes, preemption, cancellation, the context cache and ineligible rows in the mix;
nothing leaks, and the lookahead counters show the steps were really launched ahead and adopted.
"""

from __future__ import annotations

import random

import pytest
from ninfer import Engine, EngineOptions
from ninfer.contracts.events import GenerationDelta
from ninfer.contracts.options import InvalidEngineOptions
from ninfer.contracts.sampling import SamplingParams
from ninfer.testing import settled

from .streams import check_stream
from .stress import stress_until_closed
from .test_engine_qwen import start as qwen_start
from .test_engine_qwen import workload as mixed_workload


def start(artifact, **options) -> Engine:
    """test_engine_qwen's engine (CPU, fp32, pages of 4) with room for the longer runs here."""
    options.setdefault("max_context", 96)
    return qwen_start(artifact, **options)


def eligible_workload(n: int = 8, seed: int = 11):
    """Greedy and seeded-temperature rows (drawn on the device), varied lengths so rows finish apart."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(0, 256) for _ in range(rng.randint(3, 30))]
        max_tokens = rng.randint(4, 24)
        if i % 2:
            sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=max_tokens, seed=200 + i)
        else:
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=i)
        out.append((prompt, sp))
    return out


def run_all(engine: Engine, work):
    handles = [engine.submit(p, sampling=sp) for p, sp in work]
    results = [check_stream(list(h), started=True) for h in handles]
    return [r.token_ids for r in results]


def both(artifact, work, **options):
    """(tokens without lookahead, tokens with it, the lookahead engine's final stats)."""
    with start(artifact, lookahead=False, **options) as off:
        expected = run_all(off, work)
        assert off.stats().lookahead_launched == 0
    with start(artifact, lookahead=True, **options) as on:
        got = run_all(on, work)
        on.close()
        stats = on.stats()
    return expected, got, stats


def check_counts(stats):
    # Every launch is adopted or dropped, except at most one still outstanding when the engine stopped.
    assert 0 <= stats.lookahead_launched - stats.lookahead_adopted - stats.lookahead_dropped <= 1


@pytest.mark.parametrize("chunk", [5, 64])
def test_batched_tokens_equal_without_lookahead(tiny_qwen_artifact, chunk):
    expected, got, stats = both(tiny_qwen_artifact, eligible_workload(), max_concurrency=8,
                                prefill_chunk_size=chunk)
    assert got == expected
    assert stats.lookahead_adopted >= 10, stats.as_dict()
    check_counts(stats)


def test_one_request_adopts_every_step(tiny_qwen_artifact):
    work = [([5, 9, 11, 200], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))]
    expected, got, stats = both(tiny_qwen_artifact, work, max_concurrency=1)
    assert got == expected and len(got[0]) == 30
    # Prefill samples token 1 (no lookahead: the unit has a chunk); decode steps 2..29 each launch the
    # next one; step 30 draws the last token (max_tokens), so nothing is launched after it.
    assert (stats.lookahead_launched, stats.lookahead_adopted, stats.lookahead_dropped) == (28, 28, 0)


def test_preempted_tokens_equal_without_lookahead(tiny_qwen_artifact):
    expected, got, stats = both(tiny_qwen_artifact, eligible_workload(seed=12), max_concurrency=8,
                                prefill_chunk_size=5, num_pages=24)
    assert got == expected
    assert stats.preemptions > 0 and stats.lookahead_adopted > 0
    assert stats.pages_used == 0 and stats.state_slots_used == 0
    check_counts(stats)


def test_ineligible_rows_mixed_in(tiny_qwen_artifact):
    """Penalised rows keep their batches off the lookahead path, a row asking for logprobs takes it; tokens
    and logprobs equal the engine without it."""
    work = mixed_workload() + [([7, 8, 9], SamplingParams(temperature=0.0, max_tokens=10, logprobs=True,
                                                          top_logprobs=2))]
    with start(tiny_qwen_artifact, lookahead=False, max_concurrency=8) as off:
        expected = [generate(off, p, sp) for p, sp in work]
    with start(tiny_qwen_artifact, lookahead=True, max_concurrency=8) as on:
        got = [generate(on, p, sp) for p, sp in work[:-1]]  # one at a time: the eligible ones look ahead
        before = settled(on).lookahead_adopted
        got.append(generate(on, *work[-1]))
        after = settled(on).lookahead_adopted
    assert got == expected
    assert expected[-1][1] and all(lp is not None for lp in expected[-1][1])
    assert before > 0 and after - before == 8  # the logprobs request's decode steps 3..10 were adopted


def generate(engine: Engine, prompt, sp):
    """(tokens, logprobs of every delta) of one request."""
    events = list(engine.submit(prompt, sampling=sp))
    result = check_stream(events, started=True)
    return result.token_ids, [e.logprobs for e in events if isinstance(e, GenerationDelta) and e.token_ids]


def test_context_cache_hits_the_same_checkpoints(tiny_qwen_artifact):
    """A response-end checkpoint captured while a lookahead is outstanding covers what it covers
    without lookahead: the second turn hits the same number of tokens and decodes the same tokens."""
    rng = random.Random(3)
    turn1 = [rng.randrange(0, 256) for _ in range(40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = {}
    for flag in (False, True):
        with start(tiny_qwen_artifact, lookahead=flag, max_concurrency=2, max_context=160, context_cache=True,
                   cache_checkpoint_interval=16, page_size=16) as engine:
            r1 = engine.generate(turn1, sampling=greedy)
            turn2 = turn1 + list(r1.token_ids) + [rng.randrange(0, 256) for _ in range(9)]
            r2 = engine.generate(turn2, sampling=greedy)
            engine.close()
            s = engine.stats()
            out[flag] = (r1.token_ids, r2.token_ids, s.cache_hits, s.cache_hit_tokens)
        rng = random.Random(3)
        turn1 = [rng.randrange(0, 256) for _ in range(40)]
    assert out[True] == out[False]
    assert out[True][2] == 1 and out[True][3] == 40 + 12 - 1  # the response end: all but the last token


@pytest.mark.parametrize("cache", [False, True])
def test_stress_with_cancellation_frees_everything(tiny_qwen_artifact, cache):
    """Random traffic with cancellations under page pressure (with the context cache: checkpoints, pause
    Snapshots on the Host tier, reclaims) while lookahead steps are outstanding: no error, nothing leaks."""
    extra = dict(context_cache=True, cache_checkpoint_interval=8, page_size=4, cache_host_mib=64) if cache else {}
    engine = start(tiny_qwen_artifact, lookahead=True, max_concurrency=8, queue_capacity=32, prefill_chunk_size=8,
                   num_pages=24, max_context=64, **extra)
    _, program, stats = stress_until_closed(engine, n=200, vocab=(0, 256), max_prompt=24, max_tokens=10, seed=21)
    assert program.capacity().total_state_slots == 8
    assert len(program._spares) == program.lookahead_slots == 8
    assert stats.lookahead_adopted > 0
    if cache:
        assert stats.cache_captures > 0 and stats.snapshot_pauses > 0 and stats.snapshot_resumes > 0, stats.as_dict()
    assert stats.finished + stats.cancelled + stats.deadline + stats.rejected == stats.submitted == 200
    check_counts(stats)


def test_lookahead_option_rules(tiny_qwen_artifact):
    with pytest.raises(InvalidEngineOptions, match="lookahead"):
        EngineOptions(purpose="causal_scoring", lookahead=True).validate()
    with start(tiny_qwen_artifact, max_concurrency=2) as engine:  # auto on the CPU: off (no CUDA graphs)
        assert engine.info["lookahead"] is False
        engine.generate([1, 2, 3], sampling=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert engine.stats().lookahead_launched == 0
    with start(tiny_qwen_artifact, max_concurrency=2, lookahead=True) as engine:
        assert engine.info["lookahead"] is True
