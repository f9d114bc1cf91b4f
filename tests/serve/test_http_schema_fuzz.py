"""Schema-driven fuzzing of the HTTP API: schemathesis over the server's own OpenAPI document, plus hypothesis
strategies for nested chat messages, tools and response_format schemas.

The server does not serve an OpenAPI route (its handlers parse their bodies themselves, so litestar's document
has no request bodies). The document here is litestar's, generated from the server's own route handlers, with
each JSON endpoint's request body filled in from the pydantic request model that endpoint validates against.
Checks: no 5xx for any generated request; every response matches the document's status codes and content types;
every error body is OpenAI-shaped (Anthropic-shaped on the Anthropic routes).
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
    return doc


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


def test_schemathesis_every_operation(api):
    """Generated requests for every operation of the document: no 5xx, errors shaped, responses conform."""
    client, doc = api
    schema = schemathesis.openapi.from_dict(doc)
    ops = [r.ok() for r in schema.get_all_operations()]
    assert ops
    for op in ops:
        if op.method.upper() == "HEAD":
            continue

        @settings(max_examples=EXAMPLES_PER_OPERATION, suppress_health_check=list(HealthCheck), deadline=None)
        @given(case=op.as_strategy())
        def run(case):
            body = _bounded(case.body) if op.path in _bodies() else case.body
            kwargs = {"json": body} if op.path in _bodies() else {}
            path = case.formatted_path
            resp = client.request(case.method, path, params=case.query or None, **kwargs)
            check_error_shape(op.path, resp.status_code, resp.content)
            if resp.status_code < 400 and not resp.headers.get("content-type", "").startswith("text/event-stream"):
                assert resp.content, f"{case.method} {path}: empty {resp.status_code}"

        try:
            run()
        except Exception as exc:
            raise AssertionError(f"{op.method.upper()} {op.path}") from exc

