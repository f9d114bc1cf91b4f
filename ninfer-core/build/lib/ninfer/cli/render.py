"""How ``ninfer generate`` and ``ninfer chat`` show one streamed answer: reasoning set apart from the answer.

Where each channel goes (:class:`TurnDisplay`):

- stdout is a terminal: reasoning goes to stdout, dimmed, between ``Thinking...`` and ``...done thinking.``
  (as ollama shows it), then the answer;
- stdout is redirected: only the answer goes to stdout. Reasoning goes to stderr between the same markers
  (dimmed only when stderr is a terminal), or, with ``--show-thinking``, to stdout between ``<think>`` and
  ``</think>`` lines before the answer, so a file keeps it in the form the model wrote it.

:meth:`TurnDisplay.finish` leaves both streams at the start of a line, so the statistics line (stderr) always
starts on its own line, and says so on stderr when the token budget ended inside the reasoning.
"""

from __future__ import annotations

from typing import TextIO

DIM = "\x1b[2m"
RESET = "\x1b[0m"
THINKING_OPEN = "Thinking..."
THINKING_CLOSE = "...done thinking."
TAG_OPEN = "<think>"
TAG_CLOSE = "</think>"


class _Stream:
    """A text stream that remembers whether its last character ended a line."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.at_line_start = True
        self.written = False

    def write(self, text: str) -> None:
        if not text:
            return
        self.stream.write(text)
        self.stream.flush()
        self.written = True
        stripped = text.replace(DIM, "").replace(RESET, "")
        if stripped:
            self.at_line_start = stripped.endswith("\n")

    def end_line(self) -> None:
        if not self.at_line_start:
            self.write("\n")


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class TurnDisplay:
    """Shows the deltas of one answer; make one per answer (a chat turn), call :meth:`show` with each
    GenerationDelta's deltas and :meth:`finish` once, also after a cancel or an error.

    Invariants: stdout receives answer text only, except on a terminal or with ``show_thinking``; a dimmed
    block is always closed (reset) before any other text or by :meth:`finish`; after :meth:`finish` both
    streams are at the start of a line.
    """

    def __init__(self, out: TextIO, err: TextIO, *, show_thinking: bool = False) -> None:
        self._out = _Stream(out)
        self._err = _Stream(err) if err is not out else self._out
        if _isatty(out):
            self._think, self._dim, self._tags = self._out, True, False
        elif show_thinking:
            self._think, self._dim, self._tags = self._out, False, True
        else:
            self._think, self._dim, self._tags = self._err, _isatty(err), False
        self._in_reasoning = False
        self.last_channel: str | None = None

    def show(self, deltas) -> None:
        for d in deltas:
            if not d.text:
                continue
            self.last_channel = d.channel
            if d.channel == "reasoning":
                if not self._in_reasoning:
                    self._open_reasoning()
                self._think.write(d.text)
            else:
                if self._in_reasoning:
                    self._close_reasoning()
                self._out.write(d.text)

    def _open_reasoning(self) -> None:
        self._in_reasoning = True
        self._err.end_line()  # e.g. after the loading line or a cancelled turn
        self._out.end_line()
        if self._tags:
            self._think.write(TAG_OPEN + "\n")
        else:
            self._think.write((DIM if self._dim else "") + THINKING_OPEN + "\n")

    def _close_reasoning(self) -> None:
        self._in_reasoning = False
        self._think.end_line()
        if self._tags:
            self._think.write(TAG_CLOSE + "\n\n")
        else:
            self._think.write(THINKING_CLOSE + (RESET if self._dim else "") + "\n\n")

    def finish(self, finish_reason: str | None = None, *, max_tokens: int | None = None) -> None:
        """End the turn: close an open reasoning block, end both streams' lines and, when ``finish_reason`` is
        ``"length"`` while the last text was reasoning, tell the user on stderr that there is no answer."""
        cut_in_reasoning = finish_reason == "length" and self._in_reasoning
        if self._in_reasoning:
            self._close_reasoning()
        self._out.end_line()
        if not self._out.written:
            self._out.write("\n")  # an empty answer is still one line, as a redirected file expects
        self._err.end_line()
        if cut_in_reasoning:
            budget = f"--max-tokens {max_tokens}" if max_tokens is not None else "--max-tokens"
            self._err.write(f"[ninfer] the token budget ({budget}) ended inside the reasoning, so there is no "
                            "answer: raise -n/--max-tokens, or pass --no-thinking\n")


def stream_turn(handle, display: TurnDisplay, *, max_tokens: int | None = None):
    """Show one request's events through ``display``: returns ``(result, error)``, its GenerationResult or the
    error its stream ended with (the caller decides whether that ends the command). The display is finished
    in every case, also when Ctrl-C interrupts the loop (KeyboardInterrupt propagates)."""
    from ninfer.contracts.events import GenerationDelta, GenerationError, GenerationResult

    result = error = None
    try:
        for event in handle:
            if isinstance(event, GenerationDelta):
                display.show(event.deltas)
            elif isinstance(event, GenerationResult):
                result = event  # its flushed text already came as the last delta
            elif isinstance(event, GenerationError):
                error = event.error
    finally:  # no dimmed terminal and no message glued to a partial line, whatever ended the turn
        display.finish(result.finish_reason if result is not None else None, max_tokens=max_tokens)
    return result, error

