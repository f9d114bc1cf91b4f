"""The window plan of causal scoring: which tokens each window reads and which it scores.

Definitions (N tokens ``x[0..N-1]``, ``context`` C >= 1, ``stride`` S with 1 <= S <= C):

- A :class:`Window` ``(begin, end, first_target)`` feeds the model the *inputs* ``x[begin:end-1]``
  from an empty state and scores the *targets* ``x[i]`` for ``i`` in ``[first_target, end)``, each
  as ``log p(x[i] | x[begin..i-1])``. ``begin < first_target`` (every target has at least one token
  of history) and ``end - 1 - begin <= C`` (the model never reads more than C tokens: the KV of one
  window is at most C tokens).
- The first window reads ``x[0:min(C, N-1)]`` and scores ``[1, min(C+1, N))``. Each later window
  scores the next ``S`` targets (fewer at the end) and reads the C inputs before its last target
  (fewer near the start), so its first target sees ``C + 1 - S`` tokens of history and its last
  one sees C.
- ``S == C`` gives disjoint inputs (every input token is read exactly once); ``S < C`` re-reads
  ``C - S`` tokens per window as context. ``S > C`` would leave a target with no input before it
  in its window, so it is refused.

Invariant (tested): the target ranges are disjoint, in order, and cover ``[1, N)`` exactly, so every
token after ``x[0]`` is scored exactly once. A text of fewer than 2 tokens has no windows.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer.errors import NInferError


class InvalidScoringOptions(NInferError):
    """A scoring option (context, stride, top_logprobs) is out of range; the message names it."""


@dataclass(frozen=True)
class Window:
    """Inputs ``x[begin:end-1]``, targets ``x[first_target:end]`` (see the module docstring)."""

    begin: int
    end: int
    first_target: int

    @property
    def num_inputs(self) -> int:
        return self.end - 1 - self.begin

    @property
    def num_targets(self) -> int:
        return self.end - self.first_target


def check_window_options(context: int, stride: int) -> None:
    """Raise :class:`InvalidScoringOptions` unless ``1 <= stride <= context``."""
    for name, value in (("context", context), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidScoringOptions(f"invalid scoring option {name}={value!r}: must be an int >= 1")
    if stride > context:
        raise InvalidScoringOptions(f"invalid scoring option stride={stride}: it exceeds context={context}, "
                                    f"which would leave tokens that no window can score (use stride <= context)")


def plan_windows(num_tokens: int, context: int, stride: int) -> tuple[Window, ...]:
    """The windows that score a text of ``num_tokens`` tokens (pure; see the module docstring)."""
    check_window_options(context, stride)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    windows: list[Window] = []
    first = 1
    end = min(context + 1, num_tokens)
    while first < num_tokens:
        windows.append(Window(begin=max(0, end - 1 - context), end=end, first_target=first))
        first, end = end, min(end + stride, num_tokens)
    return tuple(windows)
