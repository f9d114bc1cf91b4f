"""tools/start_thread_ab.py on the CPU: one line per engine process, alternating the two start-ups, the figures in
the JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import start_thread_ab  # noqa: E402


def test_both_start_ups_alternate(tmp_path, capsys, default_artifact):
    out = tmp_path / "ab.json"
    assert start_thread_ab.main([str(default_artifact), "--device", "cpu", "--tokens", "4", "--repeats", "1",
                                 "--rounds", "1", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())
    assert [r["setup"] for r in runs] == ["thread", "caller"] and all(len(r["tok_s"]) == 1 for r in runs)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("start-up on its own thread: ") and lines[1].startswith("start-up on the calling")
