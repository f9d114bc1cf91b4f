"""Constrained OutputSessions on the real Qwen3.5 vocabulary (248,077 tokens): compilation and its
shared cache, vocabulary adaptation, the matcher's preview/commit discipline, grammar end, thinking,
and tool-call grammars whose parsed arguments validate against the tool schema."""

from __future__ import annotations

import threading

import jsonschema
import pytest
import torch
from frontend.conftest import ENDOFTEXT, IM_END, IM_START
from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.errors import InvalidConstraintError, RequestRejected
from ninfer.contracts.frontend import OutputOptions
from ninfer.program.token_bitmask import unpack_bitmask, words_per_row
from ninfer_qwen3_5.frontend import QwenFrontend
from ninfer_qwen3_5.frontend.errors import FrontendError

THINK_CLOSE_ID = 248069


def allowed(session) -> torch.Tensor:
    provider = session.token_mask()
    assert provider is not None
    vocab = session_vocab(session)
    words = torch.zeros((1, words_per_row(vocab)), dtype=torch.int32)
    provider.fill_bitmask(words[0])
    return unpack_bitmask(words, vocab)[0]


def session_vocab(session) -> int:
    return session._test_vocab


def open_session(frontend, constraint, **options):
    s = frontend.open_session(OutputOptions(constraint=constraint, **options))
    s._test_vocab = frontend.vocab_size
    return s


def feed(session, tokens):
    """Preview and commit one token at a time, like the engine; returns the last preview."""
    preview = None
    for t in tokens:
        preview = session.preview([t])
        session.commit(preview)
        if preview.finish_reason is not None:
            break
    return preview


def test_invalid_constraint_is_a_request_rejection(frontend):
    assert issubclass(InvalidConstraintError, RequestRejected)
    with pytest.raises(InvalidConstraintError, match="GBNF"):
        frontend.open_session(OutputOptions(constraint=OutputConstraint.gbnf("root ::= (")))


def test_compiled_grammars_are_cached_and_shared(frontend):
    compiler = frontend.grammar_compiler()
    c = OutputConstraint.regex("cache-test-[0-9]{3}")
    before = compiler.compiles
    first = open_session(frontend, c)
    second = open_session(frontend, c)
    assert compiler.compiles == before + 1
    assert first._matcher is not second._matcher  # one matcher per session, one compiled grammar
    open_session(frontend, c, thinking_open=True)
    assert compiler.compiles == before + 2  # the reasoning prefix is a different grammar


def test_concurrent_cold_compiles_of_one_constraint_compile_once(frontend):
    compiler = frontend.grammar_compiler()
    c = OutputConstraint.json_schema({"type": "object", "properties": {"concurrent": {"type": "boolean"}}})
    before = compiler.compiles
    barrier, errors = threading.Barrier(4), []

    def run():
        barrier.wait()
        try:
            open_session(frontend, c)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and compiler.compiles == before + 1


def test_special_and_padding_tokens_are_never_grammar_text(resources):
    fe = QwenFrontend(resources, vocab_size=248320)  # embedding rows past the tokenizer
    s = open_session(fe, OutputConstraint.json_object())
    a = allowed(s)
    assert a.shape[0] == 248320
    assert not a[248077:].any()
    assert not a[IM_START] and not a[IM_END] and not a[ENDOFTEXT]  # no EOS before the object closes
    assert a[fe.encode("{")[0]]
    feed(s, fe.encode("{}"))
    a = allowed(s)
    # After a complete object only the stop tokens remain (no free whitespace after the value).
    assert set(torch.nonzero(a).flatten().tolist()) == {IM_END, ENDOFTEXT}


def test_preview_is_pure_until_committed(frontend):
    s = open_session(frontend, OutputConstraint.choice(["alpha", "beta"]))
    tokens = frontend.encode("alpha")
    start = allowed(s)
    p1 = s.preview(tokens[:1])
    assert torch.equal(allowed(s), start)  # an uncommitted preview leaves the mask as committed
    p2 = s.preview(tokens[:1])
    assert p1 == p2
    s.commit(p2)
    after = allowed(s)
    assert not torch.equal(after, start)
    beta = frontend.encode("beta")[0]
    assert start[beta] and not after[beta]


def test_grammar_end_finishes_with_stop_and_publishes_the_text(frontend):
    s = open_session(frontend, OutputConstraint.choice(["alpha", "beta"]))
    last = feed(s, frontend.encode("beta") + [IM_END])
    assert last.finish_reason == "stop" and last.stop_reason == IM_END
    assert s.token_mask() is None
    assert s.finish("stop").content == "beta"


def test_grammar_end_stops_even_with_ignore_eos(frontend):
    s = open_session(frontend, OutputConstraint.choice(["alpha"]), ignore_eos=True)
    last = feed(s, frontend.encode("alpha"))
    assert last.finish_reason is None
    assert set(torch.nonzero(allowed(s)).flatten().tolist()) == {IM_END, ENDOFTEXT}
    last = feed(s, [ENDOFTEXT])
    assert last.finish_reason == "stop" and last.stop_reason == ENDOFTEXT
    assert s.finish("stop").content == "alpha"


def test_a_stop_string_inside_the_constraint_keeps_only_the_accepted_tokens(frontend):
    s = open_session(frontend, OutputConstraint.regex("[a-z ]{1,40}"), stop=("cd",))
    tokens = frontend.encode("ab cd ef")
    preview = s.preview(tokens)
    assert preview.finish_reason == "stop" and preview.accepted < len(tokens)
    s.commit(preview)
    assert s._matcher.committed == preview.accepted


def test_a_token_outside_the_grammar_is_an_error_not_output(frontend):
    s = open_session(frontend, OutputConstraint.choice(["alpha"]))
    with pytest.raises(FrontendError, match="constraint"):
        s.preview(frontend.encode("zzz"))
    # The failed preview left nothing behind.
    assert allowed(s)[frontend.encode("alpha")[0]]


def test_thinking_open_allows_free_reasoning_then_the_body(frontend):
    s = open_session(frontend, OutputConstraint.json_schema({"type": "object", "properties": {
        "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}), thinking_open=True)
    a = allowed(s)
    assert not a[IM_END]  # no end inside the reasoning
    assert a[THINK_CLOSE_ID] and a[frontend.encode("Hmm")[0]]
    feed(s, frontend.encode("Hmm, a boolean.\n") + [THINK_CLOSE_ID] + frontend.encode('\n\n{"ok": true}'))
    last = feed(s, [IM_END])
    assert last.finish_reason == "stop"
    final = s.finish("stop")
    assert final.reasoning == "Hmm, a boolean." and final.content == '{"ok": true}'


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "detail": {"type": "object", "properties": {"hourly": {"type": "boolean"}},
                              "required": ["hourly"], "additionalProperties": False}},
    "required": ["city", "days"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def test_tool_call_grammar_accepts_the_templates_rendering_and_parses_valid_arguments(frontend):
    tools = (WEATHER, SEARCH)
    s = open_session(frontend, OutputConstraint.tools("required"), tools=tools, parse_reasoning=False)
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=detail>\n{\"hourly\": false}\n</parameter>\n"
            "</function>\n</tool_call>")
    feed(s, frontend.encode(text))
    assert set(torch.nonzero(allowed(s)).flatten().tolist()) == {IM_END, ENDOFTEXT}
    feed(s, [IM_END])
    (call,) = s.finish("stop").tool_calls
    assert call.name == "get_weather"
    assert dict(call.arguments) == {"city": "San Francisco", "days": 3, "detail": {"hourly": False}}
    jsonschema.validate(dict(call.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n",      # required city missing
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n9",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis</parameter>",     # value may not hold "</"
    "<tool_call>\n<function=search>\n",                                              # not the named tool
])
def test_tool_call_grammar_rejects_invalid_calls(frontend, text):
    s = open_session(frontend, OutputConstraint.tools("get_weather"), tools=(WEATHER, SEARCH))
    with pytest.raises(FrontendError):
        feed(s, frontend.encode(text))


@pytest.mark.parametrize("tools, choice, problem", [
    ((), "required", "at least one tool"),
    ((WEATHER,), "nope", "not among the tools"),
    (({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": ["string", "integer"]}}}}},), "required", "ambiguous"),
    (({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"enum": [1, 2]}}}}},), "required", "type"),
    (({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string"}}, "required": ["y"]}}},), "required", "not declared"),
    (({"type": "function", "function": {"name": "bad>name"}},), "required", "cannot be written"),
])
def test_unrepresentable_tool_constraints_are_rejected(frontend, tools, choice, problem):
    with pytest.raises(InvalidConstraintError, match=problem):
        frontend.open_session(OutputOptions(constraint=OutputConstraint.tools(choice), tools=tools))
