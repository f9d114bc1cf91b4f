"""tools/gpu_bench_shapes.py at tiny widths on the CPU (``--tiny --device cpu``) for the Qwen4-Exp shape: the random
transformers model is built, converted in memory, benchmarked by ``ninfer bench`` and by transformers, and the
summary carries both sides' decode and prefill rows with their limit ratios, so the H200 run of the published shape
(fewer layers) has only the sizes left to change.

Run in a subprocess, as the lead runs the tool on the GPU (its own process, its own fla/causal_conv1d stubs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from frontend.conftest import tokenizer_json_path  # noqa: F401 - the Qwen vocabulary the tool's frontend names

pytest.importorskip("transformers.models.qwen4_exp")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow   # ~15 s on 2 cores: a benchmark tool end to end (NINFER_RUN_SLOW=1 runs it)
def test_qwen4exp_shape_tiny_cpu(tmp_path, tokenizer_json_path):  # noqa: F811 (the fixture)
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_bench_shapes.py"), "--shape", "qwen4exp",
                          "--tiny", "--device", "cpu", "--tokenizer", str(tokenizer_json_path),
                          "--out", str(tmp_path / "out"), "--budget-s", "240"],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    s = json.loads((tmp_path / "out" / "shapes_qwen4exp.json").read_text())
    assert s["layers"] == 4 and s["published_layers"] == 48
    assert s["geometry"]["indexer_budget"] == 8 and s["geometry"]["hc_count"] == 4
    for side in ("ours", "hf"):
        assert [r["batch"] for r in s[side]["decode"]] == [1, 2], side
        assert [r["tokens"] for r in s[side]["prefill"]] == [32, 64], side
        assert all(r["tokens_per_s"] > 0 and r["copy_bandwidth_ratio"] > 0 for r in s[side]["decode"]), side
        assert all(r["matmul_peak_ratio"] > 0 for r in s[side]["prefill"]), side
    assert s["hf"]["errors"] == []
    assert "Qwen4-Exp qwen4exp shape, 4 of 48 layers" in run.stdout
