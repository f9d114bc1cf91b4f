#!/usr/bin/env python3
"""The MoE prefill's grouped expert GEMMs at the 35B-A3B expert shape: launch shapes timed, and where the time goes.

Issue 39 item 2. One MoE layer call (``moe_experts``, routed experts only) at H = 2048, INTER = 512, 256 experts,
top-8, for prefill chunks of ``--tokens`` tokens with uniform random routing:

1. every candidate launch shape (:class:`ninfer.ops.triton.moe.PrefillTiles`: the row-block cap, the column tiles
   of the gate/up and down kernels, the K step, warps, pipeline stages), timed as a CUDA graph of a few calls,
   as TFLOP/s and a share of the bf16 matmul peak measured in the same run, with its largest difference from the
   default's result;
2. the default's kernels one by one (torch.profiler): the alignment, the gate/up GEMM, the down GEMM, the sum;
3. ``torch._grouped_mm`` over the same sorted pairs where this torch has it (the two GEMMs alone, and the whole
   ``moe_experts(grouped_mm=True)`` path that ``NINFER_MOE_GROUPED_MM=1`` selects), and one dense GEMM of the same
   FLOPs (the tensor cores' rate at this K with no grouping), as yardsticks.

    python3 tools/gpu_moe_prefill_sweep.py --out $OUT/moe_prefill.json
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from ninfer.ops.triton import moe as tm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernel_profile import graph_us, require_cuda, write_report  # noqa: E402

H, INTER, E, K = 2048, 512, 256, 8
CANDIDATES = [
    tm.PrefillTiles(),
    tm.PrefillTiles(128, (64, 128), 64, 4, 3),
    tm.PrefillTiles(128, (64, 128), 64, 8, 3),
    tm.PrefillTiles(128, (128, 128), 64, 8, 3),
    tm.PrefillTiles(128, (128, 256), 64, 8, 3),
    tm.PrefillTiles(128, (128, 128), 64, 8, 4),
    tm.PrefillTiles(64, (128, 128), 64, 4, 4),
    tm.PrefillTiles(64, (64, 256), 64, 8, 3),
    tm.PrefillTiles(128, (64, 128), 128, 8, 3),
    tm.PrefillTiles(64, (64, 128), 128, 4, 2),
    tm.PrefillTiles(128, (256, 128), 64, 8, 3),
    tm.PrefillTiles(32, (128, 128), 64, 4, 4),
]


def _inputs(tokens: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, E, generator=g, device="cuda")
    w, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    gate_up = (torch.randn(E, 2 * INTER, H, generator=g, device="cuda") * H ** -0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, INTER, generator=g, device="cuda") * INTER ** -0.5).to(torch.bfloat16)
    return x, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16), ids, gate_up, down


def _graph_ms(fn, calls: int = 3, replays: int = 10) -> float:
    return graph_us(fn, replays, calls) / 1000


def _profile(fn) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key, "us_per_call": e.device_time_total / 5, "calls": e.count / 5}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def _grouped_mm_ms(x, ids, gate_up, down) -> float | None:
    if not hasattr(torch, "_grouped_mm"):
        return None
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // K]
    w1, w2 = gate_up.transpose(1, 2), down.transpose(1, 2)

    def run():
        gu = torch._grouped_mm(xs, w1, offs=offs)
        act = torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]
        return torch._grouped_mm(act, w2, offs=offs)

    try:
        return _graph_ms(run)
    except (RuntimeError, TypeError) as exc:   # this build's grouped_mm refuses the layout or the device
        print(f"torch._grouped_mm not timed: {exc}", file=sys.stderr)
        return None


def _measure(tokens: int, peak: float) -> dict:
    x, w, ids, gate_up, down = _inputs(tokens)
    call = functools.partial(tm.moe_experts, x, w, ids, gate_up, down, gemv=False)
    flops = 2.0 * tokens * K * 3 * H * INTER
    base = call().float()
    run = {"tokens": tokens, "flops": flops, "candidates": []}
    for tiles in CANDIDATES:
        one = functools.partial(call, tiles=tiles)
        try:
            out = one().float()
            ms = _graph_ms(one)
        except Exception as exc:  # noqa: BLE001 (a launch shape this Triton cannot build: report it, go on)
            run["candidates"].append({"tiles": repr(tiles), "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"T={tokens} {tiles}: {type(exc).__name__}", flush=True)
            continue
        diff = float((out - base).abs().max() / base.abs().max())
        run["candidates"].append({"tiles": repr(tiles), "ms": ms, "tflops": flops / ms / 1e9,
                                  "of_peak": flops / (ms * 1e-3) / peak, "max_rel_diff_vs_default": diff})
        print(f"T={tokens} {tiles}: {ms:.3f} ms, {100 * flops / (ms * 1e-3) / peak:.1f}% of peak, "
              f"diff {diff:.1e}", flush=True)
    run["default_kernels"] = _profile(call)
    run["grouped_mm_ms"] = _grouped_mm_ms(x, ids, gate_up, down)
    # The whole candidate path (NINFER_MOE_GROUPED_MM=1): the sort, both grouped GEMMs, the pair scatter, the sum.
    path = functools.partial(call, grouped_mm=True)
    try:
        diff = float((path().float() - base).abs().max() / base.abs().max())
        run["grouped_mm_path"] = {"ms": _graph_ms(path), "max_rel_diff_vs_default": diff}
        print(f"T={tokens}: the grouped_mm path {run['grouped_mm_path']['ms']:.3f} ms, diff {diff:.1e}", flush=True)
    except Exception as exc:  # noqa: BLE001 (this torch's grouped_mm may refuse the device or the capture)
        run["grouped_mm_path"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    a = torch.randn(tokens * K, H, device="cuda").to(torch.bfloat16)
    b = torch.randn(H, 3 * INTER, device="cuda").to(torch.bfloat16)
    run["dense_gemm_same_flops_ms"] = _graph_ms(functools.partial(torch.matmul, a, b))
    print(f"T={tokens}: grouped_mm {run['grouped_mm_ms']} ms, dense GEMM of the same FLOPs "
          f"{run['dense_gemm_same_flops_ms']:.3f} ms", flush=True)
    for r in run["default_kernels"][:6]:
        print(f"   {r['us_per_call']:9.1f} us  {r['kernel'][:90]}", flush=True)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not require_cuda("gpu_moe_prefill_sweep"):
        return 2
    from ninfer.bench.limits import measure_matmul_peak
    peak = measure_matmul_peak(torch.device("cuda"), torch.bfloat16, 8192)
    report = {"device": torch.cuda.get_device_name(), "matmul_peak_flops": peak, "shape": [H, INTER, E, K], "runs": []}
    for tokens in args.tokens:
        report["runs"].append(_measure(tokens, peak))
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
