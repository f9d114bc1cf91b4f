"""Server settings that are not engine options (those are ``EngineOptions``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ninfer_serve.media_policy import MediaPolicy


@dataclass(frozen=True)
class ServeConfig:
    """- ``model_id``: the public model name clients must send (artifact ``metadata.name`` by default).
    - ``api_key``: when set, every endpoint but ``/health`` and the chat page's files needs it
      (``Authorization: Bearer`` or ``x-api-key``), ``/metrics`` included (:mod:`ninfer_serve.auth`).
    - ``keepalive_s``: an SSE stream idle this long (queueing, long prefill) gets a keep-alive, so
      proxies do not drop it and a vanished client is noticed while its request still waits.
    - ``max_body_bytes``: larger request bodies are refused with 413 before they are parsed.
    - ``max_header_bytes``: requests whose headers are larger are refused with 431 (:mod:`ninfer_serve.limits`);
      the HTTP parser itself refuses a request head still unfinished past :func:`parser_head_limit` of it.
    - ``allowed_origins``: browser origins allowed by CORS (``"*"``: any); empty (the default): no CORS headers,
      so browsers on other origins cannot read the responses.
    - ``responses_store_size``: how many stored ``/v1/responses`` results the server keeps in memory for
      ``previous_response_id`` and ``GET /v1/responses/{id}`` (least recently used dropped first; 0 keeps none).
    - ``media``: where images and videos named by URL may come from (:mod:`ninfer_serve.media_policy`): data:
      URLs always; local files and http(s) URLs only as the operator allows (``--allowed-media-path``,
      ``--allow-remote-media``).
    - ``ui``: serve the chat page at ``/`` (:mod:`ninfer_serve.routes_page`); off: ``/`` is a 404."""

    model_id: str
    api_key: str | None = None
    keepalive_s: float = 5.0
    max_body_bytes: int = 32 * 2**20
    max_header_bytes: int = 16 * 2**10
    allowed_origins: tuple[str, ...] = ()
    responses_store_size: int = 256
    media: MediaPolicy = field(default_factory=MediaPolicy)
    ui: bool = True


def parser_head_limit(max_header_bytes: int) -> int:
    """The most bytes of an unfinished request head (request line and headers) the HTTP parser buffers while it
    waits for the rest; past it the request is refused (a 400, connection closed). Twice the header limit plus
    room for a long request line, so heads somewhat over the limit reach the app and get its 431 naming the
    limit, while a head that never ends is never held in memory beyond this (plus one socket read)."""
    return 2 * max_header_bytes + 8 * 2**10
