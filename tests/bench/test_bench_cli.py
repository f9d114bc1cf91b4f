"""``ninfer bench`` on the default model on the CPU with tiny settings: the table, and a JSON report
with every field present, every measured figure positive, the FLOP and byte figures equal to what the
model's config gives by hand and what the run measured (never to the accounting functions that produced
them), and the ratios consistent with the limits measured in the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DECODE_FIELDS = ("batch", "tokens_per_s", "token_ms", "step_ms", "tokens_per_step", "engine_steps", "context_tokens",
                 "bytes_per_step", "achieved_bytes_per_s", "copy_bandwidth_ratio", "ttft_ms", "steps", "short_run_s",
                 "long_run_s")
PREFILL_FIELDS = ("tokens", "tokens_per_s", "ttft_ms", "flops", "achieved_flops_per_s", "matmul_peak_ratio")
LIMIT_FIELDS = ("copy_buffer_bytes", "copy_bytes_per_s", "matmul_n", "matmul_flops_per_s")


def default_model_config() -> dict:
    import ninfer_qwen3_5

    folder = Path(ninfer_qwen3_5.__file__).parent / "default_model" / "qwen3_5-stdlib"
    return json.loads((folder / "config.json").read_text())


def counts_by_hand(c: dict) -> dict[str, int]:
    """The compute counts of a dense Qwen3.5 from its config, written out from the architecture (independent of
    ninfer's profile code): weight elements one token multiplies (GDN layer: qkv, z, b and a, the depthwise conv,
    out; attention layer: query, output gate, key, value, out; MLP: gate, up, down), the LM head, the GDN
    recurrence (7 Dk x Dv products per value head) and causal attention per (query, key) pair (QK and PV, two
    FLOPs a multiply-add, per query head)."""
    h, kinds = c["hidden_size"], c["layer_types"]
    gdn_layers, attn_layers = kinds.count("linear_attention"), kinds.count("full_attention")
    assert gdn_layers + attn_layers == c["num_hidden_layers"] and "num_experts" not in c  # dense only
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv_dim = 2 * hk * dk + hv * dv
    gdn = conv_dim * h + hv * dv * h + 2 * hv * h + conv_dim * c["linear_conv_kernel_dim"] + h * hv * dv
    q, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    gate = q * d * h if c.get("attn_output_gate") else 0
    attn = q * d * h + gate + 2 * kv * d * h + h * q * d
    mlp = 3 * c["intermediate_size"] * h
    return {"matmul_params_per_token": gdn_layers * gdn + attn_layers * attn + c["num_hidden_layers"] * mlp,
            "head_params": c["vocab_size"] * h,
            "mixer_flops_per_token": gdn_layers * hv * 7 * dk * dv,
            "attention_flops_per_query_key": attn_layers * q * 4 * d}


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
    assert report["device_held_bytes"] == {"before_limits": None, "before_engine": None}   # a CPU run
    limits = report["limits"]
    assert all(limits[k] > 0 for k in LIMIT_FIELDS)
    assert [r["batch"] for r in report["decode"]] == [1, 2]
    assert [r["tokens"] for r in report["prefill"]] == [32, 299]
    for row in report["decode"]:
        assert all(row[k] > 0 for k in DECODE_FIELDS), row
    for row in report["prefill"]:
        assert all(row[k] > 0 for k in PREFILL_FIELDS), row

    # Expected figures from outside the code under test: compute counts from the config by hand; bytes from what
    # the run measured of the engine it built (weights, and the KV pool and state slots it allocated).
    config, mem = default_model_config(), report["memory"]
    counts = counts_by_hand(config)
    for name, value in counts.items():
        assert report["profile"][name] == value, name
    assert mem["measured"] and mem["weights_bytes"] > 0 and mem["kv_bytes"] > 0
    kv_per_token = mem["kv_bytes"] / (mem["num_pages"] * mem["page_size"])
    state_per_row = mem["state_bytes"] / mem["state_slots"]
    assert config["tie_word_embeddings"]  # the input table is the LM head: every step reads all the weights

    for row in report["decode"]:
        assert row["context_tokens"] == 8 + 2 + (6 - 1) / 2
        # A step reads every weight once; per row: the context's K/V, the new token's K/V written, the recurrent
        # state read and written back.
        per_row = row["context_tokens"] * kv_per_token + kv_per_token + 2 * state_per_row
        expected = mem["weights_bytes"] + row["batch"] * per_row
        assert abs(row["bytes_per_step"] - expected) <= 1e-12 * expected
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
        t = row["tokens"]
        # Every token through every matmul, the head once (the last position samples), the GDN recurrence per
        # token, attention over the t (t + 1) / 2 causal pairs.
        assert row["flops"] == (2 * counts["matmul_params_per_token"] * t + 2 * counts["head_params"]
                                + counts["mixer_flops_per_token"] * t
                                + counts["attention_flops_per_query_key"] * t * (t + 1) // 2)
        ratio = row["flops"] / (row["ttft_ms"] / 1000) / limits["matmul_flops_per_s"]
        assert abs(row["matmul_peak_ratio"] - ratio) < 1e-9 * ratio
    assert report["profile"]["weight_bytes"] == mem["weights_bytes"]


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
