"""Micro-benchmark of the Triton attention / norm / rope / KV-write / conv / sampling kernels on CUDA.

Usage (device): PYTHONPATH=ninfer-core/src python3 tools/bench_triton_attention.py [--out DIR] [--quick]
Writes bench_attention.json under --out and prints a table last.

Method (that of ``ninfer bench``, docs/benchmarks.md): the copy ceiling is measured first (device-to-device
copy, bytes read + written); decode attention is timed as CUDA-graph replays of N calls that rotate over N
disjoint KV sets (fragmented page tables, random bf16 data, never zeros), N chosen so the sets together exceed
the 60 MB L2 several times, so the figure is HBM bandwidth, not cache. Bytes counted = the KV actually read
(B * ctx * Hkv * D * 2 tensors * 2 bytes); q/out/partials are not counted. Eager single-call medians
(do_bench) include launch overhead and are reported beside. The torch reference op is timed eagerly (it
syncs, so it cannot be captured).
"""

# ruff: noqa: B023  -- the timed lambdas close over loop variables on purpose: each runs inside its own iteration.
from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

import torch
from ninfer.ops.reference import attention as ref_attn
from ninfer.ops.reference import kv_cache as ref_kv
from ninfer.ops.reference import norm as ref_norm
from ninfer.ops.reference import rope as ref_rope
from ninfer.ops.reference import sampling as ref_sampling
from ninfer.ops.triton import attention, kv_cache, norm, rope, sampling
from ninfer_qwen3_5.ops.reference import conv1d as ref_conv
from ninfer_qwen3_5.ops.reference import gated_norm as ref_gated_norm
from ninfer_qwen3_5.ops.triton import conv1d, gated_norm
from triton.testing import do_bench

ROWS: list[dict] = []
DEV = "cuda"
TINY = False  # --tiny (CPU smoke of this script under TRITON_INTERPRET=1): small sizes, wall-clock timing


def log(**kw):
    ROWS.append(kw)
    print(json.dumps(kw), flush=True)


def bench_ms(fn, rep=100):
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return do_bench(fn, warmup=20, rep=rep, return_mode="median")


def graph_ms_per_call(calls, replays=10):
    if DEV == "cpu":
        return sum(bench_ms(c) for c in calls) / len(calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (replays * len(calls)))
    return sorted(times)[len(times) // 2]


def copy_bandwidth():
    n = 1 << (12 if TINY else 30)  # 2 GiB of bf16
    x = torch.randn(n, dtype=torch.bfloat16, device=DEV)
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    gbs = 2 * x.numel() * 2 / ms / 1e6
    log(kind="copy", bytes=2 * n * 2, ms=ms, GBps=gbs)
    return gbs


def decode_sets(bsz, ctx, hq, hkv, d, page, n_sets, gen):
    pages_per_row = math.ceil(ctx / page)
    n_pool = n_sets * bsz * pages_per_row
    k_pool = torch.randn((n_pool, page, hkv, d), dtype=torch.bfloat16, device=DEV)
    v_pool = torch.randn((n_pool, page, hkv, d), dtype=torch.bfloat16, device=DEV)
    perm = torch.randperm(n_pool, generator=gen).to(torch.int32).view(n_sets, bsz, pages_per_row).to(DEV)
    qs = [torch.randn((bsz, hq, d), dtype=torch.bfloat16, device=DEV) for _ in range(n_sets)]
    kv_lens = torch.full((bsz,), ctx, dtype=torch.int32, device=DEV)
    return k_pool, v_pool, perm, qs, kv_lens


def bench_decode(copy_gbs, quick):
    hq, hkv, d, page = 8, 2, 256, 16
    gen = torch.Generator().manual_seed(0)
    cases = [(1, 1024), (1, 8192), (1, 32768), (8, 1024), (8, 8192), (8, 32768)]
    swept = ((1, 1024), (1, 8192), (1, 32768), (8, 8192))
    if TINY:
        hq, hkv, d, page, cases, swept = 4, 2, 16, 4, [(1, 40), (2, 300)], ((2, 300),)
    for bsz, ctx in cases:
        try:
            decode_case(bsz, ctx, hq, hkv, d, page, gen, copy_gbs, sweep=not quick and (bsz, ctx) in swept)
        except Exception:  # one failing case is recorded; the others still run
            log(kind="decode_error", B=bsz, ctx=ctx, error=traceback.format_exc()[-2000:])
        if DEV == "cuda":
            torch.cuda.empty_cache()


def decode_case(bsz, ctx, hq, hkv, d, page, gen, copy_gbs, sweep):
    kv_bytes = bsz * ctx * hkv * d * 2 * 2
    n_sets = 2 if TINY else max(2, min(64, math.ceil(512e6 / kv_bytes)))
    k_pool, v_pool, tables, qs, kv_lens = decode_sets(bsz, ctx, hq, hkv, d, page, n_sets, gen)
    scale = d ** -0.5
    outs = [None] * n_sets

    def make(i, cfg=None):
        def call():
            outs[i] = attention.paged_decode_attention(qs[i], k_pool, v_pool, kv_lens, tables[i], scale, config=cfg)
        return call

    ms = graph_ms_per_call([make(i) for i in range(n_sets)])
    eager = bench_ms(make(0))
    ref_ms = bench_ms(lambda: ref_attn.paged_decode_attention(qs[0], k_pool, v_pool, kv_lens, tables[0], scale),
                      rep=50)
    got = attention.paged_decode_attention(qs[0], k_pool, v_pool, kv_lens, tables[0], scale).double()
    want = ref_attn.paged_decode_attention(qs[0], k_pool, v_pool, kv_lens, tables[0], scale).double()
    err = ((got - want).norm() / want.norm()).item()
    log(kind="decode", B=bsz, ctx=ctx, n_sets=n_sets, graph_ms=ms, eager_ms=eager, ref_ms=ref_ms,
        GBps=kv_bytes / ms / 1e6, pct_copy=100 * kv_bytes / ms / 1e6 / copy_gbs, speedup_vs_ref=ref_ms / ms,
        rel_err_vs_ref=err)
    if not sweep:
        return
    for cfg in [dict(P_SPLIT=False), dict(BLOCK_N=64), dict(num_warps=8), dict(num_stages=3),
                dict(MIN_SPLIT_TOKENS=256), dict(MIN_SPLIT_TOKENS=64), dict(MIN_SPLIT_TOKENS=32),
                dict(MAX_SPLITS=128), dict(MAX_SPLITS=32),
                dict(BLOCK_N=64, num_warps=8, num_stages=3)]:
        try:
            t = graph_ms_per_call([make(i, cfg) for i in range(n_sets)])
            log(kind="decode_sweep", B=bsz, ctx=ctx, config=cfg, graph_ms=t, GBps=kv_bytes / t / 1e6)
        except Exception as exc:  # a config that fails to compile or run is recorded, not fatal
            log(kind="decode_sweep", B=bsz, ctx=ctx, config=cfg, error=repr(exc)[:300])


def bench_prefill():
    hq, hkv, d, page = 8, 2, 256, 16
    lengths = (2048, 8192)
    if TINY:
        hq, hkv, d, page, lengths = 4, 2, 16, 4, (32,)
    for length in lengths:
        n_pages = length // page
        k_pool = torch.randn((n_pages, page, hkv, d), dtype=torch.bfloat16, device=DEV)
        v_pool = torch.randn((n_pages, page, hkv, d), dtype=torch.bfloat16, device=DEV)
        table = torch.randperm(n_pages).to(torch.int32).view(1, -1).to(DEV)
        q = torch.randn((length, hq, d), dtype=torch.bfloat16, device=DEV)
        cu_q = torch.tensor([0, length], dtype=torch.int32, device=DEV)
        kv_lens = torch.tensor([length], dtype=torch.int32, device=DEV)
        scale = d ** -0.5
        flops = 4 * hq * d * length * length / 2  # causal: half of QK^T and PV
        ms = bench_ms(lambda: attention.paged_attention(q, k_pool, v_pool, cu_q, kv_lens, table, scale))
        ref_ms = bench_ms(lambda: ref_attn.paged_attention(q, k_pool, v_pool, cu_q, kv_lens, table, scale), rep=50)
        # Dense flash attention (torch SDPA) on the same data laid out contiguously: a ceiling, not a contract op.
        order = table[0].long()
        kd = k_pool[order].reshape(length, hkv, d).transpose(0, 1)[None]
        vd = v_pool[order].reshape(length, hkv, d).transpose(0, 1)[None]
        qd = q.transpose(0, 1)[None]
        try:
            sdpa_ms = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True))
        except Exception as exc:
            sdpa_ms = float("nan")
            log(kind="prefill_sdpa_error", error=repr(exc)[:300])
        got = attention.paged_attention(q, k_pool, v_pool, cu_q, kv_lens, table, scale).double()
        want = ref_attn.paged_attention(q, k_pool, v_pool, cu_q, kv_lens, table, scale).double()
        log(kind="prefill", L=length, ms=ms, TFLOPs=flops / ms / 1e9, ref_ms=ref_ms, sdpa_ms=sdpa_ms,
            sdpa_TFLOPs=flops / sdpa_ms / 1e9, rel_err_vs_ref=((got - want).norm() / want.norm()).item())


def bench_small_ops():
    bf = torch.bfloat16

    def row(name, fn, ref, nbytes):
        ms, rms = bench_ms(fn), bench_ms(ref, rep=50)
        log(kind="op", op=name, ms=ms, ref_ms=rms, GBps=nbytes / ms / 1e6, speedup_vs_ref=rms / ms)

    for t_len in ((8, 40) if TINY else (8, 8192)):
        x = torch.randn(t_len, 1024, dtype=bf, device=DEV)
        r = torch.randn(t_len, 1024, dtype=bf, device=DEV)
        w = torch.randn(1024, dtype=bf, device=DEV) * 0.1
        row(f"rms_norm_unit_offset[{t_len},1024]", lambda: norm.rms_norm_unit_offset(x, w, 1e-6),
            lambda: ref_norm.rms_norm_unit_offset(x, w, 1e-6), 2 * x.numel() * 2)
        row(f"add_rms_norm_unit_offset[{t_len},1024]", lambda: norm.add_rms_norm_unit_offset(x, r, w, 1e-6),
            lambda: ref_norm.add_rms_norm_unit_offset(x, r, w, 1e-6), 4 * x.numel() * 2)
        xg = torch.randn(t_len, 16, 128, dtype=bf, device=DEV)
        g = torch.randn(t_len, 16, 128, dtype=bf, device=DEV)
        wg = torch.randn(128, dtype=bf, device=DEV)
        row(f"gated_rms_norm[{t_len},16,128]", lambda: gated_norm.gated_rms_norm(xg, g, wg, 1e-6),
            lambda: ref_gated_norm.gated_rms_norm(xg, g, wg, 1e-6), 3 * xg.numel() * 2)
        q = torch.randn(t_len, 8, 256, dtype=bf, device=DEV)
        cos, sin = torch.randn(t_len, 64, device=DEV), torch.randn(t_len, 64, device=DEV)
        row(f"rope[{t_len},8,256]R64", lambda: rope.rope(q, cos, sin), lambda: ref_rope.rope(q, cos, sin),
            2 * q.numel() * 2)
        k = torch.randn(t_len, 2, 256, dtype=bf, device=DEV)
        pool_k = torch.randn(t_len // 16 + 64, 16, 2, 256, dtype=bf, device=DEV)
        pool_v = torch.randn_like(pool_k)
        slots = torch.randperm(pool_k.shape[0] * 16, device=DEV)[:t_len]
        row(f"kv_cache_write[{t_len},2,256]", lambda: kv_cache.kv_cache_write(k, k, pool_k, pool_v, slots),
            lambda: ref_kv.kv_cache_write(k, k, pool_k, pool_v, slots), 4 * k.numel() * 2)
    for bsz in (8, 64):
        xc = torch.randn(bsz, 6144, dtype=bf, device=DEV)
        wc = torch.randn(6144, 4, dtype=bf, device=DEV)
        states = torch.randn(256, 6144, 3, dtype=bf, device=DEV)
        sl = torch.randperm(256, device=DEV)[:bsz]
        row(f"causal_conv1d_update[{bsz},6144]", lambda: conv1d.causal_conv1d_update(xc, wc, states, sl),
            lambda: ref_conv.causal_conv1d_update(xc, wc, states, sl), bsz * 6144 * 2 * 8)
    vocab = 5000 if TINY else 248320
    for bsz in (1, 8):
        logits = torch.randn(bsz, vocab, device=DEV) * 3
        args = [torch.full((bsz,), 0.7, device=DEV), torch.tensor([0, 20] * (bsz // 2) or [20], dtype=torch.int32,
                                                                    device=DEV)[:bsz],
                torch.full((bsz,), 0.9, device=DEV), torch.full((bsz,), 0.05, device=DEV),
                torch.arange(bsz, device=DEV), torch.arange(bsz, device=DEV)]
        row(f"sample[{bsz},{vocab}]", lambda: sampling.sample(logits, *args),
            lambda: ref_sampling.sample(logits, *args), logits.numel() * 4)
        counts = torch.randint(0, 3, (bsz, vocab), dtype=torch.int32, device=DEV)
        prompt = torch.rand(bsz, vocab, device=DEV) < 0.01
        pen = [torch.full((bsz,), 1.1, device=DEV), torch.full((bsz,), 0.1, device=DEV),
               torch.full((bsz,), 0.1, device=DEV)]
        row(f"apply_penalties[{bsz},{vocab}]", lambda: sampling.apply_penalties(logits, counts, prompt, *pen),
            lambda: ref_sampling.apply_penalties(logits, counts, prompt, *pen), logits.numel() * 13)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode-only", action="store_true", help="only the decode section (and its sweeps)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run of this script (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global DEV, TINY
    if args.tiny:
        DEV, TINY = "cpu", True
    t0 = time.time()
    log(kind="env", device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__,
        triton=__import__("triton").__version__)
    copy_gbs = copy_bandwidth()
    sections = [lambda: bench_decode(copy_gbs, args.quick)] + ([] if args.decode_only else [bench_prefill, bench_small_ops])
    for section in sections:
        try:
            section()
        except Exception:
            log(kind="section_error", error=traceback.format_exc()[-2000:])
    log(kind="wall", seconds=time.time() - t0)
    with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    print("\n== summary ==")
    for r in ROWS:
        if r["kind"] == "decode":
            print(f"decode B={r['B']} ctx={r['ctx']:>6}: {r['graph_ms'] * 1e3:8.1f} us graph, "
                  f"{r['eager_ms'] * 1e3:8.1f} us eager, {r['GBps']:7.0f} GB/s ({r['pct_copy']:.0f}% of copy), "
                  f"ref {r['ref_ms'] * 1e3:9.1f} us (x{r['speedup_vs_ref']:.1f}), err {r['rel_err_vs_ref']:.1e}")
        elif r["kind"] == "decode_sweep" and "graph_ms" in r:
            print(f"  sweep B={r['B']} ctx={r['ctx']} {r['config']}: {r['GBps']:.0f} GB/s")
        elif r["kind"] == "prefill":
            print(f"prefill L={r['L']}: {r['ms']:.3f} ms {r['TFLOPs']:.0f} TFLOP/s; ref {r['ref_ms']:.2f} ms; "
                  f"sdpa {r['sdpa_ms']:.3f} ms; err {r['rel_err_vs_ref']:.1e}")
        elif r["kind"] == "op":
            print(f"{r['op']:34s} {r['ms'] * 1e3:8.1f} us  ref {r['ref_ms'] * 1e3:8.1f} us  {r['GBps']:6.0f} GB/s")
        elif r["kind"] in ("copy", "section_error", "prefill_sdpa_error", "wall"):
            print(r)


if __name__ == "__main__":
    main()
