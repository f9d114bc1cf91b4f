"""Bad input of every kind: each gets a clear error in its protocol's shape and status, and none of it
harms the server or other requests (checked at the end: the engine holds nothing, a request works)."""

from __future__ import annotations

import random
import threading

import pytest
from ninfer_serve import Gateway, ServeConfig, create_app
from serve_helpers import MODEL_ID, chat, client_for, scripted_engine, wait_idle

GEN_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
ALL_POST = GEN_ENDPOINTS + ("/v1/messages/count_tokens", "/tokenize", "/detokenize")


@pytest.fixture(scope="module")
def client(scripted):
    with client_for(scripted) as c:
        yield c


def openai_error(r, status: int, param: str | None = "unset") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code", "status", "status_type"} and err["message"]
    assert err["status"] == status and err["type"] in ("invalid_request_error", "requests", "server_error")
    if param != "unset":
        assert err["param"] == param, err
    return err


def anthropic_error(r, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("path", ALL_POST)
@pytest.mark.parametrize("raw", [b"{", b"", b"\xff\xfe", b"[1, 2]", b'"text"', b'{"a": NaN}', b"[" * 100000])
def test_malformed_bodies(client, path, raw):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    if path.startswith("/v1/messages"):
        msg = anthropic_error(r, 400, "invalid_request_error")["message"]
    else:
        msg = openai_error(r, 400)["message"]
    assert "JSON" in msg or "object" in msg


@pytest.mark.parametrize("fields,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": 2**64}, "seed"), ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": -1},
                                                                     "max_completion_tokens"),
    ({"stop": [""]}, "stop"), ({"stop": ["s"] * 17}, "stop"), ({"n": 2}, "n"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),   # compiled at submit: the field it came from
    ({"logit_bias": {"5": 3.0}}, "logit_bias"), ({"modalities": ["audio"]}, "modalities"),
    ({"stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),   # without stream: true (vLLM refuses it too)
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     "messages[0].content[0].image_url.url"),   # remote media is off by default
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"tools": [{"type": "function", "function": {"name": "bad name>"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": ["string", "integer"]}}}}}], "tool_choice": "required"}, "tools"),  # no unambiguous grammar
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, "messages"),
    ({"max_tokens": 100000}, "max_tokens"),
])
def test_chat_schema_violations_name_the_field(client, fields, param):
    r = client.post("/v1/chat/completions", json={**chat("hi"), **fields})
    openai_error(r, 400, param)


@pytest.mark.parametrize("fields,param", [
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [10**9]}, "prompt[0]"),
    ({"prompt": []}, "prompt"), ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"),
    ({"logprobs": 50}, "logprobs"), ({"echo": "loud"}, "echo"), ({"prompt": [True, 5]}, "prompt[0]"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
])
def test_completions_violations(client, fields, param):
    openai_error(client.post("/v1/completions", json={"prompt": "x", **fields}), 400, param)


VLLM_REFUSED = [("prompt_logprobs", 0), ("use_beam_search", True), ("bad_words", ["no"]),
                ("allowed_token_ids", list(range(100))), ("truncate_prompt_tokens", 8)]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_vllm_extensions_that_would_change_the_output_are_refused_by_name(client, path):
    # vLLM honours these; dropping them as unknown fields would answer a different request without a word.
    base = chat("hi") if path == "/v1/chat/completions" else {"prompt": "x", "max_tokens": 2}
    for field, value in VLLM_REFUSED:
        err = openai_error(client.post(path, json={**base, field: value}), 400, field)
        assert err["code"] == "unsupported_value" and f"{field}=" in err["message"] and \
            "is not supported" in err["message"] and len(err["message"]) < 250, err
    # Their neutral values change nothing and are accepted.
    neutral = {"min_tokens": 0, "prompt_logprobs": None, "use_beam_search": False, "bad_words": [],
               "allowed_token_ids": None, "include_stop_str_in_output": False, "truncate_prompt_tokens": None}
    assert client.post(path, json={**base, **neutral}).status_code == 200
    nulls = {"min_tokens": None, "use_beam_search": None, "bad_words": None, "include_stop_str_in_output": None}
    assert client.post(path, json={**base, **nulls}).status_code == 200
    # Strict types: a JSON true is not a count, and "yes" is not a boolean.
    for field, value in (("min_tokens", True), ("min_tokens", "3"), ("min_tokens", 1.5),
                         ("include_stop_str_in_output", "yes"), ("include_stop_str_in_output", 1),
                         ("use_beam_search", "false")):
        openai_error(client.post(path, json={**base, field: value}), 400, field)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_min_tokens_is_honoured_within_max_tokens(client, path):
    base = (chat("hi", max_tokens=6) if path == "/v1/chat/completions" else {"prompt": "x", "max_tokens": 6})
    err = openai_error(client.post(path, json={**base, "min_tokens": 7}), 400, "min_tokens")
    assert err["message"] == "min_tokens (7) must be at most max_tokens (6)"
    openai_error(client.post(path, json={**base, "min_tokens": -1}), 400, "min_tokens")
    r = client.post(path, json={**base, "min_tokens": 6})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    # Without a length field the bound is what the request did not set: Completions' default, or (chat) the context
    # left after the prompt.
    unset = {k: v for k, v in base.items() if k != "max_tokens"}
    err = openai_error(client.post(path, json={**unset, "min_tokens": 100_000}), 400, "min_tokens")
    want = ("the output budget (" if path == "/v1/chat/completions" else "max_tokens (16, its default: the request "
                                                                          "did not set it)")
    assert err["message"].startswith(f"min_tokens (100000) must be at most {want}"), err


@pytest.mark.parametrize("fields,needle", [
    ({"max_tokens": None}, "max_tokens"), ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"tool_choice": {"type": "tool"}}, "name"), ({"temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "1", "name": "f", "input": {}}]}]},
     "assistant"),
])
def test_anthropic_violations(client, fields, needle):
    req = {"model": MODEL_ID, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **fields}
    err = anthropic_error(client.post("/v1/messages", json=req), 400, "invalid_request_error")
    assert needle in err["message"]


def test_tokenize_detokenize_violations(client):
    openai_error(client.post("/detokenize", json={"tokens": [1, 10**9]}), 400, "tokens[1]")
    openai_error(client.post("/detokenize", json={"tokens": [False]}), 400, "tokens[0]")
    openai_error(client.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}), 400)
    openai_error(client.post("/tokenize", json={"model": "x", "prompt": "a"}), 404, "model")
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


LONE = '"a \\ud800 b"'   # JSON text of a string holding a lone UTF-16 surrogate (valid JSON, not Unicode)


@pytest.mark.parametrize("path,raw", [(path, raw.replace("LONE", LONE).replace("MODEL", MODEL_ID)) for path, raw in [
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":LONE}],"max_tokens":2}'),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":LONE}],"max_tokens":2,"stream":true}'),
    ("/v1/completions", '{"prompt":LONE,"max_tokens":2}'),
    ("/v1/messages", '{"model":"MODEL","max_tokens":2,"system":LONE,"messages":[{"role":"user","content":"hi"}]}'),
    ("/v1/messages/count_tokens", '{"model":"MODEL","messages":[{"role":"user","content":LONE}]}'),
    ("/tokenize", '{"prompt":LONE}'),
    ("/v1/chat/completions", '{"model":LONE,"messages":[{"role":"user","content":"hi"}]}'),
]])
def test_a_lone_surrogate_is_a_400_naming_it(client, path, raw):
    """Text with a lone surrogate (JSON allows the escape; it is not Unicode) is refused naming it, in the
    protocol's shape; a model name holding one is a 404 whose message still encodes (was a 500)."""
    r = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    if '"model":"a' in raw:
        assert "\\ud800" in openai_error(r, 404, "model")["message"]
    elif path.startswith("/v1/messages"):
        assert "U+D800" in anthropic_error(r, 400, "invalid_request_error")["message"]
    else:
        assert "lone UTF-16 surrogate U+D800" in openai_error(r, 400)["message"]


def test_pathologically_nested_input_is_a_400(client):
    nested = '{"a":' * 900 + "1" + "}" * 900
    raw = '{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"x":' + nested + "}}"
    assert "nested too deeply" in openai_error(client.post("/v1/chat/completions", content=raw.encode()),
                                               400)["message"]


def test_unknown_model_is_404_in_both_shapes(client):
    assert openai_error(client.post("/v1/chat/completions", json={**chat("hi"), "model": "gpt-9"}), 404,
                        "model")["code"] == "model_not_found"
    assert openai_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    anthropic_error(client.post("/v1/messages", json={"model": "claude", "max_tokens": 5,
                                                      "messages": [{"role": "user", "content": "hi"}]}),
                    404, "not_found_error")


def test_routing_errors_and_body_limit(scripted):
    with client_for(scripted, max_body_bytes=4096) as c:
        openai_error(c.get("/v1/nothing"), 404)
        assert c.get("/v1/chat/completions").status_code == 405
        anthropic_error(c.post("/v1/messages", content=b"x" * 5000), 413, "request_too_large")
        err = openai_error(c.post("/v1/chat/completions", content=b"x" * 5000), 413)
        assert "limit of 0.00390625 MiB (--max-body-mib)" in err["message"]


def test_unknown_fields_are_ignored(client):
    r = client.post("/v1/chat/completions", json={**chat("SCRIPT:ok"), "some_future_field": {"x": 1},
                                                  "user": "u1", "metadata": {"k": "v"}, "logit_bias": {"5": 0}})
    assert r.status_code == 200, r.text


def test_api_key(scripted):
    with client_for(scripted, api_key="s3cret") as c:
        assert c.get("/health").status_code == 200  # open for load balancers
        assert "missing" in openai_error(c.get("/v1/models"), 401)["message"]
        openai_error(c.post("/v1/chat/completions", json=chat("hi"), headers={"Authorization": "Bearer nope"}), 401)
        anthropic_error(c.post("/v1/messages", json={}), 401, "authentication_error")
        anthropic_error(c.post("/v1/messages", json={}, headers={"x-api-key": "wrong"}), 401,
                        "authentication_error")
        assert c.get("/metrics").status_code == 401
        ok = c.post("/v1/chat/completions", json=chat("SCRIPT:fine", max_tokens=8),
                    headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
        assert 'outcome="unauthorized"' in c.get("/metrics", headers={"x-api-key": "s3cret"}).text


def test_shutting_down_is_503(scripted):
    gw = Gateway(scripted, ServeConfig(model_id=MODEL_ID))
    from litestar.testing import TestClient

    with TestClient(create_app(gw)) as c:
        gw.begin_shutdown()
        assert c.get("/health").status_code == 503
        openai_error(c.post("/v1/chat/completions", json=chat("hi")), 503)
        anthropic_error(c.post("/v1/messages", json={"model": MODEL_ID, "max_tokens": 5,
                                                     "messages": [{"role": "user", "content": "hi"}]}),
                        503, "overloaded_error")
        assert c.get("/v1/models").status_code == 200  # metadata stays readable while draining


def test_closed_engine_is_503(engine):
    eng = scripted_engine(engine.frontend)
    with client_for(eng) as c:
        eng.close()
        assert c.get("/health").json() == {"status": "unavailable"}
        openai_error(c.post("/v1/completions", json={"prompt": "x"}), 503)


def test_random_garbage_never_crashes(client, scripted):
    rng = random.Random(7)
    values = [None, True, -1, 0, 2**70, 1e308, "x", "", [], {}, [1, "a"], {"role": "user"}, "\u0000\ud7ff"]
    keys = ["model", "messages", "prompt", "max_tokens", "temperature", "stream", "tools", "tool_choice", "stop",
            "n", "logprobs", "top_logprobs", "seed", "system", "tokens", "chat_template_kwargs", "thinking"]
    statuses = set()
    for i in range(150):
        path = ALL_POST[i % len(ALL_POST)]
        payload = {rng.choice(keys): rng.choice(values) for _ in range(rng.randint(0, 5))}
        r = client.post(path, json=payload)
        statuses.add(r.status_code)
        assert r.status_code < 500, (path, payload, r.text)
    assert statuses <= {200, 400, 404}
    wait_idle(scripted)


def test_concurrent_good_and_bad_requests(client, scripted):
    results: dict[int, int] = {}

    def good(i):
        r = client.post("/v1/chat/completions", json=chat(f"SCRIPT:answer {i}", chat_template_kwargs={
            "enable_thinking": False}))
        results[i] = r.status_code
        assert r.json()["choices"][0]["message"]["content"] == f"answer {i}"

    def bad(i):
        results[100 + i] = client.post("/v1/chat/completions", content=b"{oops").status_code

    threads = [threading.Thread(target=good if i % 2 else bad, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results.values()) == [200] * 4 + [400] * 4
    wait_idle(scripted)


def test_a_union_field_lists_its_alternatives(client):
    """A value no member of a union field accepts: one message with each alternative's expectation, no model class
    names, no 'more problems' for the alternatives themselves."""
    msg = openai_error(client.post("/v1/chat/completions", json={**chat("hi"), "tool_choice": "sometimes"}), 400,
                       "tool_choice")["message"]
    assert "'none', 'auto' or 'required'" in msg and "an object" in msg
    assert "NamedToolChoice" not in msg and "more problems" not in msg
    msg = openai_error(client.post("/v1/chat/completions", json={**chat("hi"), "stop": 5}), 400, "stop")["message"]
    assert "valid string; or: Input should be a valid list" in msg and "more problems" not in msg


def test_an_engine_failure_message_is_not_prefixed_twice():
    from ninfer.contracts.errors import EngineFailure
    from ninfer_serve.errors import from_engine_error

    prefix = "the engine failed and accepts no requests: "
    again = from_engine_error(EngineFailure(prefix + "worker crashed"))   # Engine.submit's own wording
    assert again.status == 503 and again.message == prefix + "worker crashed"
    assert from_engine_error(EngineFailure("worker crashed")).message == prefix + "worker crashed"
