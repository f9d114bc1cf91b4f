"""Helpers that read a handle's whole stream and check its shape."""

from __future__ import annotations

from ninfer.contracts.events import (
    GenerationDelta,
    GenerationError,
    GenerationResult,
    GenerationStart,
)


def check_stream(events: list, *, started: bool | None = None):
    """Assert the event-order invariants and return the terminal event.

    - exactly one terminal event, and it is last;
    - at most one GenerationStart, before every delta; token deltas only after it;
    - a GenerationResult's ``token_ids`` are exactly the concatenated delta tokens.
    """
    assert events, "no events"
    terminal = events[-1]
    assert isinstance(terminal, (GenerationResult, GenerationError)), f"last event is {terminal!r}"
    assert not any(isinstance(e, (GenerationResult, GenerationError)) for e in events[:-1]), "two terminal events"
    starts = [i for i, e in enumerate(events) if isinstance(e, GenerationStart)]
    assert len(starts) <= 1, "GenerationStart repeated"
    deltas = [i for i, e in enumerate(events) if isinstance(e, GenerationDelta)]
    if deltas:
        assert starts and starts[0] < deltas[0], "a delta before GenerationStart"
    if started is not None:
        assert bool(starts) == started
    if isinstance(terminal, GenerationResult):
        tokens = tuple(t for e in events if isinstance(e, GenerationDelta) for t in e.token_ids)
        assert tokens == terminal.token_ids
        assert terminal.usage.completion_tokens == len(tokens)
    return terminal


def delta_text(events: list) -> str:
    return "".join(d.text for e in events if isinstance(e, GenerationDelta) for d in e.deltas)
