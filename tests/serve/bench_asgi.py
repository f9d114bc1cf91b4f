"""Measure the ASGI servers NInfer could run under, with the real app and the embedded default model.

Not a test (pytest does not collect it). Each server runs in its own process serving the same app
(one engine, CPU, bfloat16); the client runs in this process:

  A. GET /v1/models, 8 concurrent connections, 1500 requests: requests/s and p50/p99 latency
     (pure server + framework overhead).
  B. 4 concurrent streaming chat completions of 96 tokens (ignore_eos, greedy), 3 rounds: wall time,
     streamed chunks/s and the client-side mean gap between chunks.
  C. 24 non-streaming chat completions of 4 tokens, 4 concurrent: requests/s.

Usage: NINFER_CACHE_DIR=... python tests/serve/bench_asgi.py [uvicorn-h11 uvicorn-httptools granian ...]
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import httpx
from ninfer_serve.process import ServerStartError, free_port, wait_until_healthy

SERVERS = ("uvicorn-h11", "uvicorn-httptools", "granian")


def _serve(kind: str, port: int) -> None:
    from ninfer import Engine
    from ninfer.model_source import resolve_model
    from ninfer_serve import Gateway, ServeConfig, create_app
    from ninfer_serve.warmup import warm_up

    engine = Engine.start(resolve_model(None), device="cpu", dtype="bfloat16", max_concurrency=4, max_context=512)
    warm_up(engine)
    app = create_app(Gateway(engine, ServeConfig(model_id="m")))
    if kind.startswith("uvicorn"):
        import uvicorn

        http = "h11" if kind == "uvicorn-h11" else "httptools"
        uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http, loop="asyncio",
                                      lifespan="off", log_level="warning", access_log=False)).run()
    else:
        from granian.constants import Interfaces
        from granian.server.embed import Server

        async def main() -> None:
            await Server(app, address="127.0.0.1", port=port, interface=Interfaces.ASGI, log_enabled=False).serve()

        asyncio.run(main())


async def _bench(port: int) -> dict[str, float]:
    base = f"http://127.0.0.1:{port}"
    out: dict[str, float] = {}
    limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as c:
        lat: list[float] = []
        queue = iter(range(1500))

        async def models_worker() -> None:
            for _ in queue:
                t = time.perf_counter()
                r = await c.get("/v1/models")
                r.raise_for_status()
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(models_worker() for _ in range(8)))
        out["models_rps"] = len(lat) / (time.perf_counter() - t0)
        lat.sort()
        out["models_p50_ms"] = 1000 * lat[len(lat) // 2]
        out["models_p99_ms"] = 1000 * lat[int(len(lat) * 0.99)]

        body = {"messages": [{"role": "user", "content": "Explain os.path.join."}], "max_tokens": 96,
                "ignore_eos": True, "temperature": 0, "stream": True}

        async def stream_one(gaps: list[float]) -> int:
            chunks = 0
            last = None
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        chunks += 1
            return chunks

        gaps: list[float] = []
        t0 = time.perf_counter()
        chunks = 0
        for _ in range(3):
            chunks += sum(await asyncio.gather(*(stream_one(gaps) for _ in range(4))))
        wall = time.perf_counter() - t0
        out["stream_wall_s"] = wall
        out["stream_chunks_per_s"] = chunks / wall
        out["stream_gap_mean_ms"] = 1000 * statistics.fmean(gaps)

        small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}
        sem = asyncio.Semaphore(4)

        async def small_one() -> None:
            async with sem:
                r = await c.post("/v1/chat/completions", json=small)
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(small_one() for _ in range(24)))
        out["small_chat_rps"] = 24 / (time.perf_counter() - t0)
    return out


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--serve":
        _serve(argv[1], int(argv[2]))
        return
    for kind in argv or SERVERS:
        port = free_port()
        proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port)], env=os.environ.copy())
        try:
            try:
                wait_until_healthy(f"http://127.0.0.1:{port}", proc, 120, poll_s=0.2)
            except ServerStartError as exc:
                raise SystemExit(f"{kind}: server did not start: {exc}") from exc
            result = asyncio.run(_bench(port))
            print(json.dumps({"server": kind, **{k: round(v, 2) for k, v in result.items()}}), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main(sys.argv[1:])
