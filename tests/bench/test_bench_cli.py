"""``ninfer bench`` on the default model on the CPU with tiny settings: the table, and a JSON report
with every field present, every measured figure positive, and the ratios consistent with the
accounting functions and the limits measured in the same run."""

from __future__ import annotations

import json
import subprocess
import sys

from ninfer.bench.report import decode_step_bytes, prefill_flops
from ninfer.contracts.architecture import ModelProfile

DECODE_FIELDS = ("batch", "tokens_per_s", "token_ms", "step_ms", "tokens_per_step", "engine_steps", "context_tokens",
                 "bytes_per_step", "achieved_bytes_per_s", "copy_bandwidth_ratio", "ttft_ms", "steps", "short_run_s",
                 "long_run_s")
PREFILL_FIELDS = ("tokens", "tokens_per_s", "ttft_ms", "flops", "achieved_flops_per_s", "matmul_peak_ratio")
LIMIT_FIELDS = ("copy_buffer_bytes", "copy_bytes_per_s", "matmul_n", "matmul_flops_per_s")


def test_bench_cli_writes_a_complete_report(bench_env, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "bench", "--device", "cpu", "--max-context", "300",
           "--batches", "1,2", "--prefill-lengths", "32,1000", "--decode-prompt-tokens", "8",
           "--decode-base-tokens", "2", "--decode-steps", "6", "--repeats", "1", "--warmup", "1",
           "--copy-mib", "16", "--matmul-size", "128", "--output", str(out)]
    run = subprocess.run(cmd, env=bench_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "decode:" in run.stdout and "prefill:" in run.stdout and "of copy BW" in run.stdout
    assert "GB/s after the workload" in run.stdout
    assert "capped to max_context - 1 = 299" in run.stderr

    report = json.loads(out.read_text())
    for key in ("schema", "date", "command", "ninfer_version", "machine", "model", "engine", "settings", "profile",
                "limits", "decode", "prefill", "memory", "startup"):
        assert key in report, key
    assert report["command"].startswith("ninfer bench --max-context 300 --device cpu --batches 1,2")
    # The cold-start figure: start-up by phase (no warm-up on the CPU by default) and the first burst after it,
    # max_concurrency (= the largest batch) requests.
    start = report["startup"]
    assert start["total_s"] >= start["load_s"] > 0 and "warmup_s" not in start
    assert len(start["first_burst"]["prompt_tokens"]) == 2 and start["first_burst"]["ttft_max_ms"] > 0
    assert "start-up:" in run.stdout and "first burst after ready: 2 requests" in run.stdout
    assert report["engine"]["device"] == "cpu" and report["engine"]["max_context"] == 300
    assert report["prefill_lengths_requested"] == [32, 1000]
    limits = report["limits"]
    assert all(limits[k] > 0 for k in LIMIT_FIELDS)
    assert [r["batch"] for r in report["decode"]] == [1, 2]
    assert [r["tokens"] for r in report["prefill"]] == [32, 299]
    for row in report["decode"]:
        assert all(row[k] > 0 for k in DECODE_FIELDS), row
    for row in report["prefill"]:
        assert all(row[k] > 0 for k in PREFILL_FIELDS), row

    profile = ModelProfile(**report["profile"])
    for row in report["decode"]:
        assert row["context_tokens"] == 8 + 2 + (6 - 1) / 2
        assert row["bytes_per_step"] == decode_step_bytes(profile, row["batch"], row["context_tokens"])
        assert abs(row["tokens_per_s"] * row["token_ms"] / 1000 - row["batch"]) < 1e-9
        # Without speculation a decode step commits one token per request: 7 decode steps in each 2 + 6-token run,
        # 1 in each 2-token run.
        assert row["long_run_row_steps"] == [7 * row["batch"]] and row["short_run_row_steps"] == [row["batch"]]
        assert row["engine_steps"] == 6 and row["tokens_per_step"] == 1
        assert abs(row["step_ms"] - row["token_ms"]) < 1e-9 * row["token_ms"]
        ratio = row["bytes_per_step"] / (row["step_ms"] / 1000) / limits["copy_bytes_per_s"]
        assert abs(row["copy_bandwidth_ratio"] - ratio) < 1e-9 * ratio
        # The copy measured again after the workload (the engine closed), and the ratio against it.
        after = row["bytes_per_step"] / (row["step_ms"] / 1000) / limits["copy_bytes_per_s_after"]
        assert abs(row["copy_bandwidth_ratio_after"] - after) < 1e-9 * after
    for row in report["prefill"]:
        assert row["flops"] == prefill_flops(profile, row["tokens"])
        ratio = row["flops"] / (row["ttft_ms"] / 1000) / limits["matmul_flops_per_s"]
        assert abs(row["matmul_peak_ratio"] - ratio) < 1e-9 * ratio
    mem = report["memory"]
    assert mem["measured"] and mem["weights_bytes"] == profile.weight_bytes > 0 and mem["kv_bytes"] > 0


def test_bench_refuses_a_batch_over_max_concurrency(bench_env):
    run = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "bench", "--device", "cpu", "--max-concurrency",
                          "1", "--batches", "2", "--no-prefill", "--copy-mib", "8", "--matmul-size", "64",
                          "--quiet"], env=bench_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "batch 2 exceeds the engine's max_concurrency 1" in run.stderr


def test_bench_with_nothing_to_run_fails_before_measuring(bench_env):
    run = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "bench", "--device", "cpu", "--no-decode",
                          "--no-prefill"], env=bench_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "nothing to run: both --no-decode and --no-prefill" in run.stderr
    assert "measuring copy bandwidth" not in run.stderr


def test_bench_prefill_only_needs_no_decode_context(bench_env, tmp_path):
    """``--no-decode`` with a short prefill: the engine is sized for the prefill alone, and the decode runs' context
    (prompt + base + steps) is not held against it."""
    out = tmp_path / "prefill.json"
    run = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "bench", "--device", "cpu", "--no-decode",
                          "--prefill-lengths", "32", "--repeats", "1", "--warmup", "0", "--copy-mib", "8",
                          "--matmul-size", "64", "--output", str(out)], env=bench_env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["decode"] == [] and [r["tokens"] for r in report["prefill"]] == [32]
    assert report["engine"]["max_context"] == 33
    # No decode runs: no second copy measurement (it only qualifies decode ratios).
    assert report["limits"]["copy_bytes_per_s_after"] is None
    assert "measuring copy bandwidth again" not in run.stderr and "after the workload" not in run.stdout


def test_bench_refuses_a_negative_seed_before_measuring(bench_env):
    run = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "bench", "--device", "cpu", "--seed", "-1"],
                         env=bench_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--seed must be >= 0, got -1" in run.stderr
    assert "measuring copy bandwidth" not in run.stderr


def test_bench_reports_acceptance_and_committed_token_rates(bench_env, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "bench", "--device", "cpu", "--max-context", "64",
           "--batches", "2", "--prefill-lengths", "8", "--decode-prompt-tokens", "8", "--decode-base-tokens", "2",
           "--decode-steps", "6", "--repeats", "1", "--warmup", "0", "--copy-mib", "16", "--matmul-size", "128",
           "--speculative", "mtp", "--num-speculative-tokens", "2", "--output", str(out)]
    run = subprocess.run(cmd, env=bench_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    spec = report["engine"]["speculation"]
    assert spec["backend"] == "mtp" and spec["num_speculative_tokens"] == 2 and spec["verifies"] > 0
    assert spec["mean_accepted_length"] == 1 + spec["accepted"] / spec["verifies"]
    assert f"speculative: mtp, 2 drafts per step; {spec['verifies']} verifies" in run.stdout
    # Per draft position: the verifies that drafted it, those that accepted it, the rate; the sums are the totals.
    drafted, accepted = spec["drafted_by_position"], spec["accepted_by_position"]
    assert len(drafted) == len(accepted) == 2 and drafted[0] == spec["verifies"] and drafted[0] >= drafted[1]
    assert sum(drafted) == spec["drafted"] and sum(accepted) == spec["accepted"]
    assert spec["acceptance_by_position"] == [a / d for a, d in zip(accepted, drafted, strict=True)]
    rates = ", ".join(f"{j}: {r:.1%} of {d}" for j, (r, d) in enumerate(zip(spec["acceptance_by_position"], drafted,
                                                                           strict=True), start=1))
    assert f"acceptance by draft position (accepted share of the verifies that drafted it): {rates}" in run.stdout
    # Decode figures count committed tokens; a step may commit several per request.
    (row,) = report["decode"]
    assert abs(row["tokens_per_s"] * row["token_ms"] / 1000 - 2) < 1e-9
    assert row["engine_steps"] == (row["long_run_row_steps"][0] - row["short_run_row_steps"][0]) / 2
    assert row["tokens_per_step"] == 6 / row["engine_steps"] >= 1
    assert abs(row["step_ms"] - row["token_ms"] * row["tokens_per_step"]) < 1e-9 * row["step_ms"]
    assert "tok/step" in run.stdout
