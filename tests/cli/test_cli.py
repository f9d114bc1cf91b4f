"""The ``ninfer`` command as a user runs it: help, generate, chat (piped and through a pseudo-terminal)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from tests.cli.conftest import PLAIN_ARGS
from tests.cli.pty_reader import PtyReader

SUBCOMMANDS = ("generate", "chat", "serve", "score", "bench", "info", "plugins", "list", "rm")


def test_help_lists_every_subcommand(run_cli):
    out = run_cli("--help")
    assert out.returncode == 0
    for name in SUBCOMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_each_subcommand_has_help(run_cli, command):
    out = run_cli(command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: ninfer {command}")


@pytest.mark.parametrize("command", ("generate", "chat"))
def test_model_commands_share_engine_and_sampling_flags(run_cli, command):
    text = run_cli(command, "--help").stdout
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--seed", "--stop",
                 "--no-thinking", "--max-concurrency", "--max-context", "--device", "--dtype"):
        assert flag in text, f"{command} lacks {flag}"


def test_generate_default_model_greedy_is_deterministic(run_cli):
    args = ("generate", "--prompt", "def fibonacci(n):", "--temperature", "0", "--max-tokens", "24")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip(), "generate printed no continuation"
    assert first.stdout == second.stdout
    # statistics go to stderr, never into the content on stdout
    assert "generated tokens" in first.stderr and "generated tokens" not in first.stdout


def test_generate_speculative_mtp_prints_the_plain_output(run_cli, plain_generate):
    plain = plain_generate
    spec = run_cli(*PLAIN_ARGS, "--speculative", "mtp")
    spec2 = run_cli(*PLAIN_ARGS, "--speculative", "mtp", "--num-speculative-tokens", "2")
    for run in (plain, spec, spec2):
        assert run.returncode == 0, run.stderr
    assert len(plain.stdout) > 8 and spec.stdout == plain.stdout and spec2.stdout == plain.stdout


def test_generate_stop_string_is_not_printed(run_cli, plain_generate):
    text = plain_generate.stdout.rstrip("\n")
    assert len(text) > 4
    stop = text[2:4]  # a string the greedy output is known to contain
    cut = run_cli(*PLAIN_ARGS, "--stop", stop)
    assert cut.returncode == 0, cut.stderr
    assert cut.stdout.rstrip("\n") == text[: text.index(stop)]


def test_generate_messages_file(run_cli, tmp_path):
    path = tmp_path / "messages.json"
    path.write_text(json.dumps([{"role": "system", "content": "Answer briefly."},
                                {"role": "user", "content": "What does `os.path.join` do?"}]))
    out = run_cli("generate", "--messages", str(path), "--temperature", "0", "--max-tokens", "48",
                  "--no-thinking")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "<|im_end|>" not in out.stdout


@pytest.mark.parametrize("content, why", [("{not json", "cannot read messages"),
                                          ('{"role": "user"}', "JSON list of messages")])
def test_generate_bad_messages_file_is_a_clear_error(run_cli, tmp_path, content, why):
    path = tmp_path / "bad.json"
    path.write_text(content)
    out = run_cli("generate", "--messages", str(path), "--max-tokens", "4")
    assert out.returncode == 2
    assert why in out.stderr and str(path) in out.stderr
    assert "Traceback" not in out.stderr


def test_generate_missing_model_is_a_clear_error(run_cli, tmp_path):
    out = run_cli("generate", str(tmp_path / "nope.ninfer"), "--prompt", "x")
    assert out.returncode == 2
    assert "nope.ninfer" in out.stderr and "Traceback" not in out.stderr


def test_generate_invalid_sampling_is_a_clear_error(run_cli):
    out = run_cli("generate", "--prompt", "x", "--top-p", "1.5")
    assert out.returncode == 2
    assert "top_p" in out.stderr and "Traceback" not in out.stderr


def test_chat_piped_stdin_multi_turn_reset_exit(run_cli):
    script = "What does `len` do?\n/reset\nWhat is `os.sep`?\n/exit\nnever read\n"
    out = run_cli("chat", "--temperature", "0", "--max-tokens", "32", "--no-thinking", stdin=script)
    assert out.returncode == 0, out.stderr
    assert "conversation reset" in out.stderr
    answers = [a for a in out.stdout.split("\n") if a.strip()]
    assert len(answers) >= 2


def test_chat_unknown_command_is_reported(run_cli):
    out = run_cli("chat", "--max-tokens", "4", stdin="/frobnicate\n/exit\n")
    assert out.returncode == 0
    assert "unknown command '/frobnicate'" in out.stderr


def test_chat_through_a_pseudo_terminal(cli_env):
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli.main", "chat", "--temperature", "0",
                             "--max-tokens", "16", "--no-thinking"],
                            stdin=slave, stdout=slave, stderr=slave, env=cli_env, close_fds=True)
    os.close(slave)
    terminal = PtyReader(master)
    try:
        seen = terminal.read_until(b">>> ", 240)
        assert b"/reset" in seen  # the interactive help line
        os.write(master, b"What does `len` do?\n")
        terminal.read_until(b">>> ", 240)
        os.write(master, b"/exit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


@pytest.mark.parametrize("device, why", [("bogus", "expected cpu, cuda or cuda:N"), ("cuda:-1", "expected cpu"),
                                         ("meta", "expected cpu, cuda or cuda:N")])
def test_a_bad_device_is_a_clear_error(run_cli, device, why):
    out = run_cli("generate", "--prompt", "x", "--device", device)
    assert out.returncode == 2 and f"device={device!r}" in out.stderr and why in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="the no-GPU error can only be provoked on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(run_cli):
    for cmd in (("generate", "--prompt", "x"), ("bench", "--no-prefill")):
        out = run_cli(*cmd, "--device", "cuda")
        assert out.returncode == 2 and "no CUDA device is available" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_json_nested_too_deeply_is_a_clear_error(run_cli, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000)
    jsonl = tmp_path / "deep.jsonl"
    jsonl.write_text("[" * 100000 + "\n")
    for cmd, why in ((("generate", "--messages", str(deep)), "nested too deeply"),
                     (("generate", "--prompt", "x", "--json-schema", str(deep)), "nested too deeply"),
                     (("score", "--input", str(jsonl), "--output", str(tmp_path / "o.json")), "nested too deeply")):
        out = run_cli(*cmd)
        assert out.returncode == 2 and why in out.stderr, (cmd, out.stderr)
        assert "Traceback" not in out.stderr


def test_info_on_a_directory_or_a_fifo_is_a_clear_error(run_cli, tmp_path):
    import os

    fifo = tmp_path / "pipe.ninfer"
    os.mkfifo(fifo)
    for path, what in ((tmp_path, "is a folder without config.json: not a Hugging Face checkpoint"),
                       (fifo, "no such artifact file (not a regular file)")):
        out = run_cli("info", str(path), timeout=60)
        assert out.returncode == 2 and what in out.stderr, out.stderr


def test_bench_bad_limits_and_output_fail_before_running(run_cli, tmp_path):
    for args, why in ((("--matmul-size", "-1"), "--matmul-size must be >= 1"),
                      (("--copy-mib", "0"), "--copy-mib must be >= 1"),
                      (("--output", str(tmp_path)), "cannot write a file there")):
        out = run_cli("bench", "--device", "cpu", *args)
        assert out.returncode == 2 and why in out.stderr, out.stderr
        assert "measuring copy bandwidth" not in out.stderr


def test_chat_goes_on_after_a_turn_that_cannot_run(run_cli):
    """A message too long for the context is that turn's error, not the session's end; /reset with arguments is
    named as such."""
    script = "hello\n/reset now\n" + "word " * 200 + "\nWhat is `os.sep`?\n/exit\n"
    out = run_cli("chat", "--max-context", "64", "--max-tokens", "4", "--temperature", "0", "--no-thinking",
                  stdin=script)
    assert out.returncode == 0, out.stderr
    assert "/reset takes no arguments" in out.stderr
    assert "[ninfer] error: the prompt has" in out.stderr
    assert len([a for a in out.stdout.split("\n") if a.strip()]) >= 2   # the turns before and after
