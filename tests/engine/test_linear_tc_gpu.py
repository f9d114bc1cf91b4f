"""The tensor-core bf16 GEMV of 2-8 rows (``NINFER_GEMV_TC=1``, ``ninfer.ops.triton.linear_tc``) through the Engine
on CUDA: the default model in bf16 with MTP (k = 3), so every verify step multiplies 4 rows, with the CUDA-core
GEMV's row limit set so that every multi-row product takes the candidate. Captured graphs give the eager tokens
and logprobs bit for bit (the split-K ticket counters are zero at every replay), the candidate really ran, and
the tokens stay the default kernels' on most prompts (bf16 sums in another order may part near-ties)."""

from __future__ import annotations

import pytest
from ninfer import Engine, EngineOptions
from ninfer.contracts.events import GenerationDelta
from ninfer.contracts.sampling import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def", "for i in range(10):"]


def _generate(artifact) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=True)
    out = []
    with Engine.start(artifact, EngineOptions(device="cuda", dtype="bfloat16", max_context=128, max_concurrency=4,
                                              speculative="mtp", num_speculative_tokens=3)) as engine:
        for prompt in PROMPTS:   # one at a time: the same step composition in every run
            with engine.submit(prompt, sampling=sp) as h:
                lps = [lp.logprob for ev in h if isinstance(ev, GenerationDelta) for lp in (ev.logprobs or ())]
                r = h.result()
            out.append((tuple(r.token_ids), tuple(lps)))
    return out


def test_verify_rows_on_the_tensor_core_gemv(default_artifact, monkeypatch):
    from ninfer.ops.triton import linear, linear_tc

    default = _generate(default_artifact)
    launches = []
    real = linear_tc.gemv_tc

    def counted(*args, **kwargs):
        launches.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(linear, "MAX_ROW_BYTES", 1)
    monkeypatch.setattr(linear_tc, "ENABLED", True)
    monkeypatch.setattr(linear_tc, "gemv_tc", counted)
    graphed = _generate(default_artifact)
    assert launches and max(launches) >= 4
    monkeypatch.setenv("NINFER_CUDA_GRAPHS", "0")
    assert _generate(default_artifact) == graphed
    same = sum(a[0] == b[0] for a, b in zip(graphed, default, strict=True))
    assert same >= len(PROMPTS) - 1, (graphed, default)
