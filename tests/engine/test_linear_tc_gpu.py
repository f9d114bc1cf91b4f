"""The tensor-core bf16 GEMV of 2-8 rows (``NINFER_GEMV_TC=1``, ``ninfer.ops.triton.linear_tc``) through the Engine
on CUDA: the default model in bf16 with MTP (k = 3), so every verify step multiplies 4 rows, with the CUDA-core
GEMV's row limit set so that every multi-row product takes the candidate. Captured graphs give the eager tokens
and logprobs bit for bit (the split-K ticket counters are zero at every replay), as do graphs with its L2 prefetch
(``NINFER_GEMV_TC_L2_PREFETCH``), the candidate really ran, and
the tokens stay the default kernels' on most prompts (bf16 sums in another order may part near-ties)."""

from __future__ import annotations

import pytest

from .gpu_runs import PROMPTS, greedy_runs

pytestmark = pytest.mark.gpu

MTP = {"speculative": "mtp", "num_speculative_tokens": 3}


def test_verify_rows_on_the_tensor_core_gemv(default_artifact, monkeypatch):
    from ninfer.ops.triton import linear, linear_tc

    default = greedy_runs(default_artifact, **MTP)
    launches = []
    real = linear_tc.gemv_tc

    def counted(*args, **kwargs):
        launches.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(linear, "MAX_ROW_BYTES", 1)
    monkeypatch.setattr(linear_tc, "ENABLED", True)
    monkeypatch.setattr(linear_tc, "gemv_tc", counted)
    graphed = greedy_runs(default_artifact, **MTP)
    assert launches and max(launches) >= 4
    # The L2 prefetch before the PDL wait (NINFER_GEMV_TC_L2_PREFETCH) inside the captured graphs: the same bits.
    monkeypatch.setattr(linear_tc, "L2_PREFETCH", True)
    assert greedy_runs(default_artifact, **MTP) == graphed
    monkeypatch.setattr(linear_tc, "L2_PREFETCH", False)
    monkeypatch.setenv("NINFER_CUDA_GRAPHS", "0")
    assert greedy_runs(default_artifact, **MTP) == graphed
    same = sum(a[0] == b[0] for a, b in zip(graphed, default, strict=True))
    assert same >= len(PROMPTS) - 1, (graphed, default)
