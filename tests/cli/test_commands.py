"""The ``ninfer`` subcommands come from the plugin registry (``ninfer_cli_commands``): core's own as a default
plugin, others from plugins; an optional command whose distribution is missing says what to install."""

from __future__ import annotations

import argparse
import types

import pytest
from ninfer.cli import main as cli_main
from ninfer.cli.command import CliCommand
from ninfer.errors import NInferError
from ninfer.plugins import PluginConflictError, PluginRegistry, hookimpl

CORE_COMMANDS = ["generate", "chat", "info", "plugins", "score", "bench", "list", "rm"]


def _plugin(name: str, *commands: CliCommand) -> types.ModuleType:
    module = types.ModuleType(name)

    @hookimpl
    def ninfer_cli_commands():
        return list(commands)

    module.ninfer_cli_commands = ninfer_cli_commands
    return module


def _echo(name: str, calls: list) -> CliCommand:
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--times", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        calls.append(args.times)
        if args.times < 0:
            raise NInferError("--times must be >= 0")
        return 7

    return CliCommand(name=name, help="repeat nothing", add_arguments=add_arguments, run=run)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_core_commands_are_a_default_plugin_registered_first():
    reg = PluginRegistry(load_entry_points=False)
    assert list(reg.cli_commands) == CORE_COMMANDS
    info = {i.name: i for i in reg.plugins()}["core_commands"]
    assert info.default and info.distribution == "ninfer-core"
    assert info.registered == {"cli_commands": tuple(CORE_COMMANDS)}


def test_installed_entry_points_add_serve_after_the_core_commands():
    reg = PluginRegistry()
    assert list(reg.cli_commands)[:len(CORE_COMMANDS)] == CORE_COMMANDS
    serve = {i.name: i for i in reg.plugins()}["serve"]
    assert serve.distribution == "ninfer-serve" and serve.registered == {"cli_commands": ("serve", "bench-serve")}


def test_a_plugin_command_is_parsed_and_run(capsys):
    calls: list = []
    reg = PluginRegistry(load_entry_points=False, extra_plugins=(_plugin("echo_plugin", _echo("echo", calls)),))
    parser = cli_main.build_parser(reg)
    assert list(_subcommands(parser))[:len(CORE_COMMANDS) + 1] == [*CORE_COMMANDS, "echo"]
    assert cli_main.main(["echo", "--times", "3"], registry=reg) == 7
    assert calls == [3]
    assert cli_main.main(["echo", "--times", "-1"], registry=reg) == 2
    assert capsys.readouterr().err == "ninfer echo: error: --times must be >= 0\n"
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["echo", "--bogus"], registry=reg)
    assert exc.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_two_plugins_registering_one_command_conflict():
    a = _plugin("cmd_a", _echo("echo", []))
    b = _plugin("cmd_b", _echo("echo", []))
    with pytest.raises(PluginConflictError, match="cli command 'echo'.*'cmd_a'.*'cmd_b'"):
        PluginRegistry(load_entry_points=False, extra_plugins=(a, b))
    with pytest.raises(PluginConflictError, match="cli command 'generate'"):
        PluginRegistry(load_entry_points=False, extra_plugins=(_plugin("cmd_c", _echo("generate", [])),))


@pytest.mark.parametrize("name", ["", "-x", "two words", "tab\there"])
def test_a_command_name_is_one_word(name):
    with pytest.raises(ValueError, match="one word"):
        _echo(name, [])


def test_serve_without_its_distribution_names_the_package(monkeypatch, capsys):
    """A registry without ninfer-serve's entry point, as on a machine without the distribution."""
    monkeypatch.setattr(cli_main, "_installed", lambda distribution: False)
    reg = PluginRegistry(load_entry_points=False)
    assert "serve" not in reg.cli_commands
    help_text = " ".join(cli_main.build_parser(reg).format_help().split())
    assert "serve serve a model over HTTP (OpenAI and Anthropic APIs) (needs ninfer-serve)" in help_text
    for argv in (["serve"], ["serve", "model.ninfer", "--port", "9"], ["serve", "--help"]):
        assert cli_main.main(argv, registry=reg) == 2
        assert capsys.readouterr().err == ("ninfer serve: error: 'ninfer serve' comes from the ninfer-serve "
                                           "distribution, which is not installed: pip install ninfer-serve\n")


def test_serve_installed_but_filtered_out_says_so(monkeypatch, capsys):
    monkeypatch.setenv("NINFER_PLUGINS", "qwen3_5")
    reg = PluginRegistry(only={"qwen3_5"})
    assert cli_main.main(["serve"], registry=reg) == 2
    err = capsys.readouterr().err
    assert "ninfer-serve distribution, which is installed but not loaded (NINFER_PLUGINS='qwen3_5'" in err


def test_a_plugin_that_fails_to_load_is_one_line(monkeypatch, capsys):
    from ninfer.plugins import PluginError

    def broken():
        raise PluginError("plugin entry point 'x' (x.plugin) failed to load: boom")

    monkeypatch.setattr(cli_main, "get_registry", broken)
    assert cli_main.main(["plugins"]) == 2
    assert capsys.readouterr().err == "ninfer: error: plugin entry point 'x' (x.plugin) failed to load: boom\n"


def test_version_loads_no_plugin(monkeypatch, capsys):
    """``ninfer --version`` answers before the registry (whose plugins import torch) is built."""
    def refuse():
        raise AssertionError("--version built the plugin registry")

    monkeypatch.setattr(cli_main, "get_registry", refuse)
    assert cli_main.main(["--version"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"ninfer {cli_main.__version__}"
    # Each installed plugin distribution with its version, from metadata alone.
    import importlib.metadata as md

    assert out[1] == "plugins:"
    listed = {line.split()[0]: line.split()[1] for line in out[2:]}
    assert listed["ninfer-qwen3_5"] == md.version("ninfer-qwen3_5")
    assert "(qwen3_5)" in next(line for line in out if line.split()[0] == "ninfer-qwen3_5")


def test_version_without_plugins(monkeypatch, capsys):
    monkeypatch.setattr(cli_main.md, "entry_points", lambda group: [])
    assert cli_main.main(["--version"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("plugins: none installed")
