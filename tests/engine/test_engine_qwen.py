"""The engine on a real (tiny, random) Qwen3.5 artifact with the fp32 reference ops.

A request's greedy and seeded tokens must be identical alone, batched with 7 others, with prefill
chunks of 1, 5 and 64, and under forced preemption (docs/design.md section 8). Greedy output alone must
also match transformers, which checks that model construction wired the artifact correctly.
"""

from __future__ import annotations

import random

import pytest
from ninfer import Engine, EngineOptions
from ninfer.artifact.errors import ArtifactNotFoundError
from ninfer.contracts.events import GenerationError
from ninfer.contracts.sampling import SamplingParams

from .conftest import IM_END, worker_threads
from .streams import check_stream
from .stress import stress_until_closed


def start(artifact, **options) -> Engine:
    options.setdefault("device", "cpu")
    options.setdefault("dtype", "float32")
    options.setdefault("max_context", 64)
    options.setdefault("page_size", 4)
    return Engine.start(artifact, EngineOptions(**options))


def workload():
    rng = random.Random(5)
    out = []
    for i in range(8):
        prompt = [rng.randrange(0, 256) for _ in range(rng.randint(3, 40))]
        if i % 2 == 0:
            sp = SamplingParams(temperature=0.0, max_tokens=12, seed=i)
        else:
            sp = SamplingParams(temperature=0.9, top_p=0.9, presence_penalty=0.5, max_tokens=12, seed=100 + i)
        out.append((prompt, sp))
    return out


def run_all(engine: Engine, work) -> list[tuple[int, ...]]:
    handles = [engine.submit(p, sampling=sp) for p, sp in work]
    return [check_stream(list(h), started=True).token_ids for h in handles]


@pytest.fixture(scope="module")
def reference(tiny_qwen_artifact):
    """Each request alone, whole prompt in one chunk."""
    work = workload()
    with start(tiny_qwen_artifact, max_concurrency=1, prefill_chunk_size=64) as engine:
        return work, [engine.generate(p, sampling=sp).token_ids for p, sp in work]


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_batched_tokens_equal_alone(tiny_qwen_artifact, reference, chunk):
    work, expected = reference
    with start(tiny_qwen_artifact, max_concurrency=8, prefill_chunk_size=chunk) as engine:
        assert run_all(engine, work) == expected
        assert engine.stats().preemptions == 0


def test_preempted_tokens_equal_alone(tiny_qwen_artifact, reference):
    work, expected = reference
    with start(tiny_qwen_artifact, max_concurrency=8, prefill_chunk_size=5, num_pages=16) as engine:
        assert run_all(engine, work) == expected
        engine.close()
        stats = engine.stats()
        assert stats.preemptions > 0 and stats.replay_tokens > 0
        assert stats.pages_used == 0 and stats.state_slots_used == 0


def test_greedy_matches_transformers(tiny_qwen_artifact, reference):
    import sys

    import torch

    sys.modules.setdefault("fla", None)
    sys.modules.setdefault("causal_conv1d", None)
    import transformers

    work, expected = reference
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen_artifact.parent / "hf",
                                                              dtype=torch.float32).eval()
    for (prompt, sp), tokens in zip(work, expected, strict=True):
        if sp.temperature != 0.0:
            continue
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=len(tokens), do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        assert tuple(out[0, len(prompt):].tolist()) == tokens, f"prompt {prompt}"


def test_stress_on_qwen(tiny_qwen_artifact):
    engine = start(tiny_qwen_artifact, max_concurrency=8, queue_capacity=32, prefill_chunk_size=8, num_pages=20)
    report, _, stats = stress_until_closed(engine, n=300, vocab=(0, 256), max_prompt=24, max_tokens=6, seed=3)
    assert sum(report.outcomes.values()) == report.submitted - report.abandoned
    assert stats.finished + stats.cancelled + stats.deadline + stats.rejected == stats.submitted == 300


def test_close_with_requests_in_flight_leaves_no_thread(tiny_qwen_artifact):
    engine = start(tiny_qwen_artifact, max_concurrency=4, queue_capacity=8)
    handles = [engine.submit("hello engine", sampling=SamplingParams(max_tokens=50, ignore_eos=True, seed=i))
               for i in range(8)]
    engine.close(timeout=60)
    assert not worker_threads()
    for h in handles:
        check_stream(list(h))
    assert any(isinstance(h._control.channel.terminal, GenerationError) for h in handles)


def test_text_generation_and_defaults(tiny_qwen_artifact):
    with start(tiny_qwen_artifact, max_concurrency=2) as engine:
        assert engine.info["architecture"] == "Qwen3_5ForCausalLM"
        assert IM_END in engine.frontend.eos_token_ids
        result = engine.generate("hi", sampling=SamplingParams(temperature=0.0, max_tokens=5, seed=0))
        assert result.usage.prompt_tokens == 2 and 1 <= len(result.token_ids) <= 5
        assert isinstance(result.output.content, str)


def test_missing_artifact_is_a_clear_error(tmp_path):
    with pytest.raises(ArtifactNotFoundError):
        Engine.start(tmp_path / "nope.ninfer", EngineOptions(device="cpu"))
    assert not worker_threads()
