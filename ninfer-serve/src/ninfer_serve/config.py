"""Server settings that are not engine options (those are ``EngineOptions``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    """- ``model_id``: the public model name clients must send (artifact ``metadata.name`` by default).
    - ``api_key``: when set, every endpoint but ``/health`` needs it (``Authorization: Bearer`` or
      ``x-api-key``).
    - ``keepalive_s``: an SSE stream idle this long (queueing, long prefill) gets a keep-alive, so
      proxies do not drop it and a vanished client is noticed while its request still waits.
    - ``max_body_bytes``: larger request bodies are refused with 413 before they are parsed.
    - ``allowed_origins``: browser origins allowed by CORS (``"*"``: any); empty (the default): no CORS headers,
      so browsers on other origins cannot read the responses."""

    model_id: str
    api_key: str | None = None
    keepalive_s: float = 5.0
    max_body_bytes: int = 32 * 2**20
    allowed_origins: tuple[str, ...] = ()
