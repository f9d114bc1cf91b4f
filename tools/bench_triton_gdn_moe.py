"""Micro-benchmark of the Triton GDN and MoE kernels against the torch reference ops, on CUDA.

Usage (device): PYTHONPATH=ninfer-core/src python3 tools/bench_triton_gdn_moe.py [--quick] [--out DIR]
Prints a table last; writes bench.json under --out. Inputs are random (never zeros); decode-type timings
replay a CUDA graph of many calls that rotate over more state/weights than the 60 MB L2 holds, which also
proves the ops capture (no host sync). ``--only gdn_scan_pipeline`` (not in the default set) sweeps the GDN
scan kernel's num_stages / warps / Dv tile at the 9B and 35B-A3B GDN shape (a prefill bound:
docs/dev/perf-log.md).
"""

# ruff: noqa: B023  (timing lambdas are called inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
from ninfer.ops.reference import moe as rmoe
from ninfer.ops.triton import moe as tmoe
from ninfer_qwen3_5.ops.reference import gdn as rgdn
from ninfer_qwen3_5.ops.triton import gdn as tgdn
from ninfer_qwen3_5.ops.triton import gdn_step as tsgdn
from triton.testing import do_bench

ROWS: list[dict] = []


def log(**kw):
    ROWS.append(kw)
    print(json.dumps(kw), flush=True)


def bench(fn, rep=200):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")  # ms


def graph_time(calls, reps=20):
    """Capture all `calls` in one CUDA graph, replay, return ms per call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        t0.record()
        g.replay()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1))
    times.sort()
    return times[len(times) // 2] / len(calls)


def gdn_inputs(gen, t_len, hk, hv, dk, dv, g_scale=-2.0):
    """Random bf16 q, k, v, fp32 log gates in [g_scale, 0], beta in [0, 1) and an fp32 state, drawn in this order."""
    q = torch.randn(t_len, hk, dk, device="cuda", generator=gen).bfloat16()
    k = torch.randn(t_len, hk, dk, device="cuda", generator=gen).bfloat16()
    v = torch.randn(t_len, hv, dv, device="cuda", generator=gen).bfloat16()
    g = torch.rand(t_len, hv, device="cuda", generator=gen) * g_scale
    beta = torch.rand(t_len, hv, device="cuda", generator=gen)
    s0 = torch.randn(hv, dk, dv, device="cuda", generator=gen) * 0.5
    return q, k, v, g, beta, s0


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def copy_bw():
    x = torch.randn(2**29, device="cuda")  # 2 GiB fp32, far over the 60 MB L2
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), rep=100)
    gbs = 2 * x.numel() * 4 / ms / 1e6
    log(what="copy_bw", ms=ms, GBps=gbs)
    return gbs


class Recorder:
    """Wraps a Triton kernel to record the compiled kernel's registers/spills."""

    def __init__(self, kern, name):
        self.kern, self.name, self.seen_keys = kern, name, set()

    def __getitem__(self, grid):
        def launch(*a, **kw):
            ck = self.kern[grid](*a, **kw)
            key = (grid if not callable(grid) else None, tuple(sorted((k, str(v)) for k, v in kw.items())))
            if key not in self.seen_keys and ck is not None:
                self.seen_keys.add(key)
                try:
                    log(what="compiled", kernel=self.name, cfg=str(key[1])[:200], n_regs=int(ck.n_regs),
                        n_spills=int(ck.n_spills), shared=int(ck.metadata.shared))
                except Exception as exc:  # diagnostics only
                    print("compiled-info unavailable", self.name, repr(exc)[:200])
            return ck
        return launch


class Noop:
    def __getitem__(self, grid):
        return lambda *a, **kw: None


def oracle64(q, k, v, g, beta, s0, scale):
    """fp64 token loop on the GPU, vectorised over heads (Hk == Hv here)."""
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, s0))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    o = torch.empty(v.shape, dtype=torch.float64, device=v.device)
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], s))
        s = s + k[t][:, :, None] * delta[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t], s)
    return o, s


def gdn_precision(quick):
    """Accuracy vs the fp64 recurrence at T=1024 (mild and strong gates), triton vs the torch reference."""
    hk = hv = 16
    dk = dv = 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    t_len = 1024
    for g_min in (-1.0, -30.0):
        q, k, v, g, beta, s0 = gdn_inputs(gen, t_len, hk, hv, dk, dv, g_scale=g_min)
        ref_o, ref_s = oracle64(q, k, v, g, beta, s0, dk ** -0.5)
        sr = s0.clone()
        o_r = rgdn.gdn_chunk_prefill(q, k, v, g, beta, sr, dk ** -0.5)
        log(what="gdn_prefill_accuracy", impl="torch_ref", g_min=g_min, rel_o=rel(o_r.float(), ref_o),
            rel_state=rel(sr, ref_s))
        for prec in ("ieee",):  # tf32x3 hit an illegal memory access under triton 3.6 (first run)
            tgdn._DOT_PRECISION = prec
            st = s0.clone()
            o_t = tgdn.gdn_chunk_prefill(q, k, v, g, beta, st, dk ** -0.5)
            # the bf16 output's own rounding dominates rel_o; rel_state is the fp32 criterion (2e-6)
            log(what="gdn_prefill_accuracy", impl="triton_" + prec, g_min=g_min, rel_o=rel(o_t.float(), ref_o),
                rel_state=rel(st, ref_s))
        tgdn._DOT_PRECISION = "ieee"


def gdn_prefill(quick):
    hk, hv, dk, dv = 16, 16, 128, 128          # Qwen3.5-0.8B GDN geometry
    lens = [1024, 8192] if quick else [1024, 8192, 32768]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t_len in lens:
        q, k, v, g, beta, s0 = gdn_inputs(gen, t_len, hk, hv, dk, dv)
        s_t, s_r = s0.clone(), s0.clone()
        o_t = tgdn.gdn_chunk_prefill(q, k, v, g, beta, s_t, dk ** -0.5)
        o_r = rgdn.gdn_chunk_prefill(q, k, v, g, beta, s_r, dk ** -0.5)
        torch.cuda.synchronize()
        err_o, err_s = rel(o_t.float(), o_r.float()), rel(s_t, s_r)
        st = s0.clone()
        ms_t = bench(lambda: tgdn.gdn_chunk_prefill(q, k, v, g, beta, st, dk ** -0.5))
        ms_r = bench(lambda: rgdn.gdn_chunk_prefill(q, k, v, g, beta, st, dk ** -0.5), rep=100)
        log(what="gdn_chunk_prefill", T=t_len, Hk=hk, Hv=hv, triton_ms=ms_t, torch_ref_ms=ms_r,
            speedup=ms_r / ms_t, Mtok_s=t_len / ms_t / 1e3, rel_o_vs_ref=err_o, rel_state_vs_ref=err_s)


def gdn_prefill_variants(quick):
    """T=8192: each stage alone (the other replaced by a no-op), then scan/prep launch and precision variants."""
    hk, hv, dk, dv, t_len = 16, 16, 128, 128, 8192
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, g, beta, st = gdn_inputs(gen, t_len, hk, hv, dk, dv)

    def run(**kw):
        return bench(lambda: tgdn.gdn_chunk_prefill(q, k, v, g, beta, st, dk ** -0.5, **kw))

    prep, scan = tgdn._gdn_chunk_prep_kernel, tgdn._gdn_chunk_scan_kernel
    try:
        tgdn._gdn_chunk_scan_kernel = Noop()
        ms_p = run()
        tgdn._gdn_chunk_scan_kernel = scan
        tgdn._gdn_chunk_prep_kernel = Noop()
        ms_s = run()
    finally:
        tgdn._gdn_chunk_prep_kernel, tgdn._gdn_chunk_scan_kernel = prep, scan
    log(what="gdn_prefill_stages", T=t_len, prep_only_ms=ms_p, scan_only_ms=ms_s)
    scan_kw0, prep_kw0 = dict(tgdn._SCAN_KW), dict(tgdn._PREP_KW)
    try:
        for prec, cfgs, pws in (("ieee", ((16, 4), (32, 8)), (16,)),):
            tgdn._DOT_PRECISION = prec
            for bvs, sw in cfgs:
                tgdn._SCAN_KW = {"num_warps": sw, "num_stages": 1}
                log(what="gdn_prefill_scan_variant", T=t_len, prec=prec, block_v_scan=bvs, scan_warps=sw,
                    ms=run(block_v_scan=bvs))
            tgdn._SCAN_KW = scan_kw0
            for pw in pws:
                tgdn._PREP_KW = {"num_warps": pw, "num_stages": 1}
                log(what="gdn_prefill_prep_variant", T=t_len, prec=prec, prep_warps=pw, ms=run())
            tgdn._PREP_KW = prep_kw0
    finally:
        tgdn._DOT_PRECISION, tgdn._SCAN_KW, tgdn._PREP_KW = "ieee", scan_kw0, prep_kw0


def gdn_scan_pipeline(quick):
    """The scan kernel's launch settings at the 9B / 35B-A3B GDN shape (Hk 16, Hv 32, D 128, bf16 inputs: tf32
    dots) and the engine's 2,048-token chunk: num_stages 1 (the default: no software pipelining of the per-chunk
    tile loads, which depend only on the chunk index) against 2 and 3, for 4 and 8 warps and Dv tiles of 16 and 32.
    Each variant's output and final state are compared with the default's."""
    hk, hv, dk, dv = 16, 32, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(3)
    scan_kw0 = dict(tgdn._SCAN_KW)
    for t_len in ((2048,) if quick else (2048, 8192)):
        q, k, v, g, beta, s0 = gdn_inputs(gen, t_len, hk, hv, dk, dv)
        base_s = s0.clone()
        base_o = tgdn.gdn_chunk_prefill(q, k, v, g, beta, base_s, dk ** -0.5)
        try:
            for stages in (1, 2, 3):
                for warps in (4, 8):
                    for bvs in (16, 32):
                        tgdn._SCAN_KW = {"num_warps": warps, "num_stages": stages}
                        try:
                            st = s0.clone()
                            o = tgdn.gdn_chunk_prefill(q, k, v, g, beta, st, dk ** -0.5, block_v_scan=bvs)
                            st2 = s0.clone()
                            ms = bench(lambda st2=st2, bvs=bvs: tgdn.gdn_chunk_prefill(
                                q, k, v, g, beta, st2, dk ** -0.5, block_v_scan=bvs))
                            log(what="gdn_scan_pipeline", T=t_len, Hv=hv, num_stages=stages, scan_warps=warps,
                                block_v_scan=bvs, ms=ms, rel_o_vs_default=rel(o.float(), base_o.float()),
                                rel_state_vs_default=rel(st, base_s))
                        except Exception as exc:  # noqa: BLE001 - a setting Triton refuses is a result too
                            log(what="gdn_scan_pipeline", T=t_len, num_stages=stages, scan_warps=warps,
                                block_v_scan=bvs, error=repr(exc)[:300])
        finally:
            tgdn._SCAN_KW = scan_kw0


def gdn_step(quick, bw):
    dk = dv = 128
    for hk, hv, label in ((16, 16, "0.8B"), (16, 32, "35B-A3B")):
        n_slots = 256
        states = torch.randn(n_slots, hv, dk, dv, device="cuda") * 0.5
        for bsz in (1, 8, 64):
            n_calls = 64
            gen = torch.Generator().manual_seed(bsz)
            slot_sets = [torch.randperm(n_slots, generator=gen)[:bsz].cuda() for _ in range(n_calls)]
            q = torch.randn(bsz, hk, dk, device="cuda").bfloat16()
            k = torch.randn(bsz, hk, dk, device="cuda").bfloat16()
            v = torch.randn(bsz, hv, dv, device="cuda").bfloat16()
            g = -torch.rand(bsz, hv, device="cuda")
            beta = torch.rand(bsz, hv, device="cuda")
            # correctness at this size vs the reference op
            s_t, s_r = states.clone(), states.clone()
            o_t = tsgdn.gdn_recurrent_step(q, k, v, g, beta, s_t, slot_sets[0], dk ** -0.5)
            o_r = rgdn.gdn_recurrent_step(q, k, v, g, beta, s_r, slot_sets[0], dk ** -0.5)
            err_o, err_s = rel(o_t.float(), o_r.float()), rel(s_t, s_r)
            nbytes = bsz * hv * dk * dv * 4 * 2
            for bv in (16, 32, 64):
                ms = graph_time([lambda s=s, bv=bv: tsgdn.gdn_recurrent_step(q, k, v, g, beta, states, s,
                                                                            dk ** -0.5, block_v=bv)
                                 for s in slot_sets])
                log(what="gdn_recurrent_step", model=label, B=bsz, block_v=bv, us=ms * 1e3,
                    GBps=nbytes / ms / 1e6, frac_of_copy_bw=nbytes / ms / 1e6 / bw,
                    rel_o_vs_ref=err_o, rel_state_vs_ref=err_s)
            ms_r = graph_time([lambda s=s: rgdn.gdn_recurrent_step(q, k, v, g, beta, states, s, dk ** -0.5)
                               for s in slot_sets[:16]])
            log(what="gdn_recurrent_step_torch_ref", model=label, B=bsz, us=ms_r * 1e3, GBps=nbytes / ms_r / 1e6)


def moe(quick):
    n_exp, top_k, hidden, inter = 256, 8, 2048, 512            # Qwen3.5-35B-A3B experts
    gate_up = (torch.randn(n_exp, 2 * inter, hidden, device="cuda") * hidden ** -0.5).bfloat16()
    down = (torch.randn(n_exp, hidden, inter, device="cuda") * inter ** -0.5).bfloat16()
    for t_len in (1, 8, 2048):
        gen = torch.Generator(device="cuda").manual_seed(t_len)
        n_sets = 16 if t_len <= 8 else 1
        sets = []
        for _ in range(n_sets):
            x = torch.randn(t_len, hidden, device="cuda", generator=gen).bfloat16()
            logits = torch.randn(t_len, n_exp, device="cuda", generator=gen)
            w, ids = rmoe.moe_router(logits, top_k)
            sets.append((x, w, ids))
        x, w, ids = sets[0]
        o_t = tmoe.moe_experts(x, w, ids, gate_up, down)
        o_r = rmoe.moe_experts(x, w, ids, gate_up, down)
        err = rel(o_t.float(), o_r.float())
        flops = 2 * t_len * top_k * 3 * hidden * inter
        uniq = sum(int(torch.unique(s[2]).numel()) for s in sets) / n_sets
        wbytes = uniq * 3 * hidden * inter * 2
        ms_r = bench(lambda: rmoe.moe_experts(x, w, ids, gate_up, down), rep=100)
        if t_len <= 8:
            for bn in ((32, 64), (64, 128), (16, 32)):
                ms = graph_time([lambda s=s, bn=bn: tmoe.moe_experts(*s, gate_up, down, block_n=bn) for s in sets])
                log(what="moe_experts", T=t_len, block_n=bn, us=ms * 1e3, torch_ref_us=ms_r * 1e3,
                    weight_GBps=wbytes / ms / 1e6, active_experts=uniq, rel_vs_ref=err)
        else:
            for bn in ((64, 128), (128, 128), (64, 64)):
                ms = bench(lambda bn=bn: tmoe.moe_experts(x, w, ids, gate_up, down, block_n=bn))
                log(what="moe_experts", T=t_len, block_n=bn, ms=ms, torch_ref_ms=ms_r,
                    TFLOPs=flops / ms / 1e9, speedup=ms_r / ms, rel_vs_ref=err)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default="gdn_step,moe,gdn_precision,gdn_prefill,gdn_prefill_variants")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip sections starting after this many s")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    tgdn._gdn_chunk_prep_kernel = Recorder(tgdn._gdn_chunk_prep_kernel, "gdn_prep")
    tgdn._gdn_chunk_scan_kernel = Recorder(tgdn._gdn_chunk_scan_kernel, "gdn_scan")
    tsgdn._gdn_step_kernel = Recorder(tsgdn._gdn_step_kernel, "gdn_step")
    tmoe._moe_gate_up_kernel = Recorder(tmoe._moe_gate_up_kernel, "moe_gate_up")
    tmoe._moe_down_kernel = Recorder(tmoe._moe_down_kernel, "moe_down")
    t0 = time.time()
    bw = copy_bw()
    only = a.only.split(",")
    for name, fn in (("gdn_step", lambda: gdn_step(a.quick, bw)), ("moe", lambda: moe(a.quick)),
                     ("gdn_precision", lambda: gdn_precision(a.quick)),
                     ("gdn_prefill", lambda: gdn_prefill(a.quick)),
                     ("gdn_prefill_variants", lambda: gdn_prefill_variants(a.quick)),
                     ("gdn_scan_pipeline", lambda: gdn_scan_pipeline(a.quick))):
        if name in only and time.time() - t0 < a.budget_s:
            try:
                fn()
            except Exception as exc:  # keep the other sections' numbers
                log(what="error", section=name, error=repr(exc)[:500])
            log(what="section_done", section=name, elapsed_s=time.time() - t0)
    with open(os.path.join(a.out, "bench.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    print("\n==== summary ====")
    for r in ROWS:
        if r["what"] != "compiled":
            print({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
