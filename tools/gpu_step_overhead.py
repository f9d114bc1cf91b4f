#!/usr/bin/env python3
"""What a B=1 decode step costs the GPU outside its captured graph (diagnostics, one artifact).

Starts the public Engine on ``ARTIFACT`` (the bench's options: bf16, graphs on), runs one greedy request so the
B=1 graph's inputs are staged, then times ``--steps`` queued steps with CUDA events (no host waits in between)
in four ways, each repeated ``--repeats`` times interleaved:

- ``bare``: back-to-back replays of the B=1 graph;
- ``h2d``: each replay preceded by the engine's input copy (a pinned host image of the same bytes, non-blocking);
- ``d2h``: each replay followed by the tokens' copy back to pinned memory and an event (DeviceTokens' protocol);
- ``both``: the two copies, as the engine queues a lookahead step;
- ``event``: each replay followed by an event record only.

Then the Engine's own B=1 decode step, as ``ninfer bench`` measures it (decode-span difference of 8 and 8+64
tokens, median of 3). ``both - bare`` is what the stream operations between replays cost; ``engine - both`` is
what the host adds on top. Prints one JSON object (and writes it to ``--out`` when given).

    python3 tools/gpu_step_overhead.py /tmp/w35/qwen3_5-35b-a3b-12l.ninfer --out $OUT/overhead.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from diag_report import emit_report


def _timed(fn, steps: int) -> float:
    """Microseconds per step of ``fn`` called ``steps`` times back to back (one untimed call first)."""
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(steps):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1000 / steps


def probe_host_store() -> bool:
    """Whether a Triton kernel (eager and inside a CUDA graph) can store into pinned host memory directly."""
    import triton
    import triton.language as tl

    @triton.jit
    def _store(src, dst, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(dst + i, tl.load(src + i) + 1)

    src = torch.arange(4, dtype=torch.int64, device="cuda")
    dst = torch.zeros(4, dtype=torch.int64, pin_memory=True)
    _store[(1,)](src, dst, N=4)
    torch.cuda.synchronize()
    eager = dst.tolist() == [1, 2, 3, 4]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _store[(1,)](src, dst, N=4)
    src.add_(10)
    g.replay()
    torch.cuda.Event().record()
    torch.cuda.synchronize()
    return eager and dst.tolist() == [11, 12, 13, 14]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from ninfer import Engine, EngineOptions
    from ninfer.bench.workload import BenchSettings, Workload
    from ninfer.contracts.sampling import SamplingParams
    from ninfer.program.graphs import _Layout

    opts = EngineOptions(device="cuda", dtype="bfloat16", max_concurrency=8, max_context=4096)
    report: dict = {"artifact": str(args.artifact), "steps": args.steps}
    try:
        report["host_store_ok"] = probe_host_store()
    except Exception as exc:  # noqa: BLE001 (diagnostics: report, go on)
        report["host_store_ok"] = f"{type(exc).__name__}: {exc}"
    with Engine.start(args.artifact, opts) as engine:
        sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        with engine.submit([(31 * i + 7) % 5000 + 10 for i in range(128)], sampling=sp) as h:
            h.result()
        torch.cuda.synchronize()
        graphs = engine._program.graphs  # noqa: SLF001 (diagnostics)
        graph, _ = graphs._graphs[1]  # noqa: SLF001
        # The engine's B=1 input copy starts at the ring row (the tokens stay on the device) and ends after the
        # row's pages (16 here: 256 tokens): the same span. (The replays below store into whatever ring row was
        # staged last; nothing reads it.)
        lay = _Layout(1, graphs.max_batch, graphs.max_pages)
        meta, end = lay.ring, -(-(lay.table32 + 16) // 2)
        n_in = end - meta
        host_in = graphs.packed[meta:end].cpu().pin_memory()
        tokens = graphs.packed[:1]
        host_out = torch.empty(1, dtype=torch.int64, pin_memory=True)

        def h2d():
            graphs.packed[meta:end].copy_(host_in, non_blocking=True)

        def d2h():
            host_out.copy_(tokens, non_blocking=True)
            torch.cuda.Event().record()

        variants = {
            "bare": graph.replay,
            "event": lambda: (graph.replay(), torch.cuda.Event().record()),
            "h2d": lambda: (h2d(), graph.replay()),
            "d2h": lambda: (graph.replay(), d2h()),
            "both": lambda: (h2d(), graph.replay(), d2h()),
        }
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.repeats):
            for name, fn in variants.items():
                samples[name].append(_timed(fn, args.steps))
        report["input_copy_bytes"] = n_in * 8
        report["us_per_step"] = {k: statistics.median(v) for k, v in samples.items()}
        report["samples_us"] = samples
        settings = BenchSettings(batches=(1,), prefill_lengths=(), repeats=3)
        result = Workload(engine, settings).decode(1)
        report["engine_step_us"] = result.step_s * 1e6
        report["engine_tok_s"] = result.tokens_per_s
    return emit_report(report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
