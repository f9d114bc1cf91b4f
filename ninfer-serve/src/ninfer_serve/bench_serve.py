"""``ninfer bench-serve``: load-test any OpenAI-compatible server the way vLLM's ``vllm bench serve`` does.

The protocol, so figures compare with those published for vLLM and SGLang: ``--num-prompts`` requests of random
token ids (``--random-input-len`` tokens each, ``--random-output-len`` output tokens, lengths varied by
``--random-range-ratio``), sent to ``/v1/completions`` (or ``/v1/chat/completions`` with the ids as text) as
streams, arrivals a Poisson process of ``--request-rate`` requests/s (a gamma process with ``--burstiness`` != 1;
``inf``: all at once), at most ``--max-concurrency`` in flight. Per request: TTFT = send to the first streamed
token, ITL = the gaps between streamed chunks, TPOT = (latency - TTFT) / (output tokens - 1), E2EL = latency.
Throughputs divide by the wall time of the whole run. Output tokens are the server's ``usage`` counts
(``stream_options.include_usage``). The result JSON uses vLLM's key names (``mean_ttft_ms``, ``p99_itl_ms``,
``output_throughput``, ...). Any server works: ``ninfer serve``, vLLM, SGLang, llama.cpp's ``llama-server``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from ninfer.cli.command import CliCommand
from ninfer.errors import NInferError


@dataclass
class RequestOutcome:
    """One request as the client saw it: times in seconds from its send."""
    prompt_len: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8080", help="the server (default http://127.0.0.1:8080)")
    p.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--model", default=None, help="the model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--num-prompts", type=int, default=100, metavar="N")
    p.add_argument("--random-input-len", type=int, default=1024, metavar="TOKENS")
    p.add_argument("--random-output-len", type=int, default=128, metavar="TOKENS")
    p.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                   help="lengths drawn uniformly from [len * (1 - R), len * (1 + R)], 0 <= R < 1")
    p.add_argument("--token-range", default="256:6000", metavar="LO:HI",
                   help="random prompt token ids are drawn from [LO, HI) (default 256:6000: ordinary tokens of the "
                        "Qwen vocabularies and of the embedded default model's)")
    p.add_argument("--request-rate", type=float, default=math.inf, metavar="RPS",
                   help="mean arrival rate (default inf: every request at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, metavar="N", help="most requests in flight")
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly the output length (ignore_eos)")
    p.add_argument("--percentiles", default="50,90,99", help="percentiles to report (default 50,90,99)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="per request")


def _check(args: argparse.Namespace) -> tuple[int, int]:
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            raise NInferError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for q in args.percentiles.split(","):
        try:
            ok = 0 <= float(q) <= 100
        except ValueError:
            ok = False
        if not ok:
            raise NInferError(f"--percentiles must be comma-separated numbers in [0, 100], got {args.percentiles!r}")
    if not 0 <= args.random_range_ratio < 1:
        raise NInferError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not args.request_rate > 0 or not args.burstiness > 0:
        raise NInferError("--request-rate and --burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise NInferError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    try:
        lo, hi = (int(x) for x in args.token_range.split(":"))
    except ValueError:
        raise NInferError(f"--token-range must be LO:HI, got {args.token_range!r}") from None
    if not 0 <= lo < hi:
        raise NInferError(f"--token-range needs 0 <= LO < HI, got {args.token_range!r}")
    return lo, hi


def make_requests(args: argparse.Namespace, lo: int, hi: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, seeded."""
    rng = random.Random(args.seed)

    def length(n: int) -> int:
        r = args.random_range_ratio
        return max(1, rng.randint(int(n * (1 - r)), int(n * (1 + r))))

    return [([rng.randrange(lo, hi) for _ in range(length(args.random_input_len))], length(args.random_output_len))
            for _ in range(args.num_prompts)]


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: 0 at rate inf, else gamma(burstiness, 1 / (rate * burstiness))
    (mean 1 / rate; exponential, a Poisson process, at burstiness 1)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def one_request(client, args: argparse.Namespace, model: str, prompt: list[int], out_len: int) -> RequestOutcome:
    o = RequestOutcome(len(prompt))
    body: dict = {"model": model, "max_tokens": out_len, "stream": True, "temperature": 0,
                  "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "/v1/completions":
        body["prompt"] = prompt
    else:  # a chat message cannot carry ids: the ids' text, as vLLM's random dataset sends it
        body["messages"] = [{"role": "user", "content": " ".join(map(str, prompt))}]
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", args.endpoint, json=body) as r:
            if r.status_code != 200:
                o.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return o
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    o.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                choices = chunk.get("choices") or ()
                if not any(c.get("text") or (c.get("delta") or {}).get("content")
                           or (c.get("delta") or {}).get("reasoning_content") for c in choices):
                    continue
                now = time.perf_counter()
                if o.ttft == 0.0:
                    o.ttft = now - start
                else:
                    o.itl.append(now - last)
                last = now
    except Exception as exc:  # a refused connection, a timeout, a broken stream: that request's error
        o.error = f"{type(exc).__name__}: {exc}"
        return o
    o.latency = time.perf_counter() - start
    o.ok = o.ttft > 0.0
    if not o.ok:
        o.error = "the stream carried no token"
    return o


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000.0 for v in values_s) or [0.0]
    out = {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
           f"std_{name}_ms": statistics.pstdev(ms)}
    for q in percentiles:   # numpy's default (linear) percentile, as vLLM reports them
        pos = q / 100 * (len(ms) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(ms) - 1)
        out[f"p{q:g}_{name}_ms"] = ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)
    return out


def summarize(outcomes: list[RequestOutcome], duration: float, percentiles: list[float]) -> dict:
    """vLLM's result fields from the requests' outcomes and the run's wall time."""
    done = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in done)
    in_tokens = sum(o.prompt_len for o in done)
    tpot = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    result = {"duration": duration, "completed": len(done), "failed": len(outcomes) - len(done),
              "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
              "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
              "total_token_throughput": (in_tokens + out_tokens) / duration}
    result.update(_stats("ttft", [o.ttft for o in done], percentiles))
    result.update(_stats("tpot", tpot, percentiles))
    result.update(_stats("itl", [g for o in done for g in o.itl], percentiles))
    result.update(_stats("e2el", [o.latency for o in done], percentiles))
    result["errors"] = sorted({o.error for o in outcomes if not o.ok})[:10]
    return result


async def run_benchmark(args: argparse.Namespace) -> dict:
    import httpx

    lo, hi = _check(args)
    percentiles = [float(q) for q in args.percentiles.split(",")]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, timeout=args.timeout,
                                 limits=limits) as client:
        model = args.model
        if model is None:
            try:
                r = await client.get("/v1/models")
                r.raise_for_status()
                model = r.json()["data"][0]["id"]
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                raise NInferError(f"cannot read the model name from {args.base_url}/v1/models ({exc}); pass "
                                  f"--model") from None
        requests = make_requests(args, lo, hi)
        gaps = arrival_gaps(len(requests), args.request_rate, args.burstiness, args.seed)
        gate = asyncio.Semaphore(args.max_concurrency or len(requests))

        async def limited(prompt, out_len):
            async with gate:
                return await one_request(client, args, model, prompt, out_len)

        start = time.perf_counter()
        tasks = []
        for (prompt, out_len), gap in zip(requests, gaps, strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt, out_len)))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    result = summarize(list(outcomes), duration, percentiles)
    result.update(model_id=model, endpoint=args.endpoint, num_prompts=args.num_prompts,
                  request_rate=args.request_rate if math.isfinite(args.request_rate) else "inf",
                  burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                  random_input_len=args.random_input_len, random_output_len=args.random_output_len)
    return result


def _print(result: dict, percentiles: list[float]) -> None:
    print("{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="))
    for label, key in (("Successful requests", "completed"), ("Failed requests", "failed"),
                       ("Benchmark duration (s)", "duration"), ("Total input tokens", "total_input_tokens"),
                       ("Total generated tokens", "total_output_tokens"),
                       ("Request throughput (req/s)", "request_throughput"),
                       ("Output token throughput (tok/s)", "output_throughput"),
                       ("Total token throughput (tok/s)", "total_token_throughput")):
        value = result[key]
        print(f"{label:<45}{value:>15.2f}" if isinstance(value, float) else f"{label:<45}{value:>15}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "median", *(f"p{q:g}" for q in percentiles)):
            print(f"{stat.capitalize() + ' ' + name.upper() + ' (ms):':<45}{result[f'{stat}_{name}_ms']:>15.2f}")
    print("=" * 60)
    for error in result["errors"]:
        print(f"error: {error}")


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(run_benchmark(args))
    _print(result, [float(q) for q in args.percentiles.split(",")])
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(result, indent=1))
    return 0 if result["completed"] else 1


COMMAND = CliCommand(
    name="bench-serve", help="load-test an OpenAI-compatible server (vLLM's `bench serve` protocol)",
    add_arguments=add_arguments, run=run,
    description="Send random-token streaming requests to an OpenAI-compatible server (ninfer serve, vLLM, SGLang, "
                "llama-server) at a request rate and concurrency, and report TTFT, TPOT, ITL, end-to-end latency "
                "and throughput with vLLM's definitions and result keys.")
