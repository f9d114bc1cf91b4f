"""Startup planning (DESIGN.md section 7): the device budget, the KV capacity candidates, the plan.

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
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ninfer.errors import NInferError
from ninfer.runtime.contract.architecture import ModelProfile
from ninfer.runtime.contract.memory import MemorySummary
from ninfer.runtime.engine.options import EngineOptions, InvalidEngineOptions

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

    @property
    def runtime_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.state_bytes + self.workspace_bytes + self.graph_bytes

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
                 load_bytes: int, num_pages: int | None = None, graph_batches: int = 0) -> StartupPlan:
    """Plan weights + KV/State + workspace (+ the decode graphs' pool for ``graph_batches`` batch sizes)
    under ``budget`` (module docstring). ``num_pages``: an explicitly sized pool (checked, not changed);
    None lets the candidates choose."""
    ps = options.page_size
    lanes = options.max_concurrency
    scoring = options.purpose == "causal_scoring"
    work = workspace_bytes(profile, step_tokens=options.prefill_chunk_size + lanes,
                           logit_rows=lanes + (options.prefill_chunk_size if scoring else 0),
                           max_context=max_context)
    state = (lanes + options.checkpoint_slots) * profile.state_bytes_per_sequence  # + context-cache checkpoints
    graphs = graph_pool_bytes(profile, graph_batches, max_context)
    runtime_fixed = profile.weight_bytes + state + work + graphs
    startup_fixed = load_bytes + profile.converted_weight_bytes + state
    room = budget.budget_bytes - budget.headroom_bytes - max(runtime_fixed, startup_fixed)
    page_bytes = ps * profile.kv_bytes_per_token
    one_request = -(-max_context // ps)

    def why() -> str:
        return (f"budget {_mib(budget.budget_bytes)} [{budget.source}] - headroom {_mib(budget.headroom_bytes)} "
                f"- max(runtime: weights {_mib(profile.weight_bytes)} + State {_mib(state)} ({lanes} lanes + "
                f"{options.checkpoint_slots} checkpoints) + workspace {_mib(work)} + graphs {_mib(graphs)}, startup: stored weights {_mib(load_bytes)} + converted "
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
                       startup_peak_bytes=startup_fixed + kv, kv_candidate=candidate, graph_bytes=graphs)


# -- measuring what startup left --------------------------------------------------------------------
def resident_tensor_bytes(root: Any) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``root`` through containers and
    NInfer objects (a view counts its whole storage once: that is what stays allocated)."""
    storages: dict[tuple[str, int], int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
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
    return sum(storages.values())


class StartupProbe:
    """Started before the first large allocation; :meth:`retained_bytes` after construction."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0

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


def artifact_profile(artifact: str | os.PathLike, options: EngineOptions) -> ArtifactProfile:
    """The ModelProfile an engine started from ``artifact`` with ``options`` uses, reading only the
    artifact directory (no weight is loaded, no device memory is allocated)."""
    from ninfer.artifact import ArtifactReader
    from ninfer.plugins import get_registry
    from ninfer.runtime.engine.model_construction import resolve_device, resolve_dtype

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
    return ArtifactProfile(profile, source, device, dtype, max_context)


def plan_artifact(artifact: str | os.PathLike, options: EngineOptions,
                  env: Mapping[str, str] | None = None) -> MemorySummary:
    """The MemorySummary an engine started from ``artifact`` with ``options`` would plan, without
    loading weights (the same rules as startup, read now)."""
    from ninfer.runtime.engine.model_construction import plan_num_pages

    options.validate()
    if options.purpose == "causal_scoring":
        options = dataclasses.replace(options, max_concurrency=1)
    a = artifact_profile(artifact, options)
    explicit = None
    if options.num_pages is not None or options.kv_budget_mib is not None:
        explicit = plan_num_pages(options, a.profile, a.max_context)
    from ninfer.runtime.engine.model_construction import graph_batches

    plan = plan_startup(options, a.profile, a.max_context, device_budget(a.device, env),
                        load_bytes=a.source.load_bytes, num_pages=explicit,
                        graph_batches=graph_batches(a.device, options))
    return plan.summary(a.dtype)
