"""The context cache through the public Engine (fp32, CPU): hits give exactly the cold tokens,
eviction under a tiny page pool keeps requests correct, nothing leaks, a request with the cache off
binds and publishes nothing, and a broken checkpoint is an engine failure, never a silent miss."""

from __future__ import annotations

import dataclasses
import random

import pytest
from ninfer import Engine, EngineOptions
from ninfer.contracts.errors import EngineFailure
from ninfer.contracts.options import InvalidEngineOptions
from ninfer.contracts.request import GenerationRequest
from ninfer.contracts.sampling import SamplingParams

from .conftest import settled

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, seed=1)


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


def test_second_turn_hits_and_equals_cold(make_engine):
    rng = random.Random(1)
    turn1 = toks(rng, 100)
    cold = make_engine(max_context=512, max_concurrency=2, prefill_chunk_size=64)
    warm = make_engine(max_context=512, max_concurrency=2, prefill_chunk_size=64, context_cache=True,
                       cache_checkpoint_interval=32)
    r1 = warm.generate(turn1, sampling=GREEDY)
    assert r1.token_ids == cold.generate(turn1, sampling=GREEDY).token_ids
    s = settled(warm)
    assert s.cache_checkpoints == 5  # boundaries 32, 64, 96, the prompt end 100, the response end 107
    assert s.cache_device_bytes > 0 and s.cache_host_bytes == 0
    turn2 = turn1 + list(r1.token_ids) + toks(rng, 20)
    before = s.prefill_tokens
    r2 = warm.generate(turn2, sampling=GREEDY)
    assert r2.token_ids == cold.generate(turn2, sampling=GREEDY).token_ids
    s = settled(warm)
    assert s.cache_hits == 1 and s.cache_hit_tokens == 107 and s.cache_saved_prefill_tokens == 107
    assert s.prefill_tokens - before == len(turn2) - 107
    # Each result reports the prompt tokens its admission restored (the cold engine's none).
    assert (r1.usage.cached_tokens, r2.usage.cached_tokens) == (0, 107)
    assert r2.usage.prompt_tokens == len(turn2)


def test_request_with_cache_off_binds_and_publishes_nothing(make_engine):
    rng = random.Random(2)
    prompt = toks(rng, 70)
    engine = make_engine(max_context=256, max_concurrency=1, prefill_chunk_size=32, context_cache=True,
                         cache_checkpoint_interval=16)
    engine.generate(GenerationRequest(prompt=prompt, sampling=GREEDY, cache=False))
    s = settled(engine)
    assert (s.cache_checkpoints, s.cache_captures, s.cache_lookups, s.pages_used, s.state_slots_used) == (0, 0, 0, 0, 0)
    engine.generate(prompt, sampling=GREEDY)
    assert settled(engine).cache_checkpoints > 0
    before = settled(engine)
    engine.generate(prompt + [1, 2, 3], sampling=GREEDY, cache=False)
    after = settled(engine)
    assert (after.cache_hits, after.cache_captures, after.cache_checkpoints) == \
        (before.cache_hits, before.cache_captures, before.cache_checkpoints)
    assert after.prefill_tokens - before.prefill_tokens == len(prompt) + 3


def conversation_workload(seed: int, conversations: int, turns: int, max_out: int | None = None):
    """Per conversation, a list of (prompt builder, sampling): turn k's prompt is turn k-1's prompt and
    answer (sometimes re-rendered: its last 3 tokens replaced) plus a new message. Answers have 2-10
    tokens, or ``max_out // 3 .. max_out`` (long enough that a small pool must preempt)."""
    rng = random.Random(seed)
    system = toks(rng, 40)
    plans = []
    for c in range(conversations):
        first = (system if c % 2 == 0 else []) + toks(rng, rng.randint(5, 60))
        msgs = [toks(rng, rng.randint(3, 30)) for _ in range(turns - 1)]
        rerender = [rng.random() < 0.4 for _ in range(turns - 1)]
        n = rng.randint(2, 10) if max_out is None else rng.randint(max_out // 3, max_out)
        if c % 3 == 2:  # seeded sampling must survive cache hits, Snapshot and Replay resumes too
            sp = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=n, ignore_eos=True, seed=c)
        else:
            sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=c)
        plans.append((first, msgs, rerender, sp))
    return plans


def run_conversations(engine: Engine, plans) -> list[list[tuple[int, ...]]]:
    """Turn by turn, every conversation's turn submitted together (they share the engine)."""
    prompts = [list(first) for first, _, _, _ in plans]
    outputs: list[list[tuple[int, ...]]] = [[] for _ in plans]
    turns = 1 + len(plans[0][1])
    for t in range(turns):
        handles = [engine.submit(list(p), sampling=sp) for p, (_, _, _, sp) in zip(prompts, plans, strict=True)]
        for i, h in enumerate(handles):
            out = h.result(120).token_ids
            h.release()
            outputs[i].append(out)
            if t + 1 < turns:
                _, msgs, rerender, _ = plans[i]
                answer = list(out)
                if rerender[t]:
                    answer = answer[:-3] + [7, 7, 7] if len(answer) > 3 else [7]
                prompts[i] = prompts[i] + answer + msgs[t]
    return outputs


@pytest.mark.parametrize("seed", [0, 1])
def test_random_multi_turn_with_a_tiny_page_pool(make_engine, seed):
    plans = conversation_workload(seed, conversations=5, turns=3)
    common = dict(max_context=256, max_concurrency=3, prefill_chunk_size=24)
    cold = run_conversations(make_engine(**common), plans)
    # 20 pages x 16 tokens: the cache must be reclaimed for requests to fit.
    engine = make_engine(**common, num_pages=20, context_cache=True, cache_checkpoint_interval=16,
                         cache_checkpoint_slots=6)
    warm = run_conversations(engine, plans)
    assert warm == cold
    s = settled(engine)
    assert s.cache_hits > 0 and s.cache_evictions > 0
    engine.clear_context_cache(timeout=30)
    s = settled(engine)
    assert (s.cache_checkpoints, s.cache_device_bytes, s.pages_used, s.state_slots_used) == (0, 0, 0, 0)
    usage = engine._program.checkpoint_usage()
    assert usage.count == 0 and usage.free_slots == usage.total_slots == 6
    assert engine._program.kv.num_prefixes == 0


def test_close_drops_the_cache(make_engine):
    engine = make_engine(max_context=128, max_concurrency=1, prefill_chunk_size=16, context_cache=True)
    engine.generate(toks(random.Random(3), 40), sampling=GREEDY)
    assert settled(engine).cache_checkpoints > 0
    engine.close(timeout=30)
    program = engine._program
    cap = program.capacity()
    assert cap.free_pages == cap.total_pages and cap.free_state_slots == cap.total_state_slots
    assert program.checkpoint_usage().count == 0


@pytest.mark.parametrize("break_it", ["covered", "kv_prefix"])
def test_a_broken_checkpoint_is_an_engine_failure(make_engine, break_it):
    rng = random.Random(4)
    prompt = toks(rng, 50)
    engine = make_engine(max_context=256, max_concurrency=1, prefill_chunk_size=16, context_cache=True)
    out = engine.generate(prompt, sampling=GREEDY).token_ids
    settled(engine)
    program = engine._program  # the worker is idle: no request is in flight
    records = program._checkpoints
    cid = max(records)  # the response-end checkpoint
    rec = records[cid]
    if break_it == "covered":   # the recorded count disagrees with the tokens it claims
        records[cid] = dataclasses.replace(rec, handle=dataclasses.replace(rec.handle, covered=rec.handle.covered - 1))
    else:                       # the KV prefix disagrees with the image's coverage
        records[cid] = dataclasses.replace(rec, prefix=dataclasses.replace(rec.prefix, num_tokens=rec.prefix.num_tokens - 1))
    with pytest.raises(EngineFailure):
        engine.generate(prompt + list(out) + [5], sampling=GREEDY)
    assert engine.stats().status == "failed"


def test_options(make_engine, long_tiny_artifact):
    with pytest.raises(InvalidEngineOptions):
        EngineOptions(page_size=16, context_cache=True, cache_checkpoint_interval=24).validate()
    with pytest.raises(InvalidEngineOptions):
        EngineOptions(context_cache=True, cache_checkpoint_slots=0).validate()
    assert EngineOptions(page_size=16, prefill_chunk_size=100).checkpoint_interval == 96
    assert EngineOptions(context_cache=True, max_concurrency=2).checkpoint_slots == 20
    assert EngineOptions().checkpoint_slots == 16 + 2 * 4  # on by default for generation
    assert EngineOptions(context_cache=False).checkpoint_slots == 0
    assert EngineOptions(purpose="causal_scoring").checkpoint_slots == 0
    with pytest.raises(InvalidEngineOptions, match="causal_scoring engine keeps no context cache"):
        EngineOptions(purpose="causal_scoring", context_cache=True).validate()
    default = make_engine(max_context=64, max_concurrency=1)
    assert default.options.context_cache is True and default.stats().cache_checkpoints == 0
    plain = make_engine(max_context=64, max_concurrency=1, context_cache=False)
    assert plain._program.checkpoint_states is None
    # The default on a Program without checkpoint slots is off; asking for it there is an error.
    assert Engine.from_parts(plain._program, plain.frontend, max_context=64, max_concurrency=1).options.context_cache \
        is False
    with pytest.raises(InvalidEngineOptions):  # a Program built without checkpoint slots
        Engine.from_parts(plain._program, plain.frontend, EngineOptions(max_context=64, max_concurrency=1,
                                                                        context_cache=True))


def test_serve_warm_up_leaves_no_entry(make_engine):
    warmup = pytest.importorskip("ninfer_serve.warmup")
    engine = make_engine(max_context=256, max_concurrency=1, prefill_chunk_size=32, context_cache=True,
                         cache_checkpoint_interval=16)
    # The frontend falls back to our bundled Qwen3.5 template, so the warm-up's chat prompt always renders.
    engine.frontend.prepare_chat([{"role": "user", "content": "hi"}], enable_thinking=False)
    warmup.warm_up(engine, max_tokens=3)
    s = settled(engine)
    assert (s.cache_checkpoints, s.cache_captures, s.cache_lookups, s.pages_used) == (0, 0, 0, 0)
