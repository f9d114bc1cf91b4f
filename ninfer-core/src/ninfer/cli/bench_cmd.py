"""``ninfer bench [MODEL]``: decode and prefill speed through the public Engine, each figure also as a
ratio to the device's copy bandwidth or matmul peak measured in the same run (method:
:mod:`ninfer.bench`). Prints a table; ``--output FILE`` writes the full JSON report."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from ninfer.cli import common
from ninfer.cli.command import CliCommand


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("the list is empty")
    return values


def add_arguments(p) -> None:
    # Repeated prompts must be computed, not found; --warmup N below counts the excluded measurement runs.
    common.add_model_args(p, context_cache_default=False, warmup_flag="engine-warmup")
    g = p.add_argument_group("workload")
    g.add_argument("--batches", type=_ints, default=(1, 2, 4, 8), metavar="B,...", help="decode batch sizes")
    g.add_argument("--prefill-lengths", type=_ints, default=(1024, 8192, 32768), metavar="N,...",
                   help="prefill prompt lengths in tokens")
    g.add_argument("--decode-prompt-tokens", type=int, default=128, metavar="N",
                   help="prompt length of the decode runs")
    g.add_argument("--decode-base-tokens", type=int, default=8, metavar="N",
                   help="output tokens of the short decode run (cancelled by the difference)")
    g.add_argument("--decode-steps", type=int, default=64, metavar="N",
                   help="measured output tokens per request (one decode step each without speculation)")
    g.add_argument("--repeats", type=int, default=3, metavar="N", help="measured repeats")
    g.add_argument("--warmup", type=int, default=1, metavar="N", help="warm-up runs (excluded)")
    g.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the synthetic prompts, >= 0")
    g.add_argument("--no-decode", action="store_true", help="skip the decode runs")
    g.add_argument("--no-prefill", action="store_true", help="skip the prefill runs")
    lim = p.add_argument_group("limits")
    lim.add_argument("--copy-mib", type=int, default=None, metavar="MIB",
                     help="copy buffer (default: 1024 on CUDA, 256 on the CPU)")
    lim.add_argument("--matmul-size", type=int, default=None, metavar="N",
                     help="matmul n (default: 8192 on CUDA, 1024 on the CPU)")
    p.add_argument("--output", type=Path, default=None, metavar="FILE", help="write the JSON report here")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(__file__))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _machine(device) -> dict:
    import torch

    out = {"torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "platform": platform.platform()}
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
    else:
        out["device_name"] = platform.processor() or platform.machine()
    return out


def command_line(args) -> str:
    """The equivalent ``ninfer bench`` command with every setting explicit (for the report)."""
    parts = ["ninfer", "bench"] + ([str(args.model)] if args.model else [])
    flags = [("max_concurrency", args.max_concurrency), ("max_context", args.max_context), ("device", args.device),
             ("dtype", args.dtype), ("batches", ",".join(map(str, args.batches))),
             ("prefill_lengths", ",".join(map(str, args.prefill_lengths))),
             ("decode_prompt_tokens", args.decode_prompt_tokens), ("decode_base_tokens", args.decode_base_tokens),
             ("decode_steps", args.decode_steps), ("repeats", args.repeats), ("warmup", args.warmup),
             ("seed", args.seed), ("prefill_chunk_size", args.prefill_chunk_size),
             ("max_step_tokens", getattr(args, "max_step_tokens", None)), ("copy_mib", args.copy_mib),
             ("matmul_size", args.matmul_size), ("cache_host_mib", getattr(args, "cache_host_mib", None)),
             ("cache_checkpoint_interval", getattr(args, "cache_checkpoint_interval", None)),
             ("lookahead", getattr(args, "lookahead", "auto"))]
    parts += [f"--{k.replace('_', '-')} {v}" for k, v in flags if v is not None]
    parts += [f"--{k}" for k in ("context-cache", "no-decode", "no-prefill")
              if getattr(args, k.replace("-", "_"), False)]
    warmup = getattr(args, "engine_warmup", None)
    if warmup is not None:
        parts.append("--engine-warmup" if warmup else "--no-engine-warmup")
    return " ".join(parts)


def run(args) -> int:
    from ninfer import Engine, __version__
    from ninfer.bench.limits import measure_limits, remeasure_copy
    from ninfer.bench.report import build_report, format_report
    from ninfer.bench.workload import BenchError, BenchSettings, Workload
    from ninfer.model_source import resolve_model
    from ninfer.planning.planner import artifact_profile

    show = not args.quiet

    def say(msg: str) -> None:
        if show:
            print(f"[bench] {msg}", file=sys.stderr, flush=True)

    batches = () if args.no_decode else args.batches
    lengths = () if args.no_prefill else args.prefill_lengths
    if not (batches or lengths):  # before any measurement or loading
        raise BenchError("nothing to run: both --no-decode and --no-prefill")
    if args.seed < 0:
        raise BenchError(f"--seed must be >= 0, got {args.seed}")
    for flag, value in (("--copy-mib", args.copy_mib), ("--matmul-size", args.matmul_size)):
        if value is not None and value < 1:
            raise BenchError(f"{flag} must be >= 1, got {value}")
    if args.output is not None and (args.output.is_dir() or any(p.exists() and not p.is_dir()
                                                                 for p in args.output.parents)):
        # Found now, not after the whole run: a report that cannot be written would be lost.
        raise BenchError(f"--output {args.output}: cannot write a file there (a directory, or under a file)")
    settings = BenchSettings(batches=batches or (1,), prefill_lengths=lengths,
                             decode_prompt_tokens=args.decode_prompt_tokens,
                             decode_base_tokens=args.decode_base_tokens, decode_steps=args.decode_steps,
                             repeats=args.repeats, warmup=args.warmup, seed=args.seed).validate()
    options = common.engine_options(args)
    overrides = {}
    if args.max_concurrency is None:
        overrides["max_concurrency"] = max(settings.batches)
    if args.max_context is None:
        need = max([settings.decode_context_needed if batches else 2] + [n + 1 for n in lengths])
        overrides["max_context"] = need
    options = dataclasses.replace(options, **overrides)
    if batches and max(batches) > options.max_concurrency:  # before any measurement or loading
        raise BenchError(f"batch {max(batches)} exceeds the engine's max_concurrency {options.max_concurrency}")
    artifact = resolve_model(args.model, progress=show and sys.stderr.isatty(), quiet=not show,
                             draft=options.speculative)
    planned = artifact_profile(artifact, options)
    # Limits first, on an empty device: the engine's KV pool may take the memory the buffers need.
    say(f"measuring copy bandwidth and matmul peak on {planned.device}")
    held = {"before_limits": _device_held(planned.device)}
    limits = measure_limits(planned.device, planned.dtype,
                            copy_bytes=None if args.copy_mib is None else args.copy_mib << 20,
                            matmul_n=args.matmul_size)
    held["before_engine"] = _device_held(planned.device)
    say(f"starting the engine ({artifact.name})")
    with Engine.start(artifact, options) as engine:
        cap = engine.max_context - 1
        used = tuple(dict.fromkeys(min(n, cap) for n in lengths))
        if used != tuple(lengths):
            say(f"prefill lengths {list(lengths)} capped to max_context - 1 = {cap}: {list(used)}")
        work = Workload(engine, dataclasses.replace(settings, prefill_lengths=used), progress=say,
                        decode=bool(batches))
        first_burst = work.first_burst()   # the cold-start figure: before any other request
        say(f"first burst after start: TTFT max {first_burst.ttft_max_s * 1000:.1f} ms")
        decode = [work.decode(b) for b in batches]
        prefill = [work.prefill(n) for n in used]
        info = engine.info
        summary = engine.memory_summary()
        engine_info = {k: info.get(k) for k in ("device", "dtype", "num_pages", "page_size", "max_context", "ops",
                                                "cuda_graphs", "lookahead")}
        stats = engine.stats()
        engine_info.update(max_concurrency=engine.options.max_concurrency,
                           prefill_chunk_size=engine.options.prefill_chunk,
                           lookahead_steps={k: getattr(stats, f"lookahead_{k}") for k in ("launched", "adopted",
                                                                                          "dropped")})
        if engine.options.speculative is not None:
            engine_info["speculation"] = speculation_summary(engine.options, stats)
        if engine.options.host_experts:
            engine_info["host_experts"] = host_experts_summary(engine.options, stats,
                                                               engine.info.get("host_expert_kernel"),
                                                               engine.info.get("host_expert_threads"))
    run_settings = work.settings
    if batches:
        # The same copy again once the engine's memory is free: the ceiling drifts with what the device just ran
        # (limits.py). A closed Engine still holds its Program (weights, KV pool, graphs) until it is dropped.
        del work, engine
        gc.collect()
        if planned.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
        say("measuring copy bandwidth again after the workload")
        try:
            limits = remeasure_copy(limits, planned.device)
        except (RuntimeError, MemoryError) as exc:   # the report of the finished runs is not lost over it
            say(f"the second copy measurement failed ({exc}); the report has none")
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": command_line(args),
            "ninfer_version": __version__, "git_commit": _git_commit(), "machine": _machine(planned.device),
            "model": {"name": info.get("name"), "architecture": info.get("architecture"),
                      "artifact": str(artifact), "artifact_id": info.get("artifact_id")},
            "prefill_lengths_requested": list(lengths),
            # What a --vram-budget-mib cap is charged before the engine plans (CUDA: total - free, context included).
            "device_held_bytes": held}
    report = build_report(meta=meta, engine_info=engine_info, profile=planned.profile, limits=limits,
                          settings=run_settings, decode=decode, prefill=prefill,
                          memory=summary.as_dict() if summary is not None else None,
                          startup=info.get("startup"), first_burst=first_burst)
    print(format_report(report))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        say(f"report written to {args.output}")
    return 0


def _device_held(device) -> int | None:
    """Bytes in use on a CUDA device now (``total - free``, as the device budget counts them); None elsewhere."""
    if device.type != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def host_experts_summary(options, stats, kernel: str | None = None, threads: int | None = None) -> dict:
    """Host experts (docs/memory.md): the MoE layers kept whole on the device, the device cache's slots per host
    layer and, per host MoE layer, the routed pairs computed from it and on the host over the whole run (warm-up
    excluded), and their hit rate; ``kernel``: the
    host kernel the engine resolved (``Engine.info["host_expert_kernel"]``; None: the option as given); ``threads``:
    the host threads it resolved (``Engine.info["host_expert_threads"]``; None: the option as given)."""
    return {"device_expert_layers": options.device_expert_layers,
            "expert_cache_slots": options.expert_cache_slots,
            "expert_copy_min_tokens": options.expert_copy_min_tokens,
            "host_expert_threads": threads or options.host_expert_threads,
            "host_expert_kernel": kernel or options.host_expert_kernel or "auto",
            "cache_hits": list(stats.expert_cache_hits), "cache_misses": list(stats.expert_cache_misses),
            "cache_hit_rate_by_layer": list(stats.expert_cache_hit_rate_by_layer())}


def speculation_summary(options, stats) -> dict:
    """The speculative backend, its drafts per step and what the run's verifies committed: the mean accepted
    length is the tokens one verify row commits on average (accepted drafts plus the target's own token);
    per draft position j, the verifies that drafted at least j tokens, those that accepted draft j, and
    their ratio (``EngineStats.spec_acceptance_by_position``)."""
    verifies = stats.spec_verifies
    return {"backend": options.speculative, "num_speculative_tokens": options.num_speculative_tokens,
            "verifies": verifies, "drafted": stats.spec_drafted, "accepted": stats.spec_accepted,
            "mean_accepted_length": (1 + stats.spec_accepted / verifies) if verifies else None,
            "drafted_by_position": list(stats.spec_drafted_by_position),
            "accepted_by_position": list(stats.spec_accepted_by_position),
            "acceptance_by_position": list(stats.spec_acceptance_by_position())}


COMMAND = CliCommand(
    name="bench", help="measure decode and prefill speed against the device's limits", add_arguments=add_arguments,
    run=run,
    description="Benchmark a model through the public Engine: decode tok/s at each batch, prefill tok/s and time "
                "to first token at each prompt length (capped to the model's context), each as a ratio to the copy "
                "bandwidth / matmul peak measured in the same run, and the cold start (load, decode-graph capture, kernel "
                "warm-up, the first burst after ready). Synthetic prompts of seeded random token ids; warm-up "
                "excluded from the rates; medians.")
