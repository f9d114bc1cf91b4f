"""tools/vision_speed.py at tiny widths on the CPU (``--tiny --device cpu``): every encode row and the TTFT row are
measured on both sides with positive times and peak fractions, the inputs get the patch grids the tool's
docstring states (the real input sizes: only the widths are tiny), and our tower's merged embeddings equal
transformers' (fp32), so both sides time the same work.

Run in a subprocess, as the lead runs the tool on the GPU (its own process, its own fla/causal_conv1d stubs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("PIL")

ROOT = Path(__file__).resolve().parents[2]
GRIDS = {"image 448x448": [1, 28, 28], "image 1024x1024": [1, 64, 64], "image 1920x1080": [1, 68, 120],
         "video 10s 2fps 1280x720": [10, 44, 80]}


@pytest.mark.slow   # ~20 s on 2 cores: a benchmark tool end to end (NINFER_RUN_SLOW=1 runs it); the tower's
# equality with transformers is also tested by tests/models/qwen3_5 (vision)
def test_vision_speed_tiny_cpu(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "vision_speed.py"), "--tiny", "--device", "cpu",
                          "--out", str(tmp_path), "--budget-s", "240"], capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    s = json.loads((tmp_path / "vision_speed.json").read_text())
    assert s["errors"] == []
    assert s["limits"]["flops_per_s"] > 0
    assert [r["input"] for r in s["encode"]] == list(GRIDS)
    for r in s["encode"]:
        assert r["grid"] == GRIDS[r["input"]]
        t, h, w = r["grid"]
        assert r["patches"] == t * h * w and r["tokens"] == t * h * w // 4
        assert r["flops"]["total"] == r["flops"]["linear"] + r["flops"]["attention"] > 0
        for side in ("ours", "hf"):
            assert r[side]["ms"] > 0 and r[side]["peak_fraction"] > 0, (r["input"], side)
            assert all(x > 0 for x in r[side]["samples_ms"])
        assert r["hf_over_ours"] > 0
        assert r["max_abs_diff"] <= 1e-4 * max(1.0, r["max_abs_hf"]), r
    t = s["ttft"]
    assert t["image"] == "1024x1024" and t["image_tokens"] == 1024 and t["prompt_tokens"] > 1024
    assert t["image_grid"] == [1, 64, 64]
    assert t["ours"]["ms"] > 0 and t["hf"]["ms"] > 0 and t["hf_over_ours"] > 0 and t["prepare_chat_ms"] > 0
    assert "| TTFT |" in run.stdout and "| video 10s 2fps 1280x720 |" in run.stdout
