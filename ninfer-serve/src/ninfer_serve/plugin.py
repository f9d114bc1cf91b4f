"""The ``ninfer`` entry point of ninfer-serve (group ``ninfer``, name ``serve``): the ``ninfer serve`` command."""

from __future__ import annotations

from ninfer.plugins import hookimpl

from ninfer_serve.cli import COMMAND


@hookimpl
def ninfer_cli_commands() -> list:
    return [COMMAND]
