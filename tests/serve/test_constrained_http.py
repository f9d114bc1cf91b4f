"""Constrained output over HTTP: on /v1/chat/completions response_format json_object / json_schema and
vLLM's guided_json / guided_regex / guided_choice / guided_grammar, the same fields on /v1/completions, and
forced tool calls (Chat Completions tool_choice required/named, Anthropic /v1/messages tool_choice any/tool),
Anthropic's structured outputs (output_config.format),
on the real default model at temperature 1.0 (the tiny model knows no JSON: only the constraint makes the
output valid), plus the field -> OutputConstraint mapping of ninfer_serve.constraints."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from ninfer.contracts.constraint import OutputConstraint
from ninfer_serve.constraints import (
    ConstraintFieldError,
    body_constraint,
    request_constraint,
    tool_constraint,
)
from serve_helpers import MODEL_ID, client_for, wait_idle

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 10},
                                           "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["title", "year"], "additionalProperties": False}
NO_THINK = {"enable_thinking": False}


def test_mapping_of_fields():
    assert body_constraint(None, {}) is None
    assert body_constraint({"type": "text"}) is None
    assert body_constraint({"type": "json_object"}) == OutputConstraint.json_object()
    assert body_constraint({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}) \
        == OutputConstraint.json_schema(SCHEMA)
    assert body_constraint(None, {"guided_json": json.dumps(SCHEMA)}) == OutputConstraint.json_schema(SCHEMA)
    assert body_constraint(None, {"guided_regex": "a+"}) == OutputConstraint.regex("a+")
    assert body_constraint(None, {"guided_choice": ["x", "y"]}) == OutputConstraint.choice(["x", "y"])
    assert body_constraint(None, {"guided_grammar": 'root ::= "a"'}) == OutputConstraint.gbnf('root ::= "a"')
    assert body_constraint(None, {"structured_outputs": {"choice": ["x"]}}) == OutputConstraint.choice(["x"])
    assert tool_constraint("required", has_tools=True, parallel=False) == OutputConstraint.tools("required")
    assert tool_constraint({"type": "function", "function": {"name": "f"}}, has_tools=True, parallel=True) \
        == OutputConstraint.tools("f", parallel=True)
    assert tool_constraint("auto", has_tools=True, parallel=True) is None
    assert body_constraint(schemas={"output_config.format.schema": SCHEMA}) == OutputConstraint.json_schema(SCHEMA)


@pytest.mark.parametrize("call, param", [
    (lambda: body_constraint({"type": "json_schema"}), "response_format.json_schema.schema"),
    (lambda: body_constraint({"type": "json_object"}, {"guided_choice": ["a"]}), "guided_choice"),
    (lambda: body_constraint(None, {"guided_choice": []}), "guided_choice"),
    (lambda: body_constraint(None, {"guided_json": "{nope"}), "guided_json"),
    (lambda: body_constraint(None, {"structured_outputs": {"regex": 5}}), "structured_outputs.regex"),
    (lambda: tool_constraint("required", has_tools=False, parallel=True), "tool_choice"),
    (lambda: request_constraint(response_format={"type": "json_object"}, tool_choice="required", has_tools=True),
     "tool_choice"),
    (lambda: body_constraint(schemas={"output_config.format.schema": "nope"}), "output_config.format.schema"),
    (lambda: body_constraint(schemas={"output_config.format.schema": SCHEMA, "output_format.schema": SCHEMA}),
     "output_format.schema"),
    (lambda: request_constraint(schemas={"output_format.schema": SCHEMA}, tool_choice="required", has_tools=True),
     "tool_choice"),
])
def test_mapping_errors_name_the_field(call, param):
    with pytest.raises(ConstraintFieldError) as info:
        call()
    assert info.value.param == param


@pytest.fixture(scope="module")
def client(engine):
    with client_for(engine) as c:
        yield c
    wait_idle(engine)


def _content(client, seed: int, finish: str = "stop", **fields) -> dict:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Describe json.dumps."}],
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": seed, "max_tokens": 160,
            "chat_template_kwargs": NO_THINK, **fields}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == finish, (choice, r.json()["usage"])
    return choice["message"]


@pytest.mark.parametrize("seed", range(4))
def test_response_format_json_schema(client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA, "strict": True}}
    jsonschema.validate(json.loads(_content(client, seed, response_format=fmt)["content"]), SCHEMA)


# json_object bounds nothing (the tiny model rambles inside strings at T=1), so a cut-off output would prove nothing
# about the constraint: these seeds' paths end within max_tokens on this model, and each must end with a parsed
# object ("{}" for seed 0, a nested object of several keys for seed 6). A path that stops ending is a failure.
@pytest.mark.parametrize("seed, nonempty", [(0, False), (6, True)])
def test_response_format_json_object(client, seed, nonempty):
    message = _content(client, seed, max_tokens=300, response_format={"type": "json_object"},
                       messages=[{"role": "user", "content": "Describe json.dumps as a JSON object."}])
    value = json.loads(message["content"])
    assert isinstance(value, dict) and bool(value) is nonempty, value


@pytest.mark.parametrize("seed", range(3))
def test_guided_fields(client, seed):
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", _content(client, seed, guided_regex=r"[a-z]{2,5}-[0-9]{2}")["content"])
    assert _content(client, seed, guided_choice=["alpha", "beta", "gamma"])["content"] in ("alpha", "beta", "gamma")
    grammar = 'root ::= "v" [0-9] "." [0-9]{1,2}'
    assert re.fullmatch(r"v[0-9]\.[0-9]{1,2}", _content(client, seed, guided_grammar=grammar)["content"])
    jsonschema.validate(json.loads(_content(client, seed, guided_json=SCHEMA)["content"]), SCHEMA)


def test_a_grammar_that_does_not_compile_is_a_400_naming_it(client):
    r = client.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": [{"role": "user", "content": "x"}],
                                                  "guided_grammar": "root ::= nowhere"})
    assert r.status_code == 400, r.text
    assert "nowhere" in r.json()["error"]["message"] and r.json()["error"]["param"] == "guided_grammar"


BAD_SCHEMA = {"type": "nonsense"}   # passes the shape checks, fails when the engine compiles it


@pytest.mark.parametrize("path,fields,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                         "schema": BAD_SCHEMA}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar"),
    ("/v1/completions", {"guided_json": BAD_SCHEMA}, "guided_json"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
     "text.format.schema"),
    ("/v1/messages", {"output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}},
     "output_config.format.schema"),
])
def test_a_constraint_that_does_not_compile_names_its_field(client, path, fields, param):
    """The engine compiles a request's constraint at submit; its refusal names the field the constraint came from
    (OpenAI routes: ``param`` and the message; Anthropic's errors have no param: the message)."""
    body = {"model": MODEL_ID, "max_tokens": 4, **fields}
    body.update({"prompt": "x"} if path == "/v1/completions" else
                {"input": "x"} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "x"}]})
    if path == "/v1/responses":
        body["max_output_tokens"] = body.pop("max_tokens")
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith(f"{param}: ") and "compile" in err["message"], err
    assert path == "/v1/messages" or err["param"] == param, err


# Short names: the template's tool instructions already take 2/3 of the test engine's 512-token context.
TOOL = {"type": "function", "function": {"name": "find", "parameters": {
    "type": "object", "properties": {"t": {"type": "string", "maxLength": 6},
                                     "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "x": {"type": "boolean"}},
    "required": ["t"], "additionalProperties": False}}}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "find"}}])
@pytest.mark.parametrize("thinking", [False, True])
def test_forced_tool_call_arguments_satisfy_the_schema(client, seed, tool_choice, thinking):
    """With thinking on, the grammar allows the reasoning first; these seeds close it within the context, so the
    call (and its schema) is always reached: a reasoning-only answer fails here."""
    msg = _content(client, seed, "tool_calls" if tool_choice == "required" else "stop", tools=[TOOL],
                   tool_choice=tool_choice, max_tokens=None, chat_template_kwargs={"enable_thinking": thinking},
                   parallel_tool_calls=False)  # else the tiny model may append call after call
    [call] = msg["tool_calls"]
    assert call["function"]["name"] == "find"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL["function"]["parameters"])
    assert bool(msg.get("reasoning_content")) is thinking


def _completion(client, seed: int, **fields) -> str:
    body = {"model": MODEL_ID, "prompt": "import json\n", "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "seed": seed, "max_tokens": 64, **fields}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", (choice, r.json()["usage"])
    return choice["text"]


@pytest.mark.parametrize("seed", range(3))
def test_completions_guided_fields(client, seed):
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", _completion(client, seed, guided_regex=r"[a-z]{2,5}-[0-9]{2}"))
    assert _completion(client, seed, guided_choice=["alpha", "beta"]) in ("alpha", "beta")
    assert re.fullmatch(r"v[0-9]\.[0-9]", _completion(client, seed, structured_outputs={"regex": r"v[0-9]\.[0-9]"}))
    fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA}}
    jsonschema.validate(json.loads(_completion(client, seed, response_format=fmt, max_tokens=160)), SCHEMA)


def test_completions_constraint_errors_name_the_field(client):
    for fields, param in (({"guided_choice": []}, "guided_choice"),
                          ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                          ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema")):
        r = client.post("/v1/completions", json={"model": MODEL_ID, "prompt": "x", **fields})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()


ANTHROPIC_TOOL = {"name": "find", "input_schema": TOOL["function"]["parameters"]}


# Anthropic requests carry no seed. Thinking off: each repeat samples anew at T=1 (the call comes first, so every
# path reaches it). Thinking on: greedy, a deterministic path that closes the thinking within the context, so the
# call is always reached (unseeded T=1 thinking may never close, and a thinking-only answer proves nothing).
@pytest.mark.parametrize("thinking, temperature, repeat", [("disabled", 1.0, 0), ("disabled", 1.0, 1),
                                                           ("disabled", 1.0, 2), ("enabled", 0.0, 0)])
@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "find"}])
def test_anthropic_forced_tool_input_satisfies_the_schema(client, thinking, temperature, repeat, tool_choice):
    body = {"model": MODEL_ID, "tools": [ANTHROPIC_TOOL], "temperature": temperature, "top_p": 1.0, "top_k": 0,
            "tool_choice": {**tool_choice, "disable_parallel_tool_use": True},  # else call after call
            "thinking": {"type": thinking, **({"budget_tokens": 1024} if thinking == "enabled" else {})},
            "messages": [{"role": "user", "content": "Find a book."}]}
    counted = client.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200, counted.text
    body["max_tokens"] = 512 - counted.json()["input_tokens"]  # all the room the test engine has
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop_reason"] == "tool_use", out
    assert [b["type"] for b in out["content"]] == (["thinking", "tool_use"] if thinking == "enabled" else ["tool_use"])
    [call] = [b for b in out["content"] if b["type"] == "tool_use"]
    assert call["name"] == "find"
    jsonschema.validate(call["input"], ANTHROPIC_TOOL["input_schema"])


# Structured outputs on /v1/messages (output_config.format, and the beta's output_format): the answer's text is JSON
# that satisfies the schema. Greedy (Anthropic requests carry no seed), with thinking off and on.
@pytest.mark.parametrize("thinking", ["disabled", "enabled"])
@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_anthropic_output_format_satisfies_the_schema(client, thinking, field):
    fmt = {"type": "json_schema", "schema": SCHEMA}
    body = {"model": MODEL_ID, "temperature": 0.0, "thinking": {"type": thinking},
            "messages": [{"role": "user", "content": "Describe a book."}],
            **({"output_config": {"format": fmt, "effort": "low"}} if field == "output_config" else {field: fmt})}
    counted = client.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200, counted.text
    body["max_tokens"] = 512 - counted.json()["input_tokens"]
    out = client.post("/v1/messages", json=body).json()
    assert out["stop_reason"] == "end_turn", out
    assert [b["type"] for b in out["content"]] == (["thinking", "text"] if thinking == "enabled" else ["text"])
    jsonschema.validate(json.loads(out["content"][-1]["text"]), SCHEMA)
    # The same request without the format answers in prose: the constraint, not the prompt, made the JSON.
    plain = {k: v for k, v in body.items() if k not in ("output_config", "output_format")}
    text = client.post("/v1/messages", json=plain).json()["content"][-1]["text"]
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_anthropic_output_format_errors(client):
    base = {"model": MODEL_ID, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    fmt = {"type": "json_schema", "schema": SCHEMA}
    for fields, needle in (
            ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
            ({"output_config": {"format": {"type": "xml", "schema": SCHEMA}}},
             "field 'output_config.format': type must be 'json_schema'"),
            # The wrong type is named, not the schema a text format would not have.
            ({"output_config": {"format": {"type": "text"}}}, "must be 'json_schema' (the one output format served), "
                                                             "got 'text'"),
            ({"output_format": {"type": "json_schema", "schema": {"type": "nonsense"}}}, "does not compile"),
            ({"output_config": {"format": fmt}, "output_format": fmt}, "only one output constraint"),
            ({"output_format": fmt, "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "any"}}, "forced tool call")):
        r = client.post("/v1/messages", json={**base, **fields})
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert needle in err["error"]["message"], err


def test_extension_fields_are_not_logged_as_unknown(caplog):
    """vLLM's guided_* / structured_outputs are read by the routes: body validation must not log them as ignored
    (a truly unknown field still is)."""
    import logging

    from ninfer_serve.body import validate
    from ninfer_serve.constraints import GUIDED
    from ninfer_serve.openai_models import ChatCompletionRequest, CompletionRequest

    assert frozenset(GUIDED) < ChatCompletionRequest.READ_FROM_EXTRA
    body = {"messages": [{"role": "user", "content": "hi"}], "guided_choice": ["a", "b"], "made_up_field": 1}
    with caplog.at_level(logging.WARNING):
        validate(ChatCompletionRequest, json.dumps(body).encode())
        validate(CompletionRequest, json.dumps({"prompt": "x", "structured_outputs": {"regex": "a+"}}).encode())
    assert "made_up_field" in caplog.text
    assert "guided_choice" not in caplog.text and "structured_outputs" not in caplog.text
