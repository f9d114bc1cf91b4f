"""Model construction: artifact path + EngineOptions -> Program + Frontend.

Flow (docs/design.md section 3): reader -> Text component (required) -> registry architecture (dispatch
on ``architectures[0]`` once, here) -> parameter specs of the selected features -> profile ->
KV sizing -> load_weights -> resolve_ops -> ``ArchitectureSpec.create_program`` -> decode-graph capture
and calibration (:func:`start_program`); the Frontend is built from the component's frontend resources
by the spec's frontend family.

Graph calibration (docs/design.md section 7): after the decode graphs are captured, startup measures what
stays free (``planner.runtime_free_bytes``). When that is below the headroom it makes at most one
corrective rebuild: it drops the graphs and the Program, shrinks an automatic KV pool by the deficit
(``planner.calibrate_kv``), builds the Program again from the same loaded weights and captures
again; still short, or a pool that cannot shrink, is a MemoryPlanError. Each build gets its own copy of
the weights mapping (``create_program`` may rearrange its dict; the tensors are read-only views by the
ProgramInit contract, and Qwen3.5 casts into new tensors, never in place), so the rebuild sees the
weights as loaded.

Only the selected features' parameters are read. The reader is closed before returning: the weights
are materialized tensors and the frontend resources are read eagerly.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer.contracts.architecture import ModelProfile, ProgramInit, ProgramOptions
from ninfer.contracts.frontend import Frontend
from ninfer.contracts.memory import MemorySummary
from ninfer.contracts.program import Program
from ninfer.engine.options import EngineOptions, InvalidEngineOptions
from ninfer.errors import NInferError
from ninfer.planning.planner import (
    CALIBRATION_WAYS,
    MemoryPlanError,
    StartupPlan,
    StartupProbe,
    calibrate_kv,
    device_budget,
    plan_startup,
    released_weight_bytes,
    runtime_free_bytes,
    weight_source,
)

log = logging.getLogger("ninfer.engine")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class ModelConstructionError(NInferError):
    """The artifact cannot be served with these options (the message names what is missing)."""


@dataclass
class ModelInstance:
    """What an engine serves. ``options`` are the effective ones (device, dtype, KV pages and
    max_context resolved). Destruction order is the engine's: worker, Program, Frontend, weights."""

    program: Program
    frontend: Frontend
    options: EngineOptions
    info: dict[str, Any] = field(default_factory=dict)
    memory: MemorySummary | None = None


def resolve_device(options: EngineOptions) -> torch.device:
    """The device: the option when given (``cpu``, ``cuda`` or ``cuda:N`` of a present GPU), else cuda when CUDA is
    present, else cpu. Anything else is an InvalidEngineOptions naming the value and what is available."""
    if options.device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(options.device)
    except (RuntimeError, ValueError):
        raise InvalidEngineOptions(f"invalid engine option device={options.device!r}: expected cpu, cuda or "
                                   f"cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidEngineOptions(f"invalid engine option device={options.device!r}: no CUDA device is available "
                                       f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None})")
        if device.index is not None and not 0 <= device.index < count:
            raise InvalidEngineOptions(f"invalid engine option device={options.device!r}: {count} CUDA device(s), "
                                       f"indices 0..{count - 1}")
    elif device.type != "cpu":
        raise InvalidEngineOptions(f"invalid engine option device={options.device!r}: expected cpu, cuda or cuda:N")
    return device


def resolve_dtype(options: EngineOptions, device: torch.device) -> torch.dtype:
    """The activation dtype: the option when given, else bfloat16 on CUDA and float32 on the CPU
    (the CPU has no fast bf16 matmul, and fp32 is what the oracle tests pin down). The model casts its
    stored weights to it once at construction."""
    if options.dtype is not None:
        try:
            return _DTYPES[options.dtype]
        except KeyError:
            raise InvalidEngineOptions(f"invalid engine option dtype={options.dtype!r}: "
                                       f"one of {sorted(_DTYPES)}") from None
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def plan_num_pages(options: EngineOptions, profile: ModelProfile, max_context: int) -> int:
    """KV pages: explicit ``num_pages``, else ``kv_budget_mib`` worth, else every lane at max_context.
    The pool must hold one full-context request, else the scheduler could not guarantee progress."""
    ps = options.page_size
    if options.num_pages is not None:
        pages = options.num_pages
    elif options.kv_budget_mib is not None:
        per_token = max(1, profile.kv_bytes_per_token)
        pages = int(options.kv_budget_mib * 2**20) // (per_token * ps)
    else:
        pages = options.max_concurrency * -(-max_context // ps)
    if pages * ps < max_context:
        raise InvalidEngineOptions(f"the KV pool of {pages} pages x {ps} tokens cannot hold one request of "
                                   f"max_context {max_context}")
    return pages


GRAPHS_ENV = "NINFER_CUDA_GRAPHS"


def graph_batches(device: torch.device, options: EngineOptions) -> int:
    """How many decode graph sizes startup plans and captures: ``max_concurrency`` on CUDA for
    generation unless ``NINFER_CUDA_GRAPHS=0``, else 0."""
    if device.type != "cuda" or options.purpose != "generation" or os.environ.get(GRAPHS_ENV, "1").strip() == "0":
        return 0
    return options.max_concurrency


def lookahead_lanes(device: torch.device, options: EngineOptions, supported: bool) -> int:
    """Lookahead-decode spare StateImage slots (``EngineOptions.lookahead``): ``max_concurrency`` when
    it is on, else 0. Forcing it on for an architecture without support is an error naming both."""
    if options.purpose != "generation" or options.lookahead is False:
        return 0
    if not supported:
        if options.lookahead:
            raise InvalidEngineOptions("invalid engine option lookahead=True: this architecture's Program does "
                                       "not support lookahead decode")
        return 0
    if options.lookahead or graph_batches(device, options):
        return options.max_concurrency
    return 0


def _capture_graphs(program: Program, options: EngineOptions, device: torch.device) -> tuple[tuple[int, ...], int]:
    """Decode CUDA graphs for B = 1..max_concurrency (docs/design.md section 7) when :func:`graph_batches`
    says so and the Program supports them. Returns the captured sizes and the growth of the allocator's
    reserved bytes they caused (their memory pool, which the plan reserved an estimate for)."""
    capture = getattr(program, "capture_decode_graphs", None)
    if graph_batches(device, options) == 0 or capture is None:
        return (), 0
    before = _reserved(device)  # after returning the unused cache: capture cannot hide in cached blocks
    try:
        sizes = tuple(capture(options.max_concurrency))
    except Exception as exc:  # the engine cannot serve what it planned: say how to start without graphs
        raise ModelConstructionError(f"capturing decode CUDA graphs for batch sizes 1..{options.max_concurrency} "
                                     f"failed ({type(exc).__name__}: {exc}); {GRAPHS_ENV}=0 starts without "
                                     f"them") from exc
    torch.cuda.synchronize(device)
    growth = torch.cuda.memory_reserved(device) - before
    log.info("captured decode CUDA graphs for batch sizes 1..%d (%.1f MiB)", max(sizes, default=0), growth / 2**20)
    return sizes, growth


def _reserved(device: torch.device) -> int:
    """The caching allocator's reserved bytes after a sync and returning its unused cache."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


@dataclass(frozen=True)
class StartedProgram:
    """What :func:`start_program` built: the Program with its graphs, the final KV pages (fewer than
    ``planned_pages`` after a corrective rebuild) and the graph memory it measured."""

    program: Program
    num_pages: int
    planned_pages: int
    graph_sizes: tuple[int, ...]
    calibration_growth_bytes: int = 0      # the first capture's growth of reserved bytes
    retained_after_release_bytes: int = 0  # reserved above the first capture's base after dropping its graphs
    final_growth_bytes: int = 0            # the capture the engine serves with

    @property
    def rebuilt(self) -> bool:
        return self.num_pages != self.planned_pages


def _drop_graphs(program: Program, device: torch.device, base: int) -> int:
    """Drop ``program``'s decode graphs; returns the reserved bytes still above ``base`` afterwards."""
    close = getattr(program, "close_graphs", None)
    if close is not None:
        close()
    gc.collect()
    return max(0, _reserved(device) - base)


def start_program(make_program: Callable[[int], Program], plan: StartupPlan, options: EngineOptions,
                  device: torch.device, probe: StartupProbe, *,
                  released_bytes: Callable[[Program], int] = lambda program: 0) -> StartedProgram:
    """Build the Program with ``plan.num_pages`` KV pages (``make_program(num_pages)``), capture its decode
    graphs, and calibrate (module docstring): with less than ``plan.budget.headroom_bytes`` left, one
    corrective rebuild with fewer pages. ``released_bytes(program)``: device bytes construction frees when
    it returns (the stored weight originals the Program does not keep)."""
    num_pages = plan.num_pages
    program = make_program(num_pages)
    base = _reserved(device) if graph_batches(device, options) else 0
    sizes, first = _capture_graphs(program, options, device)
    if not sizes:
        return StartedProgram(program, num_pages, num_pages, ())

    def headroom_decision(p: Program, pages: int):
        free = runtime_free_bytes(device, plan.budget, probe, pending_bytes=plan.workspace_bytes,
                                  released_bytes=released_bytes(p))
        return calibrate_kv(free_bytes=free, headroom_bytes=plan.budget.headroom_bytes, page_bytes=plan.page_bytes,
                            num_pages=pages, min_pages=plan.min_pages, shrinkable=plan.kv_shrinkable)

    def graphs(growth: int) -> str:
        return (f"decode CUDA graphs for batch sizes 1..{max(sizes)} grew reserved memory by {growth / 2**20:,.1f} "
                f"MiB (planned {plan.graph_bytes / 2**20:,.1f} MiB)")

    decision = headroom_decision(program, num_pages)
    if decision.action == "keep":
        return StartedProgram(program, num_pages, num_pages, sizes, first, 0, first)
    if decision.action == "fail":
        raise MemoryPlanError(f"{graphs(first)}; {decision.reason}")
    retained = _drop_graphs(program, device, base)
    program = None  # the only reference: the KV pool, State and converted weights go with it
    gc.collect()
    torch.cuda.empty_cache()
    log.info("graph calibration: %s; %s: rebuilding the Program with %d instead of %d KV pages",
             graphs(first), decision.reason, decision.num_pages, num_pages)
    num_pages = decision.num_pages
    program = make_program(num_pages)
    sizes, final = _capture_graphs(program, options, device)
    again = headroom_decision(program, num_pages)
    if again.action != "keep":
        reason = again.reason if again.action == "fail" else f"{again.reason}; {CALIBRATION_WAYS}"
        raise MemoryPlanError(f"still short after one corrective rebuild ({plan.num_pages} -> {num_pages} KV "
                              f"pages): {graphs(final)}, {retained / 2**20:,.1f} MiB stayed reserved after "
                              f"dropping the first graphs; {reason}")
    return StartedProgram(program, num_pages, plan.num_pages, sizes, first, retained, final)


def build_model(artifact: str | os.PathLike, options: EngineOptions, *, progress=None) -> ModelInstance:
    """``progress(bytes_read, total_bytes)`` is called while weights load (a CLI progress bar)."""
    from ninfer.artifact import ArtifactReader, load_weights
    from ninfer.artifact.errors import MissingComponentError
    from ninfer.ops.registry import resolve_ops
    from ninfer.plugins import get_registry

    options.validate()
    if options.purpose == "causal_scoring":
        # Scoring runs one window on one sequence: State slots and KV pages for that one only.
        options = dataclasses.replace(options, max_concurrency=1)
    features = options.features()
    reader = ArtifactReader.open(artifact)
    try:
        try:
            text = reader.component("text")
        except MissingComponentError as exc:
            raise ModelConstructionError(f"{artifact}: the artifact has no Text component: {exc}") from exc
        registry = get_registry()
        spec = registry.architecture(text.architecture)
        config = text.config
        device = resolve_device(options)
        dtype = resolve_dtype(options, device)
        specs = spec.parameter_specs(config, features)
        source = weight_source(reader, specs)  # stored dtypes and loader bytes, from the directory only
        profile = spec.profile(config, features, dtype=dtype, stored_dtypes=source.stored_dtypes)
        max_context = options.max_context
        if profile.max_position_embeddings and max_context > profile.max_position_embeddings:
            log.warning("max_context %d exceeds the model's %d positions; using %d", max_context,
                        profile.max_position_embeddings, profile.max_position_embeddings)
            max_context = profile.max_position_embeddings
        explicit = (None if options.num_pages is None and options.kv_budget_mib is None
                    else plan_num_pages(options, profile, max_context))
        lookahead = lookahead_lanes(device, options, spec.lookahead)
        plan = plan_startup(options, profile, max_context, device_budget(device), load_bytes=source.load_bytes,
                            num_pages=explicit, graph_batches=graph_batches(device, options),
                            lookahead_slots=lookahead)
        num_pages = plan.num_pages
        probe = StartupProbe(device)
        family = registry.frontends.get(spec.frontend)
        if family is None:
            raise ModelConstructionError(f"architecture {spec.name!r} uses frontend family {spec.frontend!r}, "
                                         f"which no installed plugin provides (installed: {sorted(registry.frontends)})")
        resources = {role: reader.resource("text", role) for role in text.resources}
        frontend = family.create({k: v for k, v in resources.items() if v is not None}, profile.vocab_size)
        weights = load_weights(reader, specs, device, progress=progress)
        metadata = reader.directory.metadata or {}
        artifact_id = reader.artifact_id
    finally:
        reader.close()
    ops = resolve_ops(registry.ops, device.type, dtype)
    program_options = ProgramOptions(device=device, dtype=dtype, max_sequences=options.max_concurrency,
                                     page_size=options.page_size, num_pages=num_pages, max_context=max_context,
                                     checkpoint_slots=options.checkpoint_slots, lookahead_slots=lookahead)

    def make_program(pages: int) -> Program:
        opts = dataclasses.replace(program_options, num_pages=pages)
        return spec.create_program(ProgramInit(config=config, weights=dict(weights), ops=ops, options=opts,
                                               features=features))

    started = start_program(make_program, plan, options, device, probe,
                            released_bytes=lambda p: released_weight_bytes(weights, p, device))
    program, num_pages = started.program, started.num_pages
    effective = dataclasses.replace(options, device=str(device), dtype=str(dtype).removeprefix("torch."),
                                    num_pages=num_pages, max_context=max_context,
                                    prefill_chunk_size=options.prefill_chunk)
    info = {"architecture": spec.name, "name": metadata.get("name") or spec.name, "artifact_id": artifact_id,
            "device": str(device), "dtype": effective.dtype, "num_pages": num_pages, "page_size": options.page_size,
            "max_context": max_context, "max_position_embeddings": profile.max_position_embeddings,
            "ops": ops.describe(), "cuda_graphs": list(started.graph_sizes), "lookahead": lookahead > 0}
    memory = plan.with_num_pages(num_pages).summary(dtype, retained_bytes=probe.retained_bytes(program))
    if started.graph_sizes:
        memory = dataclasses.replace(memory, graph_calibration_growth_bytes=started.calibration_growth_bytes,
                                     graph_retained_after_release_bytes=started.retained_after_release_bytes,
                                     graph_final_growth_bytes=started.final_growth_bytes,
                                     kv_pages_before_rebuild=plan.num_pages if started.rebuilt else 0)
    info["memory"] = memory.as_dict()
    return ModelInstance(program=program, frontend=frontend, options=effective, info=info, memory=memory)
