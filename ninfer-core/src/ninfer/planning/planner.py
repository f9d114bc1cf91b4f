"""The startup planner (docs/design.md section 7): ``plan(artifact, options) -> StartupPlan``.

One derivation of everything an engine fixes before any large read, used by ``Engine.start`` (through
``ninfer.engine.model_construction.build_model``), ``ninfer info --memory`` and ``ninfer bench``:

1. :func:`artifact_profile` reads the artifact directory only (no payload): the Text component's
   architecture and config, the selected parameters and how they are stored
   (:class:`WeightSource`), the ModelProfile for the resolved device and dtype, and the
   options resolved once against it (``planning.resolution``).
2. :func:`plan` adds the device budget read now (``planning.budget``) and the memory plan under it
   (``planning.memory``: workspace, KV candidates, State, graph pool), and, when the
   architecture places weights in host memory on a device that is not the CPU, the host budget they must fit.

The planner never loads a weight or builds a Program; graph calibration after the build may still
shrink an automatic KV pool (``planning.calibration``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer.artifact import ArtifactReader
from ninfer.contracts.architecture import ArchitectureSpec, ModelProfile, ParameterSpec
from ninfer.contracts.memory import MemorySummary
from ninfer.contracts.options import EngineOptions
from ninfer.errors import NotSupportedError
from ninfer.planning.budget import (
    BUDGET_ENV,
    BUDGET_SOURCE_KEY,
    DeviceBudget,
    MemoryPlanError,
    device_budget,
    host_budget,
)
from ninfer.planning.memory import MemoryPlan, plan_memory
from ninfer.planning.resolution import (
    ResolvedOptions,
    resolve_device,
    resolve_dtype,
    resolve_options,
    resolve_vision,
)

log = logging.getLogger("ninfer.planning")


@dataclass(frozen=True)
class WeightSource:
    """The selected parameters as the artifact stores them (directory only, nothing read).

    ``load_bytes``: what the loader holds at once on the run device, every parent object a device-placed
    parameter reads plus the gathered copy of every such parameter that is not one contiguous range of one
    parent; ``host_load_bytes`` the same for the parameters placed in host memory (``ParameterSpec.placement``;
    a parent both kinds read counts in both); ``packed_host_load_bytes`` the same for the host-placed parameters
    stored packed (uint8: quantized banks). ``packed_bytes``: for each parameter stored in a quantized format, the
    bytes of the stored objects it reads that no parameter before it (in binding order) reads: what the Program holds
    for it, since packed weights are kept as loaded. Parameters sharing an object (fused projections) sum to that
    object's bytes once."""

    stored_dtypes: Mapping[str, torch.dtype]
    load_bytes: int
    host_load_bytes: int = 0
    packed_host_load_bytes: int = 0
    packed_bytes: Mapping[str, int] = field(default_factory=dict)


def weight_source(reader: ArtifactReader, specs) -> WeightSource:
    from ninfer.artifact.binder import bind

    bound = bind(reader, specs)
    host = {s.name for s in specs if s.placement == "host"}

    def held(params) -> int:
        parents = {piece.object.id: piece.object.bytes for bp in params for piece in bp.pieces}
        return sum(parents.values()) + sum(bp.nbytes for bp in params if not bp.is_view)

    on_host = [bp for bp in bound.parameters if bp.name in host]
    seen: set[str] = set()
    packed: dict[str, int] = {}
    for bp in bound.parameters:
        if bp.quantized:
            fresh = {p.object.id: p.object.bytes for p in bp.pieces if p.object.id not in seen}
            seen.update(fresh)
            packed[bp.name] = sum(fresh.values())
    return WeightSource(stored_dtypes={bp.name: bp.dtype for bp in bound.parameters},
                        load_bytes=held([bp for bp in bound.parameters if bp.name not in host]),
                        host_load_bytes=held(on_host),
                        packed_host_load_bytes=held([bp for bp in on_host if bp.dtype == torch.uint8]),
                        packed_bytes=packed)


def _check_components(reader: ArtifactReader, specs, options: EngineOptions) -> None:
    """Every component the selected parameters name is in the artifact; a speculative backend's missing
    component is a MissingComponentError naming it and the option that asked for it."""
    from ninfer.artifact.errors import MissingComponentError

    have = set(reader.directory.components)
    missing = sorted({s.component for s in specs} - have)
    if missing and options.speculative is not None:
        raise MissingComponentError(
            f"speculative={options.speculative!r} (--speculative {options.speculative}) needs the artifact "
            f"component(s) {', '.join(map(repr, missing))}, which this artifact does not have (it provides: "
            f"{', '.join(sorted(have))}); convert a checkpoint that has them, or start without speculative "
            f"decoding")


@dataclass(frozen=True)
class ArtifactProfile:
    """What the artifact directory and the options determine, before any budget is read.

    Invariant: ``profile`` is ``spec.profile`` of ``config`` for ``options.dtype`` and the stored dtypes of
    ``source``; ``parameter_specs`` are the parameters the options' features select (what the loader reads);
    ``options`` were resolved against ``profile`` and ``spec``."""

    spec: ArchitectureSpec
    config: Mapping[str, Any]
    parameter_specs: tuple[ParameterSpec, ...]
    source: WeightSource
    profile: ModelProfile
    options: ResolvedOptions

    @property
    def device(self) -> torch.device:
        return self.options.device

    @property
    def dtype(self) -> torch.dtype:
        return self.options.dtype


def artifact_profile(artifact: str | os.PathLike | ArtifactReader, options: EngineOptions) -> ArtifactProfile:
    """Step 1 of the module docstring for ``artifact`` (a path, or an open reader that stays open) and
    ``options``. Reads only the directory: no weight is loaded, no device memory is allocated.

    Raises InvalidEngineOptions (a bad option, an explicit pool below one request, lookahead forced on an
    architecture without it) and the artifact's errors (no Text component, an unknown architecture)."""
    from ninfer.plugins import get_registry

    options = options.validate()
    reader = artifact if isinstance(artifact, ArtifactReader) else ArtifactReader.open(artifact)
    try:
        auto_vision = options.vision is None
        options = resolve_vision(options, reader.directory.components)
        text = reader.component("text")
        spec = get_registry().architecture(text.architecture)
        device = resolve_device(options)
        dtype = resolve_dtype(options, device)
        try:
            specs = tuple(spec.parameter_specs(text.config, options.features()))
        except NotSupportedError as exc:
            if not (auto_vision and options.vision):
                raise
            # Automatic vision: a tower this architecture cannot bind (e.g. converted before its config was
            # stored) leaves the engine text-only; asking for vision explicitly raises instead.
            log.warning("vision off: %s", exc)
            options = dataclasses.replace(options, vision=False)
            specs = tuple(spec.parameter_specs(text.config, options.features()))
        features = options.features()
        _check_components(reader, specs, options)
        source = weight_source(reader, specs)
    finally:
        if reader is not artifact:
            reader.close()
    profile = spec.profile(text.config, features, dtype=dtype, stored_dtypes=source.stored_dtypes,
                           packed_bytes=source.packed_bytes)
    resolved = resolve_options(options, device=device, dtype=dtype, profile=profile,
                               lookahead_supported=spec.lookahead, flat_steps_supported=spec.flat_steps)
    return ArtifactProfile(spec=spec, config=text.config, parameter_specs=specs, source=source,
                           profile=profile, options=resolved)


@dataclass(frozen=True)
class StartupPlan:
    """The one startup plan: ``model`` (what the artifact and options determine) and ``memory`` (the sizes
    under the device budget). Invariant: ``memory`` was planned from ``model.options`` and
    ``model.profile``."""

    model: ArtifactProfile
    memory: MemoryPlan

    @property
    def options(self) -> ResolvedOptions:
        return self.model.options

    def summary(self) -> MemorySummary:
        """The plan-only MemorySummary (what ``ninfer info --memory`` prints)."""
        return self.memory.summary(self.model.dtype)


#: Prefill chunks the planner tries, in order, when the default chunk's step workspace does not fit the budget and
#: ``prefill_chunk_size`` is left to it (llama.cpp computes in 512-token micro-batches by default).
SMALLER_CHUNKS = (4096, 2048, 1024, 512)


def plan(artifact: str | os.PathLike | ArtifactReader, options: EngineOptions,
         env: Mapping[str, str] | None = None) -> StartupPlan:
    """The plan an engine started from ``artifact`` with ``options`` commits to (module docstring), the
    budget read now from the device and ``env`` (None: ``os.environ``; ``options.vram_budget_mib`` overrides its
    ``NINFER_VRAM_BUDGET_MIB``). Raises what :func:`artifact_profile` raises, and MemoryPlanError when the model
    and one max_context request cannot fit the budget.

    ``prefill_chunk_size`` None (auto): when the plan does not fit with the purpose's default chunk, the smaller
    chunks of :data:`SMALLER_CHUNKS` are tried in order (a step's workspace grows with its chunk) and the first
    that fits is used; the resolved options say which. A plan that fits with the default keeps it.

    ``host_experts`` None (auto) on a device that is not the CPU: when everything on the device does not fit at
    any of those chunks, the plan is made again with the routed experts in host memory (if the architecture
    places any there), and the resolved options say ``host_experts=True``; if that does not fit either, the error
    gives both needs. So a model that fits on the device with a smaller chunk stays there."""
    env = dict(os.environ if env is None else env)
    if options.vram_budget_mib is not None:
        env[BUDGET_ENV] = repr(float(options.vram_budget_mib))
        env[BUDGET_SOURCE_KEY] = "--vram-budget-mib"
    model = artifact_profile(artifact, options)
    budget = device_budget(model.device, env)
    try:
        return _plan_over_chunks(artifact, options, env)
    except MemoryPlanError as on_device:
        if options.host_experts is not None or budget.device == "cpu":   # on the CPU the host is the device
            raise
        try:
            hosted = artifact_profile(artifact, dataclasses.replace(options, host_experts=True))
        except NotSupportedError:
            raise on_device from None
        if hosted.profile.host_weight_bytes <= model.profile.host_weight_bytes:
            raise
        try:
            result = _plan_over_chunks(artifact, dataclasses.replace(options, host_experts=True), env)
        except MemoryPlanError as exc:
            raise MemoryPlanError(f"{exc} (that is with the routed experts in host memory; with them on the "
                                  f"device: {on_device})") from None
        log.info("routed experts placed in host memory: %s", on_device)
        return result


def _plan_over_chunks(artifact, options: EngineOptions, env: Mapping[str, str]) -> StartupPlan:
    """One placement: the default chunk, then (auto only) the smaller ones; the first error if none fits."""
    chunks = [options.prefill_chunk_size]
    if options.prefill_chunk_size is None:
        chunks += [c for c in SMALLER_CHUNKS if c < min(options.prefill_chunk, options.max_context)]
    first: MemoryPlanError | None = None
    for chunk in chunks:
        opts = dataclasses.replace(options, prefill_chunk_size=chunk)
        try:
            model = artifact_profile(artifact, opts)
            budget = device_budget(model.device, env)
            result = _fill_expert_cache(artifact, opts, model, _plan_memory(model, budget, env), budget, env)
        except MemoryPlanError as exc:
            first = first or exc
            continue
        if first is not None:
            log.info("prefill chunk lowered from %d to %d tokens to fit the device budget", options.prefill_chunk,
                     chunk)
        return result
    if len(chunks) > 1:
        raise MemoryPlanError(f"{first} (also with prefill chunks down to {chunks[-1]} tokens)") from None
    raise first


def _fill_expert_cache(artifact, options: EngineOptions, model: ArtifactProfile, memory: MemoryPlan,
                       budget: DeviceBudget, env: Mapping[str, str]) -> StartupPlan:
    """The plan with host experts, the room it leaves filled: with ``device_expert_layers`` None (auto), as many
    whole MoE layers kept on the device as the room holds (at least one stays on the host), then with
    ``expert_cache_slots`` None (auto) and an ``expert_routing_file`` (the record that warms the cache, or that a
    first run writes at close), as many cache slots per host layer as the room left holds, at most one per expert;
    without one, none. A layer's or
    a slot's cost is what it adds to the profile's device weights. Whole layers come first: a device layer has no
    host step at all (no wait for the host, no copies, no cache bookkeeping), where the same bytes spread as slots
    over every layer turn only a share of each layer's pairs into device pairs and every layer still waits for the
    host. Slots need the routing file because, with routing that has no favourites, a cache of a few percent of
    the experts measured slower than none at B=1 and B=8 (docs/memory.md, "Device cache"): asking for the record is
    asking for the cache. Other plans as they are; on the CPU host and device are one memory."""
    if not options.host_experts or budget.device == "cpu":
        return StartupPlan(model=model, memory=memory)
    if options.device_expert_layers is None:
        options, model, memory = _whole_layers(artifact, options, model, memory, budget, env)
    if options.expert_cache_slots is not None:
        return StartupPlan(model=model, memory=memory)
    if not options.expert_routing_file:
        return StartupPlan(model=artifact_profile(artifact, dataclasses.replace(options, expert_cache_slots=0)),
                           memory=memory)
    one = artifact_profile(artifact, dataclasses.replace(options, expert_cache_slots=1))
    per_slot = one.profile.weight_bytes - model.profile.weight_bytes
    slots = min(model.profile.num_experts, _spare(memory, budget) // per_slot) if per_slot > 0 else 0
    if slots <= 0:
        return StartupPlan(model=model, memory=memory)
    cached = artifact_profile(artifact, dataclasses.replace(options, expert_cache_slots=int(slots)))
    try:
        filled = _plan_memory(cached, budget, env)
    except MemoryPlanError:   # an estimate a slot too far: keep the plan without the cache
        return StartupPlan(model=model, memory=memory)
    # Recorded so that graph calibration takes from the cache before the KV (ninfer.planning.calibration).
    return StartupPlan(model=cached, memory=dataclasses.replace(filled, cache_slots=int(slots),
                                                                 slot_bytes=_stored_slot_bytes(model, per_slot)))


def _spare(memory: MemoryPlan, budget: DeviceBudget) -> int:
    """The budget a plan leaves unused (its larger of the runtime and the start-up peak counted)."""
    return budget.budget_bytes - budget.headroom_bytes - max(memory.runtime_bytes, memory.startup_peak_bytes)


def _whole_layers(artifact, options: EngineOptions, model: ArtifactProfile, memory: MemoryPlan,
                  budget: DeviceBudget, env: Mapping[str, str]
                  ) -> tuple[EngineOptions, ArtifactProfile, MemoryPlan]:
    """``device_expert_layers`` None (auto): the options, profile and plan with as many whole device layers as fit
    (the options resolved to that count, 0 when none)."""
    none = dataclasses.replace(options, device_expert_layers=0)
    layers = model.profile.moe_layers
    if layers < 2:
        return none, artifact_profile(artifact, none), memory
    one = artifact_profile(artifact, dataclasses.replace(options, device_expert_layers=1))
    per_layer = one.profile.weight_bytes - model.profile.weight_bytes
    n = min(layers - 1, _spare(memory, budget) // per_layer) if per_layer > 0 else 0
    while n > 0:   # the estimate may be a layer too far
        opts = dataclasses.replace(options, device_expert_layers=int(n))
        whole = artifact_profile(artifact, opts)
        try:
            return opts, whole, _plan_memory(whole, budget, env)
        except MemoryPlanError:
            n -= 1
    return none, artifact_profile(artifact, none), memory


def _stored_slot_bytes(model: ArtifactProfile, per_slot: int) -> int:
    """The device bytes one cache slot per layer holds. A profile may price a slot of quantized banks at a byte a
    weight (their uint8 view), while a slot holds an expert as stored: about half that at 4 bits, a little more at 8
    bits with fp16 scales. Graph calibration drops slots by this figure and must free what it counts, so for banks
    stored packed (uint8) it is scaled by the banks' stored bytes over the profile's host bytes for them; dense
    banks are cached in the run dtype, which the profile prices exactly."""
    stored = model.source.stored_dtypes
    packed = [s for s in model.parameter_specs if s.placement == "host" and stored.get(s.name) == torch.uint8]
    weights = sum(math.prod(s.shape) for s in packed)   # the profile's byte a weight for them
    if not packed or weights <= 0 or model.source.packed_host_load_bytes <= 0:
        return per_slot
    return per_slot * model.source.packed_host_load_bytes // weights


def _plan_memory(model: ArtifactProfile, budget: DeviceBudget, env: Mapping[str, str]) -> MemoryPlan:
    host = host_budget(env) if model.device.type != "cpu" and model.profile.host_weight_bytes else None
    return plan_memory(model.options, model.profile, budget, load_bytes=model.source.load_bytes,
                       host_load_bytes=model.source.host_load_bytes, host_budget=host)
