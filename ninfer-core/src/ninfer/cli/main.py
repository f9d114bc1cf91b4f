"""Entry point of the ``ninfer`` command.

Each subcommand lives in its own module of this package and exposes ``register(subparsers)``,
which adds its parser and sets ``func`` (called with the parsed args, returning an exit code).
Errors that NInfer raises on purpose print one line naming the problem and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ninfer import __version__
from ninfer.errors import NInferError

SUBCOMMANDS: tuple[str, ...] = ("generate", "chat", "info", "plugins", "serve", "score", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ninfer", description="NInfer: single-GPU inference for the Qwen hybrid architectures.")
    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(f"ninfer.cli.{name}_cmd").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except NInferError as exc:
        print(f"ninfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
