"""Resolving EngineOptions for one artifact, once: :class:`ResolvedOptions`.

Every default and rule an engine applies to its options is applied here, and every later step (the
memory plan, Program construction, graph capture, the Engine) reads the result instead of deriving it
again:

- the purpose rules (:meth:`EngineOptions.for_purpose`: a causal_scoring engine runs one request at a time);
- the device (:func:`resolve_device`) and the activation dtype (:func:`resolve_dtype`);
- ``max_context`` capped at the model's positions;
- the prefill chunk (``EngineOptions.prefill_chunk``: the explicit value or the purpose's default);
- an explicitly sized KV pool (:func:`explicit_pages`: ``num_pages``, else ``kv_budget_mib`` worth);
- the decode CUDA graph sizes (:func:`graph_batches`) and the lookahead spares (:func:`lookahead_slots`);
- whether the engine runs its start-up warm-up (:func:`warmup_enabled`, decided by the Engine on the
  Program's device);
- whether the vision tower binds (:func:`resolve_vision`, from the artifact's components);
- the speculative backend named against the registered ones (:func:`check_speculative`) and the drafts per
  step (:func:`speculative_tokens`); a speculating engine captures no decode graphs and runs no lookahead.

The device and dtype come first because the model's profile (which the cap and the explicit pool need)
is computed for them; :func:`resolve_options` then takes that profile.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ninfer.contracts.architecture import ModelProfile, ProgramOptions
from ninfer.contracts.options import EngineOptions, InvalidEngineOptions

GRAPHS_ENV = "NINFER_CUDA_GRAPHS"
# The smallest prefill-graph bucket: a step of fewer tokens pads to it (its forward costs the same as 16 tokens').
MIN_PREFILL_GRAPH_TOKENS = 16

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


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


def explicit_pages(options: EngineOptions, profile: ModelProfile, max_context: int) -> int | None:
    """KV pages the user sized explicitly: ``num_pages``, else ``kv_budget_mib`` worth; None when neither is
    given (the memory plan's candidates choose). The pool must hold one full-context request, else the
    scheduler could not guarantee progress."""
    ps = options.page_size
    if options.num_pages is not None:
        pages = options.num_pages
    elif options.kv_budget_mib is not None:
        per_token = max(1, profile.kv_bytes_per_token)
        pages = int(options.kv_budget_mib * 2**20) // (per_token * ps)
    else:
        return None
    if pages * ps < max_context:
        raise InvalidEngineOptions(f"the KV pool of {pages} pages x {ps} tokens cannot hold one request of "
                                   f"max_context {max_context}")
    return pages


def prefill_graph_tokens(device: torch.device, options: EngineOptions, supported: bool = True) -> tuple[int, ...]:
    """The token buckets of the prefill-step graphs (``EngineOptions.prefill_graphs``): powers of two from
    :data:`MIN_PREFILL_GRAPH_TOKENS` up to the first that holds a step while streams decode (``max_step_tokens``,
    at most the prefill chunk); none when turned off, where no decode graphs are captured, for an architecture
    that runs no flat steps (``supported``: ``ArchitectureSpec.flat_steps``), or with speculation, vision or host
    experts."""
    if (not options.prefill_graphs or not supported or not graph_batches(device, options) or options.host_experts
            or options.speculative or options.num_speculative_tokens or options.vision):
        return ()
    top = min(options.step_tokens, options.prefill_chunk)
    buckets = [MIN_PREFILL_GRAPH_TOKENS]
    while buckets[-1] < top:
        buckets.append(2 * buckets[-1])
    return tuple(buckets)


def graph_batches(device: torch.device, options: EngineOptions) -> int:
    """How many graph sizes startup plans and captures (batch sizes 1..N): ``max_concurrency`` on CUDA for
    generation unless ``NINFER_CUDA_GRAPHS=0``, else 0. A speculating Program captures its verify graphs for those
    row counts instead of decode graphs (``Program.capture_decode_graphs`` says which it captures). With host
    experts (``EngineOptions.host_experts``) each graph is captured in segments around the host's share of every
    MoE layer (``ninfer.program.host_steps``)."""
    if device.type != "cuda" or options.purpose != "generation" or os.environ.get(GRAPHS_ENV, "1").strip() == "0":
        return 0
    return options.max_concurrency


def warmup_enabled(device: torch.device, options: EngineOptions) -> bool:
    """Whether the engine runs the start-up warm-up (``EngineOptions.warmup``): as asked, else on exactly for a
    generation engine on CUDA."""
    if options.purpose != "generation":
        return False
    if options.warmup is not None:
        return options.warmup
    return device.type == "cuda"


def lookahead_slots(device: torch.device, options: EngineOptions, supported: bool) -> int:
    """Lookahead-decode spare StateImage slots (``EngineOptions.lookahead``): ``max_concurrency`` when
    it is on, else 0. Forcing it on for an architecture without support, or beside speculative decoding
    (a verify commits a variable number of tokens: nothing to run ahead of), is an error naming both."""
    if options.purpose != "generation" or options.lookahead is False:
        return 0
    if options.speculative is not None:
        if options.lookahead:
            raise InvalidEngineOptions(f"invalid engine option lookahead=True: speculative decoding "
                                       f"(speculative={options.speculative!r}) runs no lookahead decode")
        return 0
    if not supported:
        if options.lookahead:
            raise InvalidEngineOptions("invalid engine option lookahead=True: this architecture's Program does "
                                       "not support lookahead decode")
        return 0
    if options.lookahead or (graph_batches(device, options) and not options.host_experts):
        return options.max_concurrency   # not on by default with host experts: each step waits for the host
    return 0


def resolve_vision(options: EngineOptions, components: Collection[str]) -> EngineOptions:
    """``options`` with ``vision`` decided for an artifact whose components are ``components``: None (auto) is on
    exactly when the artifact has a ``vision`` component, for a generation engine that does not speculate (the
    two are not combined yet); an explicit True without the component is an InvalidEngineOptions naming it."""
    has = "vision" in components
    if options.vision is None:
        on = has and options.purpose == "generation" and options.speculative is None
        return dataclasses.replace(options, vision=on)
    if options.vision and not has:
        raise InvalidEngineOptions(f"invalid engine option vision=True: the artifact has no vision tower (no "
                                   f"'vision' component; it has {', '.join(sorted(components))}): convert a "
                                   f"checkpoint with one, or start without vision")
    return options


def check_speculative(options: EngineOptions, backends: Mapping[str, Any] | None = None) -> None:
    """``options.speculative`` against the registered speculative backends (``backends``: name ->
    SpeculativeBackendSpec; None: the plugin registry's). None and a registered name pass; an unregistered
    name is an InvalidEngineOptions listing the registered ones. Reads no artifact, so callers run it before
    any conversion (whether the artifact has the backend's component is checked when parameters are bound)."""
    name = options.speculative
    if name is None:
        return
    if backends is None:
        from ninfer.plugins import get_registry

        backends = get_registry().speculative_backends
    if name not in backends:
        known = ", ".join(sorted(backends)) or "none"
        raise InvalidEngineOptions(f"invalid engine option speculative={name!r}: no installed plugin registers this "
                                   f"speculative backend (registered: {known}; 'ninfer plugins' lists them)")


#: Drafts per speculative step when ``num_speculative_tokens`` is not given. Each draft costs one MTP layer
#: step and one more verified position; acceptance falls with the draft's depth, so beyond a few drafts a
#: verify mostly computes tokens it throws away. Three is the depth the Qwen3.5 model cards recommend.
DEFAULT_SPECULATIVE_TOKENS = 3


def speculative_tokens(options: EngineOptions, default: int = 0) -> int:
    """Drafts per speculative decode row: 0 without ``speculative``, else ``num_speculative_tokens``, or
    ``default`` (the backend's own for the artifact, ``ModelProfile.default_speculative_tokens``; 0: none), or
    :data:`DEFAULT_SPECULATIVE_TOKENS`."""
    if options.speculative is None or options.purpose != "generation":
        return 0
    return options.num_speculative_tokens or default or DEFAULT_SPECULATIVE_TOKENS


@dataclass(frozen=True)
class ResolvedOptions:
    """EngineOptions with every rule of the module docstring applied for one artifact.

    Invariants: ``options`` is validated and under its purpose's rules; ``options.device`` /
    ``options.dtype`` name ``device`` / ``dtype``; ``options.max_context`` is at most the model's positions;
    ``options.prefill_chunk_size`` is the resolved chunk; ``options.num_pages`` / ``kv_budget_mib`` are as
    given (the memory plan names the rule that sized the pool from them). ``explicit_pages`` is the pool
    they size (None: automatic); ``graph_batches`` the decode graphs captured for batch sizes
    1..graph_batches (0: none); ``prefill_graph_tokens`` the prefill-step graphs' token buckets (empty: none);
    ``lookahead_slots`` the lookahead spares (0: lookahead off);
    ``speculative_tokens`` the drafts per speculative decode row (0: no speculation; > 0: no lookahead, and
    the graphs are the Program's verify graphs)."""

    options: EngineOptions
    device: torch.device
    dtype: torch.dtype
    explicit_pages: int | None
    graph_batches: int
    lookahead_slots: int
    speculative_tokens: int = 0
    prefill_graph_tokens: tuple[int, ...] = ()

    def program_options(self, num_pages: int) -> ProgramOptions:
        """The Program's physical sizing with a KV pool of ``num_pages`` pages."""
        o = self.options
        return ProgramOptions(device=self.device, dtype=self.dtype, max_sequences=o.max_concurrency,
                              page_size=o.page_size, num_pages=num_pages, max_context=o.max_context,
                              checkpoint_slots=o.checkpoint_slots, lookahead_slots=self.lookahead_slots,
                              speculative_tokens=self.speculative_tokens,
                              prefill_graph_tokens=self.prefill_graph_tokens)

    def engine_options(self, num_pages: int) -> EngineOptions:
        """The effective EngineOptions an engine serving ``num_pages`` KV pages reports and runs with."""
        return dataclasses.replace(self.options, num_pages=num_pages)


def resolve_options(options: EngineOptions, *, device: torch.device, dtype: torch.dtype,
                    profile: ModelProfile, lookahead_supported: bool,
                    flat_steps_supported: bool = False) -> ResolvedOptions:
    """Resolve validated ``options`` (module docstring) for a model with ``profile`` on ``device`` in
    ``dtype`` (from :func:`resolve_device` / :func:`resolve_dtype`); ``lookahead_supported``: the
    architecture's Program supports lookahead decode (``ArchitectureSpec.lookahead``); ``flat_steps_supported``:
    it runs flat steps, so prefill-step graphs (``ArchitectureSpec.flat_steps``)."""
    check_speculative(options)
    options = options.for_purpose()
    max_context = options.max_context
    if profile.max_position_embeddings:
        max_context = min(max_context, profile.max_position_embeddings)
    pages = explicit_pages(options, profile, max_context)
    spares = lookahead_slots(device, options, lookahead_supported)
    drafts = profile.default_speculative_tokens
    resolved = dataclasses.replace(options, device=str(device), dtype=str(dtype).removeprefix("torch."),
                                   max_context=max_context, prefill_chunk_size=options.prefill_chunk,
                                   num_speculative_tokens=speculative_tokens(options, drafts) or None)
    return ResolvedOptions(options=resolved, device=device, dtype=dtype, explicit_pages=pages,
                           graph_batches=graph_batches(device, options), lookahead_slots=spares,
                           speculative_tokens=speculative_tokens(options, drafts),
                           prefill_graph_tokens=prefill_graph_tokens(device, options, flat_steps_supported))
