"""tools/gpu_mixed_step_profile.py: its kernel table on stand-in profiler events, and its engine-driving path on the CPU
with the default model (streams decoding, then a long prompt whose steps are counted; the CPU has no kernels)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import gpu_mixed_step_profile as tool  # noqa: E402


def test_kernels_per_step_from_the_profiler():
    # The kernel table the tool shares with gpu_kernel_profile.py: device time per step, graph launches and host
    # ops (no device time) left out, largest first.
    event = types.SimpleNamespace
    prof = event(key_averages=lambda: [event(key="gemm", device_time_total=80.0, count=2),
                                       event(key="scan", device_time_total=10.0, count=1),
                                       event(key="cudaGraphLaunch", device_time_total=5.0, count=2),
                                       event(key="aten::mm", device_time_total=0.0, count=4)])
    rows = tool.kernel_table(prof, 2)
    assert rows == [{"kernel": "gemm", "calls_per_step": 1.0, "us_per_step": 40.0},
                    {"kernel": "scan", "calls_per_step": 0.5, "us_per_step": 5.0}]
    assert "gemm" in tool.fmt(rows, 45.0) and "88.9" in tool.fmt(rows, 45.0)


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
