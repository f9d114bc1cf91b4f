#!/usr/bin/env python3
"""Load benchmark of ``ninfer serve``: requests/s, TTFT and TPOT percentiles against client concurrency.

Starts ``ninfer serve`` on a free loopback port (or uses ``--base-url``), then for each concurrency C runs
C closed-loop clients, each sending ``--requests`` streaming chat completions (greedy, fixed
``--max-tokens``, ``ignore_eos`` so every answer has the same length). Per request: TTFT = first
streamed token chunk; TPOT = (last chunk - first chunk) / (completion tokens - 1). Requests/s = completed
requests / wall time of the level. Only 127.0.0.1 is ever contacted.

    python3 tools/serve_load_bench.py --concurrency 1,2,4,8,16 --output load.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def start_server(args) -> tuple[str, subprocess.Popen]:
    from ninfer_serve.process import ServerStartError, free_port, wait_until_healthy

    port = free_port()
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", *([args.model] if args.model else []),
           "--host", "127.0.0.1", "--port", str(port), "--max-concurrency", str(args.max_concurrency),
           "--max-context", str(args.max_context), "--queue-capacity", "256", "--model-id", "bench",
           "--log-level", "warning", "--quiet", *(["--device", args.device] if args.device else []),
           *(["--dtype", args.dtype] if args.dtype else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc, 300, poll_s=0.2)
    except ServerStartError as exc:
        proc.kill()
        raise SystemExit(f"ninfer serve did not start: {exc}") from exc
    return base, proc


def one_request(base: str, prompt: str, max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=600, max_retries=0)
    start = time.perf_counter()
    first = last = None
    tokens = 0
    stream = client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    for chunk in stream:
        if chunk.choices and (chunk.choices[0].delta.content or getattr(chunk.choices[0].delta, "reasoning_content", None)):
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    ttft = (first if first is not None else end) - start
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return {"ttft_s": ttft, "tpot_s": tpot, "latency_s": end - start, "completion_tokens": tokens}


def pct(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="default: the embedded default model")
    ap.add_argument("--base-url", default=None, help="benchmark a running server instead of starting one")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=4, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()

    proc = None
    base = args.base_url
    if base is None:
        base, proc = start_server(args)
    try:
        one_request(base, "warm up", 4)
        levels = []
        for c in [int(x) for x in args.concurrency.split(",")]:
            prompts = [f"What does `{m}` do in Python? Explain." for m in range(c * args.requests)]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=c) as pool:
                results = list(pool.map(lambda p: one_request(base, p, args.max_tokens), prompts))
            wall = time.perf_counter() - t0
            ttft = [r["ttft_s"] for r in results]
            tpot = [r["tpot_s"] for r in results]
            level = {"concurrency": c, "requests": len(results), "wall_s": wall,
                     "requests_per_s": len(results) / wall,
                     "output_tok_per_s": sum(r["completion_tokens"] for r in results) / wall,
                     **{f"ttft_p{q}_ms": 1000 * pct(ttft, q) for q in (50, 90, 99)},
                     **{f"tpot_p{q}_ms": (1000 * pct(tpot, q) if pct(tpot, q) is not None else None)
                        for q in (50, 90, 99)},
                     "mean_ttft_ms": 1000 * statistics.fmean(ttft)}
            levels.append(level)
            print(f"C={c:<3} {level['requests_per_s']:6.2f} req/s  {level['output_tok_per_s']:7.1f} tok/s  "
                  f"TTFT p50/p90/p99 {level['ttft_p50_ms']:.0f}/{level['ttft_p90_ms']:.0f}/{level['ttft_p99_ms']:.0f} ms  "
                  f"TPOT p50/p90/p99 {level['tpot_p50_ms']:.1f}/{level['tpot_p90_ms']:.1f}/{level['tpot_p99_ms']:.1f} ms",
                  flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "cpu_count": os.cpu_count(),
                       "levels": levels}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
