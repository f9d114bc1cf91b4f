"""Splitting model output into the ``reasoning`` and ``content`` channels at ``<think>...</think>``.

Qwen3.5 opens ``<think>`` in the generation prompt (the output then starts as reasoning: the prompt is
``thinking_open``), or the model may emit ``<think>`` itself as the first non-whitespace output.
Reasoning ends at the first ``</think>``; an output that never closes it is all reasoning.

Whitespace rule (the chat template re-renders history as ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``,
so the split must give back exactly those pieces): newlines at both ends of the reasoning and newlines
at the start of the content after ``</think>`` are not published. Trailing newlines of the reasoning are
held back until later text shows they are inside it. Markers are never published; a partial marker is
held back (:mod:`holdback`) and published by :meth:`ReasoningSplitter.flush` if it never completes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ninfer.contracts.frontend import Channel

from ninfer_qwen3_5.frontend.holdback import partial_marker_len

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

Phase = Literal["detect", "reasoning", "content"]
Piece = tuple[Channel, str]


@dataclass(frozen=True)
class ReasoningSplitter:
    """``phase``: ``detect`` (output start, deciding whether the model opens ``<think>``), ``reasoning``
    or ``content``. ``fresh``: nothing published yet in this phase (leading newlines are dropped).
    ``held``: text not yet published."""

    phase: Phase = "detect"
    held: str = ""
    fresh: bool = True

    @classmethod
    def start(cls, thinking_open: bool) -> ReasoningSplitter:
        return cls("reasoning" if thinking_open else "detect")

    def feed(self, text: str) -> tuple[ReasoningSplitter, tuple[Piece, ...]]:
        state, pieces = self, []
        while True:
            state, out, rest = state._step(text)
            pieces.extend(p for p in out if p[1])
            if rest is None:
                return state, tuple(pieces)
            text = rest

    def _step(self, text: str) -> tuple[ReasoningSplitter, tuple[Piece, ...], str | None]:
        """Consume ``text`` up to a phase change; return the text after it (None when consumed)."""
        window = self.held + text
        if self.phase == "detect":
            body = window.lstrip()
            if body.startswith(THINK_OPEN):
                # Whitespace before the model's own <think> is formatting, not content.
                return ReasoningSplitter("reasoning"), (), body[len(THINK_OPEN):]
            if THINK_OPEN.startswith(body):
                return ReasoningSplitter("detect", window), (), None
            return ReasoningSplitter("content", fresh=False), (("content", window),), None
        if self.phase == "reasoning":
            if self.fresh:
                window = window.lstrip("\n")
            end = window.find(THINK_CLOSE)
            if end >= 0:
                reasoning = window[:end].rstrip("\n")
                return ReasoningSplitter("content"), (("reasoning", reasoning),), window[end + len(THINK_CLOSE):]
            cut = len(window) - partial_marker_len(window, (THINK_CLOSE,))
            publish = window[:cut].rstrip("\n")
            state = ReasoningSplitter("reasoning", window[len(publish):], self.fresh and not publish)
            return state, (("reasoning", publish),), None
        if self.fresh:
            window = window.lstrip("\n")
        return ReasoningSplitter("content", fresh=self.fresh and not window), (("content", window),), None

    def flush(self) -> tuple[Piece, ...]:
        """Publish what is held at the end of the output: a partial marker is text after all; trailing
        reasoning newlines are dropped (the whitespace rule)."""
        if self.phase == "detect":
            return (("content", self.held),) if self.held else ()
        if self.phase == "reasoning":
            tail = self.held.rstrip("\n")
            return (("reasoning", tail),) if tail else ()
        return ()
