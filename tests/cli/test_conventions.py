"""Command-line conventions of ``ninfer`` (issue 29, item 9): short flags, the prompt from stdin, values checked
before the model loads, --max-tokens against the context, --help with defaults and without RST markup, and the
first run's conversion notice."""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys

import pytest
from ninfer.cli import common, generate_cmd
from ninfer.cli.main import build_parser, main
from ninfer.errors import NInferError
from ninfer.plugins import get_registry


class _Stdin(io.StringIO):
    def __init__(self, text: str, *, tty: bool) -> None:
        super().__init__(text)
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


# --- short flags and -m/--model ---------------------------------------------------------------------------------

def test_short_flags_are_the_long_ones():
    args = _parse("generate", "-m", "a.ninfer", "-p", "hi", "-n", "7", "-t", "0.5")
    common.merge_model_flag(args)
    assert (args.model, args.prompt, args.max_tokens, args.temperature) == ("a.ninfer", "hi", 7, 0.5)
    long = _parse("generate", "--model", "a.ninfer", "--prompt", "hi", "--max-tokens", "7", "--temperature", "0.5")
    common.merge_model_flag(long)
    assert (long.model, long.prompt, long.max_tokens, long.temperature) == ("a.ninfer", "hi", 7, 0.5)


@pytest.mark.parametrize("command", ("generate", "chat", "score", "bench", "info", "serve"))
def test_model_flag_or_positional(command):
    extra = ("--input", "a.txt", "--output", "r.json") if command == "score" else ()
    by_flag = _parse(command, *extra, "-m", "m.ninfer")
    common.merge_model_flag(by_flag)
    by_position = _parse(command, *extra, "m.ninfer")
    common.merge_model_flag(by_position)
    assert by_flag.model == by_position.model == "m.ninfer"


def test_model_named_twice_is_an_error(capsys, monkeypatch):
    monkeypatch.setattr("ninfer.model_source.resolve_model", _no_model)
    assert main(["generate", "a.ninfer", "-m", "b.ninfer", "-p", "x"]) == 2
    err = capsys.readouterr().err
    assert "ninfer generate: error: the model is named twice" in err and "a.ninfer" in err and "b.ninfer" in err


# --- the prompt ------------------------------------------------------------------------------------------------

def test_prompt_text_sources():
    assert generate_cmd.prompt_text(_parse("generate", "-p", "a\\nb"), _Stdin("unused", tty=False)) == "a\\nb"
    assert generate_cmd.prompt_text(_parse("generate", "--prompt", "-"), _Stdin("from\nstdin\n", tty=True)) \
        == "from\nstdin\n"
    assert generate_cmd.prompt_text(_parse("generate"), _Stdin("piped", tty=False)) == "piped"
    assert generate_cmd.prompt_text(_parse("generate", "--messages", "m.json"), _Stdin("x", tty=False)) is None


@pytest.mark.parametrize("argv, stdin, message", [
    ((), _Stdin("", tty=True), "no prompt: give --prompt TEXT"),
    ((), _Stdin("", tty=False), "the prompt read from stdin is empty"),
    (("--prompt", "-"), _Stdin("", tty=False), "the prompt read from stdin is empty"),
])
def test_missing_prompt_is_an_error(argv, stdin, message):
    with pytest.raises(NInferError, match=message):
        generate_cmd.prompt_text(_parse("generate", *argv), stdin)


def test_piped_prompt_equals_the_prompt_flag(run_cli):
    flags = ("-t", "0", "-n", "6", "--quiet")
    given = run_cli("generate", "-p", "def add(a, b):", *flags)
    piped = run_cli("generate", *flags, stdin="def add(a, b):")
    dash = run_cli("generate", "--prompt", "-", *flags, stdin="def add(a, b):")
    assert given.returncode == piped.returncode == dash.returncode == 0, (given.stderr, piped.stderr, dash.stderr)
    assert given.stdout.strip()
    assert piped.stdout == dash.stdout == given.stdout


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_reader_that_stops_early_ends_the_command_quietly(cli_env, command):
    """``ninfer generate ... | head -c 20``: once the pipe's reader is gone the command stops, with no traceback,
    and exits 141 as a shell reports a process ended by SIGPIPE."""
    args = [sys.executable, "-m", "ninfer.cli.main", command, "-n", "300", "--ignore-eos", "-t", "0"]
    args += ["-p", "def f():"] if command == "generate" else ["--no-thinking"]
    proc = subprocess.Popen(args, env=cli_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(b"hello\n" if command == "chat" else b"")
    proc.stdin.close()
    got = b""
    while len(got) < 20:
        chunk = proc.stdout.read1(64)
        if not chunk:
            break
        got += chunk
    proc.stdout.close()   # the reader goes away with most of the answer unread
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=240) == 141 and len(got) >= 20, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_closed_standard_output_is_not_a_crash(cli_env):
    """Started with standard output closed (">&-"): the answer goes nowhere, and the command still ends cleanly."""
    script = ("import os, sys; os.close(1); sys.stdout = None; from ninfer.cli.main import main; "
              "sys.exit(main(['generate', '-p', 'def f():', '-n', '4', '-t', '0', '--quiet']))")
    run = subprocess.run([sys.executable, "-c", script], env=cli_env, capture_output=False, stderr=subprocess.PIPE,
                         text=True, timeout=240)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr


# --- values checked before the model is resolved or loaded ------------------------------------------------------

def _no_model(*args, **kwargs):
    raise AssertionError("the model was resolved before the flags were checked")


BAD_VALUES = [("-t", "-1", "--temperature"), ("--temperature", "nan", "--temperature"), ("--top-p", "0", "--top-p"),
              ("--top-p", "1.5", "--top-p"), ("--top-k", "-1", "--top-k"), ("--min-p", "2", "--min-p"),
              ("--repetition-penalty", "0", "--repetition-penalty"), ("--presence-penalty", "3", "--presence-penalty"),
              ("--frequency-penalty", "-3", "--frequency-penalty"), ("--seed", "-1", "--seed"),
              ("-n", "0", "--max-tokens"), ("--max-concurrency", "9", "--max-concurrency"),
              ("--max-context", "1", "--max-context"), ("--prefill-chunk-size", "0", "--prefill-chunk-size"),
              ("--max-step-tokens", "0", "--max-step-tokens"), ("--num-pages", "0", "--num-pages"),
              ("--num-speculative-tokens", "0", "--num-speculative-tokens"),
              ("--speculative", "no-such-backend", "--speculative")]


@pytest.mark.parametrize("command", ("generate", "chat"))
@pytest.mark.parametrize("flag, value, named", BAD_VALUES)
def test_bad_value_fails_before_the_model(command, flag, value, named, capsys, monkeypatch):
    monkeypatch.setattr("ninfer.model_source.resolve_model", _no_model)
    extra = ("-p", "x") if command == "generate" else ()
    assert main([command, *extra, flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ninfer {command}: error: {named} ") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, named", [
    (("score", "--input", "a.txt", "--output", "r.json", "--top-logprobs", "-1"), "--top-logprobs"),
    (("score", "--input", "a.txt", "--output", "r.json", "--prefill-chunk-size", "0"), "--prefill-chunk-size"),
    (("info", "--memory", "--num-pages", "0"), "--num-pages"),
    (("info", "--memory", "--kv-budget-mib", "-1"), "--kv-budget-mib"),
    (("bench", "--max-concurrency", "0"), "--max-concurrency"),
])
def test_other_commands_check_before_the_model(argv, named, capsys, monkeypatch):
    monkeypatch.setattr("ninfer.model_source.resolve_model", _no_model)
    assert main(list(argv)) == 2
    assert f"error: {named} " in capsys.readouterr().err


# --- --max-tokens against the context ---------------------------------------------------------------------------

@pytest.fixture
def default_cache_env(default_model_cache, monkeypatch):
    monkeypatch.setenv("NINFER_CACHE_DIR", str(default_model_cache))


def test_max_tokens_above_the_context_is_an_error(default_cache_env, capsys):
    assert main(["generate", "-p", "hello", "--max-context", "32", "-n", "40", "--quiet", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    match = re.search(r"--max-tokens is too large: 40\. This model's maximum context length is 32 tokens and the "
                      r"prompt has (\d+) tokens \(40 > 32 - \1\)", err)
    assert match, err


def test_default_max_tokens_is_lowered_to_the_room(default_cache_env, capsys):
    assert main(["generate", "-p", "hello world", "--max-context", "16", "--ignore-eos", "--device", "cpu"]) == 0
    stats = re.search(r"(\d+) prompt \+ (\d+) generated tokens", capsys.readouterr().err)
    assert stats and int(stats[1]) + int(stats[2]) == 16  # the default 128 did not fit: it took the 16 - prompt


def test_chat_refuses_a_max_tokens_no_turn_fits(default_cache_env, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _Stdin("hi\n", tty=False))
    assert main(["chat", "--max-context", "32", "-n", "32", "--quiet", "--device", "cpu"]) == 2
    assert "--max-tokens is too large: 32. This model's maximum context length is 32 tokens" in capsys.readouterr().err


def test_chat_turn_that_does_not_fit_is_dropped(default_cache_env, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _Stdin("tell me everything about python\n/exit\n", tty=False))
    assert main(["chat", "--max-context", "32", "-n", "30", "--quiet", "--device", "cpu"]) == 0
    assert "[ninfer] error: --max-tokens is too large: 30." in capsys.readouterr().err


# --- --help ---------------------------------------------------------------------------------------------------

def _helps() -> dict[str, str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"ninfer": parser.format_help(), **{n: p.format_help() for n, p in sub.choices.items()
                                                if n in get_registry().cli_commands}}


def test_help_has_no_rst_markup():
    for name, text in _helps().items():
        for markup in ("``", ":mod:", ":class:", ":func:", ":data:", ":meth:"):
            assert markup not in text, f"{name} --help shows {markup!r}"


def test_help_shows_defaults():
    helps = _helps()
    flat = {name: " ".join(text.split()) for name, text in helps.items()}
    assert "(default: auto)" in flat["generate"]  # --lookahead
    assert "default 128" in flat["generate"] and "default 512" in flat["chat"]  # --max-tokens
    assert "(default: 1,2,4,8)" in flat["bench"] and "(default: 64)" in flat["bench"]
    assert "(default: 0)" in flat["score"]  # --top-logprobs
    for name, text in flat.items():
        assert "default: None" not in text and "default: False" not in text, name


# --- the first run ---------------------------------------------------------------------------------------------

def test_first_run_says_it_converts_the_default_model(tmp_path):
    env = dict(os.environ, NINFER_CACHE_DIR=str(tmp_path))
    env.pop("NINFER_PLUGINS", None)

    def info():
        return subprocess.run([sys.executable, "-m", "ninfer.cli.main", "info", "--json"], env=env,
                              capture_output=True, text=True, timeout=240)

    first = info()
    assert first.returncode == 0, first.stderr
    line = re.search(r"converting the default model (\S+) \(once\) into (\S+\.ninfer)", first.stderr)
    assert line, first.stderr
    assert line[2].startswith(str(tmp_path)) and os.path.isfile(line[2])
    second = info()
    assert second.returncode == 0 and "converting" not in second.stderr


def test_quiet_conversion_says_nothing(tmp_path, monkeypatch, capsys):
    from ninfer.model_source import resolve_model

    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    assert resolve_model(None, quiet=True).is_file()
    assert "converting" not in capsys.readouterr().err


def test_show_thinking_is_one_flag_shared_by_the_chat_commands():
    """generate and chat declare --show-thinking through common.add_show_thinking_arg: same help, same parse."""
    reference = argparse.ArgumentParser()
    common.add_show_thinking_arg(reference)
    want = next(a for a in reference._actions if a.dest == "show_thinking")
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("generate", "chat"):
        action = next(a for a in subparsers.choices[command]._actions if a.dest == "show_thinking")
        assert (action.option_strings, action.help, action.default) == (want.option_strings, want.help, False)
        assert _parse(command, "--show-thinking").show_thinking is True
        assert _parse(command).show_thinking is False


def test_a_prompt_that_is_not_utf8_is_named_before_loading(cli_env):
    """Bytes that are not UTF-8, on stdin or in --prompt: one line naming the byte and its offset, before the
    model loads (they reached the tokenizer as 'a lone UTF-16 surrogate at character N')."""
    base = [sys.executable, "-m", "ninfer.cli.main", "generate", "-n", "2"]
    piped = subprocess.run(base, input=b"abc\xff\xfe def", env=cli_env, capture_output=True, timeout=240)
    flag = subprocess.run([*base, "-p", os.fsdecode(b"ab\xffcd")], env=cli_env, capture_output=True, timeout=240)
    for run, what, at in ((piped, "the prompt read from stdin", 3), (flag, "--prompt", 2)):
        err = run.stderr.decode()
        assert run.returncode == 2 and f"{what} is not valid UTF-8: byte 0xFF at byte {at}" in err, err
        assert "loaded" not in err


def test_chat_names_a_message_or_system_text_that_is_not_utf8(cli_env):
    """In chat a line that is not UTF-8 is refused naming its byte, and the chat goes on (a bad /system message was
    set and then failed every turn)."""
    args = [sys.executable, "-m", "ninfer.cli.main", "chat", "-n", "2", "-t", "0", "--no-thinking"]
    run = subprocess.run(args, input=b"/system ab\xffc\nhi \xfe\nhello\n", env=cli_env, capture_output=True,
                         timeout=240)
    err = run.stderr.decode()
    assert run.returncode == 0, err
    assert "the system message is not valid UTF-8: byte 0xFF at byte 2" in err
    assert "the message is not valid UTF-8: byte 0xFE at byte 3" in err
    assert "system message set" not in err and run.stdout.strip(), err   # "hello" is answered
