#!/usr/bin/env python3
"""Where a host-expert decode step's time goes (issue 36; docs/memory.md "Host experts").

Starts an Engine on ``MODEL`` with host experts under ``--vram-budget-mib``, decodes ``--tokens`` greedy tokens
for each of ``--batch`` random prompts, and prints the decode rate, the per-layer host-expert counts (cache hits,
copies) and the engine worker's cProfile by own and cumulative time, so that the share of the host's expert sums
(``routed_experts_fp32``), the waits for the device (``_to_host``), the cache's refreshes and the eager model
forward can be read off. ``--compare`` also runs the same decode with the experts on the device and no CUDA graphs
(``NINFER_CUDA_GRAPHS=0``): the eager step without host experts. ``--host-expert-kernel torch,compiled,native``
measures each host kernel in turn on the same model (an A/B in one run; ``--host-expert-threads`` sets the host's
threads).

    python3 tools/host_experts_profile.py /tmp/off/model.ninfer --vram-budget-mib 5271 --out $OUT/profile.txt
    python3 tools/host_experts_profile.py /tmp/off/model.ninfer --vram-budget-mib 5271 --host-expert-kernel torch,native,compiled
    python3 tools/host_experts_profile.py MOE.ninfer --device cpu --tokens 8      # a CPU smoke run (a MoE model)
    python3 tools/host_experts_profile.py MOE.ninfer --expert-cache-slots 0 --expert-copy-min-tokens 1000000 \
        --host-expert-kernel torch,native                                       # every routed expert on the host
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_profile import profiled_cycles, top_functions  # noqa: E402


def decode(engine, batch: int, tokens: int, seed: int, profile: bool) -> tuple[float, str]:
    """(decode tok/s over the whole run, the worker's profile or "")."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, engine.vocab_size) for _ in range(64)] for _ in range(batch)]
    sampling = engine.sampling_params(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.generate(prompts[0], sampling=engine.sampling_params(temperature=0.0, max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    if profile:
        with profiled_cycles(engine) as prof:
            handles = [engine.submit(p, sampling=sampling) for p in prompts]
            done = [h.result() for h in handles]
        text = top_functions(prof, own=30, cumulative=30)
    else:
        handles = [engine.submit(p, sampling=sampling) for p in prompts]
        done, text = [h.result() for h in handles], ""
    seconds = time.perf_counter() - t0
    return sum(len(r.token_ids) for r in done) / seconds, text


def runtime_line() -> str:
    """The host's side of the thread question: the OpenMP runtimes mapped into this process (torch's and the native
    kernel's: one shared library, or two thread teams), the CPUs with their SMT siblings, torch's thread count."""
    import torch

    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
        omp = sorted({line.split()[-1] for line in maps if "gomp" in line or "libomp" in line or "iomp" in line})
    except OSError:
        omp = ["(no /proc/self/maps)"]
    try:
        siblings = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text().strip()
    except OSError:
        siblings = "?"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"runtime: OpenMP libraries mapped {omp}; {cpus} CPUs, cpu0's SMT siblings {siblings}; torch threads "
            f"{torch.get_num_threads()}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} "
            f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")


def host_run(engine_cls, args, opts) -> list[str]:
    """One host-expert engine's report lines: decode rate, the host step's phases, cache counts and the profile."""
    lines = []
    with engine_cls.start(args.model, opts) as engine:
        rate, prof = decode(engine, args.batch, args.tokens, args.seed, profile=False)
        lines.append(f"host experts ({opts.host_expert_kernel} kernel, threads "
                     f"{opts.host_expert_threads or 'auto'}): B={args.batch} decode {rate:,.1f} tok/s "
                     f"(whole requests, prompt 64)")
        layers = [getattr(layer, "mlp", getattr(layer, "moe", None)) for layer in engine._program.model.layers]  # noqa: SLF001
        hosts = [m.host for m in layers if m is not None and getattr(m, "host", None) is not None]
        for h in hosts:
            h.phases = {}
        rate, _ = decode(engine, args.batch, args.tokens, args.seed + 2, profile=False)
        calls = max(1, hosts[0].phases.get("calls", 0)) if hosts else 1   # forwards (prefills included)
        phases = {p: sum(h.phases.get(p, 0.0) for h in hosts) for p in ("wait", "cache", "copy", "host", "back")}
        lines.append(f"host step phases over {calls} forwards, ms a forward summed over the {len(hosts)} MoE layers "
                     f"(that run: {rate:,.1f} tok/s): " + ", ".join(f"{p} {1e3 * s / calls:.2f}" for p, s in phases.items()))
        lines.append(runtime_line())
        for h in hosts:
            h.phases = None
        _, prof = decode(engine, args.batch, args.tokens, args.seed + 1, profile=True)
        stats = engine.stats()
        lines.append(f"cache hits per layer {list(stats.expert_cache_hits)}, misses {list(stats.expert_cache_misses)}")
        lines.append(f"host cost scale per layer (measured over estimated host time) "
                     f"{[round(h.host_scale, 2) for h in hosts]}")
        lines.append(f"cache copies per layer {[h.cache.copies if h.cache else 0 for h in hosts]}, "
                     f"copy-path experts {[h.copied_experts for h in hosts]}, "
                     f"cached pairs computed on the host {[h.cached_on_host for h in hosts]}, "
                     f"pairs read over the bus {[h.bus_pairs for h in hosts]}")
        ms = lambda v: None if v is None else round(1e3 * v, 3)  # noqa: E731
        costs = hosts[0].costs if hosts else None
        if costs is not None:
            lines.append(f"measured costs, ms an expert: copy {ms(costs.copy_s)}, host {ms(costs.host_s)} "
                         f"(+{ms(costs.host_token_s)} a further token), bus {ms(costs.bus_s)} a pair")
        lines.append(f"host ms to queue a device call per layer {[ms(h.issue.call_s) for h in hosts]}, "
                     f"an expert's copies {[ms(h.issue.expert_s) for h in hosts]}")
        lines.append(prof)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a MoE model's artifact")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vram-budget-mib", type=float, default=None)
    ap.add_argument("--expert-cache-slots", type=int, default=None)
    ap.add_argument("--device-expert-layers", type=int, default=None,
                    help="MoE layers whose experts stay on the device (default: the planner's choice)")
    ap.add_argument("--expert-copy-min-tokens", type=int, default=None,
                    help="the copy path's fixed threshold (a large number: every routed expert on the host)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host-expert-kernel", default="torch",
                    help="the host's expert kernel(s), comma-separated, each measured in turn: torch, compiled, native")
    ap.add_argument("--host-expert-threads", type=int, default=None, help="the host's compute threads (default: auto)")
    ap.add_argument("--compare", action="store_true", help="also the device-resident eager decode")
    ap.add_argument("--out", type=Path, default=None, help="write the report here too")
    args = ap.parse_args(argv)

    from ninfer import Engine, EngineOptions

    lines = []
    for kernel in args.host_expert_kernel.split(","):
        opts = EngineOptions(device=args.device, max_concurrency=max(1, args.batch), max_context=1024,
                             host_experts=True, vram_budget_mib=args.vram_budget_mib,
                             expert_cache_slots=args.expert_cache_slots, host_expert_kernel=kernel,
                             device_expert_layers=args.device_expert_layers,
                             expert_copy_min_tokens=args.expert_copy_min_tokens,
                             host_expert_threads=args.host_expert_threads)
        lines += host_run(Engine, args, opts)
    if args.compare:
        before = os.environ.get("NINFER_CUDA_GRAPHS")
        os.environ["NINFER_CUDA_GRAPHS"] = "0"
        try:
            with Engine.start(args.model, EngineOptions(device=args.device, max_concurrency=max(1, args.batch),
                                                        max_context=1024, host_experts=False)) as engine:
                rate, _ = decode(engine, args.batch, args.tokens, args.seed, profile=False)
        finally:
            if before is None:
                os.environ.pop("NINFER_CUDA_GRAPHS", None)
            else:
                os.environ["NINFER_CUDA_GRAPHS"] = before
        lines.append(f"experts on the device, no CUDA graphs: B={args.batch} decode {rate:,.1f} tok/s")
    report = "\n".join(lines)
    print(report)
    if args.out is not None:
        args.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
