"""Schema-driven fuzzing of the HTTP API: schemathesis over the server's own OpenAPI document, plus hypothesis
strategies for nested chat messages, tools and response_format schemas.

The server does not serve an OpenAPI route (its handlers parse their bodies themselves and build their own
responses, so litestar's document has neither request bodies nor the real responses). The document here is
litestar's, generated from the server's own route handlers, completed with what litestar cannot see: each JSON
endpoint's request body from the pydantic request model that endpoint validates against, the media types the
handlers declare for their 200s (the page files, the Prometheus exposition, SSE for the generation routes), and
the error statuses of docs/http.md's error table (JSON bodies) on every operation.
Checks: no 5xx for any generated request; every response's status is one the document lists for its operation,
and its content type one the document lists for that status; every error body is OpenAI-shaped
(Anthropic-shaped on the Anthropic routes).
"""

from __future__ import annotations

import json
import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from litestar import Litestar  # noqa: E402
from litestar.openapi import OpenAPIConfig  # noqa: E402
from ninfer_serve import Gateway, ServeConfig, create_app  # noqa: E402
from serve_helpers import MODEL_ID, client_for, wait_idle  # noqa: E402

# A few per operation in CI (13 operations); ``HYPOTHESIS_PROFILE=explore`` hunts with many more.
EXAMPLES_PER_OPERATION = 300 if os.environ.get("HYPOTHESIS_PROFILE") == "explore" else 12
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def _bodies():
    from ninfer_serve.anthropic_models import CountTokensRequest, MessagesRequest
    from ninfer_serve.openai_models import ChatCompletionRequest, CompletionRequest
    from ninfer_serve.responses_models import ResponsesRequest
    from ninfer_serve.tokenize_models import DetokenizeRequest, TokenizeRequest

    return {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
            "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest,
            "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def openapi_document(app: Litestar) -> dict:
    """litestar's OpenAPI document for ``app``'s route handlers, with the request bodies the handlers parse.

    Registering the handlers in the document's app rebinds them (exception handlers included): build the app
    that serves requests after this."""
    handlers = dict.fromkeys(h for route in app.routes for h in route.route_handlers   # not litestar's OPTIONS
                             if getattr(h.fn, "__module__", "").startswith("ninfer_serve"))
    shadow = Litestar(route_handlers=list(handlers),
                      openapi_config=OpenAPIConfig(title="NInfer", version="1"))
    doc = shadow.openapi_schema.to_schema()
    for operations in doc["paths"].values():   # litestar's ``path`` converter (model ids hold slashes) is no URI
        for op in operations.values():
            for param in op.get("parameters", []):
                param.get("schema", {}).pop("format", None)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in _bodies().items():
        if path not in doc["paths"] or "post" not in doc["paths"][path]:
            continue
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        doc["paths"][path]["post"]["requestBody"] = {"required": True,
                                                     "content": {"application/json": {"schema": schema}}}
    _document_responses(doc)
    return doc


# docs/http.md, "Errors": every status an error can have but 500 (never expected: check_error_shape fails on 5xx
# first) and 499 (a client that went away reads nothing).
ERROR_STATUSES = ("400", "401", "404", "405", "413", "429", "431", "503")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


def _ok_media(path: str) -> set[str]:
    from ninfer_serve.metrics import CONTENT_TYPE
    from ninfer_serve.routes_page import PAGE_FILES

    if path == "/":
        return {PAGE_FILES["index.html"]}
    if path.startswith("/static/"):
        return set(PAGE_FILES.values())
    if path == "/metrics":
        return {CONTENT_TYPE}
    if path in GENERATION_PATHS:
        return {"application/json", "text/event-stream"}
    return {"application/json"}


def _document_responses(doc: dict) -> None:
    for path, operations in doc["paths"].items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            responses.setdefault("200", {"description": "OK"})["content"] = {t: {} for t in _ok_media(path)}
            for status in ERROR_STATUSES:
                responses[status] = {"description": "error", "content": {"application/json": {}}}


def _media(content_type: str) -> str:
    return content_type.split(";")[0].strip().lower()


def check_documented(op, status: int, content_type: str) -> None:
    """``status`` is listed for ``op`` in the document, and ``content_type`` for that status."""
    responses = op.definition.raw["responses"]
    assert str(status) in responses, f"{op.method.upper()} {op.path}: {status} is not in {sorted(responses)}"
    listed = {_media(t) for t in responses[str(status)].get("content", {})}
    assert _media(content_type) in listed, f"{op.method.upper()} {op.path} {status}: {content_type!r} not in {listed}"


def check_error_shape(path: str, status: int, body: bytes) -> None:
    assert status < 500, f"{path}: {status} {body[:300]!r}"
    if status < 400 or status == 499:
        return
    err = json.loads(body)
    if path in ANTHROPIC_PATHS:
        assert err["type"] == "error" and isinstance(err["error"]["message"], str), err
    else:
        e = err["error"]
        assert isinstance(e["message"], str) and e["message"] and isinstance(e["type"], str), err
        assert "param" in e and "code" in e and e["status"] == status, err


# Generation endpoints: every generated request is held to a few tokens (the scripted model otherwise writes
# until its context is full), so the run stays short; everything else in the body is as generated.
_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def _bounded(body):
    if isinstance(body, dict):
        for field in _TOKEN_FIELDS:
            if not isinstance(body.get(field), int) or body[field] > 4:
                body[field] = 4
    return body


@pytest.fixture(scope="module")
def api(scripted):
    doc = openapi_document(create_app(Gateway(scripted, ServeConfig(model_id=MODEL_ID))))
    client = client_for(scripted)
    with client:
        yield client, doc
    wait_idle(scripted)


def test_openapi_document_covers_every_route(api):
    client, doc = api
    paths = set(doc["paths"])
    assert {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/models"} <= paths
    assert "requestBody" in doc["paths"]["/v1/chat/completions"]["post"]


def test_the_conformance_check_refuses_what_the_document_does_not_list(api):
    _, doc = api
    ops = {(op.method.upper(), op.path): op for op in
           (r.ok() for r in schemathesis.openapi.from_dict(doc).get_all_operations())}
    models, metrics = ops[("GET", "/v1/models")], ops[("GET", "/metrics")]
    check_documented(models, 200, "application/json")
    check_documented(metrics, 200, "text/plain; version=0.0.4; charset=utf-8")
    check_documented(models, 429, "application/json")
    with pytest.raises(AssertionError, match="418"):
        check_documented(models, 418, "application/json")
    with pytest.raises(AssertionError, match="text/html"):
        check_documented(models, 200, "text/html; charset=utf-8")
    with pytest.raises(AssertionError, match="text/plain"):
        check_documented(models, 404, "text/plain")


def test_schemathesis_every_operation(api):
    """Generated requests for every operation of the document: no 5xx, errors shaped, responses conform."""
    client, doc = api
    schema = schemathesis.openapi.from_dict(doc)
    ops = [r.ok() for r in schema.get_all_operations()]
    assert ops
    for op in ops:
        if op.method.upper() != "HEAD":   # HEAD answers GET's headers with no body: nothing to check
            _fuzz_operation(client, op)


def _fuzz_operation(client, op) -> None:
    json_body = op.path in _bodies()

    @settings(max_examples=EXAMPLES_PER_OPERATION, suppress_health_check=list(HealthCheck), deadline=None)
    @given(case=op.as_strategy())
    def run(case):
        kwargs = {"json": _bounded(case.body)} if json_body else {}
        path = case.formatted_path
        resp = client.request(case.method, path, params=case.query or None, **kwargs)
        check_error_shape(op.path, resp.status_code, resp.content)
        check_documented(op, resp.status_code, resp.headers.get("content-type", ""))
        if resp.status_code < 400 and not resp.headers.get("content-type", "").startswith("text/event-stream"):
            assert resp.content, f"{case.method} {path}: empty {resp.status_code}"

    try:
        run()
    except Exception as exc:
        raise AssertionError(f"{op.method.upper()} {op.path}") from exc



# -- hypothesis strategies for what a chat request nests: messages, tools, JSON schemas ------------------
SCALAR_SCHEMA = st.one_of(
    st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null")]),
    st.lists(st.one_of(st.text(max_size=6), st.integers(-5, 5), st.none()), min_size=1, max_size=4)
    .map(lambda v: {"enum": v}),
    st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi}, st.integers(-99, 99),
              st.integers(-99, 99)),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(["^[a-z]+$", "[0-9]{2}", "(", "a|"])),
    # wrong types where a schema keyword expects another
    st.sampled_from([{"type": 5}, {"type": "nonsense"}, {"enum": "x"}, {"properties": []}, {"required": 3},
                     {"minLength": -1, "type": "string"}, {"items": 1, "type": "array"}, {"$ref": "#/nowhere"}]),
)
NAME = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
SCHEMA = st.recursive(
    SCALAR_SCHEMA,
    lambda inner: st.one_of(
        st.builds(lambda props, req: {"type": "object", "properties": props,
                                      "required": [k for k in props if req]},
                  st.dictionaries(NAME, inner, max_size=3), st.booleans()),
        st.builds(lambda items: {"type": "array", "items": items, "maxItems": 2}, inner),
        st.lists(inner, min_size=1, max_size=3).map(lambda alts: {"anyOf": alts}),
    ),
    max_leaves=8,
)
TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=24)
CONTENT = st.one_of(TEXT, st.none(), st.lists(st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, TEXT),
    st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "refusal", "bogus", 7])}),
), max_size=3))
TOOL = st.builds(lambda name, params, desc: {"type": "function", "function": {"name": name, "parameters": params,
                                                                               "description": desc}},
                 NAME, SCHEMA, TEXT)
TOOL_CALL = st.builds(lambda i, name, args: {"id": f"call_{i}", "type": "function",
                                             "function": {"name": name, "arguments": args}},
                      st.integers(0, 9), NAME, st.one_of(st.just("{}"), st.just('{"a": 1}'), TEXT))
MESSAGE = st.one_of(
    st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["system", "developer", "user"]), CONTENT),
    st.builds(lambda c, calls: {"role": "assistant", "content": c, **({"tool_calls": calls} if calls else {})},
              CONTENT, st.lists(TOOL_CALL, max_size=2)),
    st.builds(lambda i, c: {"role": "tool", "tool_call_id": f"call_{i}", "content": c}, st.integers(0, 9), CONTENT),
    st.fixed_dictionaries({"role": st.sampled_from(["wizard", "", 3])}, optional={"content": CONTENT}),
)
RESPONSE_FORMAT = st.one_of(
    st.none(), st.just({"type": "text"}), st.just({"type": "json_object"}),
    st.builds(lambda s, strict: {"type": "json_schema", "json_schema": {"name": "out", "schema": s, "strict": strict}},
              SCHEMA, st.booleans()),
    st.sampled_from([{"type": "json_schema"}, {"type": "xml"}, {"type": "json_schema", "json_schema": []}]),
)
TOOL_CHOICE = st.one_of(st.none(), st.sampled_from(["auto", "none", "required", "sometimes"]),
                        NAME.map(lambda n: {"type": "function", "function": {"name": n}}))


@settings(max_examples=EXAMPLES_PER_OPERATION * 2, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=st.lists(MESSAGE, min_size=1, max_size=4), tools=st.lists(TOOL, max_size=2),
       response_format=RESPONSE_FORMAT, tool_choice=TOOL_CHOICE, stream=st.booleans())
def test_nested_chat_requests(api, messages, tools, response_format, tool_choice, stream):
    """Nested messages, tools and response_format schemas: a 200 with choices or an OpenAI-shaped 4xx."""
    client, _ = api
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": 4, "stream": stream}
    for key, value in (("tools", tools), ("response_format", response_format), ("tool_choice", tool_choice)):
        if value:
            body[key] = value
    resp = client.post("/v1/chat/completions", json=body)
    check_error_shape("/v1/chat/completions", resp.status_code, resp.content)
    if resp.status_code == 200 and not stream:
        assert resp.json()["choices"], resp.text


# -- the constraint limits answer 400 naming the limit --------------------------------------------------
def _deep(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}}
    return s


@pytest.mark.parametrize("fields, limit", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": _deep(40)}}},
     "MAX_SCHEMA_DEPTH"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {
        "enum": list(range(5000))}}}}, "MAX_ENUM_MEMBERS"),
    ({"guided_regex": "(a|b)*" * 1000}, "MAX_REGEX_CHARS"),
    ({"guided_choice": [str(i) for i in range(5000)]}, "MAX_CHOICES"),
    ({"guided_grammar": 'root ::= "a"\n' + "# pad\n" * 50_000}, "MAX_SOURCE_BYTES"),
])
def test_constraint_limits_are_400s_naming_the_limit(api, fields, limit):
    """(The tools' limits are tests/constrained/test_grammar_limits.py's: rendered into a prompt, tools deep
    enough to pass one exceed this test server's 512-token context, which is checked first.)"""
    client, _ = api
    resp = client.post("/v1/chat/completions", json={"model": MODEL_ID, "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}], **fields})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert limit in err["message"] and err["type"] == "invalid_request_error", err


def test_a_slow_submit_does_not_stall_the_event_loop(scripted, monkeypatch):
    """``Engine.submit`` compiles the constraint (native, uninterruptible): it runs off the event loop, so
    /health answers while a submit is still compiling."""
    import asyncio
    import threading

    import httpx

    entered, release = threading.Event(), threading.Event()
    released_in_time: list[bool] = []   # False: the loop could not answer /health while submit was held
    real_submit = scripted.submit

    def slow_submit(*args, **kwargs):
        entered.set()
        released_in_time.append(release.wait(5))
        return real_submit(*args, **kwargs)

    monkeypatch.setattr(scripted, "submit", slow_submit)
    app = create_app(Gateway(scripted, ServeConfig(model_id=MODEL_ID)))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            chat = asyncio.create_task(client.post("/v1/chat/completions", json={
                "model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "SCRIPT:ok"}]}))
            await asyncio.to_thread(entered.wait, 10)
            health = await client.get("/health")
            release.set()
            return health, await chat

    try:
        health, chat = asyncio.run(main())
    finally:
        release.set()
    assert released_in_time == [True]
    assert health.status_code == 200 and chat.status_code == 200, (health.text, chat.text)
    wait_idle(scripted)
