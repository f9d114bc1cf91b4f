"""Startup planning (docs/design.md section 7): the device budget, the KV capacity candidates, the plan.

Everything here runs before any large read: it needs the architecture's address-free ModelProfile,
the artifact directory (stored dtypes, loader bytes) and the options.

Budget (:func:`device_budget`):
- CUDA: the free memory ``torch.cuda.mem_get_info`` reports now, capped by ``NINFER_VRAM_BUDGET_MIB``
  when set; headroom ``CUDA_HEADROOM_BYTES`` (1 GiB) is kept free on top of the plan.
- CPU: ``NINFER_VRAM_BUDGET_MIB`` when set, else ``CPU_BUDGET_FRACTION`` of physical memory
  (``os.sysconf``): the host also carries the interpreter, tokenizer, server and other processes.
  Headroom is proportionate, ``CPU_HEADROOM_FRACTION`` of the budget, because host allocations outside
  the engine scale with the machine, not with a fixed driver reserve.

Plan (:func:`plan_startup`), with S = State of every lane, W = workspace estimate:
- runtime bytes = weights + KV + S + W; startup peak = loaded stored weights + converted copies +
  KV + S (the stored originals are held until construction ends). Both + headroom must fit.
- KV candidates, largest first: ``every lane at max_context`` (``max_concurrency * ceil(max_context /
  page_size)`` pages: without a context cache no page beyond that can ever be used), else ``fit to
  budget`` (the most pages the room holds). Explicit ``num_pages`` / ``kv_budget_mib`` are taken as
  given and checked against the same room.
- Either way the pool must hold one full max_context request; if the room cannot, startup fails with
  :class:`MemoryPlanError` naming every number.

Graph calibration (after the Program is built and its decode CUDA graphs are captured, CUDA only):
- :func:`runtime_free_bytes` measures what will stay free while serving: ``torch.cuda.mem_get_info``
  now, capped by what the budget leaves (``budget - held``, held = how much the device's free memory
  fell since the :class:`StartupProbe`; the same two caps as :func:`device_budget`), plus the stored
  weight originals the Program does not keep (freed when construction returns), minus the planned
  workspace (allocated by the first steps, not yet).
- :func:`calibrate_kv` (pure) decides: keep the pool when that keeps ``headroom`` free, else shrink an
  automatic pool by the deficit plus :func:`calibration_margin` in whole pages, else fail (an explicit
  pool, or fewer pages than one max_context request).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ninfer.contracts.architecture import ModelProfile
from ninfer.contracts.memory import MemorySummary
from ninfer.engine.options import EngineOptions, InvalidEngineOptions
from ninfer.errors import NInferError

MIB = 1 << 20
GIB = 1 << 30
BUDGET_ENV = "NINFER_VRAM_BUDGET_MIB"
CUDA_HEADROOM_BYTES = GIB
CPU_BUDGET_FRACTION = 0.5
CPU_HEADROOM_FRACTION = 0.1
# The reference attention materialises at most 2**24 fp32 scores per query block, two live at once
# (scores, then softmax); a single query row over a long context may exceed it.
SCORE_BLOCK_BYTES = 2 * 4 * (1 << 24)
# Per sampled logit: fp32 logits plus the sampler's copies (penalised, probabilities, sorted values and
# int64 indices): six 4-byte words.
LOGIT_BYTES = 6 * 4


class MemoryPlanError(NInferError):
    """The model, its KV/State and workspace cannot fit the device budget (the message has the numbers)."""


def _mib(n: int) -> str:
    return f"{n / MIB:,.1f} MiB"


# -- budget ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceBudget:
    """What the plan may use on ``device``: ``budget_bytes`` of which ``headroom_bytes`` stay free."""

    device: str
    budget_bytes: int
    headroom_bytes: int
    source: str


def _env_budget(env: Mapping[str, str]) -> int | None:
    raw = env.get(BUDGET_ENV)
    if raw is None or raw.strip() == "":
        return None
    try:
        mib = float(raw)
    except ValueError:
        mib = -1.0
    if not mib > 0:
        raise InvalidEngineOptions(f"{BUDGET_ENV}={raw!r} must be a positive number of MiB")
    return int(mib * MIB)


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_budget(device: torch.device, env: Mapping[str, str] | None = None) -> DeviceBudget:
    """The budget rule of the module docstring, read now."""
    env = os.environ if env is None else env
    capped = _env_budget(env)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if capped is not None and capped < free:
            budget, source = capped, f"{BUDGET_ENV}={capped // MIB} (CUDA free {_mib(free)} of {_mib(total)})"
        else:
            budget, source = free, f"CUDA free memory {_mib(free)} of {_mib(total)}"
        return DeviceBudget(str(device), int(budget), CUDA_HEADROOM_BYTES, source)
    if device.type != "cpu":
        raise InvalidEngineOptions(f"no memory planning rule for device {device}")
    if capped is not None:
        budget, source = capped, f"{BUDGET_ENV}={capped // MIB}"
    else:
        phys = physical_memory_bytes()
        budget, source = int(phys * CPU_BUDGET_FRACTION), f"{CPU_BUDGET_FRACTION:g} x physical {_mib(phys)}"
    return DeviceBudget("cpu", budget, int(budget * CPU_HEADROOM_FRACTION), source)


# -- what the artifact stores ---------------------------------------------------------------------
@dataclass(frozen=True)
class WeightSource:
    """The selected parameters as the artifact stores them (directory only, nothing read).

    ``load_bytes``: what the loader holds at once, every parent object read plus the gathered copy of
    every parameter that is not one contiguous range of one parent."""

    stored_dtypes: Mapping[str, torch.dtype]
    load_bytes: int


def weight_source(reader, specs) -> WeightSource:
    from ninfer.artifact.binder import bind

    bound = bind(reader, specs)
    gathered = sum(bp.nbytes for bp in bound.parameters if not bp.is_view)
    return WeightSource(stored_dtypes={bp.name: bp.dtype for bp in bound.parameters},
                        load_bytes=sum(o.bytes for o in bound.parents) + gathered)


# -- workspace ------------------------------------------------------------------------------------
def workspace_bytes(profile: ModelProfile, *, step_tokens: int, logit_rows: int, max_context: int) -> int:
    """Estimated transient bytes of the largest step: ``step_tokens`` tokens through the widest layer,
    one attention call over ``max_context`` cached tokens with its live scores, and ``logit_rows``
    sampled rows of the vocabulary."""
    qk = profile.score_bytes_per_query_key
    scores = min(step_tokens * max_context * qk, max(SCORE_BLOCK_BYTES, max_context * qk))
    return (step_tokens * profile.activation_bytes_per_token
            + max_context * profile.attention_bytes_per_context_token
            + scores
            + logit_rows * profile.vocab_size * LOGIT_BYTES)


# -- the plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StartupPlan:
    """The sizes startup commits to. Invariant: ``max(runtime_bytes, startup_peak_bytes) +
    budget.headroom_bytes <= budget.budget_bytes`` and ``num_pages * page_size >= max_context``."""

    budget: DeviceBudget
    max_context: int
    page_size: int
    num_pages: int
    state_slots: int
    weights_bytes: int
    kv_bytes: int
    state_bytes: int
    workspace_bytes: int
    startup_peak_bytes: int
    kv_candidate: str
    graph_bytes: int = 0          # the decode graphs' private pool, estimated (0: no graphs planned)
    page_bytes: int = 0           # KV bytes of one page (page_size x the profile's KV bytes per token)

    @property
    def runtime_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.state_bytes + self.workspace_bytes + self.graph_bytes

    @property
    def min_pages(self) -> int:
        """The pages of one full max_context request (the pool never goes below it)."""
        return -(-self.max_context // self.page_size)

    @property
    def kv_shrinkable(self) -> bool:
        """Whether graph calibration may shrink the pool: only an automatically sized one (docs/design.md
        section 7); an explicit ``num_pages`` / ``kv_budget_mib`` is what the user asked for."""
        return not self.kv_candidate.startswith("explicit")

    def with_num_pages(self, num_pages: int) -> StartupPlan:
        """This plan with a pool of ``num_pages`` (after a corrective rebuild; the startup peak stays the
        first build's, which had the larger pool)."""
        return dataclasses.replace(self, num_pages=num_pages, kv_bytes=num_pages * self.page_bytes)

    def summary(self, dtype: torch.dtype | str, *, retained_bytes: int | None = None) -> MemorySummary:
        """The MemorySummary of this plan; ``retained_bytes`` (measured after construction) makes it an
        engine's summary, None a plan-only one."""
        dtype_name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        reserved = self.kv_bytes + self.state_bytes
        return MemorySummary(
            device=self.budget.device, dtype=dtype_name, budget_bytes=self.budget.budget_bytes,
            budget_source=self.budget.source, headroom_bytes=self.budget.headroom_bytes,
            weights_bytes=self.weights_bytes, kv_bytes=self.kv_bytes, state_bytes=self.state_bytes,
            workspace_bytes=self.workspace_bytes, startup_peak_bytes=self.startup_peak_bytes,
            startup_retained_bytes=(self.weights_bytes + reserved) if retained_bytes is None else retained_bytes,
            runtime_reservation_bytes=reserved, num_pages=self.num_pages, page_size=self.page_size,
            state_slots=self.state_slots, max_context=self.max_context, kv_candidate=self.kv_candidate,
            measured=retained_bytes is not None, graph_rebuild_estimate_bytes=self.graph_bytes)


def graph_pool_bytes(profile: ModelProfile, max_batch: int, max_context: int) -> int:
    """Estimated private memory pool of decode CUDA graphs for batch sizes 1..``max_batch``: the largest
    graph's step (smaller graphs reuse its blocks). 0 for ``max_batch`` 0 (no graphs)."""
    if max_batch < 1:
        return 0
    return workspace_bytes(profile, step_tokens=max_batch, logit_rows=max_batch, max_context=max_context)


def plan_startup(options: EngineOptions, profile: ModelProfile, max_context: int, budget: DeviceBudget, *,
                 load_bytes: int, num_pages: int | None = None, graph_batches: int = 0,
                 lookahead_slots: int = 0) -> StartupPlan:
    """Plan weights + KV/State + workspace (+ the decode graphs' pool for ``graph_batches`` batch sizes)
    under ``budget`` (module docstring). ``num_pages``: an explicitly sized pool (checked, not changed);
    None lets the candidates choose. ``lookahead_slots``: StateImage spares of lookahead decode."""
    ps = options.page_size
    lanes = options.max_concurrency
    scoring = options.purpose == "causal_scoring"
    chunk = min(options.prefill_chunk, max_context)  # no prefill chunk is longer than a request
    work = workspace_bytes(profile, step_tokens=chunk + lanes, logit_rows=lanes + (chunk if scoring else 0),
                           max_context=max_context)
    # + context-cache checkpoints + lookahead spares
    state = (lanes + options.checkpoint_slots + lookahead_slots) * profile.state_bytes_per_sequence
    graphs = graph_pool_bytes(profile, graph_batches, max_context)
    runtime_fixed = profile.weight_bytes + state + work + graphs
    startup_fixed = load_bytes + profile.converted_weight_bytes + state
    room = budget.budget_bytes - budget.headroom_bytes - max(runtime_fixed, startup_fixed)
    page_bytes = ps * profile.kv_bytes_per_token
    one_request = -(-max_context // ps)

    def why() -> str:
        return (f"budget {_mib(budget.budget_bytes)} [{budget.source}] - headroom {_mib(budget.headroom_bytes)} "
                f"- max(runtime: weights {_mib(profile.weight_bytes)} + State {_mib(state)} ({lanes} lanes + "
                f"{options.checkpoint_slots} checkpoints + {lookahead_slots} lookahead) + workspace {_mib(work)} + graphs {_mib(graphs)}, startup: stored weights {_mib(load_bytes)} + converted "
                f"{_mib(profile.converted_weight_bytes)} + State {_mib(state)}) leaves {_mib(room)} for KV")

    if num_pages is not None:
        pages, candidate = num_pages, "explicit num_pages" if options.num_pages is not None else "explicit kv_budget_mib"
        if pages * page_bytes > room:
            raise MemoryPlanError(f"the KV pool of {pages} pages x {ps} tokens ({_mib(pages * page_bytes)}) does not "
                                  f"fit: {why()}")
    else:
        every_lane = lanes * one_request
        fit = every_lane if page_bytes == 0 else max(0, room) // page_bytes
        if fit >= every_lane:
            pages, candidate = every_lane, "every lane at max_context"
        else:
            pages, candidate = fit, "fit to budget"
    if pages < one_request:
        raise MemoryPlanError(
            f"cannot fit one request of max_context {max_context}: it needs {one_request} KV pages x {ps} tokens = "
            f"{_mib(one_request * page_bytes)}, but {why()}; lower max_context or max_concurrency, or raise "
            f"{BUDGET_ENV} / free device memory")
    kv = pages * page_bytes
    return StartupPlan(budget=budget, max_context=max_context, page_size=ps, num_pages=pages, state_slots=lanes,
                       weights_bytes=profile.weight_bytes, kv_bytes=kv, state_bytes=state, workspace_bytes=work,
                       startup_peak_bytes=startup_fixed + kv, kv_candidate=candidate, graph_bytes=graphs,
                       page_bytes=page_bytes)


# -- graph calibration: the final KV capacity -------------------------------------------------------
@dataclass(frozen=True)
class KVCalibration:
    """What :func:`calibrate_kv` decided: ``action`` is ``"keep"`` (``num_pages`` unchanged),
    ``"shrink"`` (rebuild with ``num_pages``) or ``"fail"`` (``reason`` says why and what to change)."""

    action: str
    num_pages: int
    reason: str = ""


CALIBRATION_WAYS = (f"lower --max-context or --max-concurrency, raise {BUDGET_ENV} / free device memory, or "
                    f"start without decode graphs (NINFER_CUDA_GRAPHS=0)")


def calibration_margin(deficit_bytes: int) -> int:
    """Extra bytes a corrective shrink frees beyond the measured deficit: the rebuild re-captures the
    same graphs, but allocator segments (2 MiB granularity) and what the first graphs left reserved may
    differ a little. 16 MiB, or 1/16 of a larger deficit."""
    return max(16 * MIB, deficit_bytes // 16)


def calibrate_kv(*, free_bytes: int, headroom_bytes: int, page_bytes: int, num_pages: int, min_pages: int,
                 shrinkable: bool = True) -> KVCalibration:
    """The final KV capacity after graph capture (pure; module docstring). ``free_bytes``: what stays free
    while serving with ``num_pages`` pages of ``page_bytes`` (:func:`runtime_free_bytes`); ``min_pages``:
    one max_context request; ``shrinkable``: the pool was sized automatically."""
    deficit = headroom_bytes - free_bytes
    if deficit <= 0:
        return KVCalibration("keep", num_pages)
    short = (f"{_mib(free_bytes)} stays free after graph capture, {_mib(deficit)} short of the "
             f"{_mib(headroom_bytes)} headroom")
    ways = CALIBRATION_WAYS
    if not shrinkable:
        return KVCalibration("fail", num_pages, f"{short}, and the KV pool of {num_pages} pages was sized "
                                                f"explicitly; lower --num-pages / --kv-budget-mib, or {ways}")
    if page_bytes <= 0:
        return KVCalibration("fail", num_pages, f"{short}, and the model has no KV pages to shrink; {ways}")
    drop = -(-(deficit + calibration_margin(deficit)) // page_bytes)
    pages = num_pages - drop
    if pages < min_pages:
        return KVCalibration("fail", num_pages, (
            f"{short}: the KV pool would have to shrink by {drop} pages of {_mib(page_bytes)} (deficit + "
            f"margin) from {num_pages} to {pages}, below the {min_pages} pages one max_context request "
            f"needs; {ways}"))
    return KVCalibration("shrink", pages, short)


# -- measuring what startup left --------------------------------------------------------------------
def _storages(root: Any, device: torch.device | None = None) -> dict[tuple[str, int], int]:
    """The distinct storages of every tensor (on ``device``, where ``cuda`` without an index matches any
    CUDA device; None: any device) reachable from ``root`` through containers and NInfer objects:
    (device, data pointer) -> bytes."""
    storages: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            d = obj.device
            if device is None or (d.type == device.type and (device.index is None or d.index == device.index)):
                st = obj.untyped_storage()
                storages[(str(obj.device), st.data_ptr())] = st.nbytes()
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("ninfer"):
            stack.extend(getattr(obj, "__dict__", {}).values())
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    stack.append(getattr(obj, name))
    return storages


def resident_tensor_bytes(root: Any) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``root`` through containers and
    NInfer objects (a view counts its whole storage once: that is what stays allocated)."""
    return sum(_storages(root).values())


def released_weight_bytes(weights: Any, program: Any, device: torch.device) -> int:
    """Bytes on ``device`` held by the loaded ``weights`` that ``program`` does not keep: the stored
    originals of converted weights (and loader parents no kept view shares), freed when construction
    drops the loaded weights."""
    kept = _storages(program, device)
    return sum(n for key, n in _storages(weights, device).items() if key not in kept)


def runtime_free_bytes(device: torch.device, budget: DeviceBudget, probe: StartupProbe, *, pending_bytes: int,
                       released_bytes: int) -> int:
    """What stays free while serving (CUDA; module docstring): the device's free memory now (after
    returning the allocator's unused cache), capped by ``budget - held`` (held: how much the free memory
    fell since ``probe``), plus ``released_bytes`` (freed when construction returns) minus
    ``pending_bytes`` (the planned workspace, allocated by the first steps)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    held = probe.free_bytes - free
    return min(free, budget.budget_bytes - held) + released_bytes - pending_bytes


class StartupProbe:
    """Started before the first large allocation; :meth:`retained_bytes` after construction. On CUDA it
    also records the device's free memory then (``free_bytes``), the base of :func:`runtime_free_bytes`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        self.free_bytes = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0

    def retained_bytes(self, program: Any) -> int:
        """CUDA: growth of the caching allocator's reserved bytes (freed startup blocks it keeps count);
        CPU: the distinct storages of the Program's tensors (the host allocator returns the rest)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_reserved(self.device) - self._reserved
        return resident_tensor_bytes(program)


# -- a plan without loading (ninfer info --memory) ---------------------------------------------------
@dataclass(frozen=True)
class ArtifactProfile:
    """What the directory and the options determine: the profile for the resolved device and dtype."""

    profile: ModelProfile
    source: WeightSource
    device: torch.device
    dtype: torch.dtype
    max_context: int              # the option, capped at the model's positions
    lookahead: bool = False       # the architecture supports lookahead decode (ArchitectureSpec.lookahead)


def artifact_profile(artifact: str | os.PathLike, options: EngineOptions) -> ArtifactProfile:
    """The ModelProfile an engine started from ``artifact`` with ``options`` uses, reading only the
    artifact directory (no weight is loaded, no device memory is allocated)."""
    from ninfer.artifact import ArtifactReader
    from ninfer.engine.model_construction import resolve_device, resolve_dtype
    from ninfer.plugins import get_registry

    features = options.features()
    with ArtifactReader.open(artifact) as reader:
        text = reader.component("text")
        spec = get_registry().architecture(text.architecture)
        device = resolve_device(options)
        dtype = resolve_dtype(options, device)
        source = weight_source(reader, spec.parameter_specs(text.config, features))
        profile = spec.profile(text.config, features, dtype=dtype, stored_dtypes=source.stored_dtypes)
    max_context = options.max_context
    if profile.max_position_embeddings:
        max_context = min(max_context, profile.max_position_embeddings)
    return ArtifactProfile(profile, source, device, dtype, max_context, spec.lookahead)


def plan_artifact(artifact: str | os.PathLike, options: EngineOptions,
                  env: Mapping[str, str] | None = None) -> MemorySummary:
    """The MemorySummary an engine started from ``artifact`` with ``options`` would plan, without
    loading weights (the same rules as startup, read now)."""
    from ninfer.engine.model_construction import plan_num_pages

    options.validate()
    if options.purpose == "causal_scoring":
        options = dataclasses.replace(options, max_concurrency=1)
    a = artifact_profile(artifact, options)
    explicit = None
    if options.num_pages is not None or options.kv_budget_mib is not None:
        explicit = plan_num_pages(options, a.profile, a.max_context)
    from ninfer.engine.model_construction import graph_batches, lookahead_lanes

    plan = plan_startup(options, a.profile, a.max_context, device_budget(a.device, env),
                        load_bytes=a.source.load_bytes, num_pages=explicit,
                        graph_batches=graph_batches(a.device, options),
                        lookahead_slots=lookahead_lanes(a.device, options, a.lookahead))
    return plan.summary(a.dtype)
