#!/usr/bin/env python3
"""The device-to-device copy ceiling measured more than once (diagnostics for the roofline's denominator).

``ninfer bench`` measures the copy bandwidth once per run (median of 10 copies of one 1 GiB buffer pair); on the H200
consecutive benches in one device call read 4.00-4.21 TB/s while their decode rates moved 0.1%. This measures the
same copy (``dst.copy_(src)``, read + write bytes over event time) over ``--allocations`` fresh buffer pairs,
``--copies`` timed copies each after ``--warmup`` untimed ones, and prints one JSON object: each pair's median, and
the median, min and max over all copies. With ``--bench-limits`` it also runs the bench's own measurement that
many times.

    python3 tools/gpu_copy_ceiling.py --out $OUT/copy.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from diag_report import emit_report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--allocations", type=int, default=6)
    ap.add_argument("--copies", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bench-limits", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    n = args.mib << 20
    per_pair, every = [], []
    for _ in range(args.allocations):
        src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
        dst = torch.empty_like(src)
        for _ in range(args.warmup):
            dst.copy_(src)
        times = []
        for _ in range(args.copies):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1000.0)
        rates = [2 * n / t / 1e9 for t in times]
        per_pair.append(statistics.median(rates))
        every.extend(rates)
        del src, dst
        torch.cuda.empty_cache()
    report = {"buffer_mib": args.mib, "pair_medians_gb_s": per_pair, "median_gb_s": statistics.median(every),
              "min_gb_s": min(every), "max_gb_s": max(every), "copies": len(every)}
    if args.bench_limits:
        from ninfer.runtime.bench.limits import measure_copy_bandwidth

        report["bench_measurements_gb_s"] = [measure_copy_bandwidth(torch.device("cuda"), n) / 1e9
                                             for _ in range(args.bench_limits)]
    return emit_report(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
