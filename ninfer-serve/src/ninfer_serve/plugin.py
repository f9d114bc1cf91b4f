"""The ``ninfer`` entry point of ninfer-serve (group ``ninfer``, name ``serve``): the ``ninfer serve`` and
``ninfer bench-serve`` commands."""

from __future__ import annotations

from ninfer.plugins import hookimpl

from ninfer_serve.bench_serve import COMMAND as BENCH_SERVE
from ninfer_serve.cli import COMMAND


@hookimpl
def ninfer_cli_commands() -> list:
    return [COMMAND, BENCH_SERVE]
