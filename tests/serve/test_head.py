"""``HEAD`` on the GET routes: the GET's status and headers, no body; errors (404, 503, 401) keep their
status, and a HEAD on a POST-only route is still a 405.

The TestClient (httpx) drops whatever body a HEAD response carries, so the last test reads the raw ASGI
messages to check that the app itself sends none."""

from __future__ import annotations

import asyncio

import pytest
from ninfer_serve import Gateway, ServeConfig, create_app
from serve_helpers import MODEL_ID, AsgiCall, client_for, scripted_engine

GET_ROUTES = ("/health", "/metrics", "/v1/models", f"/v1/models/{MODEL_ID}")
POST_ONLY = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
             "/detokenize")


@pytest.fixture(scope="module")
def client(scripted):
    with client_for(scripted) as c:
        yield c


def same_as_get(client, path: str, status: int, *, same_length: bool = True, **headers):
    """HEAD ``path``: ``status``, an empty body, and the GET's content-type and content-length (unless
    ``same_length`` is off: /metrics, whose counters may move between the two requests, and errors whose
    message names the method)."""
    got = client.get(path, headers=headers)
    head = client.head(path, headers=headers)
    assert (got.status_code, head.status_code) == (status, status), (got.text, head.headers)
    assert got.content and head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    if same_length and path != "/metrics":
        assert head.headers["content-length"] == got.headers["content-length"] == str(len(got.content))
    return head


def test_head_health(client):
    head = same_as_get(client, "/health", 200)
    assert head.headers["content-type"] == "application/json"


@pytest.mark.parametrize("path", GET_ROUTES)
def test_head_on_every_get_route(client, path):
    same_as_get(client, path, 200)


@pytest.mark.parametrize("path", ("/v1/models/nope", "/v1/models/org/other"))
def test_head_on_an_unknown_model_is_404(client, path):
    same_as_get(client, path, 404)


def test_head_on_an_unknown_path_is_404(client):
    same_as_get(client, "/no/such/path", 404, same_length=False)  # the message names the method


@pytest.mark.parametrize("path", POST_ONLY)
def test_head_on_a_post_only_route_is_405(client, path):
    r = client.head(path)
    assert r.status_code == 405 and r.content == b""
    assert "POST" in r.headers["allow"]


def test_head_health_while_shutting_down(scripted):
    gw = Gateway(scripted, ServeConfig(model_id=MODEL_ID))
    from litestar.testing import TestClient

    with TestClient(create_app(gw)) as c:
        gw.begin_shutdown()
        same_as_get(c, "/health", 503)
        same_as_get(c, "/v1/models", 200)  # metadata stays readable while draining


def test_head_health_on_a_closed_engine(engine):
    eng = scripted_engine(engine.frontend)
    with client_for(eng) as c:
        same_as_get(c, "/health", 200)
        eng.close()
        same_as_get(c, "/health", 503)


def test_head_with_an_api_key(scripted):
    with client_for(scripted, api_key="s3cret") as c:
        same_as_get(c, "/health", 200)  # open, as GET
        same_as_get(c, "/v1/models", 401)
        assert c.head("/v1/models").headers["www-authenticate"] == "Bearer"
        same_as_get(c, "/v1/models", 200, **{"x-api-key": "s3cret"})
        same_as_get(c, "/metrics", 200, authorization="Bearer s3cret")


def test_the_app_sends_no_body_on_head(scripted):
    app = create_app(Gateway(scripted, ServeConfig(model_id=MODEL_ID)))

    async def exchange(method: str, path: str) -> tuple[dict, bytes]:
        call = AsgiCall(app, path, method=method).start()
        start = await asyncio.wait_for(call.messages.get(), 10)
        body = await call.rest()
        await asyncio.wait_for(call.task, 10)
        return start, body

    async def scenario() -> None:
        for path, status in [*((p, 200) for p in GET_ROUTES), ("/v1/models/nope", 404), ("/no/such/path", 404),
                             *((p, 405) for p in POST_ONLY)]:
            head, head_body = await exchange("HEAD", path)
            got, got_body = await exchange("GET", path)
            assert (head["status"], got["status"], head_body) == (status, status, b""), path
            assert got_body, path
            same = {b"content-type", b"allow", b"www-authenticate"}
            if path not in ("/metrics", "/no/such/path"):
                same.add(b"content-length")
            assert ([h for h in head["headers"] if h[0] in same] == [h for h in got["headers"] if h[0] in same]), path

    asyncio.run(scenario())
