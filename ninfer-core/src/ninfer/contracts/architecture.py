"""What an architecture plugin registers: :class:`ArchitectureSpec`.

The engine dispatches on ``ArchitectureSpec.name`` once, at construction; after that it talks to
the Program it created and to the Frontend, never to the spec again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ninfer.contracts.features import StartupFeatures

if TYPE_CHECKING:  # annotations only: plugins import this module at registration, before any model runs
    import torch


@dataclass(frozen=True)
class ParameterSpec:
    """One logical parameter a selected feature needs.

    ``name`` is the artifact binding name (e.g. ``text/layers/3/attention/qkv``); ``shape`` is its
    logical shape, derived from config by the architecture (never from the objects); the binder
    checks the binding covers exactly ``prod(shape)`` elements. ``placement``: ``"device"`` (the run
    device) or ``"host"`` (loaded into CPU memory whatever the run device: a table too large for the
    device of which a step reads a few rows; the planner counts it as host memory).
    """

    name: str
    shape: tuple[int, ...]
    component: str = "text"
    placement: str = "device"

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"parameter {self.name!r}: placement must be one of {PLACEMENTS}, got {self.placement!r}")


#: Where a parameter is loaded: the run device, or host (CPU) memory.
PLACEMENTS = ("device", "host")


@dataclass(frozen=True)
class ModelProfile:
    """Address-free sizes the planner needs before any large read (docs/design.md section 7), for one run
    (activation) dtype and the artifact's stored formats.

    Exact (equal to the nbytes of the tensors the Program allocates): ``weight_bytes`` (resident
    weights and constants derived from them, tied tensors once), ``converted_weight_bytes`` (the part
    of them created at construction from stored weights of another dtype, while the stored originals
    are still held), ``kv_bytes_per_token``, ``state_bytes_per_sequence`` and ``host_weight_bytes`` (the
    parameters placed in host memory, ``ParameterSpec.placement == "host"``, as the Program holds them; not part
    of ``weight_bytes``, which is what the run device holds).
    Estimates of one step's transient workspace: ``activation_bytes_per_token`` (per step token, the
    widest layer plus the residual stream), ``attention_bytes_per_context_token`` (what one attention
    call gathers per cached token), ``score_bytes_per_query_key`` (live attention scores).
    Compute counts (benchmark ratios): ``matmul_params_per_token`` (weight elements one token
    multiplies: no embedding lookup, no LM head, MoE counts its routed top-k), ``head_params`` (the LM
    head, multiplied only by rows that sample), ``mixer_flops_per_token`` (context-free sequence mixing,
    e.g. a linear-attention recurrence) and ``attention_flops_per_query_key`` (over attention layers).
    Parts of ``weight_bytes`` a decode step reads only in part (benchmark byte counts; 0 = read whole):
    ``embedding_bytes`` (an input table read one row per token; 0 when it is also the tied LM head) and
    ``routed_expert_bytes`` (all MoE layers' routed experts, of which a row reads ``experts_per_token`` of
    ``num_experts`` per layer), over ``moe_layers`` MoE layers. ``routed_experts_on_host``: routed experts are placed
    in host memory (all of them, or all but some whole layers'; part of ``host_weight_bytes``, not of
    ``weight_bytes``). ``host_read_bytes``: the part of ``host_weight_bytes`` the decode byte accounting counts as if
    the device read it (host routed experts, a host input embedding); ``embedding_bytes`` and
    ``routed_expert_bytes`` still count their tables whole, wherever they are.
    ``encoder_bytes_per_row`` (0: no encoder bound): an estimate of the transient bytes of one encoder call per
    input row (an image patch), its attention's live scores included, valid for a call of up to
    ``EngineOptions.max_encode_rows`` rows; the planner reserves it for that many rows.
    ``default_speculative_tokens``: the drafts per step of the selected speculative backend when the options name
    none (e.g. a block drafter's checkpoint block size - 1); 0: the engine's default.
    """

    weight_bytes: int
    kv_bytes_per_token: int           # summed over attention layers, K and V
    state_bytes_per_sequence: int     # one StateImage (all GDN layers, conv + recurrent)
    vocab_size: int
    max_position_embeddings: int
    converted_weight_bytes: int = 0
    activation_bytes_per_token: int = 0
    attention_bytes_per_context_token: int = 0
    score_bytes_per_query_key: int = 0
    matmul_params_per_token: int = 0
    head_params: int = 0
    mixer_flops_per_token: int = 0
    attention_flops_per_query_key: int = 0
    embedding_bytes: int = 0
    routed_expert_bytes: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    encoder_bytes_per_row: int = 0
    default_speculative_tokens: int = 0
    host_weight_bytes: int = 0
    routed_experts_on_host: bool = False
    moe_layers: int = 0
    host_read_bytes: int = 0


@dataclass(frozen=True)
class ProgramOptions:
    """Physical sizing of one Program. Invariant: max_sequences >= the engine's max_concurrency.
    ``checkpoint_slots``: StateImage slots for context-cache checkpoints (0: no checkpoints).
    ``lookahead_slots``: extra StateImage slots held as lookahead-decode spares (0: no lookahead;
    given only to an architecture that declares ``ArchitectureSpec.lookahead``, see
    ``ninfer.program.lookahead``). ``speculative_tokens``: the most drafts a speculative decode row may
    verify (``DecodeRow.drafts``; 0: the Program does not speculate and is built exactly as without it);
    only an architecture with a drafter accepts more than 0. ``prefill_graph_tokens``: the token buckets of the
    prefill-step CUDA graphs to capture beside the decode graphs (``ninfer.program.prefill_graphs``; empty: none;
    a Program whose architecture cannot run flat steps captures none)."""

    device: torch.device
    dtype: torch.dtype
    max_sequences: int
    page_size: int
    num_pages: int
    max_context: int
    checkpoint_slots: int = 0
    lookahead_slots: int = 0
    speculative_tokens: int = 0
    prefill_graph_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class ProgramInit:
    """Everything ``ArchitectureSpec.create_program`` receives. ``weights`` are read-only views."""

    config: Mapping[str, Any]
    weights: Mapping[str, torch.Tensor]
    ops: Any  # ninfer.ops.registry.OpSet
    options: ProgramOptions
    features: StartupFeatures = field(default_factory=StartupFeatures)


@dataclass(frozen=True)
class ArchitectureSpec:
    """An architecture as registered through the ``ninfer_architectures`` hook.

    - ``parameter_specs(config, features)``: every logical parameter the features bind.
    - ``profile(config, features, dtype=None, stored_dtypes=None, packed_bytes=None)``: the address-free
      :class:`ModelProfile` for run dtype ``dtype`` (None: bfloat16) and the artifact's stored dtype
      of each parameter name (None: every parameter stored in ``dtype``; ``torch.uint8`` for a quantized format).
      ``packed_bytes`` (None: none) gives each quantized parameter's held bytes
      (``ninfer.planning.planner.WeightSource.packed_bytes``): a Program keeps packed weights as loaded, so these,
      not the parameter's shape, are what it holds for them.
    - ``create_program(init)``: a Program (``ninfer.contracts.program.Program``; an architecture subclasses
      ``ninfer.program.model.ModelProgram``).
    - ``summarize_config(config)``: a few lines for ``ninfer info``.
    - ``frontend``: the name of the frontend family (a ``ninfer_frontends`` registration) the artifact's
      resources are read with.
    - ``lookahead``: the one declaration of lookahead decode support (``ninfer.program.lookahead``): its
      Program's decode forward reads each row's state from ``decode_slots`` and rewrites every StateImage
      field of ``decode_out_slots``. Only then does the engine give it ``ProgramOptions.lookahead_slots``
      (and plan their memory).
    - ``flat_steps``: the one declaration that its Program can run flat padded steps (``ModelProgram.flat_steps``,
      ``ninfer.program.flat_batch``) for some features: only then does the engine plan and ask for prefill-step
      graphs (``ProgramOptions.prefill_graph_tokens``); the Program may still decline them for features it cannot
      run flat (it then captures none and leaves its padding slot unheld).
    """

    name: str
    family: str
    parameter_specs: Callable[[Mapping[str, Any], StartupFeatures], list[ParameterSpec]]
    profile: Callable[..., ModelProfile]
    create_program: Callable[[ProgramInit], Any]
    summarize_config: Callable[[Mapping[str, Any]], dict[str, Any]]
    frontend: str
    lookahead: bool = False
    flat_steps: bool = False
