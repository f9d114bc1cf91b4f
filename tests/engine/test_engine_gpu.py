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


def test_cuda_fp32_multi_prefill_burst_equals_alone(tiny_qwen_artifact):
    """Several prefills per step on the CUDA ops, decode graphs and lookahead, such steps launched eagerly
    (``prefill_graphs=False``): a burst of 8 mixed prompts, chunked across steps by a small step budget, gives each
    request's tokens alone."""
    from .test_multi_prefill import burst, qwen_work

    work = qwen_work([40, 3, 33, 9, 50, 2, 21, 28], seed=7)
    with start(tiny_qwen_artifact, "float32", max_concurrency=1, prefill_chunk_size=64,
               context_cache=False, prefill_graphs=False) as engine:
        alone = [engine.generate(p, sampling=sp).token_ids for p, sp in work]
    with start(tiny_qwen_artifact, "float32", max_concurrency=8, prefill_chunk_size=16,
               max_step_tokens=12, prefill_graphs=False) as engine:
        assert burst(engine, engine._program, work) == alone  # noqa: SLF001
        assert engine.stats().max_unit_chunks >= 2


def test_cuda_fp32_prefill_graphs_equal_eager(tiny_qwen_artifact):
    """Prefill and mixed steps replayed from the flat prefill graphs (``prefill_graphs``): a burst of 8 mixed prompts,
    chunked across steps by a small step budget beside decoding requests, gives each request's tokens alone, and the
    graphs did replay."""
    from .test_multi_prefill import burst, qwen_work

    work = qwen_work([40, 3, 33, 9, 50, 2, 21, 28], seed=7)
    with start(tiny_qwen_artifact, "float32", max_concurrency=1, prefill_chunk_size=64,
               context_cache=False, prefill_graphs=False) as engine:
        alone = [engine.generate(p, sampling=sp).token_ids for p, sp in work]
    with start(tiny_qwen_artifact, "float32", max_concurrency=8, prefill_chunk_size=16, max_step_tokens=12,
               prefill_graphs=True) as engine:
        assert engine.info["prefill_graphs"] == [16]
        assert 0 < engine.info["startup"]["prefill_graphs_s"] <= engine.info["startup"]["graphs_s"]
        program = engine._program  # noqa: SLF001
        assert burst(engine, program, work) == alone
        assert program.prefill_graphs.replays > 0
        assert engine.stats().max_unit_chunks >= 2

