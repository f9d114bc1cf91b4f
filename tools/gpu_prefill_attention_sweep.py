#!/usr/bin/env python3
"""The prefill attention at the 9B's head shape (16 query / 4 KV heads of 256, output gate): launch tiles timed.

Issue 39 item 3. The sm_90 build of the old tile (64 x 32, 8 warps) spills at D = 256 (docs/dev/perf-log.md reads
the SASS of each candidate offline; the first sweep on an H100 replaced it by 128 x 64); this times the candidates
on the device for one prompt of ``--tokens``
tokens, each as a share of the bf16 matmul peak measured in the same run (causal FLOPs: ``2 * T^2 * Hq * D``),
with its largest difference from the default's output. torch's SDPA over the same (contiguous) K and V, causal,
is the yardstick.

    python3 tools/gpu_prefill_attention_sweep.py --out $OUT/attn_prefill.json
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from ninfer.ops.triton import attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernel_profile import graph_us, require_cuda, write_report  # noqa: E402

HQ, HKV, D, PAGE = 16, 4, 256, 16
# (BLOCK_M, BLOCK_N, warps, stages): today's default first, then the old one (64 x 32) and wider tiles.
CONFIGS = [(128, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
           (128, 64, 4, 2), (256, 64, 8, 2), (128, 32, 4, 2), (64, 64, 4, 2)]


def _measure(tokens: int, peak: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(tokens, HQ, D, generator=g, device="cuda").to(bf)
    gate = torch.randn(tokens, HQ * D, generator=g, device="cuda").to(bf)
    k = torch.randn(tokens, HKV, D, generator=g, device="cuda").to(bf)
    v = torch.randn(tokens, HKV, D, generator=g, device="cuda").to(bf)
    pages = -(-tokens // PAGE)
    k_pool = torch.zeros(pages * PAGE, HKV, D, device="cuda", dtype=bf)
    v_pool = torch.zeros_like(k_pool)
    k_pool[:tokens], v_pool[:tokens] = k, v
    k_pool, v_pool = k_pool.view(pages, PAGE, HKV, D), v_pool.view(pages, PAGE, HKV, D)
    cu = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    lens = torch.tensor([tokens], device="cuda", dtype=torch.int32)
    table = torch.arange(pages, device="cuda", dtype=torch.int32)[None]
    scale = D ** -0.5
    flops = 2.0 * tokens * tokens * HQ * D
    call = functools.partial(attention.paged_attention, q, k_pool, v_pool, cu, lens, table, scale, gate)
    base = call().float()
    run = {"tokens": tokens, "flops": flops, "configs": []}
    for bm, bn, warps, stages in CONFIGS:
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        one = functools.partial(call, config=cfg)
        try:
            out = one().float()
            ms = graph_us(one, 5) / 1000
        except Exception as exc:  # noqa: BLE001 (a tile this Triton cannot build: report it, go on)
            run["configs"].append({"config": cfg, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(f"T={tokens} {cfg}: {type(exc).__name__}", flush=True)
            continue
        diff = float((out - base).abs().max() / base.abs().max())
        run["configs"].append({"config": cfg, "ms": ms, "of_peak": flops / (ms * 1e-3) / peak,
                               "max_rel_diff_vs_default": diff})
        print(f"T={tokens} {cfg}: {ms:.3f} ms, {100 * flops / (ms * 1e-3) / peak:.1f}% of peak, diff {diff:.1e}",
              flush=True)
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt, is_causal=True,
                             scale=scale, enable_gqa=True)
    try:
        run["sdpa_ms"] = graph_us(sdpa, 5) / 1000
        print(f"T={tokens} SDPA: {run['sdpa_ms']:.3f} ms, {100 * flops / (run['sdpa_ms'] * 1e-3) / peak:.1f}% of "
              f"peak", flush=True)
    except RuntimeError as exc:
        run["sdpa_error"] = str(exc)[:300]
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not require_cuda("gpu_prefill_attention_sweep"):
        return 2
    from ninfer.bench.limits import measure_matmul_peak
    peak = measure_matmul_peak(torch.device("cuda"), torch.bfloat16, 8192)
    report = {"device": torch.cuda.get_device_name(), "matmul_peak_flops": peak, "heads": [HQ, HKV, D],
              "runs": [_measure(t, peak) for t in args.tokens]}
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
