"""tools/host_experts_profile.py on the CPU with a tiny top-2 of 8 MoE model (the code path is the GPU's, host and
device being one memory): the report gives the host-expert decode rate, one hit/miss/copy entry per MoE layer with
every routed pair counted, the host step's phases, the worker's profile with the host's expert sum in it, and with ``--compare`` the
device-resident decode rate."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch
from ninfer.conversion import convert
from support.models import tiny_text_model, write_byte_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import host_experts_profile  # noqa: E402
from engine.test_host_experts import GEOMETRY  # noqa: E402


def _tiny_moe(tmp_path: Path) -> Path:
    """A converted top-2 of 8 MoE model (the host-expert tests' geometry)."""
    torch.manual_seed(0)
    model = tiny_text_model("moe", dict(GEOMETRY, num_experts=8, num_experts_per_tok=2), seed=5)
    model.config.architectures = ["Qwen3_5MoeForCausalLM"]
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    write_byte_tokenizer(tmp_path / "hf")
    artifact = convert(tmp_path / "hf", tmp_path / "m.ninfer", progress=False).paths[0]
    return artifact


def test_profile_reports_rates_counts_and_the_host_sum(tmp_path, monkeypatch):
    artifact = _tiny_moe(tmp_path)
    monkeypatch.setenv("NINFER_CUDA_GRAPHS", "1")   # restored afterwards whatever the tool does
    out = tmp_path / "report.txt"
    assert host_experts_profile.main([str(artifact), "--device", "cpu", "--tokens", "6", "--batch", "2",
                                      "--expert-cache-slots", "2", "--compare", "--out", str(out)]) == 0
    report = out.read_text()
    assert float(re.search(r"host experts \(torch kernel, threads auto\): B=2 decode ([\d,.]+) tok/s",
                           report)[1].replace(",", "")) > 0
    hits = [int(n) for n in re.search(r"cache hits per layer \[([^\]]*)\]", report)[1].split(",")]
    misses = [int(n) for n in re.search(r"misses \[([^\]]*)\]", report)[1].split(",")]
    assert len(hits) == len(misses) == 4 and len({h + m for h, m in zip(hits, misses, strict=True)}) == 1
    assert "routed_sum" in report
    assert re.search(r"host cost scale per layer \(measured over estimated host time\) \[[\d., ]+\]", report)
    phases = re.search(r"host step phases over (\d+) forwards.*: wait ([\d.]+), cache ([\d.]+), copy ([\d.]+), "
                       r"host ([\d.]+), back ([\d.]+)", report)
    assert int(phases[1]) >= 6 and float(phases[5]) > 0   # every forward's host sum is timed
    assert re.search(r"experts on the device, no CUDA graphs: B=2 decode [\d,.]+ tok/s", report)
    assert os.environ["NINFER_CUDA_GRAPHS"] == "1"   # the tool put it back


def test_each_host_kernel_is_measured_in_turn(tmp_path):
    """``--host-expert-kernel torch,compiled,native``: one report block per kernel, in that order, with the threads
    set."""
    artifact = _tiny_moe(tmp_path)
    out = tmp_path / "report.txt"
    assert host_experts_profile.main([str(artifact), "--device", "cpu", "--tokens", "4", "--host-expert-kernel",
                                      "torch,compiled,native", "--host-expert-threads", "1", "--out", str(out)]) == 0
    report = out.read_text()
    kernels = re.findall(r"host experts \((\w+) kernel, threads 1\): B=1 decode [\d,.]+ tok/s", report)
    assert kernels == ["torch", "compiled", "native"]
    assert len(re.findall(r"host step phases over", report)) == 3


def test_the_copy_threshold_reaches_the_engine(tmp_path):
    """``--expert-copy-min-tokens 1``: every routed expert takes the copy path (on the CPU a copy into the staging
    buffer), which the report's copy-path counts show; a threshold no call reaches leaves them at zero."""
    artifact = _tiny_moe(tmp_path)
    counts = {}
    for threshold in ("1", "1000000"):
        out = tmp_path / f"report-{threshold}.txt"
        assert host_experts_profile.main([str(artifact), "--device", "cpu", "--tokens", "4", "--expert-cache-slots",
                                          "0", "--expert-copy-min-tokens", threshold, "--out", str(out)]) == 0
        listed = re.search(r"copy-path experts \[([\d, ]+)\]", out.read_text()).group(1)
        counts[threshold] = [int(n) for n in listed.split(",")]
    assert all(n > 0 for n in counts["1"]) and not any(counts["1000000"])
