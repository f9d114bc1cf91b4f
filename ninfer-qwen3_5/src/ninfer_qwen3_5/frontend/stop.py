"""Stop strings matched across token boundaries.

A stop string may arrive split over any number of tokens, so the matcher holds back the longest text
suffix that could still become a stop string (see :mod:`holdback`). Invariants:
- nothing published ever contains a stop string or text after the first one;
- the stop string that completes first wins (of those completing at the same character, the earliest-starting,
  that is the longest), so where the output ends and which stop ended it never depend on how the text was split
  into tokens: token by token the first completed stop string is what the matcher sees first;
- a partial match that never completes is published by :meth:`StopStringMatcher.flush`;
- text fed with ``match=False`` (an output still shorter than ``min_tokens``) ends nothing: only a stop string that
  completes in text fed later ends the output, though it may begin in the earlier text (vLLM's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer_qwen3_5.frontend.errors import FrontendError
from ninfer_qwen3_5.frontend.holdback import partial_marker_len


@dataclass(frozen=True)
class StopFeed:
    """One step's result: ``text`` to publish, and ``stop`` the stop string that ended the output."""

    text: str
    stop: str | None = None


@dataclass(frozen=True)
class StopStringMatcher:
    stops: tuple[str, ...]
    held: str = ""
    quiet: int = 0   # leading characters of ``held`` fed with match=False: a stop must complete after them

    def __post_init__(self) -> None:
        if any(not s for s in self.stops):
            raise FrontendError("stop strings must be non-empty")

    def feed(self, text: str, *, match: bool = True) -> tuple[StopStringMatcher, StopFeed]:
        """Publish ``text`` up to the first stop string that completes in it, holding back a suffix that could
        still become one; with ``match`` False nothing ends (a stop string completing here is published)."""
        if not self.stops:
            return self, StopFeed(text)
        window = self.held + text
        floor = self.quiet if match else len(window)   # a match must end after window[:floor]
        best: tuple[int, int, str] | None = None  # (end, start, stop) orders first completed, then earliest
        for stop in self.stops:
            # The first occurrence ending after the floor is also the first completion there.
            at = window.find(stop, max(0, floor - len(stop) + 1))
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        if best is not None:
            return StopStringMatcher(self.stops), StopFeed(window[: best[1]], best[2])
        keep = partial_marker_len(window, self.stops)
        cut = len(window) - keep
        return StopStringMatcher(self.stops, window[cut:], max(0, floor - cut)), StopFeed(window[:cut])

    def flush(self) -> str:
        """The held partial match, which never completed."""
        return self.held
