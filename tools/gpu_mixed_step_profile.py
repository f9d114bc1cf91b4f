#!/usr/bin/env python3
"""Where a mixed step's GPU time goes: decode rows beside a long prompt's chunks (diagnostics, not a benchmark).

The serving bursts (tools/serve_bursts.py) show a step that prefills beside running streams costing far more than
a decode step even at the smallest step budgets. This tool finds where that time goes. For each step budget of
``--budgets`` and each of prefill-step graphs on and off, it starts the public Engine on ARTIFACT, lets ``--streams``
requests decode, then submits one ``--long``-token prompt and records, under torch.profiler, every GPU kernel
until the prompt's first token (kernels replayed from CUDA graphs are recorded one by one). Each step of that
window holds the decode rows and one chunk of the prompt, so the kernels' time over the window's steps is a mixed
step's time. Writes ``mixed_steps.json`` and ``mixed_steps.txt`` (per configuration: the step count, the wall
and kernel time per step, and the kernels by GPU time per step) under ``--out``.

    python3 tools/gpu_mixed_step_profile.py /tmp/ninfer_serving/art/qwen3_5-9b-32l.ninfer --out $OUT \
        --budgets 256,512,2048
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gpu_kernel_profile import fmt, kernel_table


def profile_config(artifact: Path, budget: int, graphs: bool, args) -> dict:
    """One configuration's mixed-step profile (module docstring)."""
    import torch
    from ninfer import Engine, EngineOptions
    from ninfer.contracts.sampling import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    opts = EngineOptions(device=args.device, max_concurrency=args.streams + 1, max_context=args.long + 1024,
                         max_step_tokens=budget, prefill_graphs=graphs)
    cuda = args.device == "cuda"
    gen = torch.Generator().manual_seed(5)
    vocab = tuple(int(v) for v in args.vocab.split(","))

    def prompt(n: int) -> list[int]:
        return torch.randint(*vocab, (n,), generator=gen).tolist()

    with Engine.start(artifact, opts) as engine:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        engine.generate(prompt(args.long), sampling=one)   # the long prompt's kernels compiled before timing
        streaming = SamplingParams(temperature=0.0, max_tokens=args.stream_tokens or args.long, ignore_eos=True)
        base = engine.stats().decode_tokens
        streams = [engine.submit(prompt(args.short), sampling=streaming) for _ in range(args.streams)]
        # Every stream decoding before the window opens, so its steps hold decode rows beside the prompt's chunks.
        while engine.stats().decode_tokens - base < 4 * args.streams:
            time.sleep(0.01)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            # Counted from inside the window: the profiler's start takes several steps.
            before = engine.stats()
            t0 = time.perf_counter()
            with engine.submit(prompt(args.long), sampling=one) as long:
                long.result()
            wall = time.perf_counter() - t0
            if cuda:
                torch.cuda.synchronize()
        after = engine.stats()
        for s in streams:
            s.cancel()
        buckets = engine.info["prefill_graphs"]
    steps = max(1, after.units - before.units)
    rows = kernel_table(prof, steps)
    kernel_us = sum(r["us_per_step"] for r in rows)
    return {"budget": budget, "prefill_graphs": graphs, "steps": steps, "wall_ms": wall * 1000,
            "chunks": after.chunks - before.chunks, "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
            "decode_tokens": after.decode_tokens - before.decode_tokens,
            "wall_us_per_step": wall * 1e6 / steps, "kernel_us_per_step": kernel_us, "prefill_graph_buckets": buckets,
            "kernels": rows[:60]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--budgets", default="256,512,2048")
    ap.add_argument("--graphs", default="on,off", help="prefill-step graphs: on, off or both (on,off)")
    ap.add_argument("--streams", type=int, default=7)
    ap.add_argument("--short", type=int, default=110)
    ap.add_argument("--long", type=int, default=8192)
    ap.add_argument("--stream-tokens", type=int, default=None,
                    help="each stream's max_tokens (default --long): enough to outlast the long prompt's prefill")
    ap.add_argument("--vocab", default="1000,30000", help="the prompts' token ids are drawn from this range")
    ap.add_argument("--device", default="cuda", help="cpu: the engine-driving path alone, for tests (no kernels)")
    args = ap.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_mixed_step_profile: needs a CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results, text = [], []
    for budget in (int(b) for b in args.budgets.split(",")):
        for flag in args.graphs.split(","):
            r = profile_config(args.artifact, budget, flag == "on", args)
            results.append(r)
            head = (f"== budget {budget}, prefill graphs {flag}: {r['steps']} steps, wall {r['wall_us_per_step']:.0f} "
                    f"us/step, kernels {r['kernel_us_per_step']:.0f} us/step")
            print(head, flush=True)
            text.append(head + "\n" + fmt(r["kernels"], r["wall_us_per_step"], limit=30))
            (args.out / "mixed_steps.json").write_text(json.dumps(results, indent=1))
            (args.out / "mixed_steps.txt").write_text("\n\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
