"""Qwen3.5 XML tool calls: typed arguments, several calls, malformed text kept as content, streaming."""

from __future__ import annotations

import pytest
from ninfer.contracts.frontend import OutputOptions
from ninfer_qwen3_5.frontend import QwenFrontend
from ninfer_qwen3_5.frontend.tool_calls import ToolSchemas, convert_argument, parse_tool_call

from .conftest import IM_END, stream

TOOLS = (
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer"}, "threshold": {"type": "number"},
        "exact": {"type": "boolean"}, "filters": {"type": "object"}, "tags": {"type": "array"},
        "cursor": {"type": ["integer", "null"]}, "mode": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}},
    {"name": "write_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                                           "content": {"type": "string"}}}},
)
SCHEMAS = ToolSchemas.from_tools(TOOLS)


def call_xml(name: str, **params: str) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


def _body(xml: str) -> str:
    return xml[len("<tool_call>"):-len("</tool_call>")]


def test_arguments_typed_by_schema():
    call = parse_tool_call(_body(call_xml(
        "search", query="  spaced 42  ", limit="10", threshold="0.5", exact="True", filters='{"lang": ["en"]}',
        tags='["a", 1]', cursor="null", mode="7", unknown="3")), SCHEMAS)
    assert call is not None and call.name == "search"
    assert dict(call.arguments) == {"query": "  spaced 42  ", "limit": 10, "threshold": 0.5, "exact": True,
                                    "filters": {"lang": ["en"]}, "tags": ["a", 1], "cursor": None, "mode": 7,
                                    "unknown": "3"}
    assert type(call.arguments["limit"]) is int and type(call.arguments["unknown"]) is str


def test_values_that_do_not_fit_stay_strings():
    assert convert_argument("ten", {"type": "integer"}) == "ten"
    assert convert_argument("1.5", {"type": "integer"}) == "1.5"
    assert convert_argument("yes", {"type": "boolean"}) == "yes"
    assert convert_argument("[1,", {"type": "array"}) == "[1,"
    assert convert_argument("{}", {"type": "array"}) == "{}"
    assert convert_argument("nan", {"type": "number"}) == "nan"
    assert convert_argument("1e3", {"type": "number"}) == 1000.0
    assert convert_argument("-3", {"type": "number"}) == -3
    assert convert_argument("abc", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == "abc"
    assert convert_argument("12", None) == "12"


def test_unknown_tool_keeps_strings_and_multiline_values_survive():
    call = parse_tool_call(_body(call_xml("other", n="5", text="line 1\n\n  line 3")), SCHEMAS)
    assert call is not None and dict(call.arguments) == {"n": "5", "text": "line 1\n\n  line 3"}


@pytest.mark.parametrize("body", [
    "\n<function=f>\n<parameter=a>\n1\n</function>\n",                      # unclosed parameter
    "\n<function=f>\n<parameter=a>\n1\n</parameter>\n",                      # unclosed function
    "\n<function=f>\nstray text\n</function>\n",                             # text outside a parameter
    "\n<function=f>\n<parameter=a>\n<parameter=b>\n2\n</parameter>\n</function>\n",  # nested parameter
    "\n<function=f>\n</function>\n<function=g>\n</function>\n",             # two functions in one call
    "\n<function=>\n</function>\n",                                          # empty name
    "\nprefix <function=f>\n</function>\n",                                  # text before the function
    "\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>\n",  # duplicate
])
def test_malformed_bodies(body: str):
    assert parse_tool_call(body, SCHEMAS) is None


def test_session_multiple_calls_and_content(frontend: QwenFrontend):
    first = call_xml("search", query="weather Paris", limit="3")
    second = call_xml("write_file", path="/tmp/a.txt", content="héllo\nwörld 🌍")
    text = "I'll look that up.\n\n" + first + "\n" + second
    ids = frontend.encode("<think>\nplan\n</think>\n\n" + text) + [IM_END]
    out = stream(frontend, ids, OutputOptions(tools=TOOLS))
    final = out.final
    assert final.reasoning == "plan" and final.content == "I'll look that up."
    assert [(c.name, dict(c.arguments)) for c in final.tool_calls] == [
        ("search", {"query": "weather Paris", "limit": 3}),
        ("write_file", {"path": "/tmp/a.txt", "content": "héllo\nwörld 🌍"})]
    assert len({c.id for c in final.tool_calls}) == 2 and all(c.id.startswith("call_") for c in final.tool_calls)
    published = [c for d in out.deltas for c in d.tool_calls]
    assert published == list(final.tool_calls)
    assert all(d.channel == "content" for d in out.deltas if d.tool_calls)
    assert all("<tool_call>" not in d.text and "parameter" not in d.text for d in out.deltas)


def test_call_published_only_when_complete(frontend: QwenFrontend):
    xml = call_xml("search", query="x")
    ids = frontend.encode(xml)
    session = frontend.open_session(OutputOptions(tools=TOOLS))
    for i, token in enumerate(ids):
        preview = session.preview([token])
        session.commit(preview)
        has_call = any(d.tool_calls for d in preview.deltas)
        assert has_call == (i == len(ids) - 1)
        assert all(not d.text for d in preview.deltas)


def test_malformed_call_is_content_and_later_calls_still_parse(frontend: QwenFrontend):
    broken = "<tool_call>\n<function=search>\n<parameter=query>\nx\n</function>\n</tool_call>"
    good = call_xml("search", limit="2")
    out = stream(frontend, frontend.encode("Before " + broken + "\n" + good + "\nAfter"), OutputOptions(tools=TOOLS))
    assert out.final.content == "Before " + broken + "After"
    assert [(c.name, dict(c.arguments)) for c in out.final.tool_calls] == [("search", {"limit": 2})]


def test_unterminated_call_at_finish(frontend: QwenFrontend):
    complete_function = call_xml("search", limit="1")[: -len("</tool_call>")]
    out = stream(frontend, frontend.encode(complete_function), OutputOptions(tools=TOOLS))
    assert [c.name for c in out.final.tool_calls] == ["search"] and out.final.content == ""
    cut = call_xml("search", limit="1")[:40]
    out = stream(frontend, frontend.encode("ok " + cut), OutputOptions(tools=TOOLS))
    assert out.final.tool_calls == () and out.final.content == "ok " + cut


def test_partial_marker_is_content_when_it_never_completes(frontend: QwenFrontend):
    out = stream(frontend, frontend.encode("a <tool_"), OutputOptions(tools=TOOLS))
    assert out.final.content == "a <tool_" and out.final.deltas


def test_calls_in_reasoning_are_not_parsed(frontend: QwenFrontend):
    xml = call_xml("search", limit="1")
    out = stream(frontend, frontend.encode(xml + "</think>done"), OutputOptions(tools=TOOLS, thinking_open=True))
    assert out.final.reasoning == xml and out.final.tool_calls == () and out.final.content == "done"


def test_parse_tool_calls_off(frontend: QwenFrontend):
    xml = call_xml("search", limit="1")
    out = stream(frontend, frontend.encode(xml), OutputOptions(tools=TOOLS, parse_tool_calls=False))
    assert out.final.content == xml and out.final.tool_calls == ()


def test_round_trip_through_the_template(frontend: QwenFrontend):
    """A parsed call re-renders (as assistant history) to exactly the text the model produced."""
    generated = "Checking.\n\n" + call_xml("search", query="q", limit="5", exact="false", tags='["x"]')
    out = stream(frontend, frontend.encode(generated), OutputOptions(tools=TOOLS))
    history = [{"role": "user", "content": "u"},
               {"role": "assistant", "content": out.final.content, "reasoning_content": out.final.reasoning,
                "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
                               for c in out.final.tool_calls]}]
    prompt = frontend.render_chat([history[0]])
    rendered = frontend.render_chat(history, add_generation_prompt=False)
    assert rendered == prompt + "\n</think>\n\n" + generated + "<|im_end|>\n"
