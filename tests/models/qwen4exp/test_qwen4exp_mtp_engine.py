"""Qwen4-Exp with ``speculative="mtp"`` through the public Engine (fp32 reference ops, CPU): the MTP head changes
how many tokens a step commits, never which. Greedy output with k = 1, 2, 4 equals plain greedy token for token,
alone, batched with 7 others under prefill chunks that cut n-gram windows and QSA blocks, under forced preemption
(Replay and Snapshot resumes) and on context-cache hits; an artifact without an ``mtp`` component refuses
``speculative="mtp"`` at start. The checkpoints carry a random MTP head (test_qwen4exp_mtp_head), so most drafts are
rejected here: test_qwen4exp_mtp_program forces acceptance."""

from __future__ import annotations

import random

import pytest
from ninfer import Engine
from ninfer.contracts.sampling import SamplingParams
from ninfer.testing import convert_checkpoint, settled

from .harness import EOS
from .test_qwen4exp_engine import start
from .test_qwen4exp_mtp_head import _checkpoint

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def workload(seed: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        p = [rng.randrange(0, 256) for _ in range(rng.randint(3, 30))]
        for i in range(rng.randrange(5, 13), len(p), 11):
            p[i] = EOS
        prompts.append(p)
    return prompts


def run_all(engine: Engine, prompts) -> list[tuple[int, ...]]:
    handles = [engine.submit(p, sampling=GREEDY) for p in prompts]
    return [h.result().token_ids for h in handles]


@pytest.fixture(scope="module", params=["sparse", "plain"])
def world(request, tmp_path_factory):
    """(artifact with an mtp component, prompts, each prompt's plain greedy tokens alone)."""
    pytest.importorskip("transformers.models.qwen4_exp")
    root = tmp_path_factory.mktemp(f"q4x-mtp-engine-{request.param}")
    _, _, src = _checkpoint(root, request.param)
    artifact = convert_checkpoint(src, root / "model.ninfer")
    prompts = workload(7)
    with start(artifact, max_concurrency=1, prefill_chunk_size=64) as engine:
        return artifact, prompts, [engine.generate(p, sampling=GREEDY).token_ids for p in prompts]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_alone_equals_plain(world, k):
    artifact, prompts, expected = world
    with start(artifact, max_concurrency=1, prefill_chunk_size=64, speculative="mtp",
               num_speculative_tokens=k) as engine:
        assert [engine.generate(p, sampling=GREEDY).token_ids for p in prompts[:4]] == expected[:4]
        assert settled(engine).spec_drafted > 0


@pytest.mark.parametrize("k, chunk", [(1, 3), (2, 5), (4, 3)])
def test_batched_with_seven_others_under_chunked_prefill_equals_plain(world, k, chunk):
    artifact, prompts, expected = world
    with start(artifact, max_concurrency=8, prefill_chunk_size=chunk, speculative="mtp",
               num_speculative_tokens=k) as engine:
        assert run_all(engine, prompts) == expected


def test_forced_preemption_and_replay_equal_plain(world):
    artifact, prompts, expected = world
    with start(artifact, max_concurrency=8, prefill_chunk_size=5, num_pages=30, max_context=96, speculative="mtp",
               num_speculative_tokens=2) as engine:
        assert run_all(engine, prompts) == expected
        s = settled(engine)
        assert s.preemptions > 0


def test_snapshot_pause_and_context_cache_hits_equal_plain(world):
    artifact, prompts, first = world
    rng = random.Random(3)
    second = [p + list(a) + [rng.randrange(0, 256) for _ in range(rng.randint(1, 9))]
              for p, a in zip(prompts[:4], first[:4], strict=True)]
    with start(artifact, max_concurrency=2, prefill_chunk_size=16) as cold:
        expected = [cold.generate(p, sampling=GREEDY).token_ids for p in second]
    with start(artifact, max_concurrency=2, prefill_chunk_size=16, page_size=5, context_cache=True,
               cache_checkpoint_interval=10, speculative="mtp", num_speculative_tokens=2) as warm:
        got = []
        for p, follow_up in zip(prompts[:4], second, strict=True):
            warm.generate(p, sampling=GREEDY)
            got.append(warm.generate(follow_up, sampling=GREEDY).token_ids)
        s = settled(warm)
    assert got == expected
    assert s.cache_hits == len(second)


def test_an_artifact_without_mtp_refuses_mtp(q4x_case):
    case = q4x_case("plain")
    with pytest.raises(Exception, match="has none: its checkpoint had no mtp"):
        start(case.artifact, speculative="mtp", num_speculative_tokens=2)
