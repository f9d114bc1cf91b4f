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
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from ninfer_serve.app import create_app
from ninfer_serve.config import ServeConfig
from ninfer_serve.gateway import Gateway

log = logging.getLogger("ninfer.serve")


class _Server(uvicorn.Server):
    """uvicorn's server, telling the gateway about a shutdown signal before connections drain."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self._gateway = gateway

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


def serve(engine: Any, config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8080,
          log_level: str = "info", shutdown_timeout_s: float = 30.0, access_log: bool = False) -> None:
    """Serve ``engine`` until a shutdown signal; the caller closes the engine afterwards."""
    gateway = Gateway(engine, config)
    app = create_app(gateway)
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                               lifespan="off", timeout_graceful_shutdown=shutdown_timeout_s,
                               # Requests are long-lived streams; idle keep-alive sockets are cheap.
                               timeout_keep_alive=30, server_header=False)
    _Server(uv_config, gateway).run()
