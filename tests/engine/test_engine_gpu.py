"""The engine on CUDA with the tiny Qwen3.5 artifact: fp32 keeps the batching/preemption invariance,
bf16 serves mixed traffic and leaves every page and slot free (its tokens may differ by numerics)."""

from __future__ import annotations

import pytest
from ninfer import Engine, EngineOptions

from .stress import stress_until_closed
from .test_engine_qwen import run_all, workload

pytestmark = pytest.mark.gpu


def start(artifact, dtype, **options) -> Engine:
    return Engine.start(artifact, EngineOptions(device="cuda", dtype=dtype, max_context=64, page_size=4, **options))


def test_cuda_fp32_batched_and_preempted_equal_alone(tiny_qwen_artifact):
    work = workload()
    with start(tiny_qwen_artifact, "float32", max_concurrency=1, prefill_chunk_size=64) as engine:
        alone = [engine.generate(p, sampling=sp).token_ids for p, sp in work]
    with start(tiny_qwen_artifact, "float32", max_concurrency=8, prefill_chunk_size=5, num_pages=16) as engine:
        assert run_all(engine, work) == alone
        assert engine.stats().preemptions > 0


def test_cuda_bf16_stress_frees_everything(tiny_qwen_artifact_bf16):
    engine = start(tiny_qwen_artifact_bf16, None, max_concurrency=8, queue_capacity=32, prefill_chunk_size=8,
                   num_pages=20)
    assert engine.info["dtype"] == "bfloat16"  # taken from the artifact's weights
    stress_until_closed(engine, n=300, vocab=(0, 256), max_prompt=24, max_tokens=6, seed=9)
