"""Core's own ``ninfer`` subcommands, registered as a default plugin (``registry.DEFAULT_PLUGINS``) through the
same ``ninfer_cli_commands`` hook as a plugin distribution's commands."""

from __future__ import annotations

from ninfer.cli import bench_cmd, chat_cmd, generate_cmd, info_cmd, plugins_cmd, score_cmd
from ninfer.cli.command import CliCommand
from ninfer.plugins.hookspecs import hookimpl


class _OwnParser:
    """The subparsers stand-in ``info_cmd.register`` declares its arguments through: it hands over the parser
    the dispatcher already made for ``info`` (whose help and description :data:`INFO` carries)."""

    def __init__(self, parser) -> None:
        self._parser = parser

    def add_parser(self, name: str, **_options):
        return self._parser


INFO = CliCommand(
    name="info", help="describe a .ninfer artifact", run=info_cmd.run,
    add_arguments=lambda parser: info_cmd.register(_OwnParser(parser)),
    description="Describe a V3 .ninfer artifact: components and config summary, objects and bytes per component "
                "and per format, files, metadata, artifact id.")


@hookimpl
def ninfer_cli_commands() -> list[CliCommand]:
    return [generate_cmd.COMMAND, chat_cmd.COMMAND, INFO, plugins_cmd.COMMAND, score_cmd.COMMAND,
            bench_cmd.COMMAND]
