#!/usr/bin/env python3
"""Whether another thread's OpenMP pool slows a worker thread's parallel regions (ninfer.engine.start_thread).

GNU OpenMP stops spinning between regions once the threads of all pools in the process exceed the CPUs. This
times a small torch parallel region on a worker thread, after ``--gap-us`` of busy waiting (the engine thread
waiting on the GPU between host-expert calls), in three setups: ``clean`` (no other pool), ``mainpool`` (the main
thread ran a region with the same thread count first, and its pool lives on) and ``joined`` (that region ran on a
thread that has exited). Each setup runs in a fresh process.

    python3 tools/omp_pool_probe.py --threads 2
    python3 tools/omp_pool_probe.py --threads 8,16 --out $OUT/omp.json     # on a GPU machine's host
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpu_kernel_profile import write_report

SETUPS = ("clean", "mainpool", "joined")


def busy_until(end: float) -> None:
    """Keeps this thread busy until ``end`` (``time.perf_counter``): the engine thread spinning on the GPU."""
    while time.perf_counter() < end:
        continue


def child(setup: str, threads: int, gap_us: float) -> float:
    """Median microseconds of the worker's small parallel region (run in the child process)."""
    import torch

    def parallel_op():
        torch.set_num_threads(threads)
        a = torch.randn(8_000_000)
        for _ in range(3):
            (a * 2.0).sum()

    if setup == "mainpool":
        parallel_op()
    elif setup == "joined":
        t = threading.Thread(target=parallel_op)
        t.start()
        t.join()
    out = {}

    def worker():
        torch.set_num_threads(threads)
        a = torch.randn(100_000 * threads)
        b = torch.empty_like(a)
        times = []
        for _ in range(400):
            busy_until(time.perf_counter() + gap_us * 1e-6)
            t0 = time.perf_counter()
            torch.mul(a, 2.0, out=b)
            times.append(time.perf_counter() - t0)
        out["us"] = statistics.median(times[50:]) * 1e6

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    return out["us"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="2", help="a comma list of thread counts")
    ap.add_argument("--gap-us", type=float, default=200.0)
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON too")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(child(args.child, int(args.threads), args.gap_us))
        return 0
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        row = {"threads": threads, "gap_us": args.gap_us}
        for setup in SETUPS:
            done = subprocess.run([sys.executable, __file__, "--child", setup, "--threads", str(threads),
                                   "--gap-us", str(args.gap_us)], capture_output=True, text=True, check=True)
            row[setup] = float(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"threads {threads:3d}: a small parallel region after {args.gap_us:.0f} us busy: "
              + ", ".join(f"{s} {row[s]:.1f} us" for s in SETUPS), flush=True)
    write_report(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
