"""The start-up warm-up flag (EngineOptions.warmup): --warmup/--no-warmup on generate, chat and serve, and
--engine-warmup/--no-engine-warmup on bench, whose --warmup N counts its excluded measurement runs. Not given,
the option stays None (the engine decides: on with CUDA)."""

from __future__ import annotations

import pytest
from ninfer.cli import common
from ninfer.cli.bench_cmd import command_line
from ninfer.cli.main import build_parser

COMMANDS = {"generate": ("--prompt", "x"), "chat": (), "serve": (), "bench": ()}
FLAG = {"generate": "warmup", "chat": "warmup", "serve": "warmup", "bench": "engine-warmup"}


def _options(command: str, *flags: str):
    return common.engine_options(build_parser().parse_args([command, *COMMANDS[command], *flags]))


@pytest.mark.parametrize("command", COMMANDS)
def test_warmup_flag_sets_the_engine_option(command):
    assert _options(command).warmup is None
    assert _options(command, f"--{FLAG[command]}").warmup is True
    assert _options(command, f"--no-{FLAG[command]}").warmup is False


def test_bench_keeps_its_warmup_runs_beside_the_engine_warmup():
    args = build_parser().parse_args(["bench", "--warmup", "2", "--no-engine-warmup"])
    assert args.warmup == 2 and args.engine_warmup is False
    line = command_line(args)
    assert "--warmup 2" in line and line.endswith("--no-engine-warmup")


def test_startup_phases_line():
    assert common.startup_phases(None) == ""
    assert common.startup_phases({"load_s": 1.04, "graphs_s": 0.5, "warmup_s": None}) == \
        " (load 1.0 s, graphs 0.5 s)"
    assert common.startup_phases({"load_s": 1.0, "graphs_s": 0.8, "prefill_graphs_s": 0.34}) == \
        " (load 1.0 s, graphs 0.8 s, prefill graphs 0.3 s)"
    assert common.startup_phases({"load_s": 1.0, "graphs_s": 0.0, "warmup_s": 2.31}).endswith("warm-up 2.3 s)")
