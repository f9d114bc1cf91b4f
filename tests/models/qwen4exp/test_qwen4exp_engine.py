"""Qwen4-Exp through the public Engine (fp32 reference ops, CPU): a request's greedy tokens are transformers' and are
identical alone, batched with 7 others under prefill chunks that cut n-gram windows and QSA blocks, under forced
preemption (Replay, and Snapshot resumes), and on context-cache hits (checkpoints at boundaries that cut windows and
blocks, demoted to and restored from the Host tier). These are exactly the paths where the state Qwen4-Exp adds (the
PLE conv history and n-gram context in the StateImage, the indexer's keys in the paged KV's side pool) must travel:
a wrong or missing piece changes tokens."""

from __future__ import annotations

import random

import pytest
import torch
from ninfer import Engine, EngineOptions
from ninfer.contracts.sampling import SamplingParams
from ninfer.testing import settled

from .harness import EOS, hf_logits

CASES = ("sparse", "plain")
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def start(artifact, **options) -> Engine:
    for key, value in dict(device="cpu", dtype="float32", max_context=256, page_size=4).items():
        options.setdefault(key, value)
    return Engine.start(artifact, EngineOptions(**options))


def workload(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(8):
        p = [rng.randrange(0, 256) for _ in range(rng.randint(3, 40))]
        for i in range(rng.randrange(5, 13), len(p), 11):   # EOS inside: the n-gram windows restart there
            p[i] = EOS
        prompts.append(p)
    return prompts


def run_all(engine: Engine, prompts) -> list[tuple[int, ...]]:
    handles = [engine.submit(p, sampling=GREEDY) for p in prompts]
    return [h.result().token_ids for h in handles]


@pytest.fixture(scope="module", params=CASES)
def alone(request, q4x_case):
    """(case, prompts, each request's tokens alone with its whole prompt in one chunk)."""
    case = q4x_case(request.param)
    prompts = workload(7)
    with start(case.artifact, max_concurrency=1, prefill_chunk_size=64) as engine:
        return case, prompts, [engine.generate(p, sampling=GREEDY).token_ids for p in prompts]


def test_alone_equals_transformers(alone):
    case, prompts, tokens = alone
    for prompt, out in zip(prompts, tokens, strict=True):
        ref = hf_logits(case, prompt + list(out))[len(prompt) - 1:-1].argmax(dim=-1)
        assert list(out) == ref.tolist(), f"{case.name}: prompt {prompt}"


@pytest.mark.parametrize("chunk", [3, 5])
def test_batched_with_seven_others_equals_alone(alone, chunk):
    case, prompts, expected = alone
    with start(case.artifact, max_concurrency=8, prefill_chunk_size=chunk) as engine:
        assert run_all(engine, prompts) == expected
        assert engine.stats().preemptions == 0


def test_forced_preemption_and_replay_equal_alone(alone):
    case, prompts, expected = alone
    # 26 pages of 4 tokens: one request of up to 72 tokens fits, eight do not.
    with start(case.artifact, max_concurrency=8, prefill_chunk_size=5, num_pages=26, max_context=96) as engine:
        assert run_all(engine, prompts) == expected
        s = settled(engine)
        assert s.preemptions > 0 and s.replays > 0 and s.replay_tokens > 0
        engine.close()
        s = engine.stats()
        assert s.pages_used == 0 and s.state_slots_used == 0


def test_snapshot_pause_and_resume_equal_alone(alone):
    case, prompts, expected = alone
    with start(case.artifact, max_concurrency=8, prefill_chunk_size=5, num_pages=26, max_context=96,
               context_cache=True, cache_host_mib=64) as engine:
        assert run_all(engine, prompts) == expected
        s = settled(engine)
        assert s.preemptions > 0 and s.snapshot_resumes > 0


def _conversations(prompts, answers, rng):
    return [p + list(a) + [rng.randrange(0, 256) for _ in range(rng.randint(1, 9))] for p, a in
            zip(prompts, answers, strict=True)]


@pytest.fixture(scope="module")
def second_turns(alone):
    """(every conversation's second turn, each one's tokens from a cold engine without the context cache): the
    reference of both cache tests below, computed once per case."""
    case, prompts, first = alone
    second = _conversations(prompts, first, random.Random(3))
    with start(case.artifact, max_concurrency=2, prefill_chunk_size=16) as cold:
        return second, [cold.generate(p, sampling=GREEDY).token_ids for p in second]


def test_context_cache_hits_equal_cold(alone, second_turns):
    case, prompts, _ = alone
    second, expected = second_turns
    # Checkpoints every 10 tokens and at every prompt and response end: boundaries that cut n-gram windows (3
    # tokens) and QSA blocks (2 or 4 tokens).
    with start(case.artifact, max_concurrency=2, prefill_chunk_size=16, page_size=5, context_cache=True,
               cache_checkpoint_interval=10) as warm:
        got = []
        for p, follow_up in zip(prompts, second, strict=True):   # each conversation's two turns in a row
            warm.generate(p, sampling=GREEDY)
            got.append(warm.generate(follow_up, sampling=GREEDY).token_ids)
        s = settled(warm)
    assert got == expected
    assert s.cache_hits == len(second)
    assert s.cache_saved_prefill_tokens >= sum(len(p) for p in prompts)


def test_host_tier_demotion_and_restore_equal_cold(alone, second_turns):
    """A small device pool with a Host tier: checkpoints (StateImage + KV pages, the indexer's side pool among
    them) are demoted to Host while the other conversations run, and restored on the second turn's hit."""
    case, prompts, _ = alone
    second, expected = second_turns
    with start(case.artifact, max_concurrency=2, prefill_chunk_size=16, page_size=5, num_pages=60, max_context=128,
               context_cache=True, cache_checkpoint_interval=10, cache_checkpoint_slots=4, cache_host_mib=64) as warm:
        for p in prompts:
            warm.generate(p, sampling=GREEDY)
        got = [warm.generate(p, sampling=GREEDY).token_ids for p in second]
        s = settled(warm)
    assert got == expected
    assert s.cache_demotions > 0 and s.cache_restores > 0 and s.cache_hits == len(second)


def test_logits_are_not_degenerate_on_the_engine_prompts(alone):
    case, prompts, _ = alone
    logits = hf_logits(case, prompts[0])
    assert logits.std() > 0.5 and torch.isfinite(logits).all()


@pytest.mark.parametrize("options", [dict(), dict(expert_cache_slots=3), dict(expert_copy_min_tokens=2),
                                     dict(expert_cache_slots=2, expert_copy_min_tokens=3),
                                     dict(device_expert_layers=1, expert_cache_slots=2)],
                         ids=["host", "cache", "copy", "cache+copy", "device-layer+cache"])
def test_host_experts_equal_alone(alone, options):
    """The text layers' routed experts in host memory (docs/memory.md "Host experts"): the CPU's routed sum, the
    device cache and the copy path give the tokens of the resident model, batched and chunked; the banks are
    host-placed and the cache counts its hits."""
    case, prompts, expected = alone
    with start(case.artifact, max_concurrency=8, prefill_chunk_size=5, host_experts=True, **options) as engine:
        assert run_all(engine, prompts) == expected
        memory = engine.memory_summary()
        assert memory.host_weights_bytes > 0
        hits = settled(engine).expert_cache_hits
        host_layers = len(engine._program.model.layers) - options.get("device_expert_layers", 0)  # noqa: SLF001
        assert len(hits) == (host_layers if options.get("expert_cache_slots") else 0)
        assert all(h > 0 for h in hits)


def test_host_experts_are_placed_and_counted(q4x_case):
    from ninfer.planning import planner

    case = q4x_case("plain")
    opts = EngineOptions(device="cpu", dtype="float32", max_context=256, page_size=4)
    plain = planner.plan(case.artifact, opts)
    hosted = planner.plan(case.artifact, EngineOptions(**{**opts.__dict__, "host_experts": True}))
    banks = [s for s in hosted.model.parameter_specs if s.placement == "host" and "/moe/experts/" in s.name]
    assert len(banks) == 2 * len(case.config["layer_types"]) and all(s.name.startswith("text/") for s in banks)
    moved = hosted.model.profile.host_weight_bytes - plain.model.profile.host_weight_bytes
    assert moved == sum(s.shape[0] * s.shape[1] * s.shape[2] for s in banks) * 4   # fp32, as stored
