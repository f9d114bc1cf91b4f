"""Issue 29 item 4: the chat prompt: commands, multi-line messages, and the line editor on a terminal
(Ctrl-C clears the line, bracketed paste is one message, history is kept, Ctrl-D leaves)."""

from __future__ import annotations

import io
import json
import os
import pty
import subprocess
import sys

import pytest
from ninfer.cli.chat_input import PipedLines, read_message

from tests.cli.pty_reader import PtyReader

CHAT = ("chat", "-t", "0", "-n", "8", "--no-thinking")


@pytest.mark.parametrize("script, expected", [
    ('"""\nfirst\n\nsecond\n"""\n', ["first\n\nsecond"]),
    ('"""first\nsecond"""\nnext\n', ["first\nsecond", "next"]),
    ('"""one line"""\n', ["one line"]),
    ('"""\nnever closed\n', ["never closed"]),
    ('plain\n/help\n', ["plain", "/help"]),
    ('plain\r\n/exit\r\n"""\r\na\r\nb\r\n"""\r\n', ["plain", "/exit", "a\nb"]),   # a CRLF file
])
def test_multi_line_blocks_are_one_message(script, expected):
    source = PipedLines(io.StringIO(script))
    got = []
    while (message := read_message(source)) is not None:
        got.append(message)
    assert got == expected


def test_piped_commands_and_a_multi_line_turn(run_cli, tmp_path):
    saved, after_reset = tmp_path / "chat.json", tmp_path / "reset.json"
    script = ("/system Answer briefly.\n"
              '"""\nWhat does `len` do?\nAnd `os.sep`?\n"""\n'
              f"/save {saved}\n"
              "/reset\n"
              f"/save {after_reset}\n"
              "/system\n/help\n/save\n/bye\nnever read\n")
    out = run_cli(*CHAT, stdin=script)
    assert out.returncode == 0, out.stderr
    messages = json.loads(saved.read_text())
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[0]["content"] == "Answer briefly."
    assert messages[1]["content"] == "What does `len` do?\nAnd `os.sep`?"
    assert messages[2]["content"].strip()
    # /reset keeps the system message /system set; `ninfer generate --messages` reads what /save wrote.
    assert json.loads(after_reset.read_text()) == [{"role": "system", "content": "Answer briefly."}]
    assert "system message: 'Answer briefly.'" in out.stderr
    assert "/save FILE (write the conversation" in out.stderr  # /help
    assert "/save needs a file name" in out.stderr
    assert "never read" not in out.stdout
    assert len([line for line in out.stdout.split("\n") if line.strip()]) >= 1


@pytest.fixture
def private_cache(tmp_path, default_model_cache):
    """A cache folder of its own (for the history file) that shares the converted default model."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "artifacts").symlink_to(default_model_cache / "artifacts", target_is_directory=True)
    return cache


def test_terminal_prompt_ctrl_c_paste_history_ctrl_d(cli_env, private_cache, tmp_path):
    saved_empty, saved = tmp_path / "empty.json", tmp_path / "chat.json"
    # A terminal that does not answer cursor-position requests: prompt_toolkit must not wait for one.
    env = dict(cli_env, NINFER_CACHE_DIR=str(private_cache), TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1")
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli.main", *CHAT], stdin=slave, stdout=slave,
                            stderr=slave, env=env, close_fds=True)
    os.close(slave)
    terminal = PtyReader(master)
    try:
        terminal.read_until(b">>> ", 240)
        os.write(master, b"half typed\x03")  # Ctrl-C at the prompt: the line goes, the chat stays
        terminal.read_until(b">>> ", 60)
        os.write(master, f"/save {saved_empty}\r".encode())
        terminal.read_until(b"saved 0 messages", 60)
        terminal.read_until(b">>> ", 60)
        # A bracketed paste holding a newline is one message, sent by Enter.
        os.write(master, b"\x1b[200~What does `len` do?\nAnd `os.sep`?\x1b[201~")
        os.write(master, b"\r")
        terminal.read_until(b"\x1b[?2004l", 240)
        terminal.read_until(b">>> ", 240)  # the prompt closed, the answer came, a new prompt
        os.write(master, f"/save {saved}\r".encode())
        terminal.read_until(b"saved 2 messages", 60)
        terminal.read_until(b">>> ", 60)
        os.write(master, b"\x04")  # Ctrl-D on an empty line leaves
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert json.loads(saved_empty.read_text()) == []
    messages = json.loads(saved.read_text())
    assert messages[0] == {"role": "user", "content": "What does `len` do?\nAnd `os.sep`?"}
    assert messages[1]["role"] == "assistant"
    history = (private_cache / "chat_history").read_text()
    assert "+What does `len` do?\n+And `os.sep`?" in history and f"+/save {saved}" in history
    assert "half typed" not in history
