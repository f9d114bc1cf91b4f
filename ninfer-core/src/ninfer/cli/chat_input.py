"""Where ``ninfer chat`` reads user messages from: a line editor on a terminal, plain lines from a pipe.

On a terminal (stdin and stderr both terminals) :class:`TerminalLines` uses prompt_toolkit: line editing, a
history kept in ``chat_history`` under the cache folder (:func:`ninfer.model_source.cache_dir`),
bracketed paste (a pasted block with newlines is one message, sent by Enter), Ctrl-C clearing the line and
Ctrl-D on an empty line leaving. The prompt goes to stderr, so ``ninfer chat > log.txt`` logs only answers.

:func:`read_message` adds the explicit multi-line mode on top of either source: a line starting with
``\"\"\"`` opens a message that goes on until a line ending with ``\"\"\"`` (as ollama's).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Protocol, TextIO

PROMPT = ">>> "
CONTINUATION = "... "
FENCE = '"""'


class LineSource(Protocol):
    """Lines typed or piped by the user.

    ``read(continuation)`` returns one entry without its final newline (a pasted block may hold newlines),
    ``None`` at the end of input; Ctrl-C while it waits raises KeyboardInterrupt, after which the source
    is ready for the next call. ``continuation`` is True inside a multi-line message (a different prompt).
    """

    def read(self, continuation: bool = False) -> str | None: ...


class PipedLines:
    """Lines from a non-interactive stream (no prompt unless ``prompt_to`` is given, no editing)."""

    def __init__(self, stream: TextIO, prompt_to: TextIO | None = None) -> None:
        self._stream = stream
        self._prompt_to = prompt_to

    def read(self, continuation: bool = False) -> str | None:
        if self._prompt_to is not None:
            self._prompt_to.write(CONTINUATION if continuation else PROMPT)
            self._prompt_to.flush()
        line = self._stream.readline()
        if not line:
            return None
        line = line[:-1] if line.endswith("\n") else line
        return line[:-1] if line.endswith("\r") else line   # a CRLF file's lines end as an LF file's do


class TerminalLines:
    """A prompt_toolkit line editor with a persistent history; bracketed paste is prompt_toolkit's own (a
    paste is inserted into the line, newlines included, and only Enter sends it)."""

    def __init__(self, history_path: Path) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.output import create_output

        # A cache folder the chat cannot write costs the history, not the chat (FileHistory writes each entry
        # as it is sent, so this is checked before the first prompt).
        try:
            history_path.parent.mkdir(parents=True, exist_ok=True)
            history_path.touch(exist_ok=True)
            history = FileHistory(str(history_path))
        except OSError:
            history = InMemoryHistory()
        self._session = PromptSession(history=history, output=create_output(stdout=sys.stderr))

    def read(self, continuation: bool = False) -> str | None:
        # The default colour, named: prompt_toolkit draws the trailing space of an unstyled prompt as a cursor
        # move, and scripts driving a terminal (and tests) wait for ">>> " as a plain prompt prints it.
        prompt = [("fg:ansidefault", CONTINUATION if continuation else PROMPT)]
        try:
            return self._session.prompt(prompt)
        except EOFError:
            return None


def history_path() -> Path:
    from ninfer.model_source import cache_dir

    return cache_dir() / "chat_history"


def open_source(stdin: TextIO, stderr: TextIO) -> LineSource:
    """TerminalLines when both stdin and stderr are terminals, PipedLines otherwise (with the ``>>>`` prompt
    on stderr when stdin alone is a terminal)."""
    if stdin.isatty() and stderr.isatty():
        return TerminalLines(history_path())
    return PipedLines(stdin, prompt_to=stderr if stdin.isatty() else None)


def read_message(source: LineSource) -> str | None:
    """The next user message: one entry, or a multi-line block between ``\"\"\"`` fences (the text between
    them, fences removed). ``None`` at the end of input; an unterminated block at the end of input is sent
    as it is. Ctrl-C inside a block abandons the block (KeyboardInterrupt propagates)."""
    first = source.read()
    if first is None or not first.lstrip().startswith(FENCE):
        return first
    body = first.lstrip()[len(FENCE):]
    if body.rstrip().endswith(FENCE) and body.strip() != "":
        return body.rstrip()[:-len(FENCE)]  # """one line""" is a one-line block
    lines = [body] if body else []
    while True:
        line = source.read(continuation=True)
        if line is None:
            return "\n".join(lines)
        if line.rstrip().endswith(FENCE):
            tail = line.rstrip()[:-len(FENCE)]
            if tail:
                lines.append(tail)
            return "\n".join(lines)
        lines.append(line)
