"""Forced tool calls (``tool_choice`` required or named) through the official ``openai`` client, against the
real default-model engine (in process: the litestar test client is the openai client's http client).

The tool-call grammar forces a complete call, so even the tiny default model answers with a parsed
``tool_calls`` entry (``finish_reason`` ``tool_calls`` for required, ``stop`` for a named function, as in
OpenAI) and no content. When ``max_tokens`` cuts the call, ``finish_reason`` is ``length``, no call is
reported, and no raw ``<tool_call>`` markup reaches ``content``, streamed or not.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from serve_helpers import MODEL_ID, client_for, wait_idle

TOOL = {"type": "function", "function": {"name": "find", "parameters": {
    "type": "object", "properties": {"t": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["t"], "additionalProperties": False}}}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
NAMED = {"type": "function", "function": {"name": "find"}}
CHOICES = pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])


@pytest.fixture(scope="module")
def client(engine):
    with client_for(engine) as http:
        yield openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)
    wait_idle(engine)


def _create(client, tool_choice, **fields):
    return client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "find cats"}], tools=[TOOL, OTHER],
        tool_choice=tool_choice, temperature=0, parallel_tool_calls=False,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **fields)


def _complete_finish(tool_choice) -> str:
    return "tool_calls" if tool_choice == "required" else "stop"   # OpenAI's values


@CHOICES
def test_a_forced_call_is_a_parsed_tool_call(client, tool_choice):
    choice = _create(client, tool_choice).choices[0]
    assert choice.finish_reason == _complete_finish(tool_choice)
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if tool_choice == NAMED:
        assert call.function.name == "find"
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in (TOOL, OTHER)}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), spec)


@CHOICES
@pytest.mark.parametrize("max_tokens", [1, 5, 12, 30])
def test_a_forced_call_cut_by_max_tokens_is_length_without_markup(client, tool_choice, max_tokens):
    response = _create(client, tool_choice, max_tokens=max_tokens)
    choice = response.choices[0]
    assert response.usage.completion_tokens == max_tokens
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    assert not choice.message.tool_calls


def _stream(client, tool_choice, **fields):
    chunks = list(_create(client, tool_choice, stream=True, **fields))
    choices = [c.choices[0] for c in chunks if c.choices]
    content = "".join(c.delta.content or "" for c in choices)
    calls = [tc for c in choices for tc in (c.delta.tool_calls or [])]
    return content, calls, [c.finish_reason for c in choices if c.finish_reason]


@CHOICES
def test_a_streamed_forced_call_is_one_tool_call_delta(client, tool_choice):
    content, calls, finish = _stream(client, tool_choice)
    assert content == "" and finish == [_complete_finish(tool_choice)]
    [call] = calls
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("find", "other")
    json.loads(call.function.arguments)


@CHOICES
@pytest.mark.parametrize("max_tokens", [5, 30])
def test_a_streamed_forced_call_cut_by_max_tokens_leaks_no_markup(client, tool_choice, max_tokens):
    content, calls, finish = _stream(client, tool_choice, max_tokens=max_tokens)
    assert content == "" and calls == [] and finish == ["length"]
