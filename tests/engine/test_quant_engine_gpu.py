"""Quantized artifacts through the Engine on CUDA: the default model converted to q4, q8 and fp8 runs the Triton
decode GEMVs (the tensor-core ones where the widths allow, the CUDA-core one elsewhere) with their split-K sums
inside the kernels. Captured decode graphs give the eager path's tokens and logprobs bit for bit (every replay
finds the ticket counters at zero), and the scores stay at bf16 distance from the fp32 reference ops on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from ninfer import Engine

from .gpu_runs import PROMPTS, greedy_runs

pytestmark = pytest.mark.gpu

TEXT = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
SOURCE = "qwen3_5-stdlib"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[str, Path]:
    import ninfer_qwen3_5
    from ninfer.conversion import convert

    src = Path(ninfer_qwen3_5.__file__).parent / "default_model" / SOURCE
    out = tmp_path_factory.mktemp("quant_gpu")
    arts = {}
    for preset in ("q4", "q8", "fp8"):
        arts[preset] = out / f"{preset}.ninfer"
        convert(src, arts[preset], progress=False, quantize=preset)
    return arts


@pytest.mark.parametrize("preset", ["q4", "q8", "fp8"])
def test_graphs_equal_eager_and_scores_stay_near_the_reference(quantized, preset, monkeypatch):
    import torch

    # Decode graphs against eager steps (prefill-step graphs off: their flat steps round differently).
    graphed = greedy_runs(quantized[preset], prefill_graphs=False)
    monkeypatch.setenv("NINFER_CUDA_GRAPHS", "0")
    eager = greedy_runs(quantized[preset], prefill_graphs=False)
    assert graphed == eager
    monkeypatch.delenv("NINFER_CUDA_GRAPHS")
    with Engine.start(quantized[preset], device="cuda", dtype="bfloat16", purpose="causal_scoring") as eng:
        gpu = [t.logprob for t in eng.score([TEXT], logprobs=True).texts[0].token_logprobs]
    with Engine.start(quantized[preset], device="cpu", dtype="float32", purpose="causal_scoring") as eng:
        ref = [t.logprob for t in eng.score([TEXT], logprobs=True).texts[0].token_logprobs]
    diff = (torch.tensor(gpu, dtype=torch.float64) - torch.tensor(ref, dtype=torch.float64)).abs()
    assert len(gpu) == len(ref) > 10
    assert float(diff.mean()) < 0.05 and float(diff.max()) < 0.5, (float(diff.mean()), float(diff.max()))


@pytest.mark.parametrize("setting", ["streamk", "l2"])
def test_the_candidate_kernels_through_the_engine(quantized, setting, monkeypatch):
    """The q4 decode GEMV candidates (``NINFER_QUANT_SPLIT=streamk``, ``NINFER_QUANT_L2_PREFETCH=1``, set on the
    modules as their variables would at import): captured graphs equal eager (stream-K's ticket counters zero at
    every replay), and the greedy tokens stay those of the default kernels on most of the prompts (bf16 sums in
    another grouping may part near-ties)."""
    from ninfer.ops.triton import quant_gemv_tc

    default = greedy_runs(quantized["q4"])
    if setting == "streamk":
        monkeypatch.setattr(quant_gemv_tc, "SPLIT_RULE", "streamk")
    else:
        monkeypatch.setattr(quant_gemv_tc, "L2_PREFETCH", True)
    graphed = greedy_runs(quantized["q4"])
    monkeypatch.setenv("NINFER_CUDA_GRAPHS", "0")
    assert greedy_runs(quantized["q4"]) == graphed
    same = sum(a[0] == b[0] for a, b in zip(graphed, default, strict=True))
    assert same >= len(PROMPTS) - 1 if setting == "streamk" else graphed == default
