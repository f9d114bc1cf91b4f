#!/usr/bin/env python3
"""The start thread's A/B (ninfer.engine.start_thread): greedy decode of one prompt on an engine started the usual
way (load and warm-up on a thread that ends) and on one whose start-up ran on the calling thread, whose OpenMP pool
then lives on beside the worker's. Each setup runs in a process of its own, alternating; the default model on the CPU
by default.

    python3 tools/start_thread_ab.py                          # the README's main command, twice each way
    python3 tools/start_thread_ab.py MODEL --device cuda --host-experts --rounds 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from gpu_kernel_profile import write_report

SETUPS = ("thread", "caller")


def child(args) -> list[float]:
    """tok/s of each repeat (run in the child process)."""
    import ninfer.engine.start_thread as start_thread

    if args.child == "caller":
        start_thread.on_start_thread = lambda fn, name="": fn()
    from ninfer import Engine

    overrides = {"device": args.device} if args.device else {}
    if args.host_experts:
        overrides["host_experts"] = True
    rates = []
    with Engine.start(args.model, **overrides) as engine:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = engine.generate(args.prompt, temperature=0, max_tokens=args.tokens)
            rates.append(out.usage.completion_tokens / (time.perf_counter() - t0))
    return rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="an artifact or model name (default: the default model)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--host-experts", action="store_true")
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="decodes per engine (the first one warms up)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per setup, alternating")
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON too")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    passed = [*([args.model] if args.model else []), *(["--device", args.device] if args.device else []),
              *(["--host-experts"] if args.host_experts else []), "--prompt", args.prompt, "--tokens",
              str(args.tokens), "--repeats", str(args.repeats)]
    runs = []
    for _ in range(args.rounds):
        for setup in SETUPS:
            done = subprocess.run([sys.executable, __file__, *passed, "--child", setup], capture_output=True,
                                  text=True, check=True)
            rates = json.loads(done.stdout.strip().splitlines()[-1])
            runs.append({"setup": setup, "tok_s": rates})
            print(f"start-up on {'its own thread' if setup == 'thread' else 'the calling thread'}: "
                  + " ".join(f"{r:.1f}" for r in rates) + " tok/s", flush=True)
    write_report(args.out, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
