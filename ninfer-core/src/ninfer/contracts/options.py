"""EngineOptions: everything fixed at engine start."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ninfer.contracts.features import Purpose, StartupFeatures
from ninfer.contracts.field_types import normalize_fields, type_problem
from ninfer.errors import NInferError

MAX_CONCURRENCY_LIMIT = 8
#: The most tokens a speculative step may draft per row (``EngineOptions.num_speculative_tokens``): a block
#: drafter's block of 16 (the published DFlash checkpoints') drafts 15.
MAX_SPECULATIVE_TOKENS = 15
# The largest KV page in tokens (a request holds whole pages; vLLM's largest block is 256).
MAX_PAGE_SIZE = 1024
# Prefill chunk defaults (``EngineOptions.prefill_chunk``). Generation: each chunk pays tens of host launches per
# layer, so small chunks leave a large GPU host-bound; 8,192 was the fastest size measured, with little gain over
# 4,096 (the sweep is in docs/dev/perf-log.md). vLLM and SGLang also default to 8,192-token batches on this class
# of GPU. Scoring keeps 2,048: each of its chunks materialises [chunk, vocab] fp32 logits (2 GiB at a 248k vocabulary).
GENERATION_PREFILL_CHUNK = 8192
SCORING_PREFILL_CHUNK = 2048
# With host experts the chunk's workspace competes with the experts kept on the device (each whole layer of them
# a host step less per token), so generation keeps 2,048 there: the chunk every host-expert figure was measured with.
HOST_EXPERTS_PREFILL_CHUNK = 2048
# Step token budget default (``EngineOptions.max_step_tokens``): while streams are decoding, every step's tokens
# (decode rows + prefill chunks) delay their next token, so this bounds a running stream's inter-token stall
# while prompts prefill; a larger budget prefills faster (better TTFT) and stalls longer. With prefill-step graphs
# (whose buckets are powers of two, so a budget between two costs the larger's step), 256 is the largest budget
# that keeps a stream's p99 gap under 3x its p50 while a long prompt arrives among running streams, at the same
# burst TTFT and throughput as 512 (docs/memory.md, "Prefill and decode in one step", has the measured curve).
DEFAULT_MAX_STEP_TOKENS = 256
# With host experts a step that prefills copies to the device (or computes on the host) most of the experts its
# chunk routes to, whatever its token count, so a smaller budget only multiplies such steps: they keep 2,048.
HOST_EXPERTS_MAX_STEP_TOKENS = 2048
# Encoder budget default (``EngineOptions.max_encode_rows``): the most encoder input rows (image patches) one step
# encodes, and so the largest single frame (an image, or one temporal patch of a video) a request may carry. 16,384
# patches of 16 x 16 pixels are 4.2 megapixels (2048 x 2048); through Qwen3.5's 27-layer tower that is about the
# compute of a 2,048-token step of a 9B text model, and the planner reserves its workspace (docs/vision.md).
DEFAULT_MAX_ENCODE_ROWS = 16384
# How the host computes host experts (``EngineOptions.host_expert_kernel``); the first is the default: on a GPU
# run the native kernel where it builds, else torch's GEMMs; on the CPU torch's (the reference op, bitwise).
HOST_EXPERT_KERNELS = ("auto", "torch", "compiled", "native")


class InvalidEngineOptions(NInferError):
    """An EngineOptions value is out of range; the message names it."""


@dataclass(frozen=True)
class EngineOptions:
    """Startup options of one engine. Invariants checked by :meth:`validate`:

    - ``1 <= max_concurrency <= 8``: requests running at once (in prefill, Replay or decode).
    - ``queue_capacity >= 0``: waiting requests beyond those running. Outstanding capacity is
      ``max_concurrency + queue_capacity`` handles (paused and finished-but-unreleased ones count).
    - ``queue_timeout_s``: None waits forever, else a request still waiting after it is rejected.
    - ``max_context``: the longest ledger (prompt + output) a request may reach.
    - KV sizing: ``num_pages`` wins; else ``kv_budget_mib``; else enough pages for every running request to hold
      ``max_context`` tokens. Either way the pool must hold one full ``max_context`` request.
    - ``prefill_chunk_size``: the most prompt/Replay tokens one engine step processes (its chunks of one or
      several requests together); None (default): 8,192 for generation (2,048 with host experts), 2,048 for
      causal scoring (:attr:`prefill_chunk` is the resolved value). A larger value prefills faster (fewer host launches
      per token); while decode rows run, ``max_step_tokens`` bounds a step further.
    - ``max_step_tokens`` (>= 1): the most tokens one engine step computes while decode rows are running:
      its decode rows (one token each) plus prefill/Replay chunks of as many other requests as fit (a long
      prompt is chunked across steps). A step with no decode row may use ``prefill_chunk`` tokens (nothing
      is stalled then). None (default): 512, or 2,048 with host experts (:attr:`step_tokens` is the
      resolved value). Smaller:
      shorter stalls of running streams while prompts arrive, slower TTFT for bursts and long prompts;
      larger favours TTFT (batch jobs): ``prefill_chunk + max_concurrency`` or more gives prefill the whole
      ``prefill_chunk`` beside running decode rows, as before this option. When the decode rows alone fill
      the budget, a chunk still gets one token a step, so prefill never stops.
    - ``admission_bypass``: how many times later requests may overtake the queue head that does not
      fit yet (bounded bypass); 0 is strict FIFO.
    - ``device``: None picks cuda when CUDA is present, else cpu. ``dtype`` (float32, bfloat16,
      float16): None picks bfloat16 on CUDA and float32 on the CPU (the model casts its weights).
    - ``purpose``: ``generation`` or ``causal_scoring`` (offline scoring, ``Engine.score``). A scoring
      engine runs one window at a time: its effective ``max_concurrency`` is 1 (:meth:`for_purpose`;
      the Program is sized for one sequence), ``max_context`` is the longest scoring window, the queue
      and admission fields are unused, and it has no context cache.
    - ``context_cache``: keep checkpoints (StateImage copy + shared KV prefix) of finished prefills
      and responses, and bind a new request to the longest one that is an exact prefix of its prompt
      (docs/context-cache.md). None (default): on for ``generation``, off for ``causal_scoring``
      (:attr:`uses_context_cache` is the resolved value; :meth:`for_purpose` writes it in); True on a
      causal_scoring engine is an error. An Engine built by hand on a Program without checkpoint slots
      turns the default off; an explicit True there is an error. ``cache_checkpoint_slots`` (>= 1; None: ``16 + 2 * max_concurrency``)
      StateImages hold checkpoints; ``cache_checkpoint_interval`` (a multiple of ``page_size``; None:
      the largest multiple of ``page_size`` not above :attr:`prefill_chunk`, at least one
      page) is the prefill distance between boundary checkpoints. ``cache_host_mib`` (>= 0; None and 0:
      no Host tier) is the Host tier's budget: checkpoints and pause Snapshots demoted from the device
      (pinned memory on CUDA, allocated on demand). Without it pressure drops checkpoints and pauses are
      Replay only. It is opt-in because a demotion allocates and copies on the engine thread, which every
      running stream waits for (docs/context-cache.md, Host tier).
    - ``lookahead`` (lookahead decode, ``ninfer.program.lookahead``): launch the next decode step from
      the device-side tokens before the host has this step's, so the host's per-step work overlaps the
      GPU. None: on exactly when decode CUDA graphs are captured (CUDA generation, and the
      architecture supports it); True forces it on (also on the CPU, where it only costs: for tests);
      False turns it off. It costs ``max_concurrency`` more StateImage slots of device memory.
    - ``speculative``: None (default, off) or the name of a registered speculative decoding backend
      (``ninfer_speculative_backends``, e.g. ``"mtp"``); a generation engine only. ``num_speculative_tokens``
      (``1..15``): tokens drafted per row and step; None: the backend's own default for the artifact (a block
      drafter's block size - 1), else 3 (``DEFAULT_SPECULATIVE_TOKENS``), filled in when options are resolved;
      given without ``speculative`` it is an error. The name is checked against the registered
      backends when options are resolved (``ninfer.planning.resolution.check_speculative``, also at
      ``Engine.start`` before any conversion): an unregistered name is an InvalidEngineOptions listing the
      registered ones. Speculation changes how many tokens a step commits, never which (docs/speculative.md);
      it turns decode graphs and lookahead off (``lookahead=True`` with it is an error).
    - ``vision``: bind the model's vision tower (images and videos in prompts, docs/vision.md). None (default):
      on when the artifact has a ``vision`` component, for a generation engine without speculative decoding;
      True requires the component (an error otherwise, as is True beside ``speculative`` or on a causal_scoring
      engine); False never binds it (less memory; a request with media is then refused).
      ``max_encode_rows`` (>= 1; None: 16,384, :attr:`encode_rows`): the most encoder input rows (image
      patches) one engine step encodes. A request's media are encoded step by step within it, one frame (an
      image, or a video's temporal patch) at a time at the least, so a large image delays other streams by at
      most this much encoder work; a frame larger than it is refused at submit. The planner reserves the
      encoder's workspace for it.
    - ``vram_budget_mib`` (> 0; None: ``NINFER_VRAM_BUDGET_MIB``, else the device's free memory): the most device
      memory the engine plans to use (weights, KV and State, workspace, graphs; ``ninfer.planning.budget``).
    - ``host_experts``: where a MoE model's routed expert banks live (docs/memory.md, "Host experts"). True: in
      host memory, computed by the CPU (a step copies the layer's hidden rows and routing to the host and the
      routed experts' sum back; the router, shared expert and everything else stay on the device); False: on
      the device. None (default): on the device when the model and one ``max_context`` request fit the budget,
      else in host memory. With host experts a step waits for the host in every MoE layer, so lookahead is off
      by default and the decode CUDA graphs are captured in segments around those waits. An architecture without routed experts ignores None and refuses True.
      ``device_expert_layers`` (>= 0): with host experts, the last this many MoE layers keep all their experts on
      the device (no host step for them; llama.cpp's ``--n-cpu-moe`` names the complement). None (default): as
      many whole layers as the device budget has room for once the weights and the KV and State of
      ``max_concurrency`` requests at ``max_context`` are planned, at least one layer staying on the host; 0: none.
      ``expert_cache_slots`` (>= 0): with host experts, per host MoE layer this many experts are also kept on the
      device, chosen by observed routing (counts with decay, refreshed as the layer runs); a routed pair whose
      expert is cached is computed on the device, the rest on the host. Counted as device weights. None
      (default): with an ``expert_routing_file`` (the record of the layers' routing that warms the caches, or that
      this run writes), as many as the room left after the whole device layers holds (at most every expert);
      without one, none (with routing that has no favourites a cache of a few percent of the experts measured
      slower than none); 0: none.
      ``expert_copy_min_tokens`` (>= 1): with host experts, an uncached expert that one layer call routes at least
      this many tokens to is copied to the device and computed there instead of on the host. None (default): the
      busiest uncached experts of each call, as many as balances the copy engine against the host (both run at
      once), from the host-to-device bandwidth and the host's expert rate measured at start on a GPU; never on
      the CPU (one memory). ``host_expert_threads`` (>= 1): the host's compute threads for host experts on a GPU
      run (None, default: one a physical core this process may use; on the CPU torch's own count is kept).
      ``host_expert_kernel``: how the host computes its experts: "auto" (None, default: "native" on a GPU run where
      the host's C compiler builds it, else "torch"), "torch" (two torch GEMMs an expert, bitwise the reference op on the CPU), "compiled" (one torch.compile-generated CPU kernel for all of a call's experts, within
      accumulation-order tolerance; compiled at start, which needs a C++ toolchain) or "native" (the
      architecture's own C kernel, each expert read once for all of its tokens and quantized banks read as
      stored; within accumulation-order tolerance; built at start with the host's C compiler).
      ``expert_routing_file`` (a path): with an expert cache, read at start when it exists (the caches start
      with the experts it counts most) and written at close with its counts plus this run's
      (``ninfer.engine.expert_routing``); a scoring engine only reads it. Ignored, with a warning, without an
      expert cache.
    - ``warmup`` (start-up warm-up, ``ninfer.program.warmup``): before the engine serves, run its step paths
      over synthetic sequences (every token-count class up to the prefill chunk, several chunks per step, decode
      rows beside chunks, constrained, sampled, penalised and logprob rows, lookahead, speculative rows,
      checkpoints) so no kernel compiles while serving; it leaves nothing behind. None: on for a generation
      engine on CUDA, off otherwise (on the CPU nothing compiles: it would only cost); True forces it on (also
      on the CPU, for tests), False off. True on a causal_scoring engine is an error.
    - ``prefill_graphs`` (default True): also capture CUDA graphs of the steps that prefill, one per token bucket
      (powers of two from 16 up to the step token budget), over the flat padded layout
      (``ninfer.program.prefill_graphs``); a step that fits a bucket replays it instead of launching its layers
      (a burst's first tokens and a step's stall of running streams both shorten: docs/memory.md, "Prefill and
      decode in one step"). Only where decode graphs are captured, and not with speculative decoding, vision or
      host experts (there it is ignored); an architecture that cannot run flat steps
      (``ArchitectureSpec.flat_steps``) captures none. False: such steps launch their layers eagerly.
    """

    max_concurrency: int = 4
    queue_capacity: int = 64
    queue_timeout_s: float | None = None
    max_context: int = 4096
    purpose: Purpose = "generation"
    device: str | None = None
    dtype: str | None = None
    page_size: int = 16
    num_pages: int | None = None
    kv_budget_mib: float | None = None
    prefill_chunk_size: int | None = None
    max_step_tokens: int | None = None
    context_cache: bool | None = None
    cache_checkpoint_slots: int | None = None
    cache_checkpoint_interval: int | None = None
    cache_host_mib: float | None = None
    admission_bypass: int = 2
    vision: bool | None = None
    max_encode_rows: int | None = None
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    lookahead: bool | None = None
    warmup: bool | None = None
    vram_budget_mib: float | None = None
    host_experts: bool | None = None
    device_expert_layers: int | None = None
    expert_cache_slots: int | None = None
    expert_copy_min_tokens: int | None = None
    host_expert_threads: int | None = None
    host_expert_kernel: str | None = None
    expert_routing_file: str | None = None
    prefill_graphs: bool = True

    def __post_init__(self) -> None:
        normalize_fields(self)   # numpy scalars, a torch.device: Python's own types

    def validate(self) -> EngineOptions:
        def bad(name: str, why: str) -> InvalidEngineOptions:
            return InvalidEngineOptions(f"invalid engine option {name}={getattr(self, name)!r}: {why}")

        for f in dataclasses.fields(self):   # first: the range checks below assume these types
            why = type_problem(getattr(self, f.name), f.type)
            if why is not None:
                raise bad(f.name, why)
        if not 1 <= self.max_concurrency <= MAX_CONCURRENCY_LIMIT:
            raise bad("max_concurrency", f"must be in 1..{MAX_CONCURRENCY_LIMIT}")
        if self.queue_capacity < 0:
            raise bad("queue_capacity", "must be >= 0")
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise bad("queue_timeout_s", "must be > 0 or None")
        if self.max_context < 2:
            raise bad("max_context", "must be >= 2 (one prompt and one output token)")
        if not 1 <= self.page_size <= MAX_PAGE_SIZE:
            # A request holds whole pages: a huge page reserves that many token slots for every short request.
            raise bad("page_size", f"must be in 1..{MAX_PAGE_SIZE} (tokens per KV page)")
        if self.num_pages is not None and self.num_pages < 1:
            raise bad("num_pages", "must be >= 1")
        if self.kv_budget_mib is not None and not self.kv_budget_mib > 0:
            raise bad("kv_budget_mib", "must be > 0")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise bad("prefill_chunk_size", "must be >= 1 or None")
        if self.max_step_tokens is not None and (isinstance(self.max_step_tokens, bool)
                                                 or not isinstance(self.max_step_tokens, int)
                                                 or self.max_step_tokens < 1):
            raise bad("max_step_tokens", "must be an int >= 1 or None")
        if self.admission_bypass < 0:
            raise bad("admission_bypass", "must be >= 0")
        if self.purpose not in ("generation", "causal_scoring"):
            raise bad("purpose", "must be 'generation' or 'causal_scoring'")
        if self.purpose == "causal_scoring" and self.context_cache:
            raise bad("context_cache", "a causal_scoring engine keeps no context cache")
        if self.cache_checkpoint_slots is not None and self.cache_checkpoint_slots < 1:
            raise bad("cache_checkpoint_slots", "must be >= 1 or None")
        if self.cache_checkpoint_interval is not None and (
                self.cache_checkpoint_interval < 1 or self.cache_checkpoint_interval % self.page_size):
            raise bad("cache_checkpoint_interval", f"must be a positive multiple of page_size {self.page_size}")
        if self.cache_host_mib is not None and not self.cache_host_mib >= 0:
            raise bad("cache_host_mib", "must be >= 0 or None")
        if self.purpose == "causal_scoring" and self.lookahead:
            raise bad("lookahead", "a causal_scoring engine runs no decode steps")
        if self.purpose == "causal_scoring" and self.warmup:
            raise bad("warmup", "a causal_scoring engine runs no generation steps to warm up")
        if self.speculative is not None and (not isinstance(self.speculative, str) or not self.speculative):
            raise bad("speculative", "must be a speculative backend name or None")
        if self.num_speculative_tokens is not None:
            k = self.num_speculative_tokens
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
                raise bad("num_speculative_tokens", f"must be an int in 1..{MAX_SPECULATIVE_TOKENS} or None")
            if self.speculative is None:
                raise bad("num_speculative_tokens", "needs speculative (a backend name): nothing is drafted without it")
        if self.purpose == "causal_scoring" and self.speculative is not None:
            raise bad("speculative", "a causal_scoring engine runs no decode steps")
        if self.vision is not None and not isinstance(self.vision, bool):
            raise bad("vision", "must be True, False or None (auto: on when the artifact has a vision tower)")
        if self.vision and self.purpose == "causal_scoring":
            raise bad("vision", "a causal_scoring engine scores text only")
        if self.vision and self.speculative is not None:
            raise bad("vision", f"vision with speculative decoding (speculative={self.speculative!r}) is not "
                                f"supported yet: start without one of them (--no-vision, or no --speculative)")
        if self.max_encode_rows is not None and (isinstance(self.max_encode_rows, bool)
                                                 or not isinstance(self.max_encode_rows, int)
                                                 or self.max_encode_rows < 1):
            raise bad("max_encode_rows", "must be an int >= 1 or None")
        if self.vram_budget_mib is not None and (isinstance(self.vram_budget_mib, bool)
                                                 or not isinstance(self.vram_budget_mib, int | float)
                                                 or not self.vram_budget_mib > 0):
            raise bad("vram_budget_mib", "must be a number of MiB > 0 or None")
        if self.host_experts is not None and not isinstance(self.host_experts, bool):
            raise bad("host_experts", "must be True, False or None (auto: on the host when the model does not fit)")
        if self.expert_cache_slots is not None and (isinstance(self.expert_cache_slots, bool)
                                                    or not isinstance(self.expert_cache_slots, int)
                                                    or self.expert_cache_slots < 0):
            raise bad("expert_cache_slots", "must be an int >= 0 or None (auto: what the budget has room for)")
        if self.expert_copy_min_tokens is not None and (isinstance(self.expert_copy_min_tokens, bool)
                                                        or not isinstance(self.expert_copy_min_tokens, int)
                                                        or self.expert_copy_min_tokens < 1):
            raise bad("expert_copy_min_tokens", "must be an int >= 1 or None (auto: a cost model measured at start)")
        if self.host_expert_threads is not None and (isinstance(self.host_expert_threads, bool)
                                                     or not isinstance(self.host_expert_threads, int)
                                                     or self.host_expert_threads < 1):
            raise bad("host_expert_threads", "must be an int >= 1 or None (auto: one a physical core)")
        if self.host_expert_kernel not in (None, *HOST_EXPERT_KERNELS):
            raise bad("host_expert_kernel", "must be 'auto', 'torch', 'compiled', 'native' or None (auto)")
        if not isinstance(self.prefill_graphs, bool):
            raise bad("prefill_graphs", "must be a bool")
        if self.expert_routing_file is not None and (not isinstance(self.expert_routing_file, str)
                                                     or not self.expert_routing_file):
            raise bad("expert_routing_file", "must be a file path (str) or None")
        if self.expert_routing_file is not None and self.host_experts is False:
            raise bad("expert_routing_file", "warms the device cache of host experts: it needs host_experts "
                                             "(not False)")
        if self.device_expert_layers is not None and (isinstance(self.device_expert_layers, bool)
                                                      or not isinstance(self.device_expert_layers, int)
                                                      or self.device_expert_layers < 0):
            raise bad("device_expert_layers", "must be an int >= 0 or None (auto: what the budget has room for)")
        if self.device_expert_layers and self.host_experts is False:
            raise bad("device_expert_layers", "keeps some layers' experts on the device beside host experts: it "
                                              "needs host_experts (not False)")
        if self.expert_cache_slots and self.host_experts is False:
            raise bad("expert_cache_slots", "caches host experts on the device: it needs host_experts (not False)")
        if self.host_experts and self.lookahead:
            raise bad("lookahead", "host experts make every MoE layer wait for the host: no lookahead with them")
        # The speculative name is checked against the registered backends at resolution: this layer sits
        # beside the plugin registry and does not import it.
        return self

    def for_purpose(self) -> EngineOptions:
        """These options under their purpose's rules, defined here only: a ``causal_scoring`` engine runs one
        window at a time on one sequence, so its ``max_concurrency`` is 1 whatever was asked (its Program
        is sized for that one sequence), and the default ``context_cache`` (None) becomes
        :attr:`uses_context_cache`. Applied once when options are resolved for an artifact
        (``ninfer.planning.resolution``) and again by the Engine itself; idempotent."""
        resolved = self
        if self.context_cache is None:
            resolved = dataclasses.replace(resolved, context_cache=self.uses_context_cache)
        if self.purpose == "causal_scoring" and self.max_concurrency != 1:
            resolved = dataclasses.replace(resolved, max_concurrency=1)
        return resolved

    @property
    def uses_context_cache(self) -> bool:
        """Whether the engine keeps a context cache: ``context_cache``, or by default on for generation
        and off for causal scoring."""
        if self.context_cache is None:
            return self.purpose == "generation"
        return self.context_cache

    @property
    def prefill_chunk(self) -> int:
        """The most prompt/Replay tokens one engine step (or one scoring chunk) processes:
        ``prefill_chunk_size``, else the purpose's default (for generation with ``host_experts`` True, that of host
        experts)."""
        if self.prefill_chunk_size is not None:
            return self.prefill_chunk_size
        if self.purpose == "causal_scoring":
            return SCORING_PREFILL_CHUNK
        return HOST_EXPERTS_PREFILL_CHUNK if self.host_experts else GENERATION_PREFILL_CHUNK

    @property
    def step_tokens(self) -> int:
        """The most tokens a step computes while decode rows run: ``max_step_tokens``, else the default (with
        ``host_experts`` True, that of host experts)."""
        if self.max_step_tokens is not None:
            return self.max_step_tokens
        return HOST_EXPERTS_MAX_STEP_TOKENS if self.host_experts else DEFAULT_MAX_STEP_TOKENS

    @property
    def encode_rows(self) -> int:
        """The most encoder input rows one step encodes: ``max_encode_rows``, else the default."""
        return DEFAULT_MAX_ENCODE_ROWS if self.max_encode_rows is None else self.max_encode_rows

    @property
    def checkpoint_slots(self) -> int:
        """StateImage slots the Program needs for checkpoints (0 without the context cache)."""
        if not self.uses_context_cache:
            return 0
        return self.cache_checkpoint_slots or 16 + 2 * self.max_concurrency

    @property
    def checkpoint_interval(self) -> int:
        if self.cache_checkpoint_interval is not None:
            return self.cache_checkpoint_interval
        # Boundaries at chunk ends cut no prefill chunk short (a boundary inside a chunk splits it, and short
        # chunks are host-bound), and each boundary keeps a whole StateImage.
        return max(self.page_size, self.prefill_chunk // self.page_size * self.page_size)

    @property
    def host_budget_bytes(self) -> int:
        """The context cache's Host tier budget in bytes (0 without the context cache)."""
        if not self.uses_context_cache:
            return 0
        return 0 if self.cache_host_mib is None else int(self.cache_host_mib * 2**20)

    @property
    def outstanding_capacity(self) -> int:
        return self.max_concurrency + self.queue_capacity

    def features(self) -> StartupFeatures:
        """The features these options bind; ``vision`` None (auto, not yet resolved for an artifact) binds none."""
        return StartupFeatures(vision=bool(self.vision), speculative=self.speculative, purpose=self.purpose,
                               host_experts=bool(self.host_experts),
                               device_expert_layers=(self.device_expert_layers or 0) if self.host_experts else 0,
                               expert_cache_slots=(self.expert_cache_slots or 0) if self.host_experts else 0,
                               expert_copy_min_tokens=self.expert_copy_min_tokens if self.host_experts else None,
                               host_expert_threads=self.host_expert_threads if self.host_experts else None,
                               host_expert_kernel=(self.host_expert_kernel or "auto") if self.host_experts
                               else "torch")
