"""Core's own ``ninfer`` subcommands, registered as a default plugin (``registry.DEFAULT_PLUGINS``) through the
same ``ninfer_cli_commands`` hook as a plugin distribution's commands."""

from __future__ import annotations

from ninfer.cli import bench_cmd, chat_cmd, generate_cmd, info_cmd, list_cmd, plugins_cmd, rm_cmd, score_cmd
from ninfer.cli.command import CliCommand
from ninfer.plugins.hookspecs import hookimpl


@hookimpl
def ninfer_cli_commands() -> list[CliCommand]:
    return [generate_cmd.COMMAND, chat_cmd.COMMAND, info_cmd.COMMAND, plugins_cmd.COMMAND,
            score_cmd.COMMAND, bench_cmd.COMMAND, list_cmd.COMMAND, rm_cmd.COMMAND]
