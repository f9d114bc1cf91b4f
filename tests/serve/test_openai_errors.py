"""OpenAI-compatible errors, seen through the official ``openai`` client (in process: the litestar test
client is an httpx client, so the openai client drives the ASGI app directly).

Error bodies carry OpenAI's ``type`` and ``code`` (context overflow is recognised by its code), keep vLLM's
values as ``status`` / ``status_type``, name ``--max-context`` when the context is the limit, and say "not
supported" for endpoints and values the server does not serve; ``reasoning_effort`` turns thinking on or off.
Anthropic routes keep Anthropic's shape.
"""

from __future__ import annotations

import openai
import pytest
from serve_helpers import MODEL_ID, chat, client_for

LONG = "word " * 600   # more tokens than the test engines' max_context of 512


@pytest.fixture(scope="module")
def http(scripted):
    with client_for(scripted) as c:
        yield c


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)


def _ask(client, content: str = "hi", **fields):
    fields.setdefault("model", MODEL_ID)
    return client.chat.completions.create(messages=[{"role": "user", "content": content}], **fields)


def test_context_overflow_is_recognisable_by_code(client):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, LONG, max_tokens=4)
    err = info.value
    assert err.code == "context_length_exceeded" and err.type == "invalid_request_error"
    assert err.param == "messages" and "--max-context" in err.message and "maximum context length is 512" \
        in err.message
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, max_tokens=100000)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    assert "--max-context" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_ID, prompt=LONG, max_tokens=2)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"


def test_a_prompt_the_engine_refuses_as_too_long_names_the_setting():
    """The engine's own PromptTooLongError (raised at submit) maps to the same code and names the setting."""
    from ninfer.contracts.errors import PromptTooLongError
    from ninfer_serve.errors import from_engine_error, openai_body

    err = openai_body(from_engine_error(PromptTooLongError("the prompt has 600 tokens"), prompt_param="prompt",
                                        at_submit=True))["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt" and err["status"] == 400
    assert err["message"] == "the prompt has 600 tokens (the server's --max-context)"


def test_unknown_model_is_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        _ask(client, model="gpt-9")
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert info.value.type == "invalid_request_error" and "gpt-9" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("other")
    assert info.value.code == "model_not_found"


def test_wrong_api_key_is_invalid_api_key(scripted):
    with client_for(scripted, api_key="s3cret") as http:
        bad = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="nope", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.code == "invalid_api_key" and "invalid API key" in info.value.message
        good = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="s3cret", http_client=http, max_retries=0)
        assert [m.id for m in good.models.list().data] == [MODEL_ID]


@pytest.mark.parametrize("call,param", [
    (lambda c: _ask(c, n=2), "n"),
    (lambda c: _ask(c, logit_bias={"5": 3.0}), "logit_bias"),
    (lambda c: _ask(c, modalities=["text", "audio"]), "modalities"),
    (lambda c: c.completions.create(model=MODEL_ID, prompt="x", suffix="y"), "suffix"),
    (lambda c: c.completions.create(model=MODEL_ID, prompt="x", best_of=3), "best_of"),
    (lambda c: c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}]}]), "messages[0].content[0].type"),
])
def test_unsupported_values_say_so(client, call, param):
    with pytest.raises(openai.BadRequestError) as info:
        call(client)
    assert info.value.code == "unsupported_value" and info.value.param == param
    assert "not supported" in info.value.message


def test_other_bad_values_have_no_code(client):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, temperature=5)
    assert info.value.code is None and info.value.param == "temperature"


def test_unsupported_endpoint_says_so_and_lists_the_served_ones(client, http):
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model=MODEL_ID, input="x")
    msg = info.value.message
    assert "POST /v1/embeddings is not supported by NInfer" in msg and "no route" not in msg
    assert "POST /v1/chat/completions" in msg and "GET /v1/models/{model_id}" in msg and "docs/http.md" in msg
    assert "HEAD" not in msg and "OPTIONS" not in msg
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "GET /v1/nothing is not supported by NInfer" in r.json()["error"]["message"]
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"]
    err = r.json()["error"]
    assert err["message"] == "this method is not supported on /v1/chat/completions: it accepts POST"
    r = http.post("/v1/models", json={})
    assert r.status_code == 405 and r.json()["error"]["message"].endswith("it accepts GET, HEAD")
    assert err["type"] == "invalid_request_error" and err["status_type"] == "MethodNotAllowedError"


def test_body_keeps_vllms_values_beside_openais(http):
    r = http.post("/v1/chat/completions", json={**chat("hi"), "model": "gpt-9"})
    assert r.json() == {"error": {
        "message": f"the model 'gpt-9' does not exist; this server serves '{MODEL_ID}'",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found",
        "status": 404, "status_type": "NotFoundError"}}
    err = http.post("/v1/chat/completions", content=b"{").json()["error"]
    assert (err["type"], err["code"], err["status"], err["status_type"]) == (
        "invalid_request_error", None, 400, "BadRequestError")


@pytest.mark.parametrize("exc,status,kind,code", [
    ("QueueFullError", 429, "requests", "rate_limit_exceeded"),
    ("QueueTimeoutError", 429, "requests", "rate_limit_exceeded"),
    ("EngineClosedError", 503, "server_error", None),
    ("DeadlineExceededError", 408, "timeout_error", None),
])
def test_engine_conditions_map_to_openai_types(exc, status, kind, code):
    import ninfer.contracts.errors as engine_errors
    from ninfer_serve.errors import from_engine_error, openai_body

    err = openai_body(from_engine_error(getattr(engine_errors, exc)("x")))["error"]
    assert (err["status"], err["type"], err["code"]) == (status, kind, code)


def test_anthropic_routes_keep_anthropics_shape(http):
    r = http.post("/v1/messages", json={"model": MODEL_ID, "max_tokens": 5,
                                        "messages": [{"role": "user", "content": LONG}]})
    body = r.json()
    assert r.status_code == 400 and set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == "invalid_request_error" and "--max-context" in body["error"]["message"]
    r = http.post("/v1/messages/batches", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert "POST /v1/messages/batches is not supported by NInfer" in r.json()["error"]["message"]


# -- reasoning_effort ----------------------------------------------------------------------------------------
def _tokens(http, **fields) -> list[int]:
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], **fields})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_reasoning_effort_maps_to_thinking_on_or_off(http):
    off, on = _tokens(http, chat_template_kwargs={"enable_thinking": False}), _tokens(http)
    assert off != on
    for effort in ("none", "minimal"):
        assert _tokens(http, reasoning_effort=effort) == off, effort
    for effort in ("low", "medium", "high", "xhigh"):
        assert _tokens(http, reasoning_effort=effort) == on, effort
    assert _tokens(http, reasoning_effort="none", chat_template_kwargs={"enable_thinking": False}) == off


def test_chat_applies_reasoning_effort(client):
    """The scripted answer is all the model writes: with thinking off it is the content; with thinking on the
    prompt opens a reasoning block, so the same text is reasoning."""
    off = _ask(client, "SCRIPT:ok", reasoning_effort="none", max_tokens=8).choices[0].message
    assert off.content == "ok" and getattr(off, "reasoning_content", None) is None
    on = _ask(client, "SCRIPT:ok", reasoning_effort="high", max_tokens=8).choices[0].message
    assert on.content != "ok" and getattr(on, "reasoning_content", None) == "ok"


@pytest.mark.parametrize("fields,needle", [
    ({"reasoning_effort": "extreme"}, "'none', 'minimal', 'low', 'medium', 'high' or 'xhigh'"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
     "reasoning_effort turns thinking off but chat_template_kwargs.enable_thinking is true"),
])
def test_a_bad_reasoning_effort_is_refused_naming_it(client, http, fields, needle):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, extra_body=fields)
    assert info.value.param == "reasoning_effort" and needle in info.value.message
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
