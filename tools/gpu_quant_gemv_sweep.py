#!/usr/bin/env python3
"""Quantized decode GEMV sweep: the Triton dequant-GEMV (``ninfer.ops.triton.quant_gemv``) against the bf16 GEMV
and cuBLAS at the Qwen3.5-9B projection shapes, one and eight rows, on the GPU (issue 32's kernel work).

Weights are random normals encoded on the GPU by the formats' own encoders. Each case runs inside one CUDA graph
of ``--calls`` calls rotating over enough weight copies (>= 256 MB of stored bytes) that every call reads its
weight from HBM, as a decode step does. Reported per case: microseconds per call, the stored bytes over that
time (GB/s) and the speed-up over the bf16 GEMV of the same shape; outputs are checked against the fp32 product
of the decoded weight.

    python3 tools/gpu_quant_gemv_sweep.py --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernel_profile import graph_call_us  # noqa: E402

SHAPES = [("9b gdn in", 12352, 4096), ("9b gdn out", 4096, 4096), ("9b mlp gate_up", 24576, 4096),
          ("9b mlp down", 4096, 12288), ("9b attn q", 8192, 4096), ("9b attn kv", 1024, 4096),
          ("9b lm head", 248320, 4096)]


def packed(fmt: str, w: torch.Tensor):
    """``w`` encoded as ``fmt`` on its device, as the loader's packed view of one stored object."""
    from ninfer.quant import encoded_size, fp8_row, packed_view
    from ninfer.quant.groupwise import GROUPWISE

    rows, k = w.shape
    buf = torch.zeros(encoded_size(fmt, (rows, k)), dtype=torch.uint8, device=w.device)

    def put(off, plane):
        raw = plane.contiguous().view(torch.uint8).reshape(-1)
        buf[off:off + raw.numel()] = raw

    if fmt == fp8_row.FORMAT:
        codes, scales = fp8_row.encode(w)
        put(0, codes)
        put(fp8_row.scale_offset(rows, k), scales)
    else:
        spec = GROUPWISE[fmt]
        base, high, scales = spec.encode(w)
        high_off, scale_off, _, _ = spec.plane_offsets(rows, k)
        put(0, base)
        put(high_off, high)
        put(scale_off, scales)
    return packed_view(fmt, buf, (rows, k), 0, rows * k, (rows, k)), buf.numel()


def bf16_impls(x: torch.Tensor, ws: list) -> list:
    """(label, call(c)) of the bf16 baselines, call c reading weight copy ``c % len(ws)``."""
    from ninfer.ops.triton.linear import gemv as bf16_gemv

    return [("cublas bf16", lambda c: F.linear(x, ws[c % len(ws)])),
            ("triton bf16", lambda c: bf16_gemv(x, ws[c % len(ws)]))]


def _tc_call(module, x: torch.Tensor, kw, in_kernel_sum: bool | None, split_rule: str | None = None,
             stages: int | None = None, l2: bool = False):
    """The engine's tensor-core GEMV; ``in_kernel_sum`` True / False forces where the split-K partials are added
    (the last program of each block / the separate sum kernel), None is the module's default (the A/B of the two);
    ``split_rule`` replaces ``NINFER_QUANT_SPLIT``'s for the call; ``stages`` builds the kernel with that many
    software-pipeline stages, with the split target of the CTAs that then fit an SM (q4: 2 stages, ~42 KB of shared
    memory and 128 registers, fit 4 an SM against 2 at the default 3 stages); ``l2`` asks L2 for each program's
    weight run before the PDL wait (NINFER_QUANT_L2_PREFETCH=1)."""
    from ninfer.ops.triton import quant_gemv_tc

    saved = quant_gemv_tc.SPLIT_RULE, dict(quant_gemv_tc.LAUNCH_OPTIONS), quant_gemv_tc._TARGET_PROGRAMS
    quant_gemv_tc.SPLIT_RULE = split_rule or saved[0]
    if stages is not None:
        quant_gemv_tc.LAUNCH_OPTIONS["num_stages"] = stages
        quant_gemv_tc._TARGET_PROGRAMS = saved[2] * 2 if stages == 2 else saved[2]
    try:
        extra = {} if in_kernel_sum is None else {"in_kernel_sum": in_kernel_sum}
        return module.gemv_tc(x, kw, l2_prefetch=l2, **extra)
    finally:
        quant_gemv_tc.SPLIT_RULE = saved[0]
        quant_gemv_tc.LAUNCH_OPTIONS.clear()
        quant_gemv_tc.LAUNCH_OPTIONS.update(saved[1])
        quant_gemv_tc._TARGET_PROGRAMS = saved[2]


def quant_impls(x: torch.Tensor, kws: list, variants: list[str]) -> list:
    """(label, call(c)) of the engine's GEMV and each candidate of ``variants`` (``BNxGxWARPS`` for
    :func:`quant_gemv_candidates.gemv`, ``tcBNxWARPS`` for the tensor-core candidate, ``t3BNxGPI`` / ``t5BNxGPI``
    for :func:`quant_gemv_candidates.gemv_tc35` on q4 weights, ``gemm`` for the engine's GEMM)."""
    import quant_gemv_candidates as cand
    from ninfer.ops.triton.quant_gemm import gemm
    from ninfer.ops.triton.quant_gemv import gemv

    def w(c):
        return kws[c % len(kws)]

    impls = [("current", lambda c: gemv(x, w(c)))]
    xp = None
    for v in variants:
        if v[:2] in ("t3", "t5"):   # q4 only: t3BNxGPI / t5BNxGPI (tc3 takes x pre-permuted, outside the timing)
            if kws[0].format != "q4_g64_fp16":
                continue
            bn, gpi = (int(t) for t in v[2:].split("x"))
            natural = v[:2] == "t5"
            if not natural and xp is None:
                xp = x[:, cand.perm_tc3(x.shape[1]).to(x.device)].contiguous()
            xin = x if natural else xp
            impls.append((f"{v[:2]} bn={bn} gpi={gpi}", lambda c, bn=bn, gpi=gpi, xin=xin, natural=natural:
                          cand.gemv_tc35(xin, w(c), natural_x=natural, bn=bn, gpi=gpi)))
        elif v in ("engine_tc", "engine_tc_sum1", "engine_tc_sum2", "engine_tc_wave", "engine_tc_st2",
                   "engine_tc_st2_wave", "engine_tc_l2", "engine_tc_wave_l2"):
            # The engine's tensor-core GEMV of the format (q4, q8, fp8) at its launch shape, as the engine runs it;
            # _sum1 with the split-K sum forced into the kernel, _sum2 forced into the second kernel; _wave with the
            # `wave` split rule; _st2 (q4 only) built with 2 pipeline stages, 4 CTAs an SM; _l2 with the L2 prefetch.
            from ninfer.ops.triton import quant_gemv_tc, quant_gemv_tc8
            where = {"engine_tc_sum1": True, "engine_tc_sum2": False}.get(v)
            rule = "wave" if "_wave" in v else None
            l2 = v.endswith("_l2")
            stages = 2 if "_st2" in v else None
            for module in (quant_gemv_tc, quant_gemv_tc8):
                if stages and module is not quant_gemv_tc:
                    continue
                if module.launch_shape(x.shape[0], kws[0]) is not None and x.dtype == torch.bfloat16:
                    impls.append((v.replace("_", " "), lambda c, module=module, where=where, rule=rule, stages=stages,
                                  l2=l2: _tc_call(module, x, w(c), where, rule, stages, l2)))
        elif v == "engine_tc_norm_sep":
            # NINFER_QUANT_NORM=separate: the Triton add + norm kernel, then the plain tensor-core GEMV (any format),
            # against engine_tc_norm's prologue in every program (timed on the same kind of random residual)
            from ninfer.ops.triton import norm as tnorm
            from ninfer.ops.triton import quant_gemv_tc, quant_gemv_tc8
            module = next((m for m in (quant_gemv_tc, quant_gemv_tc8)
                           if m.launch_shape(x.shape[0], kws[0]) is not None), None)
            if module is None or x.dtype != torch.bfloat16:
                continue
            res, nw = torch.randn_like(x), torch.rand(x.shape[1], device=x.device, dtype=x.dtype)
            impls.append(("engine tc norm sep", lambda c, module=module, res=res, nw=nw:
                          module.gemv_tc(tnorm.add_rms_norm_unit_offset(x, res, nw, 1e-6)[0], w(c))))
        elif v in ("engine_tc_pf", "engine_tc_norm", "engine_tc_norm_pf", "engine_tc_norm_l2", "engine_tc_streamk",
                   "engine_tc_streamk_l2", "engine_tc_norm_streamk"):
            # q4's tensor-core GEMV with its first weight tile loaded before the PDL wait (_pf), its weight run asked
            # of L2 there (_l2), stream-K shares (_streamk: NINFER_QUANT_SPLIT=streamk), and the fused add + norm
            # prologue (_norm: timed on a random residual; its output is x's normed product, so rel_err against the
            # plain product is not a check)
            from ninfer.ops.triton import quant_gemv_streamk, quant_gemv_tc
            if quant_gemv_tc.launch_shape(x.shape[0], kws[0]) is None or x.dtype != torch.bfloat16:
                continue
            norm = None
            if "norm" in v:
                res, nw = torch.randn_like(x), torch.rand(x.shape[1], device=x.device, dtype=x.dtype)
                norm = (res, nw, 1e-6, torch.empty_like(x), torch.empty_like(x))
            kw = {"norm": norm, "l2_prefetch": v.endswith("_l2")}
            fn = (quant_gemv_streamk.gemv_tc if "streamk" in v
                  else functools.partial(quant_gemv_tc.gemv_tc, prefetch=v.endswith("_pf")))
            impls.append((v.replace("_", " "), lambda c, fn=fn, kw=kw: fn(x, w(c), **kw)))
        elif v == "gemm":
            impls.append(("quant gemm", lambda c: gemm(x, w(c))))
        elif v.startswith("tc"):
            bn, wa = (int(t) for t in v[2:].split("x"))
            impls.append((f"tc bn={bn} w={wa}", lambda c, bn=bn, wa=wa: cand.gemv_tc(x, w(c), bn, wa)))
        else:
            bn, gg, wa = (int(t) for t in v.split("x"))
            impls.append((f"cand bn={bn} g={gg} w={wa}", lambda c, bn=bn, gg=gg, wa=wa: cand.gemv(x, w(c), bn, gg, wa)))
    return impls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--formats", default="q4_g64_fp16,q8_g32_fp16,fp8_e4m3fn_row_bf16")
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--shapes", default="")
    ap.add_argument("--variants", default="2x32x4,4x16x4,8x16x4,tc64x4,tc128x4,tc128x8,tc64x8,gemm",
                    help="candidates: BNxGxWARPS (CUDA-core), tcBNxWARPS (tensor-core), t3BNxGPI / t5BNxGPI (q4, "
                         "tensor cores, PTX decode, split-K; t3 with x pre-permuted), engine_tc (ninfer.ops.triton.quant_gemv_tc / _tc8, as the "
                         "engine runs them), engine_tc_sum1 / engine_tc_sum2 (the same with the split-K sum forced into "
                         "the kernel / into a second kernel), engine_tc_wave (NINFER_QUANT_SPLIT=wave), engine_tc_st2 / "
                         "engine_tc_st2_wave (q4 built with 2 pipeline stages: 4 CTAs an SM), engine_tc_norm_sep (the Triton norm "
                         "kernel, then the plain GEMV: NINFER_QUANT_NORM=separate), engine_tc_pf / "
                         "engine_tc_norm / engine_tc_norm_pf (q4: the first weight tile before the PDL wait; with the "
                         "fused norm prologue), engine_tc_l2 / engine_tc_wave_l2 / engine_tc_norm_l2 (each program's "
                         "weight run asked of L2 before the PDL wait: NINFER_QUANT_L2_PREFETCH=1), "
                         "engine_tc_streamk / engine_tc_streamk_l2 / engine_tc_norm_streamk (q4, stream-K shares: "
                         "NINFER_QUANT_SPLIT=streamk), "
                         "gemm (the engine's GEMM)")
    args = ap.parse_args()
    from ninfer.ops.triton._quant import kernel_weight

    picked = [s for s in SHAPES if not args.shapes or any(p in s[0] for p in args.shapes.split(","))]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    results = []

    def record(row):
        results.append(row)
        print(json.dumps(row), flush=True)

    def time_impls(base: dict, impls: list, ref: list, nbytes: int, bf_us: float | None) -> None:
        for label, call in impls:
            try:
                us, err = graph_call_us(call, args.calls, args.replays, ref)
                record(dict(base, impl=label, us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), rel_err=err,
                            ok=err < 2e-2, x_bf16=round(bf_us / us, 2) if bf_us else None))
            except Exception as exc:  # noqa: BLE001 - a launch shape Triton refuses is a result too
                record(dict(base, impl=label, error=f"{type(exc).__name__}: {exc}"[:300]))

    for name, n, k in picked:
        w_bf = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * k ** -0.5
        copies_bf = max(2, math.ceil((256 << 20) / (n * k * 2)))
        ws_bf = [w_bf] + [w_bf.clone() for _ in range(copies_bf - 1)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            base = dict(shape=name, n=n, k=k, rows=m)
            ref_bf = [F.linear(x, ws_bf[c % copies_bf]) for c in range(args.calls)]
            time_impls(dict(base, fmt="bf16"), bf16_impls(x, ws_bf), ref_bf, n * k * 2, None)
            bf_us = min((r["us"] for r in results if r.get("shape") == name and r.get("rows") == m
                         and r.get("fmt") == "bf16" and "us" in r), default=None)
            for fmt in args.formats.split(","):
                pw, nbytes = packed(fmt, w_bf.float())
                copies = max(2, math.ceil((256 << 20) / nbytes))
                kws = [kernel_weight(p, "sweep") for p in [pw] + [packed(fmt, w_bf.float())[0]
                                                               for _ in range(copies - 1)]]
                wd = pw.dequantize(torch.float32)
                ref = [(x.float() @ wd.T) for _ in range(args.calls)]
                time_impls(dict(base, fmt=fmt), quant_impls(x, kws, args.variants.split(",")), ref, nbytes, bf_us)
                del kws, wd, pw
                torch.cuda.empty_cache()
        del ws_bf, w_bf
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_gemv_sweep.json").write_text(json.dumps(results, indent=1))
    # Best per (shape, rows, fmt): current vs best candidate.
    print("shape | rows | fmt | bf16 us | current us (x bf16) | best cand us (x bf16) | best cand")
    for name, _, _ in picked:
        for m in (int(r) for r in args.rows.split(",")):
            bf = min((r["us"] for r in results if r.get("shape") == name and r.get("rows") == m
                      and r.get("fmt") == "bf16" and "us" in r), default=None)
            for fmt in args.formats.split(","):
                rs = [r for r in results if r.get("shape") == name and r.get("rows") == m and r.get("fmt") == fmt
                      and r.get("ok")]
                cur = next((r for r in rs if r["impl"] == "current"), None)
                best = min((r for r in rs if r["impl"] != "current"), key=lambda r: r["us"], default=None)
                print(f"{name} | {m} | {fmt} | {bf} | {cur and cur['us']} ({cur and cur['x_bf16']}) | "
                      f"{best and best['us']} ({best and best['x_bf16']}) | {best and best['impl']}")


if __name__ == "__main__":
    main()
