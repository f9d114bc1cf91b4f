"""tools/gpu_mixed_step_profile.py: its trace arithmetic on a synthetic trace, and its engine-driving path on the CPU
with the default model (streams decoding, then a long prompt whose steps are counted; the CPU has no kernels)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import gpu_mixed_step_profile as tool  # noqa: E402


def test_kernels_are_summed_by_name_per_step():
    events = [{"cat": "kernel", "ph": "X", "name": "gemm", "ts": 0, "dur": 30},
              {"cat": "kernel", "ph": "X", "name": "scan", "ts": 40, "dur": 10},
              {"cat": "kernel", "ph": "X", "name": "gemm", "ts": 60, "dur": 50},
              {"cat": "cpu_op", "ph": "X", "name": "aten::mm", "ts": 0, "dur": 500},
              {"cat": "kernel", "ph": "i", "name": "marker", "ts": 5}]
    rows = tool.kernel_rows(events, steps=2)
    assert rows == [{"kernel": "gemm", "us_per_step": 40.0, "calls_per_step": 1.0},
                    {"kernel": "scan", "us_per_step": 5.0, "calls_per_step": 0.5}]
    assert tool.kernel_span_us(events) == 110
    assert tool.kernel_span_us([]) == 0.0
    assert "gemm" in tool.fmt_rows(rows, 45.0) and "88.9" in tool.fmt_rows(rows, 45.0)


def test_the_tool_drives_streams_and_a_long_prompt_on_the_cpu(default_artifact, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["gpu_mixed_step_profile.py", str(default_artifact), "--out", str(out),
                                      "--device", "cpu", "--budgets", "8,32", "--graphs", "on", "--streams", "2",
                                      "--short", "5", "--long", "40", "--stream-tokens", "400",
                                      "--vocab", "0,256"])
    assert tool.main() == 0
    results = json.loads((out / "mixed_steps.json").read_text())
    assert [r["budget"] for r in results] == [8, 32]
    small, large = results
    # 40 prompt tokens beside 2 decode rows: at most 6 a step at budget 8, at most 30 at budget 32.
    assert 40 // 6 <= small["steps"] <= 40 // 6 + 3 and 2 <= large["steps"] < small["steps"]
    assert small["prefill_graph_buckets"] == [] and small["wall_us_per_step"] > 0
    assert "budget 8, prefill graphs on" in (out / "mixed_steps.txt").read_text()
