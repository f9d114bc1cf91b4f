"""Output of the diagnostic tools: one JSON object printed, and written to ``--out`` when given."""

from __future__ import annotations

import json
from pathlib import Path


def emit_report(report: dict, out: Path | None) -> int:
    """Print ``report`` as indented JSON and write it to ``out`` (parents made) when given; returns 0 (the exit code)."""
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0
