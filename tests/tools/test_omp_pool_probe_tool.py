"""tools/omp_pool_probe.py: one row of three timings (clean, mainpool, joined) per thread count, each measured in a
process of its own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import omp_pool_probe  # noqa: E402


def test_a_row_per_thread_count(tmp_path, capsys):
    out = tmp_path / "omp.json"
    assert omp_pool_probe.main(["--threads", "1", "--gap-us", "20", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["threads"] for r in rows] == [1]
    assert all(rows[0][s] > 0 for s in omp_pool_probe.SETUPS)
    assert "threads   1: a small parallel region after 20 us busy: clean" in capsys.readouterr().out
