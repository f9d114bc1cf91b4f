#!/usr/bin/env python3
"""Decode fusions, fused vs unfused, on the GPU (diagnostics for ``gdn_decode`` and ``add_rms_norm_linear``).

1. A GDN layer's decode tail at the Qwen3.5 GDN head shape (Hk 16 x 128, Hv 32 x 128, conv 4): the four Triton
   ops (gates, conv update, recurrent step, gated norm) against ``gdn_decode`` for each step-kernel warp count.
2. A block's pre-norm + first projection at the 9B and 35B-A3B shapes: the Triton ``add_rms_norm_unit_offset`` then the GEMV,
   against the GEMV with the norm prologue for two row-block sizes.

Each case is one CUDA graph of ``--calls`` calls rotating over enough copies of the weights / states that every
call reads them from HBM, as a decode step does (tools/gpu_kernel_profile.py ``graph_call_us``). The GDN calls
write their states to spare slots (the lookahead form), so every call of every variant sees the same inputs and
the outputs are compared (max relative difference from the unfused path).

    python3 tools/gpu_decode_fusion_sweep.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from ninfer.ops.triton import linear, norm
from ninfer_qwen3_5.ops.contracts import GDNDecodeParams
from ninfer_qwen3_5.ops.triton import conv1d, gated_norm, gdn_decode, gdn_gates, gdn_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernel_profile import graph_call_us  # noqa: E402

HK, DK, HV, DV, K = 16, 128, 32, 128, 4
# (name, hidden, out features of the block's first projection)
NORM_SHAPES = [("35b gdn in", 2048, 12352), ("35b moe in", 2048, 1281), ("9b gdn in", 4096, 12352),
               ("9b mlp gate_up", 4096, 24576)]


def gdn_cases(bsz: int, calls: int, replays: int, g: torch.Generator) -> list[dict]:
    dev, bf = torch.device("cuda"), torch.bfloat16
    c = 2 * HK * DK + HV * DV
    state_bytes = 2 * bsz * HV * DK * DV * 4
    copies = max(2, math.ceil((256 << 20) / state_bytes))
    fused = torch.randn(bsz, c + HV * DV + 2 * HV, device=dev, dtype=bf, generator=g)
    mixed, z = fused[:, :c], fused[:, c:c + HV * DV].view(bsz, HV, DV)
    b, a = fused[:, c + HV * DV:c + HV * DV + HV], fused[:, c + HV * DV + HV:]
    params = [GDNDecodeParams(conv_weight=torch.randn(c, K, device=dev, dtype=bf, generator=g) * 0.5,
                              neg_a=-torch.rand(HV, device=dev, generator=g), dt_bias=torch.zeros(HV, device=dev),
                              norm_weight=torch.ones(DV, device=dev, dtype=bf), key_heads=HK, key_dim=DK,
                              value_heads=HV, value_dim=DV, eps=1e-6, scale=DK ** -0.5) for _ in range(copies)]
    convs = [torch.randn(2 * bsz, c, K - 1, device=dev, dtype=bf, generator=g) for _ in range(copies)]
    states = [torch.randn(2 * bsz, HV, DK, DV, device=dev, generator=g) * 0.1 for _ in range(copies)]
    slots = torch.arange(bsz, device=dev)
    spare = slots + bsz   # written, never read: every call sees the same states

    def unfused(i: int) -> torch.Tensor:
        p, j = params[i % copies], i % copies
        gg, beta = gdn_gates.gdn_gates(a, b, p.neg_a, p.dt_bias)
        y = conv1d.causal_conv1d_update(mixed, p.conv_weight, convs[j], slots, spare)
        q, k, v = y.split([HK * DK, HK * DK, HV * DV], dim=-1)
        o = gdn_step.gdn_recurrent_step(q.view(bsz, HK, DK), k.view(bsz, HK, DK), v.view(bsz, HV, DV), gg, beta,
                                        states[j], slots, p.scale, spare)
        return gated_norm.gated_rms_norm(o, z, p.norm_weight, p.eps)

    ref = [unfused(i) for i in range(calls)]
    moved = 2 * bsz * HV * DK * DV * 4 + 2 * bsz * c * (K - 1) * 2
    rows = []
    variants = [("4 ops", unfused)] + [
        (f"gdn_decode {'one kernel' if one else 'two kernels'} w={w}", lambda i, w=w, one=one: gdn_decode.gdn_decode(
            mixed, z, a, b, params[i % copies], convs[i % copies], states[i % copies], slots, spare, step_warps=w,
            one_kernel=one))
        for one in (True, False) for w in (4, 8)]
    for label, call in variants:
        us, err = graph_call_us(call, calls, replays, ref)
        rows.append({"what": "gdn decode tail", "B": bsz, "variant": label, "us": us, "GBps": moved / us / 1e3,
                     "max_rel_diff": err})
    return rows


def norm_cases(name: str, hidden: int, n_out: int, rows_m: int, calls: int, replays: int,
               g: torch.Generator) -> list[dict]:
    dev, bf = torch.device("cuda"), torch.bfloat16
    nbytes = n_out * hidden * 2
    copies = max(2, math.ceil((400 << 20) / nbytes))
    ws = [torch.randn(n_out, hidden, device=dev, dtype=bf, generator=g) * hidden ** -0.5 for _ in range(copies)]
    x = torch.randn(rows_m, hidden, device=dev, dtype=bf, generator=g)
    res = torch.randn(rows_m, hidden, device=dev, dtype=bf, generator=g)
    nw = torch.randn(hidden, device=dev, dtype=bf, generator=g) * 0.1

    def unfused(i: int) -> torch.Tensor:
        h, _ = norm.add_rms_norm_unit_offset(x, res, nw, 1e-6)
        return linear.linear(h, ws[i % copies])

    def fused(i: int, bn: int) -> torch.Tensor:
        h, ro = torch.empty_like(x), torch.empty_like(x)
        return linear.gemv(x, ws[i % copies], norm=(res, nw, 1e-6, h, ro), block_n=bn)

    ref = [unfused(i) for i in range(calls)]
    out = []
    base_bn = 2 if rows_m == 1 else 4
    for label, call in [("add_rms_norm_unit_offset + gemv", unfused)] + [
            (f"fused bn={bn}", lambda i, bn=bn: fused(i, bn)) for bn in (base_bn, 2 * base_bn)]:
        us, err = graph_call_us(call, calls, replays, ref)
        out.append({"what": name, "M": rows_m, "variant": label, "us": us, "GBps": nbytes / us / 1e3,
                    "max_rel_diff": err})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--gdn-only", action="store_true", help="only the GDN decode tail's variants")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for bsz in (1, 8):
        results += gdn_cases(bsz, args.calls, args.replays, g)
    for name, hidden, n_out in () if args.gdn_only else NORM_SHAPES:
        for m in (1, 8):
            if linear.use_gemv(torch.empty(m, hidden, device="cuda", dtype=torch.bfloat16),
                               torch.empty(n_out, hidden, device="cuda", dtype=torch.bfloat16)):
                results += norm_cases(name, hidden, n_out, m, args.calls, args.replays, g)
    for r in results:
        size = f"B={r['B']}" if "B" in r else f"M={r['M']}"
        print(f"{r['what']:<16} {size:<4} {r['variant']:<22} {r['us']:8.2f} us {r['GBps']:8.1f} GB/s "
              f"diff {r['max_rel_diff']:.1e}")
    (args.out / "decode_fusion_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
