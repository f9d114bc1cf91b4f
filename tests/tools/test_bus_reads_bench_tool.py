"""tools/bus_reads_bench.py on the CPU (the device's op reads the same memory; the code path is the GPU's): a row per
token count and bus rank count, each with the three timings; bad arguments are refused with a message."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bus_reads_bench  # noqa: E402


def test_a_row_per_tokens_and_ranks(tmp_path, capsys):
    out = tmp_path / "bus.json"
    assert bus_reads_bench.main(["--device", "cpu", "--experts", "16", "--hidden", "64", "--inter", "32",
                                 "--threads", "1", "--tokens", "1,3", "--ranks", "0,2,8", "--repeats", "2",
                                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["tokens"], r["ranks"]) for r in report["runs"]] == [(1, 0), (1, 2), (1, 8), (3, 0), (3, 2), (3, 8)]
    for r in report["runs"]:
        assert r["both_ms"] > 0 and (r["bus_gbs"] is None) == (r["ranks"] == 0)
        assert r["host_ms"] > 0 and r["bus_ms"] > 0
    assert report["host_read_gbs"] > 0 and report["copy_gbs"] is None   # no bus to copy over on the CPU
    assert "T=3 d=2: bus" in capsys.readouterr().out


def test_bad_ranks_are_refused(capsys):
    assert bus_reads_bench.main(["--device", "cpu", "--ranks", "0,9"]) == 2
    assert "--ranks must be counts from 0 to --k (8)" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device exists here: the tool would measure it")
def test_no_cuda_device_is_said(capsys):
    assert bus_reads_bench.main([]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
