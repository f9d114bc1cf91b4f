"""``ninfer rm NAME...``: remove converted models from the cache.

Each NAME is a model name as ``ninfer list`` shows it (every artifact recording that name goes, whatever
source version it was converted from) or an artifact's file name. Every NAME is checked before anything is
removed: an unknown one is an error (exit 2) naming it and listing what the cache holds. On a terminal the
command asks before removing unless ``-y``; otherwise it removes without asking, like ``ollama rm``. Only
files in the cache's artifacts folder are ever removed; the sources (folders, the Hugging Face cache) stay.
"""

from __future__ import annotations

import sys

from ninfer.cli.command import CliCommand


def add_arguments(p) -> None:
    p.add_argument("names", nargs="+", metavar="NAME", help="a model name or artifact file name from 'ninfer list'")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation on a terminal")


def run(args) -> int:
    from ninfer.cli.list_cmd import format_size
    from ninfer.model_source import ModelSourceError
    from ninfer.model_source.store import artifacts_dir, cached_artifacts, remove

    found = cached_artifacts()
    chosen, unknown = [], []
    for name in args.names:
        hits = [a for a in found if name in (a.name, a.path.name, a.path.stem)]
        if not hits:
            unknown.append(name)
        chosen += [a for a in hits if a not in chosen]
    if unknown:
        held = sorted({a.name or a.path.name for a in found})
        listing = ", ".join(held) if held else "nothing"
        raise ModelSourceError(f"no converted model named {', '.join(map(repr, unknown))} in {artifacts_dir()} "
                               f"(it holds: {listing}); nothing was removed")
    if not args.yes and sys.stdin.isatty():
        for a in chosen:
            print(f"  {a.name or '?'}  {format_size(a.size)}  {a.path.name}")
        try:
            answer = input(f"remove {len(chosen)} converted model file set(s), "
                           f"{format_size(sum(a.size for a in chosen))}? [y/N] ")
        except EOFError:   # Ctrl-D: no answer is no
            answer = ""
            print()
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    for a in chosen:
        freed = remove(a)
        print(f"removed {a.name or '?'} ({a.path.name}, {format_size(freed)})")
    return 0


COMMAND = CliCommand(
    name="rm", help="remove converted models from the cache", add_arguments=add_arguments, run=run,
    description="Remove converted models from the cache by model name (every converted version of it) or by "
                "artifact file name, as 'ninfer list' shows them. Asks first on a terminal unless -y. The "
                "sources (checkpoint folders, the Hugging Face cache) are left alone; the next use of the model "
                "converts it again.")
