"""tools/host_kernel_bench.py at a tiny expert geometry: one timed run per format, kernel and token count, each with
the distinct experts it read and its read rate as a share of the host's measured read bandwidth."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.native import require_native_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import host_kernel_bench  # noqa: E402


def test_the_bench_reports_every_format_kernel_and_token_count(tmp_path, monkeypatch):
    require_native_kernel()
    out = tmp_path / "report.json"
    assert host_kernel_bench.main(["--hidden", "128", "--inter", "64", "--experts", "16", "--k", "4", "--tokens",
                                   "1,3", "--threads", "1", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["read_bandwidth_gbs"] > 0 and report["threads"] == 1
    runs = {(r["format"], r["kernel"], r["tokens"]): r for r in report["runs"]}
    assert set(runs) == {(f, k, t) for f in ("bf16", "q4_g64_fp16", "q8_g32_fp16") for k in ("torch", "native")
                         for t in (1, 3)}
    for (_, _, tokens), run in runs.items():
        assert run["ms"] > 0 and 4 <= run["distinct_experts"] <= 4 * tokens
        assert run["read_gbs"] == pytest.approx(run["share_of_read_bandwidth"] * report["read_bandwidth_gbs"])
    # A sweep of thread counts in one process: a report per count.
    assert host_kernel_bench.main(["--hidden", "128", "--inter", "64", "--experts", "16", "--k", "4", "--tokens", "1",
                                   "--formats", "bf16", "--kernels", "native", "--threads", "1,2", "--repeats", "2",
                                   "--out", str(out)]) == 0
    sweep = json.loads(out.read_text())["by_threads"]
    assert [r["threads"] for r in sweep] == [1, 2] and all(len(r["runs"]) == 1 for r in sweep)
    # The breakdown: the C call alone, an empty call, and both after an idle gap, for the native kernel only.
    assert host_kernel_bench.main(["--hidden", "128", "--inter", "64", "--experts", "16", "--k", "4", "--tokens", "2",
                                   "--formats", "bf16", "--kernels", "torch,native", "--threads", "1", "--repeats",
                                   "3", "--breakdown", "--gap-us", "50", "--out", str(out)]) == 0
    runs = {r["kernel"]: r for r in json.loads(out.read_text())["runs"]}
    assert "kernel_ms" not in runs["torch"]
    native = runs["native"]
    assert native["gap_us"] == 50
    assert all(native[f] > 0 for f in ("kernel_ms", "empty_ms", "kernel_after_gap_ms", "empty_after_gap_ms"))
    # Builds of the native kernel A/B'd in one process: each NINFER_HOST_BF16_DOT value, crossed with the prefetch.
    # (The tool sets the variables and loads each build; the test puts both back afterwards.)
    from ninfer_qwen3_5.layers import host_native

    for env in (host_native.ROW_PREFETCH_ENV, host_native.BF16_DOT_ENV):
        monkeypatch.setenv(env, "")   # empty: the default build; undone at teardown, whatever the tool set
    monkeypatch.setattr(host_native, "_library", host_native._library)
    assert host_kernel_bench.main(["--hidden", "128", "--inter", "64", "--experts", "16", "--k", "4", "--tokens", "1",
                                   "--formats", "q4_g64_fp16", "--kernels", "native", "--threads", "1", "--repeats",
                                   "2", "--bf16-dot", "0,1", "--row-prefetch", "0,4", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["kernel"] for r in runs] == ["native/pf0/dot0", "native/pf0/dot1", "native/pf4/dot0", "native/pf4/dot1"]
    assert [r["bf16_dot"] for r in runs] == [False, host_native.bf16_dot()] * 2
    with pytest.raises(SystemExit, match="unknown format"):
        host_kernel_bench.main(["--formats", "q3", "--hidden", "128", "--inter", "64", "--repeats", "1"])
