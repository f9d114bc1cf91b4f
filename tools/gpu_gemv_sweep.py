#!/usr/bin/env python3
"""Decode-GEMM sweep: the Triton GEMV of ``ninfer.ops.triton.linear`` against cuBLAS (``F.linear``) at the
Qwen3.5-9B and 35B-A3B projection shapes, one to eight rows, on the GPU (diagnostics for ``use_gemv``).

Each case runs inside one CUDA graph of ``--calls`` calls rotating over enough weight copies (>= 400 MB in all)
that every call reads its weight from HBM, as a decode step does. Reported per case: microseconds per call and
the weight bytes over that time (GB/s), for cuBLAS, for each GEMV launch shape and for the tensor-core GEMV of
``ninfer.ops.triton.linear_tc`` (the ``NINFER_GEMV_TC=1`` candidate; ``tc s=N``: built with N pipeline stages, ``wave``: K runs for whole waves of programs;
``--tc-tiles``: other tiles and warps);
outputs checked against cuBLAS: bf16 rounding of a reordered fp32 sum, within 2e-2 relative.

    python3 tools/gpu_gemv_sweep.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from ninfer.ops.triton import linear_tc
from ninfer.ops.triton.linear import _TILE, gemv
from ninfer.ops.triton.quant_gemv_tc import split_count

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernel_profile import graph_call_us  # noqa: E402

# (name, N, K): out features, in features.
SHAPES = [
    ("35b gdn in", 12352, 2048), ("35b gdn out", 2048, 4096), ("35b moe in", 1281, 2048),
    ("35b attn q", 8192, 2048), ("35b attn kv", 512, 2048),
    ("9b gdn in", 12352, 4096), ("9b gdn out", 4096, 4096), ("9b mlp gate_up", 24576, 4096),
    ("9b mlp down", 4096, 12288), ("9b attn q", 8192, 4096), ("9b attn kv", 1024, 4096),
    ("35b lm head", 248320, 2048), ("9b lm head", 248320, 4096),
]


def _tc(x: torch.Tensor, w: torch.Tensor, stages: int, rule: str = "fill",
        tile: tuple[int, int, int] | None = None, l2: bool = False) -> torch.Tensor:
    """The tensor-core GEMV built with ``stages`` software-pipeline stages, its K runs by split ``rule``
    (``quant_gemv_tc.split_count``: "fill", the default's, or "wave", whole waves of programs); ``tile`` = (weight
    rows a program, K elements a step, warps) instead of the module's; ``l2``: each program's weight run asked of L2
    before the PDL wait."""
    saved = dict(linear_tc.LAUNCH_OPTIONS)
    saved_tile = linear_tc._BN, linear_tc._BK
    linear_tc.LAUNCH_OPTIONS["num_stages"] = stages
    if tile is not None:
        linear_tc._BN, linear_tc._BK, linear_tc.LAUNCH_OPTIONS["num_warps"] = tile
    programs, steps = -(-w.shape[0] // linear_tc._BN), -(-w.shape[1] // linear_tc._BK)
    try:
        return linear_tc.gemv_tc(x, w, split=split_count(programs, steps, rule), l2_prefetch=l2)
    finally:
        linear_tc._BN, linear_tc._BK = saved_tile
        linear_tc.LAUNCH_OPTIONS.clear()
        linear_tc.LAUNCH_OPTIONS.update(saved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--shapes", default="", help="comma-separated substrings of the shape names to run (default all)")
    ap.add_argument("--tc-tiles", default="", help="more tensor-core GEMV launch shapes, BNxBKxWARPS[xSTAGES] "
                    "comma-separated (e.g. 64x256x4x3, or 64x256x4x3xl2 with the L2 prefetch); each as `tc BNxBKxW sS`")
    ap.add_argument("--only", default="", help="comma-separated prefixes of the implementations to time besides "
                    "cuBLAS (e.g. `tc` for the tensor-core GEMV only; default all)")
    args = ap.parse_args()
    picked = [s for s in SHAPES if not args.shapes or any(p in s[0] for p in args.shapes.split(","))]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    for name, n, k in picked:
        nbytes = n * k * 2
        copies = max(2, math.ceil((400 << 20) / nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * k ** -0.5 for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            default_bn = max(1, _TILE // min(triton_pow2(k), _TILE))
            variants = [("cublas", None)] + [(f"gemv bn={bn} w={w}", dict(block_n=bn, warps=w))
                                             for bn in sorted({max(1, default_bn // 2), default_bn, default_bn * 2,
                                                               default_bn * 4})
                                             for w in (4, 8)]
            variants += [(f"tc s={st}", {"stages": st}) for st in (2, 3, 4)]
            variants += [(f"tc s={st} wave", {"stages": st, "rule": "wave"}) for st in (2, 3)]
            variants += [(f"tc s={st} l2", {"stages": st, "l2": True}) for st in (3, 4)]
            for spec in filter(None, args.tc_tiles.split(",")):
                parts = spec.split("x")
                l2 = parts[-1] == "l2"
                bn, bk, w, *st = (int(v) for v in parts[:len(parts) - l2])
                st = st[0] if st else 3
                variants.append((f"tc {bn}x{bk}x{w} s={st}{' l2' if l2 else ''}",
                                 {"stages": st, "tile": (bn, bk, w), "l2": l2}))
            if args.only:
                variants = [v for v in variants if v[0] == "cublas" or v[0].startswith(tuple(args.only.split(",")))]
            ref = [F.linear(x, ws[c % copies]) for c in range(args.calls)]
            for label, kw in variants:
                def call(c: int, kw=kw, x=x, ws=ws, copies=copies) -> torch.Tensor:
                    w = ws[c % copies]
                    if kw is None:
                        return F.linear(x, w)
                    if "stages" in kw:
                        return _tc(x, w, kw["stages"], kw.get("rule", "fill"), kw.get("tile"), kw.get("l2", False))
                    return gemv(x, w, **kw)
                try:
                    us, err = graph_call_us(call, args.calls, args.replays, ref)
                    row = dict(shape=name, n=n, k=k, rows=m, impl=label, us=round(us, 2),
                               gbps=round(nbytes / us / 1e3, 1), rel_err=err, ok=err < 2e-2)
                except Exception as exc:  # noqa: BLE001 - a launch shape Triton refuses is a result too
                    row = dict(shape=name, n=n, k=k, rows=m, impl=label, error=f"{type(exc).__name__}: {exc}"[:200])
                results.append(row)
                print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    summary = {}
    for name, _, _ in picked:
        for m in (int(r) for r in args.rows.split(",")):
            rows = [r for r in results if r["shape"] == name and r["rows"] == m and r.get("ok")]
            cub = next((r for r in rows if r["impl"] == "cublas"), None)
            best = min((r for r in rows if r["impl"] != "cublas"), key=lambda r: r["us"], default=None)
            if cub and best:
                summary[f"{name} M={m}"] = dict(cublas_us=cub["us"], gemv_us=best["us"], gemv=best["impl"],
                                               speedup=round(cub["us"] / best["us"], 2))
    print(json.dumps(summary, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv_sweep.json").write_text(json.dumps({"results": results, "summary": summary}, indent=1))


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


if __name__ == "__main__":
    main()
