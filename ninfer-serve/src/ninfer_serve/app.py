"""The litestar application: routes, error handling, the request gates (header size limit, API key), and
per-app state.

:func:`create_app` takes an already started :class:`Gateway` (the server module builds the engine,
warms it up and owns its lifetime), so tests can serve one engine through several apps. Every error
leaves through one exception handler that writes it in the request's protocol shape; an unexpected
exception is logged with its traceback and answered with a generic 500, never a traceback. A request
no route matches is a 404 saying the endpoint is not supported and listing those that are.

``HEAD``: the GET routes accept it and run their GET handler (routes_system); :func:`drop_head_body`,
a before-send hook that sees every response the app sends (errors and unrouted requests included),
then empties the body of any response to a HEAD request. Status and headers stay the GET's
(``content-length`` included, as RFC 9110 allows), so a HEAD that would 404 or 503 does so too, and a
HEAD on a POST-only route is still a 405 (with ``Allow``), just without the error body.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from litestar import Litestar, Request, Response
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from ninfer.contracts.errors import InvalidRequestError

from ninfer_serve.auth import ApiKeyMiddleware
from ninfer_serve.disconnect import ClientDisconnected
from ninfer_serve.errors import ApiError, error_body, protocol_of
from ninfer_serve.gateway import Gateway
from ninfer_serve.limits import HeaderLimitMiddleware
from ninfer_serve.responses_route import create_response, delete_response, retrieve_response
from ninfer_serve.responses_store import ResponseStore
from ninfer_serve.routes_anthropic import count_tokens, messages
from ninfer_serve.routes_chat import chat_completions
from ninfer_serve.routes_completions import completions
from ninfer_serve.routes_page import PAGE_ROUTES, page_paths
from ninfer_serve.routes_system import get_model, health, list_models, metrics, reset_prefix_cache
from ninfer_serve.routes_tokenize import detokenize, tokenize

log = logging.getLogger("ninfer.serve")

GENERATION_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})


def supported_endpoints(app: Litestar) -> list[str]:
    """``METHOD /path`` of every route (HEAD and OPTIONS, which follow GET and any route, left out)."""
    out = []
    for route in app.routes:
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)   # "{model_id:path}" -> "{model_id}"
        out += [f"{m} {path}" for m in sorted(route.methods - {"HEAD", "OPTIONS"})]
    return out


def outcome_of(status: int) -> str:
    if status in (429, 503):
        return "rejected"
    return "invalid" if status < 500 else "error"


def _handler(request: Request, exc: Exception) -> Response:
    gw: Gateway = request.app.state.gateway
    path = request.scope["path"]
    if isinstance(exc, ClientDisconnected):
        # Nobody reads this; the generation already counted itself as cancelled.
        return Response(b"", status_code=499)
    if isinstance(exc, ApiError):
        err = exc
    elif isinstance(exc, HTTPException):
        detail = exc.detail if isinstance(exc.detail, str) and exc.detail else "request refused"
        if exc.status_code == 404:
            detail = (f"{request.method} {path} is not supported by NInfer; the endpoints it serves are "
                      f"{', '.join(supported_endpoints(request.app))} (docs/http.md)")
        elif exc.status_code == 405:
            # OPTIONS is answered on every route: not worth naming. No request method in the text: a HEAD's
            # length must stay the GET's.
            allow = (exc.headers or {}).get("allow", "")
            allowed = ", ".join(sorted({m.strip() for m in allow.split(",")} - {"", "OPTIONS"}))
            detail = f"this method is not supported on {path}: it accepts {allowed or 'other methods'}"
        elif exc.status_code == 413:
            detail = (f"the request body is larger than this server's limit of "
                      f"{gw.config.max_body_bytes / 2**20:g} MiB (--max-body-mib)")
        err = ApiError.for_status(exc.status_code, detail)
    elif isinstance(exc, InvalidRequestError):   # raised by the frontend outside a submit (tokenize, count)
        err = ApiError("invalid_request", str(exc))
    else:
        log.exception("unhandled error on %s %s", request.method, path)
        err = ApiError("internal", "internal server error")
    if path in GENERATION_ENDPOINTS:
        gw.metrics.count(path, outcome_of(err.status))
    headers = dict(exc.headers) if isinstance(exc, HTTPException) and exc.headers else None  # e.g. 405's Allow
    return Response(error_body(err, protocol_of(path)), status_code=err.status, headers=headers)


async def drop_head_body(message: dict[str, Any], scope: dict[str, Any]) -> None:
    if scope.get("method") == "HEAD" and message["type"] == "http.response.body":
        message["body"] = b""


def create_app(gateway: Gateway) -> Litestar:
    config = gateway.config
    app = Litestar(
        route_handlers=[chat_completions, completions, messages, count_tokens, create_response, retrieve_response,
                        delete_response, list_models, get_model, tokenize, detokenize, health, metrics,
                        reset_prefix_cache,
                        *(PAGE_ROUTES if config.ui else [])],
        exception_handlers={Exception: _handler},
        before_send=[drop_head_body],
        state=State({"gateway": gateway, "responses": ResponseStore(config.responses_store_size)}),
        request_max_body_size=config.max_body_bytes,
        # Off unless origins are given; a preflight passes the API-key check (it carries no key) to be answered here.
        cors_config=(CORSConfig(allow_origins=list(config.allowed_origins), allow_methods=["*"],
                                allow_headers=["*"]) if config.allowed_origins else None),
        openapi_config=None,
        logging_config=None,
        debug=False,
    )
    # The gates wrap litestar's whole handler (routing, CORS, error handling), not its routes: route middleware
    # never sees a request no route matches, and that one too must be refused without the key. Outermost
    # first: an oversized request is refused before the key is looked at. Their responses still pass the
    # before-send hooks (HEAD bodies dropped).
    gate = app.asgi_handler
    if config.api_key:
        gate = ApiKeyMiddleware(gate, config.api_key, open_preflights=bool(config.allowed_origins),
                                extra_open=page_paths() if config.ui else frozenset(),
                                on_refused=lambda path: gateway.metrics.count(path, "unauthorized")
                                if path in GENERATION_ENDPOINTS else None)
    app.asgi_handler = HeaderLimitMiddleware(gate, config.max_header_bytes)
    return app
