"""A forced tool call (a ``tools`` constraint) cut short publishes no markup: only complete calls.

The session's output under a tools constraint is calls only, so when the output ends before a call
completes (``max_tokens``), the incomplete call is dropped at ``finish`` rather than published as raw
``<tool_call>`` content. Unforced (``auto``) parsing keeps publishing a broken call as content.
"""

from __future__ import annotations

import pytest
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.frontend import OutputOptions
from ninfer_qwen3_5.frontend.tool_calls import ParsedToolCall, ToolCallExtractor, ToolSchemas

from .conftest import IM_END, stream

TOOL = {"type": "function", "function": {"name": "find", "parameters": {
    "type": "object", "properties": {"t": {"type": "string"}, "n": {"type": "integer"}}, "required": ["t"]}}}
CALL = "<tool_call>\n<function=find>\n<parameter=t>\ncats\n</parameter>\n<parameter=n>\n3\n</parameter>\n" \
       "</function>\n</tool_call>"
# The function block is complete from here on: the parser accepts the call even without </tool_call>.
COMPLETE_AT = CALL.index("</function>") + len("</function>")


def _extract(text: str, *, calls_only: bool) -> tuple:
    state, items = ToolCallExtractor(ToolSchemas.from_tools([TOOL])).feed(text)
    return items + state.flush(calls_only=calls_only)


@pytest.mark.parametrize("cut", range(1, len(CALL) + 1))
def test_a_forced_call_cut_anywhere_yields_no_text(cut):
    items = _extract(CALL[:cut], calls_only=True)
    assert not any(isinstance(i, str) for i in items)
    if cut >= COMPLETE_AT:
        assert items == (ParsedToolCall("find", {"t": "cats", "n": 3}),)
    else:
        assert items == ()


def test_an_unforced_broken_call_is_still_content():
    cut = CALL[:COMPLETE_AT - 5]
    assert _extract(cut, calls_only=False) == (cut,)
    assert _extract("hello <tool", calls_only=False) == ("hello", " <tool")


def _options(parallel: bool = False, **extra) -> OutputOptions:
    return OutputOptions(tools=(TOOL,), parse_tool_calls=True,
                         constraint=OutputConstraint.tools("required", parallel=parallel), **extra)


def test_session_publishes_no_markup_for_any_cut_of_a_forced_call(frontend):
    ids = frontend.encode(CALL)
    for n in range(len(ids) + 1):
        got = stream(frontend, ids[:n], _options())
        text = frontend.decode(ids[:n])
        assert got.text("content") == "" and got.final.content == "", (n, text)
        calls = got.final.tool_calls
        assert [c.name for c in calls] == (["find"] if len(text) >= COMPLETE_AT else []), (n, text)
        assert calls == tuple(c for d in got.deltas for c in d.tool_calls)


def test_session_keeps_the_complete_calls_before_a_cut_parallel_call(frontend):
    second = CALL.replace("cats", "dogs")
    ids = frontend.encode(CALL + "\n" + second)
    cut = len(frontend.encode(CALL + "\n" + second[:30]))
    got = stream(frontend, ids[:cut], _options(parallel=True))
    assert got.text("content") == ""
    assert [dict(c.arguments) for c in got.final.tool_calls] == [{"t": "cats", "n": 3}]
    whole = stream(frontend, ids + [IM_END], _options(parallel=True), finish_reason="stop")
    assert [c.arguments["t"] for c in whole.final.tool_calls] == ["cats", "dogs"]


def test_session_cut_after_reasoning_keeps_the_reasoning_only(frontend):
    output = "Looking it up.\n</think>\n\n" + CALL[:40]
    got = stream(frontend, frontend.encode(output), _options(parse_reasoning=True, thinking_open=True))
    assert got.text("reasoning").strip() == "Looking it up."
    assert got.text("content") == "" and got.final.tool_calls == ()
