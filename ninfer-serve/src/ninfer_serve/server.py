"""Running the app under the production ASGI server (uvicorn; docs/http.md has the measurement
behind the choice).

One process, one event loop, one Engine: the engine's worker thread owns the model, and the event
loop only parses, submits and streams. On SIGTERM/SIGINT the gateway first stops taking generation
requests (503) and uvicorn then drains in-flight ones for up to ``shutdown_timeout_s``; whatever is
still running after that is cancelled when the engine closes.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import uvicorn

from ninfer_serve.app import create_app
from ninfer_serve.config import ServeConfig, parser_head_limit
from ninfer_serve.gateway import Gateway

log = logging.getLogger("ninfer.serve")


def log_config(level: str) -> dict[str, Any]:
    """Every server log line (uvicorn's, the access log, NInfer's) on stderr with a timestamp and a level."""
    handler = {"class": "logging.StreamHandler", "formatter": "timestamped", "stream": "ext://sys.stderr"}
    logger = {"handlers": ["stderr"], "level": level.upper(), "propagate": False}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"timestamped": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
            "handlers": {"stderr": handler},
            "loggers": {"uvicorn": logger, "uvicorn.error": {"level": level.upper()},
                        "uvicorn.access": logger, "ninfer": logger}}


class _Server(uvicorn.Server):
    """uvicorn's server, telling the gateway about a shutdown signal before connections drain, and the caller
    when it answers."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, on_ready: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._gateway = gateway
        self._on_ready = on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._on_ready is not None:
            self._on_ready()

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._gateway.begin_shutdown()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Route SIGINT/SIGTERM to :meth:`handle_exit` while serving. Unlike uvicorn's own version this
        does not re-raise the signal afterwards (which would kill the process with the default
        action): the caller still has to close the engine, and a drained shutdown exits with 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def preload_async_backend() -> None:
    """Load anyio's asyncio backend now. anyio imports it on first use, which is the gateway's first
    ``to_thread`` call: inside the first request, on the event loop, where its ~20 ms of imports delayed the
    first burst after start (every request in it) against later ones."""
    anyio.run(anyio.sleep, 0, backend="asyncio")


def serve(engine: Any, config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8080,
          log_level: str = "info", shutdown_timeout_s: float = 30.0, access_log: bool | None = None,
          sock: socket.socket | None = None, on_ready: Callable[[], None] | None = None) -> None:
    """Serve ``engine`` until a shutdown signal; the caller closes the engine afterwards.

    ``sock``: an address already bound (:func:`ninfer_serve.listen.reserve_address`), else ``host:port`` is
    bound now. ``on_ready`` is called once the server accepts connections. ``access_log`` (default: at
    ``log_level`` info or debug) logs one line per request."""
    preload_async_backend()
    gateway = Gateway(engine, config)
    app = create_app(gateway)
    if access_log is None:
        access_log = log_level in ("info", "debug", "trace")
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                               log_config=log_config(log_level), lifespan="off",
                               # h11 always (uvicorn sets no request-head limit on httptools, when installed): a
                               # request head past the parser's limit is refused before it is buffered whole.
                               http="h11", h11_max_incomplete_event_size=parser_head_limit(config.max_header_bytes),
                               timeout_graceful_shutdown=shutdown_timeout_s,
                               # Requests are long-lived streams; idle keep-alive sockets are cheap.
                               timeout_keep_alive=30, server_header=False)
    _Server(uv_config, gateway, on_ready).run(sockets=None if sock is None else [sock])
