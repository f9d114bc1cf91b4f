"""``ninfer list``: the converted models in the cache, with their recorded names, files, sizes and dates.

The name is the one the artifact records (the served model name: a folder's name, a default model's name or
a Hugging Face repo id); ``ninfer rm`` takes it or the file name. An empty cache says so and exits 0.
"""

from __future__ import annotations

import json
import time

from ninfer.cli.command import CliCommand


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def format_size(n: int) -> str:
    """Bytes in binary units with three significant digits (``15.0 MiB``, ``1.25 GiB``, ``512 B``)."""
    if n < 1024:
        return f"{n} B"
    value, units = n / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while value >= 1000 and len(units) > 1:
        value /= 1024
        units.pop(0)
    unit = units[0]
    decimals = 2 if value < 10 else 1 if value < 100 else 0
    return f"{value:.{decimals}f} {unit}"


def run(args) -> int:
    from ninfer.model_source.store import artifacts_dir, cached_artifacts

    found = cached_artifacts()
    if args.json:
        print(json.dumps([{"name": a.name, "file": a.path.name, "path": str(a.path), "bytes": a.size,
                           "modified": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(a.modified)),
                           "files": [f.name for f in a.files], "problem": a.problem} for a in found], indent=2))
        return 0
    if not found:
        print(f"no converted models in {artifacts_dir()}")
        return 0
    rows = [("NAME", "SIZE", "MODIFIED", "FILE")]
    rows += [(a.name if a.name is not None else f"(unreadable: {a.problem})", format_size(a.size),
              time.strftime("%Y-%m-%d %H:%M", time.localtime(a.modified)), a.path.name) for a in found]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}")
    return 0


COMMAND = CliCommand(
    name="list", help="list the converted models in the cache", add_arguments=add_arguments, run=run,
    description="List the converted .ninfer artifacts in the cache (NINFER_CACHE_DIR, else ~/.cache/ninfer): "
                "the model name each records (the name it is served under), its size on disk, when it was "
                "converted and its file. 'ninfer rm' removes one.")
