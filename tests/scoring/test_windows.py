"""The window plan: every token after x[0] scored exactly once, windows within the context."""

from __future__ import annotations

import pytest
from ninfer.scoring.windows import InvalidScoringOptions, Window, plan_windows


def check_plan(n: int, context: int, stride: int) -> tuple[Window, ...]:
    windows = plan_windows(n, context, stride)
    scored = [i for w in windows for i in range(w.first_target, w.end)]
    assert scored == list(range(1, n)), (n, context, stride, windows)  # exactly once, in order
    for k, w in enumerate(windows):
        assert 0 <= w.begin < w.first_target < w.end <= n
        assert 1 <= w.num_inputs <= context
        assert w.num_targets <= (context if k == 0 else stride)
        if k:
            # A later window is as long as the context allows: it reads the C inputs before its
            # last target, or starts at x[0].
            assert w.num_inputs == min(context, w.end - 1)
    if windows:
        assert windows[0] == Window(0, min(context + 1, n), 1)
    return windows


@pytest.mark.parametrize("context", [1, 2, 3, 7, 16])
def test_exactly_once_for_every_length_and_stride(context):
    for stride in range(1, context + 1):
        for n in range(0, 4 * context + 5):
            check_plan(n, context, stride)


def test_stride_equal_to_context_reads_disjoint_inputs():
    windows = check_plan(49, 8, 8)  # 48 targets: six full windows
    inputs = [i for w in windows for i in range(w.begin, w.end - 1)]
    assert inputs == list(range(48))
    # A short last window still reads the full context before its targets.
    assert check_plan(50, 8, 8)[-1] == Window(41, 50, 49)


def test_stride_below_context_rereads_context_minus_stride():
    windows = check_plan(60, 10, 4)
    assert windows[:3] == (Window(0, 11, 1), Window(4, 15, 11), Window(8, 19, 15))
    for w in windows[1:]:
        assert w.first_target - 1 - w.begin == 10 - 4 or w.end == 60  # re-read context, last may be short


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_tokens_have_no_window(n):
    assert plan_windows(n, 8, 4) == ()


def test_text_shorter_than_a_window_is_one_window():
    assert plan_windows(5, 8, 4) == (Window(0, 5, 1),)
    assert plan_windows(9, 8, 4) == (Window(0, 9, 1),)      # 8 inputs: exactly one full window
    assert plan_windows(10, 8, 4) == (Window(0, 9, 1), Window(1, 10, 9))


@pytest.mark.parametrize("context, stride", [(8, 9), (0, 1), (4, 0), (-1, 1), (4, 2.0), (True, 1)])
def test_invalid_options_are_refused(context, stride):
    with pytest.raises(InvalidScoringOptions, match="invalid scoring option"):
        plan_windows(10, context, stride)
