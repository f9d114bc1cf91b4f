"""Issue 29 item 2: reasoning is set apart from the answer, on a terminal and with stdout redirected.

The embedded default model, greedy, reasons for a few dozen tokens before it answers a --chat prompt, so
``-n 40`` shows both channels and ``-n 4`` ends the token budget inside the reasoning.
"""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys

from ninfer.cli.render import DIM, RESET, THINKING_CLOSE, THINKING_OPEN, TurnDisplay
from ninfer.contracts.frontend import OutputDelta

from tests.cli.pty_reader import PtyReader

ARGS = ("generate", "--chat", "-p", "What is 2+2?", "-t", "0")


def _stats_lines_start_lines(text: str) -> None:
    for m in re.finditer(r"\[ninfer\] ", text):
        assert m.start() == 0 or text[m.start() - 1] == "\n", text


def test_redirected_stdout_gets_only_the_answer(run_cli):
    plain = run_cli(*ARGS, "-n", "40")
    assert plain.returncode == 0, plain.stderr
    assert THINKING_OPEN not in plain.stdout and "<think>" not in plain.stdout
    err = plain.stderr
    assert f"{THINKING_OPEN}\n" in err and f"\n{THINKING_CLOSE}\n" in err
    assert DIM not in err  # stderr is a pipe: markers, no escape codes
    reasoning = err.split(f"{THINKING_OPEN}\n", 1)[1].split(f"\n{THINKING_CLOSE}", 1)[0]
    assert reasoning.strip() and reasoning not in plain.stdout
    assert plain.stdout.strip()
    _stats_lines_start_lines(err)
    assert re.search(r"^\[ninfer\] \d+ prompt \+ 40 generated tokens, finish=length", err, re.M)

    shown = run_cli(*ARGS, "-n", "40", "--show-thinking")
    assert shown.returncode == 0, shown.stderr
    # The same greedy run: the reasoning between <think> lines, then exactly the answer of the plain run.
    assert shown.stdout == f"<think>\n{reasoning}\n</think>\n\n{plain.stdout}"
    assert THINKING_OPEN not in shown.stderr
    _stats_lines_start_lines(shown.stderr)


def test_a_budget_ending_inside_the_reasoning_is_explained(run_cli):
    cut = run_cli(*ARGS, "-n", "4")
    assert cut.returncode == 0, cut.stderr
    assert cut.stdout.strip() == ""
    assert "[ninfer] the token budget (--max-tokens 4) ended inside the reasoning" in cut.stderr
    assert "--no-thinking" in cut.stderr
    _stats_lines_start_lines(cut.stderr)

    direct = run_cli(*ARGS, "-n", "4", "--no-thinking")
    assert direct.returncode == 0, direct.stderr
    assert direct.stdout.strip() and "ended inside the reasoning" not in direct.stderr


def test_on_a_terminal_reasoning_is_dimmed_between_markers(cli_env):
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli.main", *ARGS, "-n", "40"],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=cli_env, close_fds=True)
    os.close(slave)
    try:
        terminal = PtyReader(master)
        seen = terminal.read_until(b"generated tokens", 240)
        seen += terminal.read_until(b"\n", 60)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = seen.decode("utf-8", "replace").replace("\r\n", "\n")
    start = text.index(f"{DIM}{THINKING_OPEN}\n")
    end = text.index(f"\n{THINKING_CLOSE}{RESET}\n\n", start)
    answer = text[end:].split("[ninfer] ", 1)[0]
    assert answer.strip() and DIM not in answer
    stats = text.index("[ninfer] 17 prompt")
    assert text[stats - 1] == "\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _deltas(*pairs: tuple[str, str]) -> tuple[OutputDelta, ...]:
    return tuple(OutputDelta(channel=c, text=t) for c, t in pairs)


def test_display_on_one_terminal_closes_the_dimmed_block_when_cut():
    term = _Terminal()
    d = TurnDisplay(term, term)
    d.show(_deltas(("reasoning", "let me"), ("reasoning", " think")))
    d.finish("length", max_tokens=7)
    out = term.getvalue()
    assert out.startswith(f"{DIM}{THINKING_OPEN}\nlet me think\n{THINKING_CLOSE}{RESET}\n")
    assert out.endswith("(--max-tokens 7) ended inside the reasoning, so there is no answer: raise "
                        "-n/--max-tokens, or pass --no-thinking\n")


def test_display_redirected_answer_ends_its_line_once():
    out, err = io.StringIO(), io.StringIO()
    d = TurnDisplay(out, err)
    d.show(_deltas(("reasoning", "hmm"), ("content", "four"), ("content", "\n")))
    d.finish("stop", max_tokens=9)
    d.finish("stop", max_tokens=9)  # a second finish (an error, then the end of the stream) adds nothing
    assert out.getvalue() == "four\n"
    assert err.getvalue() == f"{THINKING_OPEN}\nhmm\n{THINKING_CLOSE}\n\n"


def test_display_an_empty_answer_is_one_empty_line_and_stop_is_not_a_cut():
    out, err = io.StringIO(), io.StringIO()
    d = TurnDisplay(out, err, show_thinking=True)
    d.show(_deltas(("reasoning", "x")))
    d.finish("stop")
    assert out.getvalue() == "<think>\nx\n</think>\n\n"
    assert err.getvalue() == ""
    empty_out = io.StringIO()
    TurnDisplay(empty_out, io.StringIO()).finish("length", max_tokens=3)
    assert empty_out.getvalue() == "\n"
