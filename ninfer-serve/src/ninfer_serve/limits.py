"""The request-header size limit (``--max-header-kib``), as raw ASGI middleware so it covers every path.

A request whose headers (``name: value`` lines, as sent) add up to more than ``max_header_bytes`` is refused
with 431 in the protocol's own error shape, naming the limit and the flag, before any route or the API-key
check runs. The HTTP parser bounds what it buffers of an unfinished request head on its own
(:func:`ninfer_serve.config.parser_head_limit`): a head that keeps coming past that never reaches this check;
the server answers it with a bare 400 and closes the connection. Body size is litestar's
``request_max_body_size`` (413, :mod:`ninfer_serve.app`).
"""

from __future__ import annotations

import json
from typing import Any

from ninfer_serve.errors import ApiError, error_body, protocol_of


def header_bytes(headers: list[tuple[bytes, bytes]]) -> int:
    """Bytes the headers take on the wire: ``name: value\\r\\n`` per header."""
    return sum(len(name) + len(value) + 4 for name, value in headers)


class HeaderLimitMiddleware:
    def __init__(self, app: Any, max_header_bytes: int) -> None:
        self.app = app
        self._limit = max_header_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = header_bytes(scope.get("headers", []))
        if size <= self._limit:
            await self.app(scope, receive, send)
            return
        err = ApiError("headers_too_large", f"the request headers are {size} bytes, larger than this server's "
                                            f"limit of {self._limit / 2**10:g} KiB (--max-header-kib)")
        payload = json.dumps(error_body(err, protocol_of(scope["path"]))).encode()
        await send({"type": "http.response.start", "status": err.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
