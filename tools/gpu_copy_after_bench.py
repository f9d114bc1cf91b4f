#!/usr/bin/env python3
"""How soon after a decode bench the device's copy ceiling is back (diagnostics for ``remeasure_copy``'s wait).

In one process: the bench's copy measurement three times, one ``ninfer bench`` B=1 decode run of MODEL, then the
same copy at once and 1, 3 and 10 s later (and after a gc + empty_cache); prints one JSON object. The recorded
results are in docs/dev/perf-log.md.

    python3 tools/gpu_copy_after_bench.py MODEL.ninfer $OUT/bench.json
"""
from __future__ import annotations

import gc
import json
import sys
import threading
import time

import torch
from ninfer.bench import limits
from ninfer.bench.limits import measure_copy_bandwidth
from ninfer.cli.main import main


def run() -> dict:
    dev = torch.device("cuda")
    n = 1 << 30
    res = {"before": [measure_copy_bandwidth(dev, n) / 1e9 for _ in range(3)]}
    limits.AFTER_SETTLE_S = 0.0   # the bench's own second measurement at once, as before the fix that waits
    main(["bench", sys.argv[1], "--device", "cuda", "--dtype", "bfloat16", "--batches", "1", "--no-prefill",
          "--quiet", "--output", sys.argv[2]])
    res["threads_after_bench"] = [t.name for t in threading.enumerate()]
    res["mem_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
    t0 = time.time()
    for wait in (0, 1, 3, 10):
        while time.time() - t0 < wait:
            time.sleep(0.05)
        res[f"copy_at_{wait}s"] = [measure_copy_bandwidth(dev, n) / 1e9 for _ in range(2)]
    gc.collect()
    torch.cuda.empty_cache()
    res["copy_after_gc"] = [measure_copy_bandwidth(dev, n) / 1e9 for _ in range(2)]
    return res


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
