"""``ninfer bench-serve`` (vLLM's bench-serve protocol): its statistics against numpy and the definitions, its
request plan, its flag checks, and a smoke run against a real ``ninfer serve`` on the default model."""

from __future__ import annotations

import argparse
import json
import math
import signal

import numpy as np
import pytest
from ninfer.cli.main import main
from ninfer_serve import bench_serve as bs
from serve_helpers import start_server_process


def _outcome(ttft, latency, tokens, itl, prompt_len=10):
    return bs.RequestOutcome(prompt_len, ok=True, ttft=ttft, latency=latency, itl=list(itl), output_tokens=tokens)


def test_summary_follows_the_definitions_and_numpy_percentiles():
    outs = [_outcome(0.1, 1.0, 10, [0.1] * 9), _outcome(0.3, 2.0, 5, [0.2, 0.5, 0.5, 0.5]),
            _outcome(0.2, 0.2, 1, []), bs.RequestOutcome(7, error="HTTP 429: busy")]
    r = bs.summarize(outs, duration=4.0, percentiles=[50, 99])
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (3, 1, 30, 16)
    assert r["request_throughput"] == 3 / 4 and r["output_throughput"] == 16 / 4 and r["total_token_throughput"] == 46 / 4
    ttft = np.array([100.0, 300.0, 200.0])
    tpot = np.array([(1.0 - 0.1) / 9, (2.0 - 0.3) / 4]) * 1000   # a one-token answer has no TPOT
    itl = np.array([0.1] * 9 + [0.2, 0.5, 0.5, 0.5]) * 1000
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        assert r[f"mean_{name}_ms"] == pytest.approx(values.mean())
        assert r[f"median_{name}_ms"] == pytest.approx(np.median(values))
        assert r[f"std_{name}_ms"] == pytest.approx(values.std())
        for q in (50, 99):
            assert r[f"p{q}_{name}_ms"] == pytest.approx(np.percentile(values, q))
    assert r["errors"] == ["HTTP 429: busy"]


def _args(**kw):
    ns = argparse.Namespace(num_prompts=200, random_input_len=100, random_output_len=20, random_range_ratio=0.25,
                            token_range="256:6000", request_rate=math.inf, burstiness=1.0, max_concurrency=None,
                            percentiles="50,99", seed=4)
    vars(ns).update(kw)
    return ns


def test_the_request_plan_is_seeded_and_within_its_ranges():
    args = _args()
    lo, hi = bs._check(args)  # noqa: SLF001
    plan = bs.make_requests(args, lo, hi)
    assert plan == bs.make_requests(args, lo, hi) and plan != bs.make_requests(_args(seed=5), lo, hi)
    assert all(75 <= len(p) <= 125 and 15 <= n <= 25 for p, n in plan)
    assert all(256 <= t < 6000 for p, _ in plan for t in p)
    assert len({len(p) for p, _ in plan}) > 10   # the range ratio varies the lengths
    assert bs.arrival_gaps(5, math.inf, 1.0, 0) == [0.0] * 5
    for burstiness in (1.0, 0.5, 4.0):   # mean gap 1 / rate whatever the shape; burstier = more spread
        gaps = np.array(bs.arrival_gaps(20000, 8.0, burstiness, 1))
        assert gaps.mean() == pytest.approx(1 / 8, rel=0.05)
        assert gaps.std() == pytest.approx(1 / 8 / math.sqrt(burstiness), rel=0.08)


@pytest.mark.parametrize("flag, value", [("--num-prompts", "0"), ("--random-range-ratio", "1"),
                                         ("--token-range", "9:3"), ("--token-range", "x"), ("--request-rate", "0"),
                                         ("--max-concurrency", "0"), ("--percentiles", "50,101")])
def test_bad_flags_are_named_before_any_request(flag, value, capsys):
    assert main(["bench-serve", "--base-url", "http://127.0.0.1:9", flag, value]) == 2
    assert capsys.readouterr().err.startswith(f"ninfer bench-serve: error: {flag} ")


def test_smoke_against_ninfer_serve(artifact, tmp_path, capsys):
    base, proc = start_server_process(artifact, "--max-concurrency", "2", "--quiet", "--no-warmup")
    try:
        out = tmp_path / "r.json"
        assert main(["bench-serve", "--base-url", base, "--num-prompts", "6", "--random-input-len", "24",
                     "--random-output-len", "8", "--max-concurrency", "3", "--ignore-eos", "--result-file",
                     str(out)]) == 0
        r = json.loads(out.read_text())
        printed = capsys.readouterr().out
        # A token range outside the model's vocabulary: every request fails with the server's reason, exit 1.
        assert main(["bench-serve", "--base-url", base, "--num-prompts", "2", "--random-input-len", "4",
                     "--random-output-len", "2", "--token-range", "100000:100001"]) == 1
        failed = capsys.readouterr().out
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (6, 0, 144, 48)
    assert r["model_id"] == "qwen3_5-stdlib" and r["max_concurrency"] == 3
    assert r["output_throughput"] == pytest.approx(48 / r["duration"])
    assert 0 < r["mean_ttft_ms"] <= r["mean_e2el_ms"] and r["p99_ttft_ms"] >= r["median_ttft_ms"]
    assert r["mean_itl_ms"] > 0 and r["mean_tpot_ms"] > 0
    assert "Successful requests" in printed and "Mean TTFT (ms):" in printed
    assert "Failed requests                                            2" in failed and "outside the vocabulary" in failed
