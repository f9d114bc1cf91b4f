"""Model construction: a StartupPlan -> Program + Frontend (:func:`build_model`).

Flow (docs/design.md section 3): the planner (``ninfer.planning.planner.plan``) reads the artifact
directory, dispatches on the Text component's architecture once, resolves the options and sizes memory;
this module then builds the Frontend from the component's resources (the spec's frontend family), loads
the selected weights, resolves the ops, builds the Program with ``ArchitectureSpec.create_program`` and
captures and calibrates its decode graphs (:func:`start_program`). Nothing here derives a size or an
option again: every figure comes from the plan.

Graph calibration (docs/design.md section 7): after the decode graphs are captured, startup measures what
stays free (``planning.calibration.runtime_free_bytes``). When that is below the headroom it makes at most
one corrective rebuild: it drops the graphs and the Program, gives up the deficit from an automatic expert cache,
then from an automatic KV pool (``planning.calibration.calibrate_kv``), builds the Program again from the same
loaded weights and captures again; still short, or nothing that can shrink, is a MemoryPlanError. Each build
gets its own copy of the weights mapping (``create_program`` may rearrange its dict; the tensors are read-only
views by the ProgramInit contract: a Program that casts makes new tensors, never in place), so the rebuild sees the
weights as loaded. A MemoryPlanError there with whole device expert layers the planner chose itself starts the
whole construction again with one layer fewer (:func:`build_model`).

Only the selected features' parameters are read. The reader is closed before returning: the weights
are materialized tensors and the frontend resources are read eagerly.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ninfer.contracts.architecture import ProgramInit
from ninfer.contracts.frontend import Frontend
from ninfer.contracts.memory import MemorySummary
from ninfer.contracts.options import EngineOptions
from ninfer.contracts.program import Program
from ninfer.errors import NInferError
from ninfer.planning.budget import MemoryPlanError
from ninfer.planning.calibration import (
    CALIBRATION_WAYS,
    StartupProbe,
    calibrate_kv,
    released_weight_bytes,
    runtime_free_bytes,
)
from ninfer.planning.memory import MemoryPlan
from ninfer.planning.planner import plan
from ninfer.planning.resolution import GRAPHS_ENV, ResolvedOptions

log = logging.getLogger("ninfer.engine")


class ModelConstructionError(NInferError):
    """The artifact cannot be served with these options (the message names what is missing)."""


@dataclass
class ModelInstance:
    """What an engine serves. ``options`` are the effective ones (the plan's resolved options with the
    final KV pages). Destruction order is the engine's: worker, Program, Frontend, weights."""

    program: Program
    frontend: Frontend
    options: EngineOptions
    info: dict[str, Any] = field(default_factory=dict)
    memory: MemorySummary | None = None


def _capture_graphs(program: Program, max_batch: int, device: torch.device) -> tuple[tuple[int, ...], int]:
    """Decode CUDA graphs for B = 1..``max_batch`` (docs/design.md section 7;
    ``ResolvedOptions.graph_batches``, 0: none). Returns the captured sizes (none when the Program's
    architecture captures none) and the growth of the allocator's reserved bytes they caused (their memory
    pool, which the plan reserved an estimate for)."""
    if max_batch == 0:
        return (), 0
    before = _reserved(device)  # after returning the unused cache: capture cannot hide in cached blocks
    try:
        sizes = tuple(program.capture_decode_graphs(max_batch))
    except Exception as exc:  # the engine cannot serve what it planned: say how to start without graphs
        raise ModelConstructionError(f"capturing decode CUDA graphs for batch sizes 1..{max_batch} "
                                     f"failed ({type(exc).__name__}: {exc}); {GRAPHS_ENV}=0 starts without "
                                     f"them") from exc
    torch.cuda.synchronize(device)
    growth = torch.cuda.memory_reserved(device) - before
    log.info("captured decode CUDA graphs for batch sizes 1..%d (%.1f MiB)", max(sizes, default=0), growth / 2**20)
    return sizes, growth


def _reserved(device: torch.device) -> int:
    """The caching allocator's reserved bytes after a sync and returning its unused cache (after a collection:
    a graph pool kept alive only by a reference cycle would otherwise be freed inside the next measurement)."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


@dataclass(frozen=True)
class StartedProgram:
    """What :func:`start_program` built: the Program with its graphs, the final KV pages (fewer than
    ``planned_pages`` after a corrective rebuild), the expert cache slots per layer a rebuild gave it (None: as
    planned) and the graph memory it measured."""

    program: Program
    num_pages: int
    planned_pages: int
    graph_sizes: tuple[int, ...]
    calibration_growth_bytes: int = 0      # the first capture's growth of reserved bytes
    retained_after_release_bytes: int = 0  # reserved above the first capture's base after dropping its graphs
    final_growth_bytes: int = 0            # the capture the engine serves with
    graphs_s: float = 0.0                  # seconds from the first Program built to the graphs served with
    cache_slots: int | None = None         # the automatic expert cache after a rebuild (None: as planned)

    @property
    def rebuilt(self) -> bool:
        return self.num_pages != self.planned_pages or self.cache_slots is not None


def _drop_graphs(program: Program, device: torch.device, base: int) -> int:
    """Drop ``program``'s decode graphs; returns the reserved bytes still above ``base`` afterwards."""
    program.close_graphs()
    gc.collect()
    return max(0, _reserved(device) - base)


def start_program(make_program: Callable[[int, int | None], Program], memory: MemoryPlan, options: ResolvedOptions,
                  probe: StartupProbe, *,
                  released_bytes: Callable[[Program], int] = lambda program: 0) -> StartedProgram:
    """Build the Program with ``memory.num_pages`` KV pages (``make_program(num_pages, None)``; the second argument
    is the expert cache slots per layer, None: as planned), capture its decode graphs (``options.graph_batches``
    sizes on ``options.device``), and calibrate (module docstring): with less than ``memory.budget.headroom_bytes``
    left, one corrective rebuild with fewer expert cache slots, then fewer pages.
    ``released_bytes(program)``: device bytes construction frees when it returns (the stored weight originals
    the Program does not keep)."""
    device, num_pages = options.device, memory.num_pages
    program = make_program(num_pages, None)
    built = time.perf_counter()
    base = _reserved(device) if options.graph_batches else 0
    sizes, first = _capture_graphs(program, options.graph_batches, device)
    if not sizes:
        return StartedProgram(program, num_pages, num_pages, (), graphs_s=time.perf_counter() - built)

    def headroom_decision(p: Program, pages: int, slots: int):
        free = runtime_free_bytes(device, memory.budget, probe, pending_bytes=memory.workspace_bytes,
                                  released_bytes=released_bytes(p))
        return calibrate_kv(free_bytes=free, headroom_bytes=memory.budget.headroom_bytes,
                            page_bytes=memory.page_bytes, num_pages=pages, min_pages=memory.min_pages,
                            shrinkable=memory.kv_shrinkable, cache_slots=slots, slot_bytes=memory.slot_bytes)

    def graphs(growth: int) -> str:
        return (f"decode CUDA graphs for batch sizes 1..{max(sizes)} grew reserved memory by {growth / 2**20:,.1f} "
                f"MiB (planned {memory.graph_bytes / 2**20:,.1f} MiB)")

    decision = headroom_decision(program, num_pages, memory.cache_slots)
    if decision.action == "keep":
        return StartedProgram(program, num_pages, num_pages, sizes, first, 0, first, time.perf_counter() - built)
    if decision.action == "fail":
        raise MemoryPlanError(f"{graphs(first)}; {decision.reason}")
    retained = _drop_graphs(program, device, base)
    program = None  # the only reference: the KV pool, State and converted weights go with it
    gc.collect()
    torch.cuda.empty_cache()
    slots = decision.cache_slots
    change = ", ".join(part for part in (
        f"{memory.cache_slots} -> {slots} expert cache slots per layer" if slots is not None else "",
        f"{memory.num_pages} -> {decision.num_pages} KV pages" if decision.num_pages != memory.num_pages else "")
        if part)
    log.info("graph calibration: %s; %s: rebuilding the Program (%s)", graphs(first), decision.reason, change)
    num_pages = decision.num_pages
    program = make_program(num_pages, slots)
    sizes, final = _capture_graphs(program, options.graph_batches, device)
    again = headroom_decision(program, num_pages, memory.cache_slots if slots is None else slots)
    if again.action != "keep":
        reason = again.reason if again.action == "fail" else f"{again.reason}; {CALIBRATION_WAYS}"
        raise MemoryPlanError(f"still short after one corrective rebuild ({change}): {graphs(final)}, "
                              f"{retained / 2**20:,.1f} MiB stayed reserved after dropping the first graphs; {reason}")
    return StartedProgram(program, num_pages, memory.num_pages, sizes, first, retained, final,
                          time.perf_counter() - built, cache_slots=slots)


class DeviceLayersShort(MemoryPlanError):
    """:func:`start_program`'s MemoryPlanError for a plan whose ``layers`` whole device expert layers the planner
    chose itself (``device_expert_layers`` None): :func:`build_model` starts again with one fewer."""

    def __init__(self, message: str, layers: int) -> None:
        super().__init__(message)
        self.layers = layers


def build_model(artifact: str | os.PathLike, options: EngineOptions, *, progress=None) -> ModelInstance:
    """Plan (``ninfer.planning.planner.plan``) and build what an engine serves from ``artifact`` with
    ``options``. ``progress(bytes_read, total_bytes)`` is called while weights load (a CLI progress bar).

    With host experts and ``device_expert_layers`` None, the planner fills the room its estimates leave with whole
    device expert layers; the decode graphs' memory is only measured after capture, and when graph calibration
    has nothing automatic left to give (a small KV pool, no cache), the layers must yield: the whole start runs
    again with one layer fewer (its experts loaded into host memory instead), down to none."""
    auto_layers = options.device_expert_layers is None
    while True:
        try:
            return _build_model(artifact, options, progress, auto_layers)
        except DeviceLayersShort as exc:
            layers, reason = exc.layers, str(exc)
        # Out of the handler: the failed attempt's traceback, whose frames hold its weights and Program, is gone.
        options = dataclasses.replace(options, device_expert_layers=layers - 1)
        log.info("graph calibration: %s; starting again with %d whole device expert layers instead of %d",
                 reason, layers - 1, layers)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _build_model(artifact: str | os.PathLike, options: EngineOptions, progress, auto_layers: bool) -> ModelInstance:
    """:func:`build_model` with the device expert layers ``options`` names (``auto_layers``: the planner chose the
    count; a calibration failure with some of them is a :class:`DeviceLayersShort`)."""
    from ninfer.artifact import ArtifactReader, load_weights
    from ninfer.artifact.errors import MissingComponentError
    from ninfer.ops.registry import resolve_ops
    from ninfer.plugins import get_registry
    from ninfer.plugins.registry import filter_note

    begun = time.perf_counter()
    options.validate()
    reader = ArtifactReader.open(artifact)
    try:
        try:
            text = reader.component("text")
        except MissingComponentError as exc:
            raise ModelConstructionError(f"{artifact}: the artifact has no Text component: {exc}") from exc
        startup = plan(reader, options)
        model, resolved = startup.model, startup.options
        spec, profile, device = model.spec, model.profile, resolved.device
        max_context = resolved.options.max_context
        if max_context < options.max_context:  # said at start only: `info --memory` prints the capped value
            # A warning only for a length the caller chose: the default capped to a small model is expected.
            asked = options.max_context != EngineOptions.max_context
            log.log(logging.WARNING if asked else logging.INFO, "max_context %d exceeds the model's %d positions; using %d", options.max_context,
                        profile.max_position_embeddings, max_context)
        probe = StartupProbe(device)
        registry = get_registry()
        family = registry.frontends.get(spec.frontend)
        if family is None:
            raise ModelConstructionError(f"architecture {spec.name!r} uses frontend family {spec.frontend!r}, "
                                         f"which no loaded plugin provides (loaded: {sorted(registry.frontends)})"
                                         f"{filter_note()}")
        resources = {role: reader.resource("text", role) for role in text.resources}
        if "vision" in reader.directory.components:  # the image and video preprocessing settings
            resources.update({role: reader.resource("vision", role) for role in reader.component("vision").resources})
        frontend = family.create({k: v for k, v in resources.items() if v is not None}, profile.vocab_size)
        weights = load_weights(reader, model.parameter_specs, device, progress=progress)
        metadata = reader.directory.metadata or {}
        components = tuple(reader.directory.components)
        artifact_id = reader.artifact_id
    finally:
        reader.close()
    ops = resolve_ops(registry.ops, device.type, resolved.dtype)
    features = resolved.options.features()

    def make_program(pages: int, cache_slots: int | None) -> Program:
        bound = features if cache_slots is None else dataclasses.replace(features, expert_cache_slots=cache_slots)
        return spec.create_program(ProgramInit(config=model.config, weights=dict(weights), ops=ops,
                                               options=resolved.program_options(pages), features=bound))

    try:
        started = start_program(make_program, startup.memory, resolved, probe,
                                released_bytes=lambda p: released_weight_bytes(weights, p, device))
    except MemoryPlanError as exc:
        layers = resolved.options.device_expert_layers or 0
        if auto_layers and layers > 0 and resolved.options.host_experts:
            raise DeviceLayersShort(str(exc), layers) from None
        raise
    program, num_pages = started.program, started.num_pages
    effective = resolved.engine_options(num_pages)
    final_plan = startup.memory.with_num_pages(num_pages)
    if started.cache_slots is not None:   # the corrective rebuild gave up expert cache slots
        effective = dataclasses.replace(effective, expert_cache_slots=started.cache_slots)
        final_plan = final_plan.with_cache_slots(started.cache_slots)
    info = {"architecture": spec.name, "name": metadata.get("name") or Path(artifact).stem, "artifact_id": artifact_id,
            "device": effective.device, "dtype": effective.dtype, "num_pages": num_pages,
            "page_size": effective.page_size, "max_context": max_context,
            "max_position_embeddings": profile.max_position_embeddings, "ops": ops.describe(),
            "cuda_graphs": list(started.graph_sizes), "lookahead": resolved.lookahead_slots > 0,
            "prefill_graphs": list(program.prefill_graphs.buckets) if getattr(program, "prefill_graphs", None) else [],
            "vision": bool(effective.vision), "vision_tower": "vision" in components,
            "host_expert_kernel": getattr(program, "host_expert_kernel", None),
            "host_expert_threads": getattr(program, "host_expert_threads", None),
            # Start-up seconds by phase; the Engine adds its warm-up and the whole start.
            "startup": {"load_s": time.perf_counter() - begun - started.graphs_s, "graphs_s": started.graphs_s,
                        **({"prefill_graphs_s": program.prefill_graphs_s}
                           if getattr(program, "prefill_graphs", None) else {})}}
    memory = final_plan.summary(resolved.dtype, retained_bytes=probe.retained_bytes(program))
    if started.graph_sizes:
        shrunk = started.num_pages != started.planned_pages
        slots = started.cache_slots
        memory = dataclasses.replace(memory, graph_calibration_growth_bytes=started.calibration_growth_bytes,
                                     graph_retained_after_release_bytes=started.retained_after_release_bytes,
                                     graph_final_growth_bytes=started.final_growth_bytes,
                                     kv_pages_before_rebuild=startup.memory.num_pages if shrunk else 0,
                                     cache_slots_before_rebuild=0 if slots is None else startup.memory.cache_slots,
                                     cache_slots_after_rebuild=slots or 0)
    info["memory"] = memory.as_dict()
    return ModelInstance(program=program, frontend=frontend, options=effective, info=info, memory=memory)
