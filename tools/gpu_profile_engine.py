#!/usr/bin/env python3
"""Where the time of an engine decode step and of a scoring window goes, on CUDA (diagnostics, not a benchmark).

Builds the 0.8B-shape random model of tools/gpu_bench_0_8b.py (``--layers`` of them), then:
1. decode through the public Engine at B=1 and B=8 with CUDA graphs on and off (NINFER_CUDA_GRAPHS=0):
   tok/s, and a cProfile of the worker thread's B=1 run (top functions by own time);
2. the bare graph replay time per decode step (CUDA events), the GPU floor of an engine step;
3. one causal-scoring window under torch.profiler (top CUDA and CPU ops).
Writes text reports under ``--out``.

    python3 tools/gpu_profile_engine.py --tokenizer .gpu_assets/tokenizer.json --out $OUT
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from worker_profile import profiled_cycles, top_functions

HERE = Path(__file__).resolve().parent


def build_artifact(args) -> tuple[Path, dict]:
    spec = importlib.util.spec_from_file_location("gpu_check", HERE / "gpu_qwen3_5_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    from ninfer.conversion import convert

    work = Path(tempfile.mkdtemp())
    geometry = dict(check.GEOMETRIES["0.8b"], num_hidden_layers=args.layers, vocab_size=248320)
    model = check.build_hf(geometry, torch.device("cuda"), seed=0)
    model.to(torch.bfloat16).save_pretrained(work / "src")
    (work / "src" / "tokenizer.json").write_bytes(args.tokenizer.read_bytes())
    (work / "src" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (work / "src" / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044]}))
    del model
    torch.cuda.empty_cache()
    artifact = work / "m.ninfer"
    convert(work / "src", artifact, progress=False)
    return artifact, geometry


def decode_rate(engine, batch: int, tokens: int) -> float:
    from ninfer.contracts.sampling import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [[(17 * b + i) % 1000 + 10 for i in range(64)] for b in range(batch)]
    t0 = time.perf_counter()
    hs = [engine.submit(p, sampling=sp) for p in prompts]
    for h in hs:
        with h:
            h.result()
    return batch * tokens / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--score-context", type=int, default=8192)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--skip-score", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from ninfer import Engine, EngineOptions

    t0 = time.perf_counter()
    artifact, geometry = build_artifact(args)
    report: dict = {"build_s": time.perf_counter() - t0, "layers": args.layers}
    opts = EngineOptions(device="cuda", max_concurrency=8, max_context=4096, prefill_chunk_size=2048)

    for graphs in () if args.skip_decode else ("1", "0"):
        os.environ["NINFER_CUDA_GRAPHS"] = graphs
        t0 = time.perf_counter()
        with Engine.start(artifact, opts) as engine:
            key = "graphs" if graphs == "1" else "eager"
            report[f"{key}_start_s"] = time.perf_counter() - t0
            report[f"{key}_info_graphs"] = engine.info.get("cuda_graphs")
            report[f"{key}_memory_graph_bytes"] = engine.memory_summary().graph_final_growth_bytes
            decode_rate(engine, 1, 16)
            decode_rate(engine, 8, 16)
            report[f"{key}_b1_tok_s"] = decode_rate(engine, 1, 256)
            report[f"{key}_b8_tok_s"] = decode_rate(engine, 8, 128)
            if graphs == "1":
                # The worker thread's own profile: wrap its step with a profiler for one B=1 run.
                with profiled_cycles(engine) as prof:
                    report["graphs_b1_tok_s_profiled"] = decode_rate(engine, 1, 256)
                (args.out / "profile_worker_b1.txt").write_text(top_functions(prof, own=40, cumulative=50))
                # The GPU floor: bare graph replays.
                program = engine._program  # noqa: SLF001
                g = program.graphs
                for b in (1, 8):
                    if g is None or not g.has(b):
                        continue
                    graph, _ = g._graphs[b]  # noqa: SLF001
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(200):
                        graph.replay()
                    e1.record()
                    torch.cuda.synchronize()
                    report[f"graph_replay_ms_b{b}"] = e0.elapsed_time(e1) / 200
                # Sampling alone at B=1 / 8 (greedy), the other fixed part of a step.
                from ninfer.contracts.program import RowSampling  # noqa: F401
                ops = program.ops
                for b in (1, 8):
                    logits = torch.randn(b, 248320, device="cuda")
                    args_s = (torch.zeros(b, device="cuda"), torch.zeros(b, dtype=torch.int32, device="cuda"),
                              torch.ones(b, device="cuda"), torch.zeros(b, device="cuda"),
                              torch.zeros(b, dtype=torch.int64, device="cuda"),
                              torch.zeros(b, dtype=torch.int64, device="cuda"))
                    ops.sample(logits, *args_s)
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    for _ in range(50):
                        ops.sample(logits, *args_s)
                    torch.cuda.synchronize()
                    report[f"sample_ms_b{b}"] = (time.perf_counter() - t1) / 50 * 1000
        print(json.dumps(report, indent=1), flush=True)
    os.environ["NINFER_CUDA_GRAPHS"] = "1"

    # Prefill through the Engine (default chunking): one 8k prompt under torch.profiler, after a warm-up.
    from ninfer.contracts.sampling import SamplingParams
    from torch.profiler import ProfilerActivity, profile
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with Engine.start(artifact, EngineOptions(device="cuda", max_concurrency=1, max_context=args.prefill + 64)) as engine:
        report["prefill_chunk_size"] = engine.options.prefill_chunk_size
        prompt = torch.randint(0, geometry["vocab_size"], (args.prefill,),
                               generator=torch.Generator().manual_seed(3)).tolist()
        for _ in range(2):
            engine.generate(prompt, sampling=one)
        t1 = time.perf_counter()
        r = engine.generate(prompt, sampling=one)
        report["prefill_wall_s"] = time.perf_counter() - t1
        report["prefill_ttft_s"] = r.timings.ttft_s
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            engine.generate(prompt, sampling=one)
            torch.cuda.synchronize()
        (args.out / "profile_prefill.txt").write_text(
            p.key_averages().table(sort_by="cuda_time_total", row_limit=40) + "\n\n"
            + p.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    for chunk in (2048, 8192):
        with Engine.start(artifact, EngineOptions(device="cuda", max_concurrency=1, max_context=args.prefill + 64,
                                                  prefill_chunk_size=chunk)) as engine:
            for _ in range(2):
                engine.generate(prompt, sampling=one)
            report[f"prefill_ttft_s_chunk{chunk}"] = engine.generate(prompt, sampling=one).timings.ttft_s
    print(json.dumps(report, indent=1), flush=True)
    if args.skip_score:
        (args.out / "profile_report.json").write_text(json.dumps(report, indent=1))
        return 0

    # Scoring: one window under torch.profiler.
    ctx = args.score_context
    ids = torch.randint(0, geometry["vocab_size"], (ctx * 2,), generator=torch.Generator().manual_seed(7)).tolist()
    with Engine.start(artifact, purpose="causal_scoring", max_context=ctx, device="cuda",
                      prefill_chunk_size=ctx) as scorer:
        scorer.score([ids[:ctx]], context=ctx, stride=ctx)  # warm-up at the measured shape
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        scorer.score([ids], context=ctx, stride=ctx)
        torch.cuda.synchronize()
        report["score_tok_s"] = (2 * ctx - 1) / (time.perf_counter() - t1)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            scorer.score([ids[:ctx]], context=ctx, stride=ctx)
            torch.cuda.synchronize()
        (args.out / "profile_score.txt").write_text(
            p.key_averages().table(sort_by="cuda_time_total", row_limit=30) + "\n\n"
            + p.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    print(json.dumps(report, indent=1), flush=True)
    (args.out / "profile_report.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
