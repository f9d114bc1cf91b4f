#!/usr/bin/env python3
"""Bursts against ``ninfer serve``: TTFT and inter-token latency when clients start together, and the stall a
long prompt causes to running streams (issue 30's method).

For each server configuration (``--configs``: ``default``, ``ttft`` = a step budget large enough for a whole
prefill chunk beside the decode rows, ``nowarmup`` = the default without the start-up warm-up, a number =
``--max-step-tokens N``, ``graphs`` / ``graphsN`` = ``--prefill-graphs`` at the default or that step budget,
``eager`` / ``eagerN`` = ``--no-prefill-graphs`` likewise) it starts ``ninfer serve ARTIFACT`` on a loopback port,
records the seconds from
spawning the process to ``/health`` answering (start-up), and runs these scenarios through streaming
``/v1/completions`` (token-id prompts, greedy, ``ignore_eos``, ``--max-tokens`` each):

- ``first8``: 8 clients together, right after start-up (the first burst);
- ``later8``: the same burst again, ``--repeats`` times (the later bursts; reported as the median burst);
- ``c1``, ``c4``: 1 and 4 clients together;
- ``long8``: one ``--long``-token prompt among seven short ones, all together;
- ``arrival``: seven short streams run; once each has streamed ``--arrive-after`` chunks, one ``--long``-token
  prompt arrives; the seven streams' inter-token gaps while it prefills (from its arrival to its first token,
  plus one gap) against their gaps before it arrived.

Per client: TTFT (request sent -> first streamed text chunk) and the gaps between text chunks. A chunk can carry
more than one token (the detokenizer holds back an incomplete character), so each stream's chunk count is
reported beside its tokens. Aggregate tok/s = completion tokens of the burst / its wall time.
Only 127.0.0.1 is contacted. The server's stderr goes to ``serve_<config>.log`` under ``--log-dir`` (default ``--out``).

    python3 tools/serve_bursts.py ART.ninfer --out $OUT --configs default,ttft,256,512,1024,nowarmup
    python3 tools/serve_bursts.py --tiny --out /tmp/bursts     # the default model on the CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def pct(values, q):
    v = sorted(values)
    if not v:
        return None
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def stream_one(port: int, prompt: list[int], max_tokens: int, out: dict, start: threading.Barrier | None,
               arrived: threading.Event | None = None) -> None:
    """One streaming completion; fills ``out`` with send time, chunk arrival times and usage."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    if start is not None:
        start.wait()
    out["sent"] = t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        out["error"] = f"HTTP {resp.status}: {resp.read()[:300]!r}"
        return
    chunks: list[float] = []
    tokens = 0
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if event.get("choices") and event["choices"][0].get("text"):
            chunks.append(time.perf_counter())
            if arrived is not None and len(chunks) == out.get("arrive_after", -1):
                arrived.set()
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    conn.close()
    out.update(ttft=(chunks[0] - t0) if chunks else None, chunks=chunks, tokens=tokens)


def burst(port: int, prompts: list[list[int]], max_tokens: int) -> dict:
    outs = [{} for _ in prompts]
    barrier = threading.Barrier(len(prompts))
    threads = [threading.Thread(target=stream_one, args=(port, p, max_tokens, o, barrier)) for p, o in zip(prompts, outs, strict=True)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return summarize(outs, wall)


def summarize(outs: list[dict], wall: float) -> dict:
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise SystemExit(f"request failed: {errors[0]}")
    ttft = [1000 * o["ttft"] for o in outs]
    gaps = [1000 * (b - a) for o in outs for a, b in zip(o["chunks"], o["chunks"][1:], strict=False)]
    return {"clients": len(outs), "wall_s": wall, "tok_per_s": sum(o["tokens"] for o in outs) / wall,
            "ttft_ms": ttft, "ttft_p50_ms": statistics.median(ttft), "ttft_max_ms": max(ttft),
            "itl_p50_ms": pct(gaps, 50), "itl_p99_ms": pct(gaps, 99), "itl_max_ms": max(gaps, default=None),
            "tokens": [o["tokens"] for o in outs], "chunks": [len(o["chunks"]) for o in outs]}


def arrival(port: int, short: list[list[int]], long_prompt: list[int], max_tokens: int, arrive_after: int) -> dict:
    """Seven running streams; the long prompt arrives once each has streamed ``arrive_after`` chunks."""
    outs = [{"arrive_after": arrive_after} for _ in short]
    events = [threading.Event() for _ in short]
    barrier = threading.Barrier(len(short))
    threads = [threading.Thread(target=stream_one, args=(port, p, max_tokens, o, barrier, e))
               for p, o, e in zip(short, outs, events, strict=True)]
    for t in threads:
        t.start()
    for e in events:
        e.wait(600)
    long_out: dict = {}
    lt = threading.Thread(target=stream_one, args=(port, long_prompt, 8, long_out, None))
    lt.start()
    for t in threads + [lt]:
        t.join()
    if "error" in long_out:
        raise SystemExit(f"long request failed: {long_out['error']}")
    t_arrive, t_first = long_out["sent"], long_out["chunks"][0] if long_out["chunks"] else None
    if t_first is None:
        raise SystemExit("the long request streamed no text")
    before, during = [], []
    for o in outs:
        for a, b in zip(o["chunks"], o["chunks"][1:], strict=False):
            if b <= t_arrive:
                before.append(1000 * (b - a))
            elif a <= t_first:
                during.append(1000 * (b - a))
    res = {"long_ttft_ms": 1000 * (t_first - t_arrive), "before_p50_ms": pct(before, 50),
           "before_p99_ms": pct(before, 99), "during_p50_ms": pct(during, 50), "during_p99_ms": pct(during, 99),
           "during_max_ms": max(during, default=None), "during_gaps": len(during)}
    s = summarize(outs, 0.0 + max(o["chunks"][-1] for o in outs) - min(o["sent"] for o in outs))
    res.update(stream_itl_p50_ms=s["itl_p50_ms"], stream_itl_p99_ms=s["itl_p99_ms"],
               stream_itl_max_ms=s["itl_max_ms"])
    return res


def start_server(args, extra: list[str], log: Path) -> tuple[subprocess.Popen, int, float]:
    from ninfer_serve.process import free_port, wait_until_healthy

    port = free_port()
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", *([args.artifact] if args.artifact else []),
           "--host", "127.0.0.1", "--port", str(port), "--max-concurrency", str(args.max_concurrency),
           "--max-context", str(args.max_context), "--model-id", "bench", "--log-level", "warning",
           *(["--device", args.device] if args.device else []), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    wait_until_healthy(f"http://127.0.0.1:{port}", proc, 600, poll_s=0.05)
    return proc, port, time.perf_counter() - t0


def config_flags(name: str, args) -> list[str]:
    if name == "default":
        return []
    if name == "nowarmup":
        return ["--no-warmup"]
    if name == "ttft":
        return ["--max-step-tokens", str(args.long + args.max_concurrency)]
    for prefix, flag in (("graphs", "--prefill-graphs"), ("eager", "--no-prefill-graphs")):
        # graphs, graphs512, eager, eager2048, ...: prefill-step graphs on or off, at the default or that budget
        if name.startswith(prefix):
            rest = name.removeprefix(prefix)
            return [flag] + (["--max-step-tokens", str(int(rest))] if rest else [])
    return ["--max-step-tokens", str(int(name))]


def run_config(name: str, args, rng: random.Random, full: bool) -> dict:
    def prompt(n):
        return [rng.randrange(args.vocab_lo, args.vocab_hi) for _ in range(n)]

    def shorts(k):
        return [prompt(args.short + rng.randrange(-args.short // 10, args.short // 10 + 1)) for _ in range(k)]

    proc, port, startup = start_server(args, config_flags(name, args), Path(args.log_dir or args.out) / f"serve_{name}.log")
    res = {"config": name, "flags": config_flags(name, args), "startup_s": startup}
    try:
        res["first8"] = burst(port, shorts(8), args.max_tokens)
        later = [burst(port, shorts(8), args.max_tokens) for _ in range(args.repeats)]
        res["later8"] = later
        if full:
            res["c1"] = burst(port, shorts(1), args.max_tokens)
            res["c4"] = burst(port, shorts(4), args.max_tokens)
            res["long8"] = burst(port, shorts(7) + [prompt(args.long)], args.max_tokens)
        res["arrival"] = arrival(port, shorts(7), prompt(args.long), args.max_tokens, args.arrive_after)
    finally:
        proc.terminate()
        proc.wait(60)
    return res


def line(name: str, b: dict) -> str:
    return (f"  {name:<8} {b['clients']} clients  {b['tok_per_s']:8,.0f} tok/s  TTFT p50 {b['ttft_p50_ms']:7.1f} "
            f"max {b['ttft_max_ms']:7.1f} ms  ITL p50 {b['itl_p50_ms']:.2f} p99 {b['itl_p99_ms']:.2f} "
            f"max {b['itl_max_ms']:.1f} ms  chunks/tokens {sum(b['chunks'])}/{sum(b['tokens'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", nargs="?", default=None, help="default: the embedded default model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--log-dir", default=None, help="the servers' stderr logs (default: --out)")
    ap.add_argument("--configs", default="default,ttft")
    ap.add_argument("--full", default="default", help="configs that run every scenario (the others: bursts, arrival)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=9216)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--short", type=int, default=110)
    ap.add_argument("--long", type=int, default=8192)
    ap.add_argument("--arrive-after", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab-lo", type=int, default=1000)
    ap.add_argument("--vocab-hi", type=int, default=30000)
    ap.add_argument("--tiny", action="store_true", help="CPU sizes: short 12, long 96, 24 tokens, context 256")
    args = ap.parse_args()
    if args.tiny:
        args.short, args.long, args.max_tokens, args.max_context, args.arrive_after = 12, 96, 24, 256, 4
        args.vocab_lo, args.vocab_hi, args.repeats, args.device = 10, 200, 1, args.device or "cpu"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    full = set(args.full.split(","))
    results = []
    for name in args.configs.split(","):
        try:
            r = run_config(name, args, rng, name in full)
        except (Exception, SystemExit) as exc:  # one configuration failing keeps the others' figures
            log = Path(args.log_dir or args.out) / f"serve_{name}.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            print(f"[{name}] FAILED: {type(exc).__name__}: {exc}\n{tail}", flush=True)
            results.append({"config": name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        results.append(r)
        print(f"[{name}] {' '.join(r['flags']) or '(defaults)'}: start-up {r['startup_s']:.1f} s", flush=True)
        print(line("first8", r["first8"]), flush=True)
        for i, b in enumerate(r["later8"]):
            print(line(f"later8.{i}", b), flush=True)
        for k in ("c1", "c4", "long8"):
            if k in r:
                print(line(k, r[k]), flush=True)
        a = r["arrival"]
        print(f"  arrival  long TTFT {a['long_ttft_ms']:.1f} ms; running streams' gaps before p50 "
              f"{a['before_p50_ms']:.2f} p99 {a['before_p99_ms']:.2f} ms, during p50 {a['during_p50_ms']:.2f} p99 "
              f"{a['during_p99_ms']:.2f} max {a['during_max_ms']:.1f} ms ({a['during_gaps']} gaps); whole streams "
              f"p50 {a['stream_itl_p50_ms']:.2f} p99 {a['stream_itl_p99_ms']:.2f} ms", flush=True)
    Path(args.out, "serve_bursts.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"),
                                                               "args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
