"""``ninfer plugins``: every loaded plugin with its distribution, version and what it registered."""

from __future__ import annotations

import json

from ninfer.cli.command import CliCommand


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    from ninfer.plugins import get_registry

    infos = get_registry().plugins()
    if args.json:
        print(json.dumps([{"name": i.name, "module": i.module, "distribution": i.distribution,
                           "version": i.version, "default": i.default,
                           "registered": {k: list(v) for k, v in i.registered.items()}} for i in infos],
                         indent=2))
        return 0
    for info in infos:
        tag = " (default)" if info.default else ""
        print(f"{info.name}{tag}: {info.distribution} {info.version}  [{info.module}]")
        if not info.registered:
            print("    (registers nothing)")
        for kind, names in sorted(info.registered.items()):
            print(f"    {kind}: {', '.join(names)}")
    return 0


COMMAND = CliCommand(
    name="plugins", help="list loaded plugins and what each registered", add_arguments=add_arguments, run=run,
    description="List every loaded plugin (core defaults and 'ninfer' entry points) with its distribution, "
                "version and registrations. NINFER_PLUGINS (comma list of entry-point names) restricts which "
                "entry points load.")
