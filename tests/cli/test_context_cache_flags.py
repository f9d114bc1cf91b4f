"""The context-cache engine flags (--context-cache, --cache-host-mib, --cache-checkpoint-interval):
parsed by every command that shares the engine flags, turned into EngineOptions, bad values refused
with the flag's name before any model is loaded, and a real `ninfer generate --context-cache` run."""

from __future__ import annotations

import argparse

import pytest
from ninfer.cli import common
from ninfer.cli.main import build_parser, main
from ninfer.errors import NInferError

# the commands that share the engine flags (common.add_model_args), with their required arguments
COMMANDS = {"generate": ("--prompt", "x"), "chat": (), "serve": (), "bench": ()}
CACHE_FLAGS = ("--context-cache", "--no-context-cache", "--cache-host-mib", "--cache-checkpoint-interval")
# on by default where a later request can start from an earlier one's checkpoint
DEFAULT_ON = {"generate": False, "chat": True, "serve": True, "bench": False}


def _options(command: str, *flags: str):
    args = build_parser().parse_args([command, *COMMANDS[command], *flags])
    return common.engine_options(args)


@pytest.mark.parametrize("command", COMMANDS)
def test_cache_flags_build_engine_options(command):
    options = _options(command, "--context-cache", "--cache-host-mib", "0", "--cache-checkpoint-interval", "64")
    assert options.context_cache is True
    assert options.cache_host_mib == 0.0 and options.host_budget_bytes == 0  # 0: no Host tier
    assert options.cache_checkpoint_interval == 64 and options.checkpoint_interval == 64
    assert options.validate() is options


@pytest.mark.parametrize("command", COMMANDS)
def test_cache_default_per_command_and_defaults_left_to_the_engine(command):
    default = _options(command)
    assert default.context_cache is DEFAULT_ON[command]
    assert default.cache_host_mib is None and default.cache_checkpoint_interval is None
    off = _options(command, "--no-context-cache")
    assert off.context_cache is False and off.checkpoint_slots == 0 and off.host_budget_bytes == 0
    on = _options(command, "--context-cache", "--max-concurrency", "2")
    assert on.context_cache is True and on.max_concurrency == 2
    assert on.cache_host_mib is None and on.cache_checkpoint_interval is None
    assert on.checkpoint_interval == on.prefill_chunk == 8192  # the engine's default chunk, a page multiple
    assert _options(command, "--context-cache", "--cache-host-mib", "1.5").host_budget_bytes == int(1.5 * 2**20)


@pytest.mark.parametrize("command", COMMANDS)
def test_cache_flags_are_in_help(command):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    help_text = sub.choices[command].format_help()
    for flag in CACHE_FLAGS:
        assert flag in help_text, f"{command} lacks {flag}"
    assert f"(default: {'on' if DEFAULT_ON[command] else 'off'})" in " ".join(help_text.split())


def test_score_has_no_context_cache_flags(capsys):
    # a causal_scoring engine keeps no context cache (EngineOptions.validate refuses it)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["score", "--input", "a.txt", "--output", "r.json", "--context-cache"])
    assert exc.value.code == 2
    assert "--context-cache" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (("--cache-host-mib", "8"), "--cache-host-mib needs the context cache, which is off here"),
    (("--cache-checkpoint-interval", "64"), "--cache-checkpoint-interval needs the context cache"),
    (("--context-cache", "--no-context-cache", "--cache-host-mib", "8"), "--cache-host-mib needs the context cache"),
    (("--context-cache", "--cache-host-mib", "-1"), "--cache-host-mib must be a finite number >= 0"),
    (("--context-cache", "--cache-host-mib", "nan"), "--cache-host-mib must be a finite number >= 0"),
    (("--context-cache", "--cache-host-mib", "inf"), "--cache-host-mib must be a finite number >= 0"),
    (("--context-cache", "--cache-checkpoint-interval", "0"), "--cache-checkpoint-interval must be a positive "
                                                              "multiple of the page size 16, got 0"),
    (("--context-cache", "--cache-checkpoint-interval", "-16"), "--cache-checkpoint-interval must be"),
    (("--context-cache", "--cache-checkpoint-interval", "100"), "multiple of the page size 16, got 100"),
])
def test_invalid_cache_flags_name_the_flag(flags, message):
    with pytest.raises(NInferError, match=message.replace("+", r"\+").replace(".", r"\.")):
        _options("generate", *flags)


@pytest.mark.parametrize("command", ("generate", "chat", "bench"))
def test_invalid_cache_flag_fails_before_loading(command, capsys, tmp_path):
    # a model path that does not exist: the flag error must come first (nothing resolved or loaded)
    missing = str(tmp_path / "nope.ninfer")
    code = main([command, missing, *COMMANDS[command], "--context-cache", "--cache-checkpoint-interval", "24",
                 "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"ninfer {command}: error: --cache-checkpoint-interval must be a positive multiple")
    assert "nope.ninfer" not in err and "Traceback" not in err


def test_unparsable_cache_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "--prompt", "x", "--context-cache", "--cache-host-mib", "lots"])
    assert exc.value.code == 2
    assert "argument --cache-host-mib: invalid float value: 'lots'" in capsys.readouterr().err


def test_generate_with_context_cache_matches_the_cold_run(run_cli):
    args = ("generate", "--prompt", "def fibonacci(n):", "--temperature", "0", "--max-tokens", "12")
    cold = run_cli(*args, "--quiet")
    cached = run_cli(*args, "--context-cache", "--cache-host-mib", "0", "--cache-checkpoint-interval", "16")
    assert cold.returncode == 0, cold.stderr
    assert cached.returncode == 0, cached.stderr
    assert cached.stdout.strip() and cached.stdout == cold.stdout
    assert "generated tokens" in cached.stderr


@pytest.mark.parametrize("command", (("generate", "--prompt", "x", "--context-cache"), ("chat",), ("serve",)))
def test_start_engine_turns_the_context_cache_on(default_artifact, command):
    # chat and serve: on by default; generate: with --context-cache
    args = build_parser().parse_args([command[0], str(default_artifact), *command[1:], "--quiet",
                                      "--cache-host-mib", "0", "--max-concurrency", "1", "--max-context", "256"])
    with common.start_engine(args) as engine:
        assert engine.options.context_cache and engine.options.host_budget_bytes == 0
        prompt = list(engine.frontend.prepare_text("import os\nimport sys\n\n\ndef main():\n").token_ids)
        sampling = engine.sampling_params(temperature=0.0, max_tokens=4)
        first = engine.generate(prompt, sampling=sampling)
        # the next turn extends the first: it starts from the first request's prompt-end or response-end
        # checkpoint (an exact proper prefix) and prefills only the rest
        engine.generate(prompt + list(first.token_ids) + prompt, sampling=sampling)
        stats = engine.stats()
    assert stats.cache_captures > 0
    assert stats.cache_hits == 1 and stats.cache_hit_tokens >= len(prompt)
