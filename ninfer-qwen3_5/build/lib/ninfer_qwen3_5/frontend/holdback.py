"""The hold-back rule every streaming text stage shares.

A stage that looks for a marker (a stop string, ``</think>``, ``<tool_call>``) cannot publish text that
might be the beginning of that marker: the next token decides. It publishes everything up to the
longest suffix that is a *proper* prefix of some marker and holds that suffix back. Any marker
occurrence that completes later starts inside the held suffix, so nothing published ever has to be
taken back.
"""

from __future__ import annotations

from collections.abc import Iterable


def partial_marker_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper, non-empty prefix of a marker (0 if
    none). A complete marker is not a partial one: callers search for complete markers first."""
    best = 0
    for marker in markers:
        # Only lengths longer than the current best can improve it; try the longest first.
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best
