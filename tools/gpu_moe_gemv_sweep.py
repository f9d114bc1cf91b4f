#!/usr/bin/env python3
"""Launch-shape sweep of the decode MoE GEMVs (``ninfer.ops.triton.moe_gemv``) at the Qwen3.5-35B-A3B expert
geometry (E=256, H=2048, I=512, top-8, shared expert 512), on the GPU (diagnostics).

Each configuration runs inside one CUDA graph of ``--calls`` calls that rotate over ``--banks`` expert banks
(6.4 GB at 4 banks: far beyond the 50 MB L2) with fresh random routings, so a call reads its experts from
HBM as a decode step does. Reported: microseconds per call and the bytes it must read (distinct experts'
gate/up + down rows, the shared down matrix) over that time. Every configuration's output is checked
against the default launch shape's (bf16 rounding of a reordered fp32 sum: within 2e-2 relative).

    python3 tools/gpu_moe_gemv_sweep.py --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from ninfer.ops.contracts import SharedExpert
from ninfer.ops.triton.moe_gemv import moe_experts_gemv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernel_profile import graph_call_us  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--banks", type=int, default=4)
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--replays", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    E, H, I, K, IS = 256, 2048, 512, 8, 512  # noqa: E741 (the model's names)
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = [torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
               for _ in range(args.banks)]
    down = [torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(args.banks)]
    sdown = [torch.randn(H, IS, device=dev, dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(args.banks)]
    results = []
    for t in (int(x) for x in args.tokens.split(",")):
        x = torch.randn(t, H, device=dev, dtype=torch.bfloat16, generator=g)
        proj = torch.randn(t, 2 * IS, device=dev, dtype=torch.bfloat16, generator=g)
        glog = torch.randn(t, 1, device=dev, dtype=torch.bfloat16, generator=g)
        ids = [torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(t)])
               for _ in range(args.calls)]
        w = torch.softmax(torch.randn(t, K, device=dev, generator=g), -1)
        distinct = sum(len(set(i.flatten().tolist())) for i in ids) / args.calls
        nbytes = distinct * (2 * I * H + H * I) * 2 + H * IS * 2

        def call(c: int, tune: dict, x=x, w=w, ids=ids, proj=proj, glog=glog) -> torch.Tensor:
            b = c % args.banks
            return moe_experts_gemv(x, w, ids[c], gate_up[b], down[b], SharedExpert(proj, sdown[b], glog),
                                    tune=tune)

        base = [call(c, {}) for c in range(args.calls)]
        # gate/up: K tiles up to a whole row (one load per program); down: the one-shot kernel (default) and the
        # per-expert loop kernel.
        grid = ([dict(bn1=bn1, bk1=bk1, warps1=w1) for bn1, bk1, w1 in
                 itertools.product((1, 2, 4, 8), (512, 1024, 2048), (4, 8)) if bn1 * bk1 <= 8192]
                + [dict(down="one_shot", bn2=bn2, warps2=w2) for bn2, w2 in itertools.product((1, 2, 4, 8), (4, 8))]
                + [dict(down="loop", bn2=bn2, warps2=w2) for bn2, w2 in itertools.product((2, 4, 8), (2, 4))]
                + [{}])
        for tune in grid:
            try:
                us, err = graph_call_us(lambda c, tune=tune: call(c, tune), args.calls, args.replays, base)
                row = dict(tokens=t, tune=tune, us=round(us, 2), gbps=round(nbytes / us / 1e3, 1),
                           rel_err=err, ok=err < 2e-2)
            except Exception as exc:  # noqa: BLE001 - a shape Triton refuses is a result too
                row = dict(tokens=t, tune=tune, error=f"{type(exc).__name__}: {exc}"[:200])
            results.append(row)
            print(json.dumps(row), flush=True)
    best = {}
    for t in (int(x) for x in args.tokens.split(",")):
        ok = [r for r in results if r["tokens"] == t and r.get("ok")]
        for part, keys in (("gate_up", ("bn1", "bk1", "warps1")), ("down", ("down",))):
            cands = [r for r in ok if any(k in r["tune"] for k in keys)]
            if cands:
                best[f"{t}/{part}"] = min(cands, key=lambda r: r["us"])
        best[f"{t}/default"] = next(r for r in ok if not r["tune"])
    print(json.dumps(best, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_gemv_sweep.json").write_text(json.dumps({"results": results, "best": best}, indent=1))


if __name__ == "__main__":
    main()
