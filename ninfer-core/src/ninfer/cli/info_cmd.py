"""``ninfer info [MODEL.ninfer]``: components, config summary, objects, files and metadata of an artifact.

MODEL is resolved as ``ninfer generate`` resolves it (``ninfer.model_source.resolve_model``): an artifact as
is; no model, a folder, a default model's name or a Hugging Face repo id converted into the cache once.

Reads the directory only; ``--verify`` additionally streams every object and checks its checksum
(opening every part), failing with the artifact error that names the first bad object or file.
``--memory`` adds the startup memory plan for the given engine options (weights, KV/State,
workspace, headroom under the device budget), computed from the profile without loading weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ninfer.cli import checks, common
from ninfer.cli.command import CliCommand


def add_arguments(p) -> None:
    common.add_model_arg(p, metavar="MODEL.ninfer",
                         help="the artifact's entry file, or a model named as for generate (converted once; "
                              "default: the default model)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--verify", action="store_true", help="also read every object and check its checksum")
    p.add_argument("--memory", action="store_true",
                   help="also plan device memory for the options below, without loading weights")
    g = p.add_argument_group("memory plan options (with --memory; defaults: the engine's)")
    g.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="activation dtype (default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--max-concurrency", type=int, default=None, metavar="N", help="resident requests, 1..8")
    g.add_argument("--max-context", type=int, default=None, metavar="TOKENS",
                   help="longest prompt + output of one request")
    g.add_argument("--page-size", type=int, default=None, metavar="TOKENS", help="tokens per KV page")
    g.add_argument("--num-pages", type=int, default=None, metavar="N", help="KV pages (default: fit the budget)")
    g.add_argument("--kv-budget-mib", type=float, default=None, metavar="MIB", help="device MiB for KV pages")
    g.add_argument("--prefill-chunk-size", type=int, default=None, metavar="TOKENS",
                   help="most prompt tokens one engine step prefills")
    g.add_argument("--vram-budget-mib", type=float, default=None, metavar="MIB",
                   help="most device memory to plan for (default: NINFER_VRAM_BUDGET_MIB, else free memory)")
    g.add_argument("--host-experts", action=argparse.BooleanOptionalAction, default=None,
                   help="a MoE model's routed experts in host memory (default: only when the model does not fit)")
    g.add_argument("--device-expert-layers", type=int, default=None, metavar="N",
                   help="with host experts: the last N MoE layers keep their experts on the device")
    g.add_argument("--expert-cache-slots", type=int, default=None, metavar="N",
                   help="with host experts: experts per host MoE layer also cached on the device")


_MEMORY_FLAGS = ("device", "dtype", "max_concurrency", "max_context", "page_size", "num_pages", "kv_budget_mib",
                 "prefill_chunk_size", "vram_budget_mib", "host_experts", "device_expert_layers",
                 "expert_cache_slots")


def _memory_plan(artifact, args):
    from ninfer.contracts.options import EngineOptions
    from ninfer.planning.planner import plan

    options = EngineOptions(**{f: getattr(args, f) for f in _MEMORY_FLAGS if getattr(args, f) is not None})
    return plan(artifact, options)


def _expert_placement(startup) -> dict | None:
    """Where a host-expert plan keeps the routed experts (None without host experts)."""
    opts, profile = startup.options.options, startup.model.profile
    if not opts.host_experts:
        return None
    layers = opts.device_expert_layers or 0
    return {"moe_layers": profile.moe_layers, "device_expert_layers": layers,
            "host_expert_layers": profile.moe_layers - layers, "expert_cache_slots": opts.expert_cache_slots or 0}


def _placement_line(placed: dict) -> str:
    return (f"  routed experts    {placed['device_expert_layers']} of {placed['moe_layers']} MoE layers whole on the "
            f"device; {placed['host_expert_layers']} in host memory, {placed['expert_cache_slots']} cached per layer")


def run(args) -> int:
    from ninfer.artifact import ArtifactReader, describe, summarize
    from ninfer.contracts.memory import format_memory_summary
    from ninfer.errors import NInferError

    given = [f"--{f.replace('_', '-')}" for f in _MEMORY_FLAGS if getattr(args, f) is not None]
    if given and not args.memory:
        # The plan options do nothing alone; silently ignoring them would look like a plan was made.
        raise NInferError(f"{', '.join(given)}: memory plan options, which need --memory")
    checks.check_engine_flags(args, fields=tuple(f for f in _MEMORY_FLAGS if f not in ("device", "dtype")))
    # After the flag check: a bad command line converts nothing.
    from ninfer.model_source import resolve_model

    model = args.model
    if model is not None and (os.path.isfile(model) or model.endswith(".ninfer")):
        artifact = model  # the artifact reader names what is wrong with a missing or odd file
    else:
        artifact = resolve_model(model, progress=sys.stderr.isatty())
    startup = _memory_plan(artifact, args) if args.memory else None
    memory = startup.summary() if startup is not None else None
    placed = _expert_placement(startup) if startup is not None else None
    with ArtifactReader.open(artifact) as reader:
        if args.verify:
            for obj in reader.directory.objects:
                reader.verify_object(obj.id)
        if args.json:
            out = summarize(reader)
            if args.verify:
                out["verified"] = True
            if memory is not None:
                out["memory"] = memory.as_dict()
                if placed is not None:
                    out["memory"]["routed_experts"] = placed
            print(json.dumps(out, indent=2, ensure_ascii=False))
        else:
            print(describe(reader))
            if args.verify:
                print(f"verified: all {len(reader.directory.objects)} object checksums match")
            if memory is not None:
                print(format_memory_summary(memory))
                if placed is not None:
                    print(_placement_line(placed))
    return 0


COMMAND = CliCommand(
    name="info", help="describe a .ninfer artifact", add_arguments=add_arguments, run=run,
    description="Describe a V3 .ninfer artifact: components and config summary, objects and bytes per component "
                "and per format, files, metadata, artifact id.")
