"""Helpers shared by the gateway tests (imported by name: tests/serve is on sys.path under pytest)."""

from __future__ import annotations

import json
import time

from litestar.testing import TestClient
from ninfer_serve import Gateway, ServeConfig, create_app
from ninfer_serve.process import ServerStartError, free_port, wait_until_healthy

MODEL_ID = "qwen3_5-stdlib"  # the embedded default model's metadata.name


def scripted_engine(frontend, *, max_concurrency: int = 2, queue_capacity: int = 2, delay: float = 0.0,
                    **options):
    from ninfer import Engine
    from serve_scripted import ScriptedProgram

    program = ScriptedProgram(frontend, max_sequences=max_concurrency)
    program.delay = delay
    return Engine.from_parts(program, frontend, max_concurrency=max_concurrency, queue_capacity=queue_capacity,
                             max_context=512, **options)


def client_for(engine, **config) -> TestClient:
    config.setdefault("model_id", MODEL_ID)
    return TestClient(create_app(Gateway(engine, ServeConfig(**config))))


def wait_idle(engine, timeout: float = 10.0):
    """Wait until the engine holds no request (stats are published after each engine step), then drop the
    context cache's checkpoints (on by default) and check that nothing at all is held: no request, KV page
    or state slot leaked outside the cache."""
    end = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if s.outstanding == 0 and s.running == 0 and s.state_slots_used == 0:
            engine.clear_context_cache(timeout=timeout)
            s = engine.stats()
            if s.pages_used == 0 and s.cache_checkpoints == 0:
                return s
        if time.monotonic() > end:
            raise AssertionError(f"engine still holds requests: {s}")
        time.sleep(0.01)


def sse_data(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def sse_json(text: str) -> list[dict]:
    return [json.loads(d) for d in sse_data(text) if d != "[DONE]"]


def chat(content: str, **fields) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], **fields}


class AsgiCall:
    """One HTTP request driven straight through the ASGI interface, so a test can hold a stream open,
    read it chunk by chunk, run other requests meanwhile, and disconnect at a moment of its choosing
    (litestar's TestClient buffers whole responses and never disconnects)."""

    def __init__(self, app, path: str, payload: dict | None = None, method: str = "POST") -> None:
        import asyncio

        self.app, self.path, self.method = app, path, method
        self.body = json.dumps(payload).encode() if payload is not None else b""
        self.messages: asyncio.Queue = asyncio.Queue()
        self.disconnected = asyncio.Event()
        self.task = None

    def start(self):
        import asyncio

        self.task = asyncio.ensure_future(self._run())
        return self

    async def _run(self) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000),
                 "server": ("127.0.0.1", 80),
                 "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(self.body)).encode())]}
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            await self.disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await self.messages.put(message)

        await self.app(scope, receive, send)

    async def status(self, timeout: float = 10.0) -> int:
        import asyncio

        message = await asyncio.wait_for(self.messages.get(), timeout)
        assert message["type"] == "http.response.start", message
        return message["status"]

    async def chunk(self, timeout: float = 10.0) -> bytes:
        import asyncio

        while True:
            message = await asyncio.wait_for(self.messages.get(), timeout)
            if message["type"] == "http.response.body" and (message.get("body") or not message.get("more_body")):
                return message.get("body", b"")

    async def rest(self, timeout: float = 30.0) -> bytes:
        """The remaining body, until the response ends."""
        import asyncio

        out = b""
        while True:
            message = await asyncio.wait_for(self.messages.get(), timeout)
            out += message.get("body", b"")
            if not message.get("more_body"):
                return out

    async def disconnect(self, timeout: float = 10.0) -> None:
        import asyncio

        self.disconnected.set()
        await asyncio.wait_for(self.task, timeout)


def start_server_process(artifact, *args: str, timeout: float = 120):
    """``ninfer serve ARTIFACT --host 127.0.0.1 --port <free> *args`` in a subprocess, once /health answers.
    Returns (base_url, Popen); the caller stops it (SIGTERM)."""
    import os
    import subprocess
    import sys

    import pytest

    port = free_port()
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", str(artifact), "--host", "127.0.0.1", "--port",
           str(port), *args]
    proc = subprocess.Popen(cmd, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc, timeout)
    except ServerStartError as exc:
        proc.kill()
        pytest.fail(f"ninfer serve did not start ({exc}):\n{proc.communicate()[0]}")
    return base, proc
