#!/usr/bin/env python3
"""The device-to-device copy ceiling measured more than once (diagnostics for the roofline's denominator).

``ninfer bench`` measures the copy bandwidth once per run (median of 10 copies of one 1 GiB buffer pair); on the H200
consecutive benches in one device call read 4.00-4.21 TB/s while their decode rates moved 0.1%. This measures the
same copy (``dst.copy_(src)``, read + write bytes over event time) over ``--allocations`` fresh buffer pairs,
``--copies`` timed copies each after ``--warmup`` untimed ones, and prints one JSON object: each pair's median, and
the median, min and max over all copies. With ``--bench-limits`` it also runs the bench's own measurement that
many times.

It also measures a *read-only* stream (``--read``, default on): a Triton kernel in which each program sums
``ITERS`` 16-byte-per-thread tiles of one buffer and stores one value, so the bytes moved are the buffer's (the
stores are noise). A decode step mostly reads (weights, KV, state), and a read stream does not pay the copy's
read/write turnaround: on the H200 the 35B-A3B LM head GEMV alone streams 1 GB at ~4.5 TB/s, above the ~4.2 TB/s
copy. The read ceiling is the stricter denominator for a decode roofline; the bench reports the copy.

    python3 tools/gpu_copy_ceiling.py --out $OUT/copy.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl
from diag_report import emit_report
from ninfer.bench.limits import median_seconds, run_seconds


@triton.jit
def _read_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # Program p sums ITERS consecutive BLOCK-element tiles of int32 (BLOCK / (32 * warps) * 4 bytes per thread per
    # tile); the loop's loads do not depend on each other, so they are all in flight at once.
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in tl.static_range(ITERS):
        acc += tl.load(x_ptr + base + i * BLOCK + offs)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_rates(n_bytes: int, reps: int) -> dict:
    """Best-config and per-config rates (GB/s, from the median time: the bench's own timing) of the read kernel over
    one ``n_bytes`` buffer."""
    x = torch.empty(n_bytes // 4, dtype=torch.int32, device="cuda").random_(0, 1 << 20)
    out = {}
    for block, iters, warps in ((4096, 4, 8), (4096, 8, 8), (2048, 8, 4), (8192, 4, 8), (1024, 16, 4)):
        grid = x.numel() // (block * iters)
        sums = torch.empty(grid, dtype=torch.int32, device="cuda")
        t = median_seconds(lambda g=grid, b=block, i=iters, w=warps, s=sums: _read_kernel[(g,)](
            x, s, BLOCK=b, ITERS=i, num_warps=w), x.device, repeats=reps, warmup=3)
        out[f"block{block}_iters{iters}_warps{warps}"] = grid * block * iters * 4 / t / 1e9
    return {"configs_gb_s": out, "best_gb_s": max(out.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--allocations", type=int, default=6)
    ap.add_argument("--copies", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bench-limits", type=int, default=3)
    ap.add_argument("--read", type=int, default=1, help="measure the read-only stream too (0: skip)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    n = args.mib << 20
    per_pair, every = [], []
    for _ in range(args.allocations):
        src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
        dst = torch.empty_like(src)
        times = run_seconds(lambda s=src, d=dst: d.copy_(s), src.device, repeats=args.copies, warmup=args.warmup)
        rates = [2 * n / t / 1e9 for t in times]
        per_pair.append(statistics.median(rates))
        every.extend(rates)
        del src, dst
        torch.cuda.empty_cache()
    report = {"buffer_mib": args.mib, "pair_medians_gb_s": per_pair, "median_gb_s": statistics.median(every),
              "min_gb_s": min(every), "max_gb_s": max(every), "copies": len(every)}
    if args.read:
        report["read_only"] = read_rates(n * 2, args.copies)
    if args.bench_limits:
        from ninfer.bench.limits import measure_copy_bandwidth

        report["bench_measurements_gb_s"] = [measure_copy_bandwidth(torch.device("cuda"), n) / 1e9
                                             for _ in range(args.bench_limits)]
    return emit_report(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
