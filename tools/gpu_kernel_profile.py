#!/usr/bin/env python3
"""Which kernels a decode step and a prefill chunk spend their GPU time in, at a published shape (diagnostics).

Builds the random bf16 model of tools/gpu_bench_shapes.py (``--shape``, ``--layers``), converts it in memory,
starts the public Engine (CUDA graphs on), then:
1. decode: bare replays of the captured B=1 and B=8 graphs (CUDA events: the GPU floor of a step), then the same
   replays under torch.profiler: kernels by total GPU time, per step and per layer, and the sum of kernel times
   against the replay time (the difference is the gaps between kernels);
2. the Engine's own decode rate at B=1 and B=8 (host work included), for the host share of a step;
3. prefill: one ``--prefill``-token prompt through the Engine under torch.profiler: kernels by total GPU time.
Writes ``kernel_profile_<shape>.json`` and text tables under ``--out``.

    python3 tools/gpu_kernel_profile.py --shape 35b-a3b --layers 4 --tokenizer /tmp/tok.json --out $OUT
    python3 tools/gpu_kernel_profile.py --shape 9b --layers 32 --quantize q4 --prefill 1024 --tokenizer ... --out $OUT
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _shapes_module():
    spec = importlib.util.spec_from_file_location("gpu_bench_shapes", HERE / "gpu_bench_shapes.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench_shapes"] = mod
    spec.loader.exec_module(mod)
    return mod


def random_artifact(shapes, shape: str, layers: int, tokenizer: Path,
                    quantize: str | None = None) -> tuple[dict, Path]:
    """The random bf16 model of tools/gpu_bench_shapes.py at ``shape`` with ``layers`` layers, converted in
    memory into a temporary artifact (``quantize``: with that ``ninfer-convert --quantize`` recipe; the transformers
    model is freed). Returns (geometry, artifact). The artifact's folder is deleted when the process exits: an
    8-layer 35B-A3B artifact is 15 GB, and the device's disk holds only a few such leftovers."""
    geometry = shapes.geometry_for(argparse.Namespace(tiny=False, shape=shape, layers=layers))
    work = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    model = shapes.build_hf(geometry, torch.device("cuda"), seed=0)
    shapes.write_frontend(work, tokenizer)
    artifact = work / "m.ninfer"
    shapes.convert_in_memory(model, work, artifact, f"{shape}-{layers}l", quantize=quantize)
    del model
    torch.cuda.empty_cache()
    return geometry, artifact


def kernel_table(prof, steps: int) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None)
        if dev is None:
            dev = e.cuda_time_total
        if dev <= 0 or e.key.startswith(("cudaGraph", "ProfilerStep")):
            continue
        rows.append({"kernel": e.key[:110], "calls_per_step": e.count / steps, "us_per_step": dev / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def step_timeline(prof, per_step: int) -> list[dict]:
    """The last replay's kernels in start order: start and end (us from the step's first start), duration, and the
    *marginal* time ``end - latest earlier end`` -- what each kernel adds to the step's critical path. Under PDL a
    kernel starts (and its duration counts) before the previous one ends, so durations overlap and overstate; the
    marginal times sum to the step."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text()).get("traceEvents", [])
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"), key=lambda e: e["ts"])
    step = kernels[-per_step:]
    if not step:
        return []
    t0 = step[0]["ts"]
    rows, last_end = [], t0
    for e in step:
        end = e["ts"] + e["dur"]
        rows.append({"kernel": e["name"][:60], "start_us": e["ts"] - t0, "dur_us": e["dur"], "end_us": end - t0,
                     "marginal_us": max(0.0, end - last_end)})
        last_end = max(last_end, end)
    return rows


def engine_steps(prof, long_us: float = 100.0) -> dict:
    """Every GPU op (kernels, copies, memsets) of an Engine-driven decode, in start order, cut into steps at the
    LM head (the one kernel longer than ``long_us`` per step): the step period, and for three mid-run steps each op
    with its start, duration and the idle gap before it -- what the GPU does outside the captured graph."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text()).get("traceEvents", [])
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    heads = [i for i, e in enumerate(ops) if e["dur"] > long_us]
    if len(heads) < 8:
        return {"steps": len(heads)}
    ends = [ops[i]["ts"] + ops[i]["dur"] for i in heads]
    periods = sorted(b - a for a, b in zip(ends[:-1], ends[1:], strict=True))
    mid = len(heads) // 2
    window = ops[heads[mid - 2] + 1: heads[mid + 1] + 1]
    rows, last_end = [], window[0]["ts"]
    for e in window:
        rows.append({"op": e["name"][:60], "cat": e["cat"], "start_us": round(e["ts"] - window[0]["ts"], 2),
                     "dur_us": e["dur"], "gap_us": round(max(0.0, e["ts"] - last_end), 2)})
        last_end = max(last_end, e["ts"] + e["dur"])
    busy = sum(r["dur_us"] for r in rows)
    return {"steps": len(heads), "period_median_us": periods[len(periods) // 2], "period_min_us": periods[0],
            "window_us": last_end - window[0]["ts"], "window_busy_us": busy, "window": rows}


def fmt_timeline(rows: list[dict]) -> str:
    lines = [f"{'start':>8} {'dur':>7} {'end':>8} {'marg':>7}  kernel"]
    for r in rows:
        lines.append(f"{r['start_us']:8.1f} {r['dur_us']:7.1f} {r['end_us']:8.1f} {r['marginal_us']:7.1f}  {r['kernel']}")
    return "\n".join(lines)


def fmt(rows: list[dict], total_us: float, limit: int = 40) -> str:
    lines = [f"{'us/step':>9} {'%':>6} {'calls':>6}  kernel"]
    for r in rows[:limit]:
        lines.append(f"{r['us_per_step']:9.1f} {100 * r['us_per_step'] / total_us:6.1f} {r['calls_per_step']:6.1f}  "
                     f"{r['kernel']}")
    return "\n".join(lines)


def model_args(doc: str) -> argparse.ArgumentParser:
    """The arguments of the tools that build a random model at a published shape (:func:`random_artifact`)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--shape", default="35b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("."))
    return ap


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Microseconds per replay of a captured graph (CUDA events; one warm-up replay first)."""
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        graph.replay()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1000 / replays



def require_cuda(tool: str) -> bool:
    """Whether a CUDA device is here; if not, says so on stderr for ``tool`` (its main then returns 2)."""
    if torch.cuda.is_available():
        return True
    print(f"{tool}: needs a CUDA device", file=sys.stderr)
    return False


def write_report(path: Path | None, report: dict) -> None:
    """``report`` as indented JSON at ``path`` (its folder made), if a path is given."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))


def graph_us(fn, replays: int, calls: int = 1) -> float:
    """Microseconds per call of ``fn()``: run once eagerly (compiling what it launches), then ``calls`` calls
    captured as one CUDA graph and timed over ``replays`` replays (:func:`replay_us`)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return replay_us(graph, replays) / calls


def graph_call_us(call, calls: int, replays: int, reference: list[torch.Tensor]) -> tuple[float, float]:
    """``call(c)`` for c < ``calls``: (microseconds per call, timed as one captured CUDA graph of all the calls,
    and the largest relative max-abs difference of their eager outputs from ``reference``)."""
    outs = [call(c) for c in range(calls)]
    err = max(float((o.float() - r.float()).abs().max() / r.float().abs().max())
              for o, r in zip(outs, reference, strict=True))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(calls):
            call(c)
    return replay_us(graph, replays) / calls, err

def main() -> int:
    ap = model_args(__doc__)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--quantize", default=None, help="a ninfer-convert --quantize recipe (default: bf16 as built)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = _shapes_module()
    from ninfer import Engine, EngineOptions
    from ninfer.contracts.sampling import SamplingParams
    from ninfer.program.graphs import input_views
    from torch.profiler import ProfilerActivity, profile

    geometry, artifact = random_artifact(shapes, args.shape, args.layers, args.tokenizer, args.quantize)

    report: dict = {"shape": args.shape, "layers": args.layers, "types": geometry["layer_types"],
                    "quantize": args.quantize}
    text = []
    opts = EngineOptions(device="cuda", max_concurrency=8, max_context=args.prefill + 256)
    with Engine.start(artifact, opts) as engine:
        report["ops"] = engine.info.get("ops")
        program = engine._program  # noqa: SLF001 (diagnostics)
        for b in (1, 8):
            sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            for h in [engine.submit([(31 * i + 7 * r) % 5000 + 10 for i in range(64)], sampling=sp) for r in range(b)]:
                with h:
                    h.result()
            torch.cuda.synchronize()   # any fault of the engine's own steps surfaces here, not in a replay below
            graphs = program.graphs
            graph, _ = graphs._graphs[b]  # noqa: SLF001
            # The replays below reuse the inputs the engine staged for its last step (the state evolves, the
            # position does not): print them, so a fault can be told apart from a bad input.
            views = input_views(graphs.packed, b, graphs.max_batch, graphs.max_pages)
            names = ("tokens", "positions", "slots", "out_slots", "kv_lens", "page_tables", "slot_mapping")
            print(f"B={b} graph inputs: " + ", ".join(f"{n}={v.tolist() if v.dim() == 1 else v[:, :8].tolist()}"
                                                     for n, v in zip(names, views, strict=True)), flush=True)
            # All graphs share one input buffer: if the Engine never ran batch b as one decode step (its requests
            # did not overlap), b's inputs are other graphs' values (garbage slot ids make the replay an
            # illegal memory access). Then replay on the capture's valid inputs (position 0, one KV token).
            _, positions, slots, out_slots, kv_lens, _, _ = views
            limit = opts.max_context
            sane = (bool(((positions >= 0) & (positions < limit)).all()) and bool(((kv_lens >= 1) & (kv_lens <= limit)).all())
                    and bool(((slots >= 0) & (slots < 4 * opts.max_concurrency + 8)).all())
                    and bool(((out_slots >= 0) & (out_slots < 4 * opts.max_concurrency + 8)).all()))
            if not sane:
                graphs._valid_inputs(b)  # noqa: SLF001 (diagnostics)
                print(f"B={b}: the Engine never staged this batch; replaying the capture's inputs", flush=True)
            report[f"decode_b{b}_inputs"] = "engine" if sane else "capture (position 0)"
            graph.replay()
            torch.cuda.synchronize()
            for _ in range(3):
                graph.replay()
            step_us = replay_us(graph, args.steps)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    graph.replay()
                torch.cuda.synchronize()
            rows = kernel_table(prof, args.steps)
            busy = sum(r["us_per_step"] for r in rows)
            report[f"decode_b{b}"] = {"replay_us": step_us, "kernel_us": busy,
                                      "kernels_per_step": sum(r["calls_per_step"] for r in rows), "top": rows[:40]}
            text.append(f"== decode B={b}: graph replay {step_us:.1f} us, kernels {busy:.1f} us "
                        f"({sum(r['calls_per_step'] for r in rows):.0f} launches)\n" + fmt(rows, step_us))
            timeline = step_timeline(prof, round(sum(r["calls_per_step"] for r in rows
                                                     if not r["kernel"].startswith(("Memset", "Memcpy")))))
            report[f"decode_b{b}"]["timeline"] = timeline
            text.append(f"== decode B={b}: one replay's timeline (us)\n" + fmt_timeline(timeline))
            # The Engine's own rate (host work included).
            sp = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
            t0 = time.perf_counter()
            hs = [engine.submit([(13 * i + r) % 5000 + 10 for i in range(64)], sampling=sp) for r in range(b)]
            for h in hs:
                with h:
                    h.result()
            report[f"decode_b{b}"]["engine_tok_s"] = b * 256 / (time.perf_counter() - t0)
            # The same decode under the profiler: what the GPU runs between replays (inputs, sampling, copies).
            sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                hs = [engine.submit([(17 * i + r) % 5000 + 10 for i in range(64)], sampling=sp) for r in range(b)]
                for h in hs:
                    with h:
                        h.result()
                torch.cuda.synchronize()
            steps = engine_steps(prof)
            report[f"decode_b{b}"]["engine_steps"] = steps
            if "window" in steps:
                lines = [f"{r['start_us']:9.1f} {r['dur_us']:7.1f} {r['gap_us']:6.1f}  {r['cat'][:6]:6} {r['op']}"
                         for r in steps["window"]]
                text.append(f"== decode B={b} through the Engine: step period median {steps['period_median_us']:.1f} us "
                            f"(min {steps['period_min_us']:.1f}), 3-step window {steps['window_us']:.1f} us, busy "
                            f"{steps['window_busy_us']:.1f} us\n" + "\n".join(lines))

        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        prompt = torch.randint(0, geometry["vocab_size"], (args.prefill,),
                               generator=torch.Generator().manual_seed(3)).tolist()
        for _ in range(2):
            engine.generate(prompt, sampling=one)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = engine.generate(prompt, sampling=one)
        report["prefill_ttft_ms"] = r.timings.ttft_s * 1000
        report["prefill_wall_ms"] = (time.perf_counter() - t0) * 1000
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompt, sampling=one)
            torch.cuda.synchronize()
        rows = kernel_table(prof, 1)
        busy = sum(r["us_per_step"] for r in rows)
        report["prefill"] = {"kernel_us": busy, "top": rows[:40]}
        text.append(f"== prefill {args.prefill}: ttft {report['prefill_ttft_ms']:.1f} ms, kernels {busy / 1000:.1f} ms\n"
                    + fmt(rows, busy))
    out = "\n\n".join(text)
    print(out, flush=True)
    (args.out / f"kernel_profile_{args.shape}.txt").write_text(out)
    (args.out / f"kernel_profile_{args.shape}.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
