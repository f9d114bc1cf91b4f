"""API-key check (``--api-key``), as raw ASGI middleware around the whole app so it covers every path, routed or
not (:func:`ninfer_serve.app.create_app` wraps litestar's handler with it: route middleware would miss a request
no route matches, whose 404 lists the endpoints).

A request must carry the key as ``Authorization: Bearer KEY`` (OpenAI clients) or ``x-api-key: KEY``
(Anthropic clients). ``/health`` stays open for load balancers and orchestrators; so do the chat page's exact
paths when it is served (``extra_open``, :func:`ninfer_serve.routes_page.page_paths`: it holds no data, and every
API call it makes sends the key). Paths are matched exactly, never by prefix. ``/metrics`` needs the key like
every other path. With CORS on, a preflight (``OPTIONS`` with an ``Origin``) passes too: browsers send it
without credentials, and litestar's CORS layer answers it before any route with nothing but CORS headers.
Keys are compared in constant time (:func:`hmac.compare_digest`). A refusal is a 401 in the protocol's own error
shape, counted in the request metrics when it hits a generation endpoint.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from ninfer_serve.errors import INVALID_API_KEY, ApiError, error_body, protocol_of

OPEN_PATHS = frozenset({"/health"})
ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        n = name.lower()
        if n == b"x-api-key":
            return value.decode("latin-1").strip()
        if n == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return None


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, on_refused: Callable[[str], None], *,
                 open_preflights: bool = False, extra_open: frozenset[str] = frozenset()) -> None:
        self.app = app
        self._open = OPEN_PATHS | extra_open
        self._key = api_key.encode()
        self._on_refused = on_refused
        self._open_preflights = open_preflights

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self._open or (
                self._open_preflights and scope["method"] == "OPTIONS"
                and any(name.lower() == b"origin" for name, _ in scope.get("headers", []))):
            await self.app(scope, receive, send)
            return
        key = presented_key(scope.get("headers", []))
        if key is not None and hmac.compare_digest(key.encode(), self._key):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        self._on_refused(path)
        why = "missing API key" if key is None else "invalid API key"
        err = ApiError("authentication", f"{why}: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                       code=INVALID_API_KEY)
        payload = json.dumps(error_body(err, protocol_of(path))).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": payload})
