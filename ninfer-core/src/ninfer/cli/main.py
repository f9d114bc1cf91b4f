"""Entry point of the ``ninfer`` command.

The subcommands are the :class:`~ninfer.cli.command.CliCommand` values of the plugin registry, in registration
order: core's own first (a default plugin), then those of installed plugin distributions (``ninfer serve`` comes
from ninfer-serve). A command of :data:`OPTIONAL_COMMANDS` that no loaded plugin provides is still listed, and
running it says which distribution to install. Errors that NInfer raises on purpose print one line naming the
problem and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import os
import sys
from collections.abc import Mapping
from types import MappingProxyType

from ninfer import __version__
from ninfer.cli.common import merge_model_flag
from ninfer.cli.help_format import HelpFormatter
from ninfer.errors import NInferError
from ninfer.plugins import PluginRegistry, get_registry
from ninfer.plugins.registry import ENTRY_POINT_GROUP, ENV_FILTER

# Commands that NInfer's optional distributions add: name -> (distribution, help). Data only, never imported:
# without the distribution, ``ninfer NAME`` names what to install instead of argparse's "invalid choice".
OPTIONAL_COMMANDS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "serve": ("ninfer-serve", "serve a model over HTTP (OpenAI and Anthropic APIs)"),
})


def build_parser(registry: PluginRegistry | None = None) -> argparse.ArgumentParser:
    """The ``ninfer`` parser with a subcommand per registered command (``registry``: default the process-wide
    one)."""
    registry = registry if registry is not None else get_registry()
    parser = argparse.ArgumentParser(
        prog="ninfer", formatter_class=HelpFormatter,
        description="NInfer: single-GPU LLM inference; the architectures come from plugins ('ninfer plugins' lists "
                    "them).")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in registry.cli_commands.values():
        command.add_arguments(sub.add_parser(command.name, help=command.help, description=command.description,
                                             formatter_class=HelpFormatter))
    for name, (distribution, help_text) in OPTIONAL_COMMANDS.items():
        if name not in registry.cli_commands:
            # Takes any arguments: running it only reports what is missing.
            sub.add_parser(name, add_help=False, help=f"{help_text} (needs {distribution})")
    return parser


def version_text() -> str:
    """``ninfer X.Y.Z`` and a line per installed plugin distribution (name, version, its entry points in the
    ``ninfer`` group), read from package metadata without importing any plugin."""
    plugins: dict[tuple[str, str], list[str]] = {}
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        key = (ep.dist.name, ep.dist.version) if ep.dist is not None else ("?", "?")
        if ep.name not in plugins.setdefault(key, []):
            plugins[key].append(ep.name)
    lines = [f"ninfer {__version__}"]
    if plugins:
        width = max(len(name) for name, _ in plugins)
        lines.append("plugins:")
        lines += [f"  {name:<{width}}  {version}  ({', '.join(sorted(eps))})"
                  for (name, version), eps in sorted(plugins.items())]
    else:
        lines.append("plugins: none installed (pip install ninfer-qwen3_5 for the Qwen3.5 architectures)")
    return "\n".join(lines)


def _installed(distribution: str) -> bool:
    try:
        md.distribution(distribution)
    except md.PackageNotFoundError:
        return False
    return True


def missing_command_message(name: str) -> str:
    """Why the optional command ``name`` cannot run: its distribution is not installed, or not loaded."""
    distribution = OPTIONAL_COMMANDS[name][0]
    origin = f"'ninfer {name}' comes from the {distribution} distribution"
    if not _installed(distribution):
        return f"{origin}, which is not installed: pip install {distribution}"
    restricted = os.environ.get(ENV_FILTER, "").strip()
    why = f" ({ENV_FILTER}={restricted!r} leaves it out)" if restricted else ""
    return f"{origin}, which is installed but not loaded{why}; 'ninfer plugins' lists the loaded plugins"


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's last flush of what a closed pipe could not
    take raises nothing more."""
    with contextlib.suppress(OSError, ValueError, AttributeError):   # best effort: the process is ending anyway
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def main(argv: list[str] | None = None, *, registry: PluginRegistry | None = None) -> int:
    if sys.stdout is None:   # started with standard output closed (">&-"): what it prints goes nowhere
        sys.stdout = open(os.devnull, "w")   # noqa: SIM115 (open for the life of the process)
    if (sys.argv[1:] if argv is None else argv) == ["--version"]:  # answered without loading any plugin
        print(version_text())
        return 0
    try:
        registry = registry if registry is not None else get_registry()
    except NInferError as exc:  # a plugin that fails to load names itself
        print(f"ninfer: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser(registry)
    args, extra = parser.parse_known_args(argv)
    command = registry.cli_commands.get(args.command)
    if command is None:
        print(f"ninfer {args.command}: error: {missing_command_message(args.command)}", file=sys.stderr)
        return 2
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        merge_model_flag(args)
        return int(command.run(args) or 0)
    except NInferError as exc:
        print(f"ninfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:   # the reader stopped early ("| head"): nothing left to say, nobody to say it to
        _silence_stdout()
        return 141   # what a shell reports for a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
