#!/usr/bin/env python3
"""Soak ``ninfer serve`` with mixed traffic and injected faults, then check that nothing leaked.

Starts ``ninfer serve`` on the embedded default model (CPU unless ``--device``) with a KV pool small enough that
the scheduler preempts, a short queue (bursts overflow it) and a queue timeout, the context cache with a Host tier;
records a reference answer for every pool request by sending it alone; then sends ``--requests`` requests from
``--concurrency`` clients, of the kinds in ``soak_traffic.KINDS`` (greedy and seeded completions and chats,
streamed or not, multi-turn sessions, sampled, JSON-schema constrained, stop strings, and the faults: mid-stream
disconnects, client deadlines, malformed bodies, oversize prompts, bursts beyond the queue). Each pool request's
answer must equal its reference; each fault must get the status a correct server gives, with an OpenAI error body.

At the end, with no request left: after ``POST /reset_prefix_cache`` the server holds no KV page, state slot or
Host byte; its file-descriptor count is back to what it was after the references, and its thread count too, but
for the threads the event loop's bounded default executor may have added (idle anyio workers are pruned first);
and over the second half of a long run its resident memory does not grow (``--rss-slack-mib``).
Exit status 0 when there are no failures. Only 127.0.0.1 is contacted.

    python3 tools/soak.py --requests 10000 --concurrency 12 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak_traffic as t  # noqa: E402

MODEL = "soak"
IDLE_S = 12.0   # longer than an anyio worker thread may stay idle, so thread counts compare like with like


def start_server(args) -> tuple[str, subprocess.Popen]:
    from ninfer_serve.process import ServerStartError, free_port, wait_until_healthy

    port = free_port()
    cmd = [sys.executable, "-m", "ninfer.cli.main", "serve", *([args.model] if args.model else []), "--host",
           "127.0.0.1", "--port", str(port), "--device", args.device, "--max-concurrency", str(args.max_concurrency),
           "--max-context", str(args.max_context), "--num-pages", str(args.num_pages), "--queue-capacity",
           str(args.queue_capacity), "--queue-timeout", str(args.queue_timeout), "--cache-host-mib", "32",
           "--model-id", MODEL, "--log-level", "error", "--quiet", "--no-ui", *args.server_arg]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc, 600, poll_s=0.2)
    except ServerStartError as exc:
        proc.kill()
        raise SystemExit(f"ninfer serve did not start: {exc}\n{proc.stderr.read()[-2000:]}") from exc
    return base, proc


def process_counts(pid: int) -> dict[str, int]:
    """Threads, open file descriptors and resident KiB of process ``pid`` (Linux /proc)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"threads": int(status["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "rss_kib": int(status["VmRSS"].split()[0])}


def thread_dump(pid: int) -> str:
    """The server's Python thread stacks, by py-spy when it is installed (to name a leaked thread)."""
    import shutil

    if shutil.which("py-spy") is None:
        return "install py-spy for the stacks of the server's threads"
    run = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    return run.stdout[-6000:] or run.stderr[-2000:]


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = await client.get("/metrics")
    r.raise_for_status()
    return {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples if not s.labels}


async def wait_idle(client: httpx.AsyncClient, timeout: float = 120.0) -> dict[str, float]:
    end = time.monotonic() + timeout
    while True:
        m = await metrics(client)
        if m["ninfer_requests_outstanding"] == 0 and m["ninfer_queue_depth"] == 0:
            return m
        if time.monotonic() > end:
            raise RuntimeError(f"the server still holds requests after {timeout} s: {m}")
        await asyncio.sleep(0.1)


async def settled_counts(base: str, pid: int) -> dict[str, int]:
    """The server's process counts once idle, with no client connection open: anyio prunes worker threads idle
    longer than its limit only when the next blocking call is handed to a thread, so wait past that limit, send one
    request, then count. The request goes through a client that keeps no connection alive, so the server's
    descriptors are its own (the soak's client is closed first: its pool of idle keep-alive connections would
    count as server sockets)."""
    await asyncio.sleep(IDLE_S)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        r.raise_for_status()
        await wait_idle(c)
    await asyncio.sleep(1.0)   # a pruned worker thread exits after being told to
    return process_counts(pid)


async def settled_fds(pid: int, before: int | None, timeout: float = 20.0) -> int:
    """The server's open descriptors once the sockets of connections the clients just closed are gone: a loaded
    server may take a moment to see a peer's close, while a leaked descriptor stays open for good. ``before``
    None: wait until the count stops falling (two equal readings a second apart)."""
    end = time.monotonic() + timeout
    last = None
    while True:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        if (fds <= before if before is not None else fds == last) or time.monotonic() > end:
            return fds
        last = fds
        await asyncio.sleep(0.5 if before is not None else 1.0)


def open_fds(pid: int) -> list[str]:
    """What the server's descriptors point at (``socket:[inode]``, a path, ``pipe:[...]``), to name a leak."""
    out = []
    for fd in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        with contextlib.suppress(OSError):
            out.append(f"{fd}->{os.readlink(f'/proc/{pid}/fd/{fd}')}")
    return out


def refusal(body: str) -> str:
    """The kind of a 429: the queue was full, or the request waited past the queue timeout (a server deadline)."""
    return "429_queue_timeout" if "waited too long" in body else "429_queue_full"


class Soak:
    """The request plan and the coroutines that run it; ``tally`` collects what happened."""

    def __init__(self, args, client: httpx.AsyncClient, pool, answers, sessions, session_answers):
        self.args, self.client, self.pool, self.answers = args, client, pool, answers
        self.sessions, self.session_answers = sessions, session_answers
        self.tally = t.Tally()
        self.malformed = t.malformed_requests(MODEL, args.max_context)

    async def send(self, item: t.Item, stream: bool) -> tuple[int, t.Answer | str]:
        """``item`` sent as a well-behaved client sends: a 429 (queue full, or waited too long) is retried after a
        pause, as the OpenAI SDK does, up to ``--retries`` times."""
        for attempt in range(self.args.retries):
            status, got = await t.send(self.client, item, stream)
            if status != 429:
                return status, got
            self.tally.faults[refusal(got)] += 1
            await asyncio.sleep(0.05 * (1 + attempt % 8))
        return status, got

    def compare(self, what: str, got: t.Answer, want: t.Answer) -> None:
        self.tally.compared += 1
        if got != want:
            self.tally.fail(f"{what}: {got} != reference {want}")

    async def pooled(self, rng: random.Random, kind: str) -> None:
        route = {"completion": "completions", "chat": "chat/completions", "constrained": "chat/completions"}[kind]
        i = rng.choice([j for j, item in enumerate(self.pool) if item.route == route
                        and (kind != "constrained") == ("response_format" not in item.body)])
        stream = rng.random() < 0.5
        status, got = await self.send(self.pool[i], stream)
        if status != 200 or isinstance(got, str):
            self.tally.fail(f"{kind} {i} (stream={stream}): {status} {got}")
        else:
            self.compare(f"{kind} {i} (stream={stream})", got, self.answers[i])
            if kind == "constrained" and got.finish == "stop" and (why := t.check_schema(got.text)):
                self.tally.fail(f"constrained {i}: {why}")

    async def sampled(self, rng: random.Random) -> None:
        budget = rng.randint(1, 24)
        body = {"model": MODEL, "prompt": t._text(rng, rng.randint(1, 80)), "max_tokens": budget,  # noqa: SLF001
                "temperature": rng.choice((0.3, 0.7, 1.0, 1.5)), "top_p": rng.choice((1.0, 0.9, 0.5)),
                "top_k": rng.choice((0, 5, 50)), "min_p": rng.choice((0.0, 0.05)),
                "presence_penalty": rng.choice((0.0, 0.5)), "frequency_penalty": rng.choice((0.0, 0.3))}
        status, got = await self.send(t.Item("completions", body), rng.random() < 0.5)
        if status != 200 or isinstance(got, str) or got.finish not in ("stop", "length") or got.tokens > budget:
            self.tally.fail(f"sampled: {status} {got}")

    async def stop_string(self, rng: random.Random) -> None:
        idx = [j for j, item in enumerate(self.pool) if item.route == "completions" and len(self.answers[j].text) > 4]
        i = rng.choice(idx)
        ref = self.answers[i].text
        a = rng.randrange(1, len(ref) - 1)
        stop = ref[a:a + rng.randint(1, 3)]
        if not stop.strip():
            return  # whitespace-only stop strings are legal but make the expected cut hard to read in a report
        status, got = await self.send(t.Item("completions", {**self.pool[i].body, "stop": [stop]}), rng.random() < 0.5)
        want = ref[:ref.find(stop)]
        if status != 200 or isinstance(got, str) or (got.text, got.finish) != (want, "stop"):
            self.tally.fail(f"stop {stop!r} on pool {i}: {status} {got}, want {want!r}")
        else:
            self.tally.compared += 1

    async def session(self, rng: random.Random) -> None:
        i = rng.randrange(len(self.sessions))
        stream = rng.random() < 0.3
        got = await t.run_session(self.send, self.sessions[i], MODEL, stream, self.tally)
        if isinstance(got, str):
            self.tally.fail(f"session {i}: {got}")
            return
        for turn, (g, w) in enumerate(zip(got, self.session_answers[i], strict=True)):
            self.compare(f"session {i} turn {turn + 1} (stream={stream})", g, w)

    async def expect_error(self, label: str, route: str, raw: bytes, want: int) -> None:
        r = await self.client.post(f"/v1/{route}", content=raw, headers={"content-type": "application/json"})
        if r.status_code != want:
            self.tally.fail(f"malformed {label}: got {r.status_code}, want {want}: {r.text[:200]}")
        elif why := t.error_shape(r.text):
            self.tally.fail(f"malformed {label}: {why}")
        self.tally.faults[f"malformed:{label}"] += 1

    async def overflow(self, rng: random.Random) -> None:
        n = self.args.max_concurrency + self.args.queue_capacity + 6
        picks = [rng.choice([j for j, item in enumerate(self.pool) if "response_format" not in item.body])
                 for _ in range(n)]
        results = await asyncio.gather(*(t.send(self.client, self.pool[j], False) for j in picks))
        for j, (status, got) in zip(picks, results, strict=True):
            if status == 429:
                self.tally.faults[refusal(got)] += 1
            elif status != 200 or isinstance(got, str):
                self.tally.fail(f"overflow burst, pool {j}: {status} {got}")
            else:
                self.compare(f"overflow burst, pool {j}", got, self.answers[j])

    async def one(self, rng: random.Random, kind: str) -> None:
        self.tally.outcomes[kind] += 1
        if kind in ("completion", "chat", "constrained"):
            await self.pooled(rng, kind)
        elif kind == "session":
            await self.session(rng)
        elif kind == "sampled":
            await self.sampled(rng)
        elif kind == "stop":
            await self.stop_string(rng)
        elif kind == "disconnect":
            self.tally.faults["disconnect_mid_stream"] += 1
            if why := await t.disconnect_mid_stream(self.client, rng.choice(self.pool), rng.randint(1, 4)):
                self.tally.fail(why)
        elif kind == "abort":
            self.tally.faults["client_deadline"] += 1
            await t.abort_early(self.client, rng.choice(self.pool), rng.choice((0.001, 0.01, 0.05, 0.2)))
        elif kind == "malformed":
            await self.expect_error(*rng.choice(self.malformed))
        elif kind == "oversize":
            self.tally.faults["oversize_prompt"] += 1
            status, got = await t.send(self.client, t.oversize_prompt(MODEL, self.args.max_context), False)
            if status != 400 or t.error_shape(got) or "context" not in got:
                self.tally.fail(f"oversize prompt: {status} {got}")
        elif kind == "overflow":
            await self.overflow(rng)

    async def run(self, progress) -> None:
        rng = random.Random(self.args.seed)
        kinds, weights = list(t.KINDS), list(t.KINDS.values())
        plan = rng.choices(kinds, weights, k=self.args.requests)
        for n in range(100, len(plan), t.BURST_EVERY):
            plan[n] = "overflow"
        seeds = [rng.randrange(2**32) for _ in plan]
        todo = iter(range(len(plan)))
        done = 0

        async def client_loop() -> None:
            nonlocal done
            for n in todo:
                try:
                    await self.one(random.Random(seeds[n]), plan[n])
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    self.tally.fail(f"request {n} ({plan[n]}): {type(exc).__name__}: {exc}")
                done += 1
                progress(done)

        await asyncio.gather(*(client_loop() for _ in range(self.args.concurrency)))


async def soak(args) -> dict:
    base, proc = start_server(args)
    limits = httpx.Limits(max_connections=args.concurrency * 4 + 64, max_keepalive_connections=args.concurrency)
    started = time.monotonic()
    try:
        pool = t.build_pool(args.seed, MODEL, args.pool)
        sessions = t.build_sessions(args.seed, MODEL, max(2, args.pool // 8))
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
            answers, session_answers = await t.record_references(client, pool, sessions, MODEL)
        before = await settled_counts(base, proc.pid)
        before["fds"] = await settled_fds(proc.pid, None)
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
            s = Soak(args, client, pool, answers, sessions, session_answers)
            rss: list[tuple[int, int]] = []
            every = max(1, args.requests // 40)

            def progress(done: int) -> None:
                if done % every == 0 or done == args.requests:
                    rss.append((done, process_counts(proc.pid)["rss_kib"]))
                    if not args.quiet:
                        print(f"[soak] {done}/{args.requests} requests, {len(s.tally.failures)} failures, "
                              f"rss {rss[-1][1] / 1024:.0f} MiB", file=sys.stderr, flush=True)

            soak_start = time.monotonic()
            await s.run(progress)
            soak_s = time.monotonic() - soak_start
            served = await wait_idle(client)
            r = await client.post("/reset_prefix_cache")
            if r.status_code != 200:
                s.tally.fail(f"POST /reset_prefix_cache: {r.status_code} {r.text[:200]}")
            cleared = await metrics(client)
        after = await settled_counts(base, proc.pid)
        after["fds"] = await settled_fds(proc.pid, before["fds"])
        if after["fds"] > before["fds"]:
            after["open_fds"] = open_fds(proc.pid)
        if after["threads"] > before["threads"] and args.thread_dump:
            after["thread_dump"] = thread_dump(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return report(args, s.tally, served, cleared, before, after, rss, soak_s, time.monotonic() - started,
                  session_answers)


def report(args, tally: t.Tally, served, cleared, before, after, rss, soak_s: float, total_s: float,
           session_answers: list[list[t.Answer]]) -> dict:
    held = {k: cleared[f"ninfer_{k}"] for k in ("kv_pages_used", "state_slots_used", "context_cache_host_bytes",
                                                "context_cache_checkpoints", "requests_running", "requests_paused")}
    for k, v in held.items():
        if v:
            tally.fail(f"leak: {k} = {v:g} with no request left and the context cache cleared")
    if after["fds"] > before["fds"]:
        tally.fail(f"leak: the server's open file descriptors went from {before['fds']} to {after['fds']}: "
                   f"{' '.join(after['open_fds'])}")
    # The event loop's default executor (a ThreadPoolExecutor, where litestar runs sync iteration) keeps up to
    # min(32, cpus + 4) threads once it has needed them; idle anyio workers are pruned before counting.
    pool_cap = min(32, (os.cpu_count() or 1) + 4)
    if after["threads"] > before["threads"] + pool_cap:
        tally.fail(f"leak: the server's threads went from {before['threads']} to {after['threads']} (more than the "
                   f"default executor's {pool_cap} may add)")
    half = [kib for done, kib in rss if done >= args.requests // 2]
    growth_mib = (half[-1] - half[0]) / 1024 if len(half) > 1 else 0.0
    if args.requests >= 2000 and growth_mib > args.rss_slack_mib:
        tally.fail(f"memory: resident size grew {growth_mib:.0f} MiB over the second half (> {args.rss_slack_mib})")
    return {"requests": args.requests, "concurrency": args.concurrency, "seed": args.seed, "soak_s": round(soak_s, 1),
            "total_s": round(total_s, 1), "kinds": dict(sorted(tally.outcomes.items())),
            "faults": dict(sorted(tally.faults.items())), "compared_with_reference": tally.compared,
            "session_turns_with_cache_hits": tally.cached_turns,
            # The reference sessions (sent alone): their hits do not depend on the traffic beside them.
            "reference_session_turns_with_cache_hits": sum(a.cached > 0 for turns in session_answers
                                                           for a in turns[1:]),
            "server": {k.removeprefix("ninfer_"): served[k] for k in (
                "ninfer_preemptions_total", "ninfer_replays_total", "ninfer_snapshot_resumes_total",
                "ninfer_context_cache_hit_tokens_total", "ninfer_engine_cancelled_total",
                "ninfer_context_cache_demotions_total", "ninfer_context_cache_evictions_total") if k in served},
            "held_after_reset": held, "process_before": before, "process_after": after,
            "rss_mib_second_half_growth": round(growth_mib, 1), "rss_mib": [(d, round(k / 1024)) for d, k in rss],
            "failures": len(tally.failures), "failure_samples": tally.failures[:20]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="default: the embedded default model")
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=12, help="clients sending at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=int, default=48, help="requests with recorded reference answers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--max-context", type=int, default=384)
    ap.add_argument("--num-pages", type=int, default=24, help="a KV pool the running requests overflow (preemption)")
    ap.add_argument("--queue-capacity", type=int, default=8)
    ap.add_argument("--queue-timeout", type=float, default=3.0, help="seconds a request may wait for a running place")
    ap.add_argument("--retries", type=int, default=40,
                    help="times a well-behaved client retries a 429 (0.05-0.4 s apart) before it counts as a failure; "
                         "a loaded host's queue timeouts can outlast the default")
    ap.add_argument("--rss-slack-mib", type=float, default=48.0,
                    help="largest resident-size growth over the second half of a run of >= 2000 requests")
    ap.add_argument("--server-arg", action="append", default=[], help="an extra `ninfer serve` argument (repeatable)")
    ap.add_argument("--thread-dump", action="store_true",
                    help="when the server ends with more threads than it started with, add py-spy's dump to the report")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    out = asyncio.run(soak(args))
    text = json.dumps(out, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
