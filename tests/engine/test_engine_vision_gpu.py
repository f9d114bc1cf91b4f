"""Images and videos through the Engine on CUDA (the tiny vision artifact of tests/support/vision_models.py):
fp32 with the CUDA ops, decode graphs, lookahead and the start-up warm-up, a batch of multimodal and text requests
chunked across steps under an encoder budget, then preempted and resumed from Snapshots; each request's tokens
must equal its tokens alone (one request, whole prompt, no context cache). Decode rows of a multimodal sequence
read their rope delta from the StateImage inside the graphs. The same for a tiny Qwen4-Exp vision artifact (the
Qwen3.5-MoE tower in front of Qwen4-Exp's text model; no lookahead there), whose tokens must also be transformers'
(fp32 on the CPU)."""

from __future__ import annotations

import pytest
from ninfer import Engine, EngineOptions
from ninfer.testing import settled

from .test_engine_vision import conversations, greedy

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    from support.vision_models import tiny_vision_artifact

    return tiny_vision_artifact(tmp_path_factory.mktemp("tiny_vision_gpu"))


def start(artifact, **options) -> Engine:
    return Engine.start(artifact, EngineOptions(device="cuda", dtype="float32", max_context=256, page_size=4,
                                                **options))


def test_cuda_multimodal_batch_and_snapshot_resume_equal_alone(vision):
    artifact, _ = vision
    texts = [[int(t) for t in range(3, 3 + n)] for n in (7, 30)]
    with start(artifact, max_concurrency=1, prefill_chunk_size=256, context_cache=False) as engine:
        prompts = [engine.frontend.prepare_chat(c, enable_thinking=False) for c in conversations()]
        work = [texts[0], *prompts, texts[1]]
        alone = [greedy(engine, [p])[0] for p in work]
    with start(artifact, max_concurrency=4, prefill_chunk_size=5, max_encode_rows=96) as engine:
        assert engine.info["cuda_graphs"] and engine.info["lookahead"]
        assert greedy(engine, work) == alone
        stats = settled(engine)
        assert stats.max_step_encode_rows <= 96 and stats.lookahead_adopted > 0
    with start(artifact, max_concurrency=6, prefill_chunk_size=7, num_pages=64, cache_host_mib=64) as engine:
        assert greedy(engine, work * 2) == alone * 2
        engine.close()
        stats = engine.stats()
    assert stats.preemptions > 0 and stats.pages_used == 0 and stats.state_slots_used == 0


@pytest.fixture(scope="module")
def vision_qwen4exp(tmp_path_factory):
    pytest.importorskip("transformers.models.qwen4_exp")
    from support.vision_models import tiny_vision_artifact

    return tiny_vision_artifact(tmp_path_factory.mktemp("tiny_vision_qwen4exp_gpu"), seed=43, arch="qwen4exp")


def test_cuda_qwen4exp_multimodal_equals_transformers_and_batches_equal_alone(vision_qwen4exp):
    from support.vision_models import hf_greedy

    from .test_engine_vision import STEPS

    artifact, hf = vision_qwen4exp
    texts = [[int(t) for t in range(3, 3 + n)] for n in (7, 30)]
    with start(artifact, max_concurrency=1, prefill_chunk_size=256, context_cache=False) as engine:
        assert engine.info["cuda_graphs"] and engine.info["vision"]
        prompts = [engine.frontend.prepare_chat(c, enable_thinking=False) for c in conversations()]
        work = [texts[0], *prompts, texts[1]]
        alone = [greedy(engine, [p])[0] for p in work]
    for p, tokens in zip(prompts, alone[1:-1], strict=True):
        assert list(tokens) == hf_greedy(hf, p, STEPS)
    with start(artifact, max_concurrency=4, prefill_chunk_size=5, max_encode_rows=96) as engine:
        assert greedy(engine, work) == alone
