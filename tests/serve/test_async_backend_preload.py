"""The server loads anyio's asyncio backend before it takes traffic: anyio imports it on first use (the gateway's
first ``to_thread`` call), which otherwise happens inside the first request, on the event loop, delaying every
request of the first burst after start."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHECK = """
import sys
from ninfer_serve.server import preload_async_backend
backend = "anyio._backends._asyncio"
before = backend in sys.modules
preload_async_backend()
print(before, backend in sys.modules)
"""


def test_the_asyncio_backend_is_loaded_before_the_first_request():
    # A fresh interpreter: in this one another test may have loaded the backend already.
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr


def test_serve_preloads_before_it_builds_the_app(monkeypatch):
    from ninfer_serve import server

    calls = []
    monkeypatch.setattr(server, "preload_async_backend", lambda: calls.append("preload"))

    def gateway(engine, config):
        calls.append("gateway")
        raise RuntimeError("stop before serving")

    monkeypatch.setattr(server, "Gateway", gateway)
    with pytest.raises(RuntimeError, match="stop before serving"):
        server.serve(object(), object())
    assert calls == ["preload", "gateway"]
