"""The contract of a ``ninfer`` subcommand: :class:`CliCommand`, registered through the ``ninfer_cli_commands`` hook.

Core's own commands are registered exactly like a plugin's (the default plugin :mod:`ninfer.cli.plugin`), so
``ninfer serve`` from ninfer-serve and ``ninfer generate`` from core are built the same way. A plugin's command
may reuse core's flag groups and option builders (:mod:`ninfer.cli.common`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class CliCommand:
    """One subcommand of ``ninfer``.

    Invariants:

    - ``name`` is one command-line word not starting with ``-``, registered by one plugin only (the registry
      refuses a second one, naming both plugins);
    - ``add_arguments(parser)`` declares the command's arguments on its own parser and nothing else (the
      ``command`` dest is the dispatcher's); it runs for every ``ninfer`` invocation, so it imports nothing
      heavy;
    - ``run(args)`` gets the parsed arguments and returns the exit status. An
      :class:`~ninfer.errors.NInferError` it raises is printed as ``ninfer NAME: error: MESSAGE`` with exit
      status 2; Ctrl-C exits with 130.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name.startswith("-") or any(c.isspace() for c in self.name):
            raise ValueError(f"a ninfer command name must be one word not starting with '-', got {self.name!r}")
