"""The memory plan (docs/design.md section 7): workspace estimate, KV candidates, :class:`MemoryPlan`.

With S = the StateImages of every running request, checkpoint slot, lookahead spare and speculative verify
snapshot (``k + 1`` per running request when the engine drafts ``k`` tokens), W = the workspace
estimate (with a vision encoder bound: plus its call over ``max_encode_rows`` rows, which a step runs before its
model call) and G = the decode graphs' pool estimate:

- runtime bytes = weights + KV + S + W + G; startup peak = loaded stored weights + converted copies +
  KV + S (the stored originals are held until construction ends). Both + headroom must fit the budget.
- KV candidates, largest first: ``every running request at max_context`` (``max_concurrency * ceil(max_context /
  page_size)`` pages: without a context cache no page beyond that can ever be used), else ``fit to
  budget`` (the most pages the room holds). An explicitly sized pool (``num_pages`` / ``kv_budget_mib``)
  is taken as given and checked against the same room.
- Either way the pool must hold one full max_context request; if the room cannot, the plan fails with
  :class:`~ninfer.planning.budget.MemoryPlanError` naming every number.
- Weights placed in host memory (``ModelProfile.host_weight_bytes``; the loader holds ``host_load_bytes`` of them
  at startup): on a CPU run they share the one budget, counted in the weights and the startup peak; on another
  device they must fit the host budget together with the context cache's Host tier, or the plan fails naming
  the numbers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ninfer.contracts.architecture import ModelProfile
from ninfer.contracts.memory import MemorySummary
from ninfer.planning.budget import BUDGET_WAYS, HOST_BUDGET_ENV, DeviceBudget, MemoryPlanError, mib
from ninfer.planning.resolution import ResolvedOptions

# The reference attention materialises at most 2**24 fp32 scores per query block, two live at once
# (scores, then softmax); a single query row over a long context may exceed it.
SCORE_BLOCK_BYTES = 2 * 4 * (1 << 24)
# Per sampled logit: fp32 logits plus the sampler's copies (penalised, probabilities, sorted values and
# int64 indices): six 4-byte words.
LOGIT_BYTES = 6 * 4


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


def graph_pool_bytes(profile: ModelProfile, max_batch: int, max_context: int, tokens_per_row: int = 1) -> int:
    """Estimated private memory pool of CUDA graphs for batch sizes 1..``max_batch`` of ``tokens_per_row`` tokens
    per row (decode graphs: 1; verify graphs: k + 1, each with its logits): the largest graph's step (smaller
    graphs reuse its blocks). 0 for ``max_batch`` 0 (no graphs)."""
    if max_batch < 1:
        return 0
    n = max_batch * tokens_per_row
    return workspace_bytes(profile, step_tokens=n, logit_rows=n, max_context=max_context)


@dataclass(frozen=True)
class MemoryPlan:
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
    host_weights_bytes: int = 0   # weights placed in host memory (part of weights_bytes on a CPU run)
    host_budget_bytes: int = 0    # the host budget they were checked against (0: a CPU run, or none placed)
    cache_slots: int = 0          # expert cache slots per layer the planner sized (0: none, or set explicitly)
    slot_bytes: int = 0           # device bytes one such slot per layer adds (part of weights_bytes)

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

    def with_num_pages(self, num_pages: int) -> MemoryPlan:
        """This plan with a pool of ``num_pages`` (after a corrective rebuild; the startup peak stays the
        first build's, which had the larger pool)."""
        return dataclasses.replace(self, num_pages=num_pages, kv_bytes=num_pages * self.page_bytes)

    def with_cache_slots(self, cache_slots: int) -> MemoryPlan:
        """This plan with ``cache_slots`` (at most the planned ones) automatic expert cache slots per layer (after a
        corrective rebuild gave some up; the startup peak stays the first build's)."""
        if not 0 <= cache_slots <= self.cache_slots:
            raise ValueError(f"{cache_slots} expert cache slots outside the planned 0..{self.cache_slots}")
        freed = (self.cache_slots - cache_slots) * self.slot_bytes
        return dataclasses.replace(self, cache_slots=cache_slots, weights_bytes=self.weights_bytes - freed)

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
            measured=retained_bytes is not None, graph_rebuild_estimate_bytes=self.graph_bytes,
            host_weights_bytes=self.host_weights_bytes, host_budget_bytes=self.host_budget_bytes)


def _check_host(profile: ModelProfile, host_load_bytes: int, tier_bytes: int, host: DeviceBudget) -> None:
    need = max(profile.host_weight_bytes, host_load_bytes) + tier_bytes
    if need + host.headroom_bytes > host.budget_bytes:
        raise MemoryPlanError(
            f"the weights placed in host memory ({mib(profile.host_weight_bytes)}; {mib(host_load_bytes)} while "
            f"loading) and the context cache's Host tier ({mib(tier_bytes)}) need {mib(need)}, but the host budget "
            f"{mib(host.budget_bytes)} [{host.source}] - headroom {mib(host.headroom_bytes)} leaves "
            f"{mib(host.budget_bytes - host.headroom_bytes)}; free host memory, lower cache_host_mib, or raise "
            f"{HOST_BUDGET_ENV}")


def plan_memory(resolved: ResolvedOptions, profile: ModelProfile, budget: DeviceBudget, *,
                load_bytes: int, host_load_bytes: int = 0, host_budget: DeviceBudget | None = None) -> MemoryPlan:
    """Plan weights + KV/State + workspace (+ the decode graphs' pool for ``resolved.graph_batches`` batch
    sizes) under ``budget`` (module docstring). ``resolved.explicit_pages``: an explicitly sized pool
    (checked, not changed); None lets the candidates choose. ``load_bytes``: what the weight loader holds
    at once on the device (``WeightSource.load_bytes``); ``host_load_bytes`` of host-placed weights.
    ``host_budget``: the host memory host-placed weights must fit when ``budget`` is not the CPU's (None: not
    checked)."""
    if budget.device == "cpu":   # one memory: host-placed weights are the device's
        weights, startup_weights, host_checked = (profile.weight_bytes + profile.host_weight_bytes,
                                                  load_bytes + host_load_bytes, 0)
    else:
        weights, startup_weights = profile.weight_bytes, load_bytes
        host_checked = 0 if host_budget is None else host_budget.budget_bytes
        if host_budget is not None:
            _check_host(profile, host_load_bytes, resolved.options.host_budget_bytes, host_budget)
    options = resolved.options
    ps, running, max_context = options.page_size, options.max_concurrency, options.max_context
    lookahead = resolved.lookahead_slots
    scoring = options.purpose == "causal_scoring"
    chunk = min(options.prefill_chunk, max_context)  # no prefill chunk is longer than a request
    # The largest step: chunks of up to ``running`` requests, prefill_chunk tokens together, plus a decode row for
    # every other running request. Each resident is one decode row or one chunk, so at most ``running`` rows
    # sample (a scoring engine's one chunk samples every token).
    step = chunk if scoring else min(options.prefill_chunk, running * chunk)
    # A speculating decode row verifies up to k + 1 tokens, each with its logits.
    per_row = resolved.speculative_tokens + 1
    work = workspace_bytes(profile, step_tokens=step + running * per_row,
                           logit_rows=running * per_row + (chunk if scoring else 0),
                           max_context=max_context)
    # The step's encoder call (docs/vision.md): at most max_encode_rows rows; its output rows outlive it.
    work += options.encode_rows * profile.encoder_bytes_per_row if options.vision else 0
    # + context-cache checkpoints + lookahead spares + speculative verify snapshots (k + 1 per running request)
    snapshots = running * (resolved.speculative_tokens + 1) if resolved.speculative_tokens else 0
    # + the slot prefill graphs' padded rows share
    pad = 1 if resolved.prefill_graph_tokens else 0
    state = (running + options.checkpoint_slots + lookahead + snapshots + pad) * profile.state_bytes_per_sequence
    graphs = graph_pool_bytes(profile, resolved.graph_batches, max_context, tokens_per_row=per_row)
    if resolved.prefill_graph_tokens:   # their pool holds the largest bucket's step (the smaller ones reuse it)
        graphs += workspace_bytes(profile, step_tokens=resolved.prefill_graph_tokens[-1],
                                  logit_rows=running + lookahead + pad, max_context=max_context)
    runtime_fixed = weights + state + work + graphs
    startup_fixed = startup_weights + profile.converted_weight_bytes + state
    room = budget.budget_bytes - budget.headroom_bytes - max(runtime_fixed, startup_fixed)
    page_bytes = ps * profile.kv_bytes_per_token
    one_request = -(-max_context // ps)

    def why() -> str:
        return (f"budget {mib(budget.budget_bytes)} [{budget.source}] - headroom {mib(budget.headroom_bytes)} "
                f"- max(runtime: weights {mib(weights)} + State {mib(state)} ({running} running requests + "
                f"{options.checkpoint_slots} checkpoints + {lookahead} lookahead + {snapshots} speculative "
                f"snapshots) + workspace {mib(work)} "
                f"+ graphs {mib(graphs)}, startup: stored weights {mib(startup_weights)} + converted "
                f"{mib(profile.converted_weight_bytes)} + State {mib(state)}) leaves {mib(room)} for KV")

    if resolved.explicit_pages is not None:
        pages = resolved.explicit_pages
        candidate = "explicit num_pages" if options.num_pages is not None else "explicit kv_budget_mib"
        if pages * page_bytes > room:
            raise MemoryPlanError(f"the KV pool of {pages} pages x {ps} tokens ({mib(pages * page_bytes)}) does not "
                                  f"fit: {why()}")
    else:
        every_request = running * one_request
        fit = every_request if page_bytes == 0 else max(0, room) // page_bytes
        if fit >= every_request:
            pages, candidate = every_request, "every running request at max_context"
        else:
            pages, candidate = fit, "fit to budget"
    if pages < one_request:
        short = one_request * page_bytes - room
        need = (f"; a budget of at least {mib(budget.budget_bytes + budget.held_bytes + short)} holds one such "
                f"request at these options"
                if resolved.explicit_pages is None and short > 0 else "")
        raise MemoryPlanError(
            f"cannot fit one request of max_context {max_context}: it needs {one_request} KV pages x {ps} tokens = "
            f"{mib(one_request * page_bytes)}, but {why()}{need}; lower max_context or max_concurrency, or "
            f"{BUDGET_WAYS} / free device memory")
    kv = pages * page_bytes
    return MemoryPlan(budget=budget, max_context=max_context, page_size=ps, num_pages=pages, state_slots=running,
                      weights_bytes=weights, kv_bytes=kv, state_bytes=state, workspace_bytes=work,
                      startup_peak_bytes=startup_fixed + kv, kv_candidate=candidate, graph_bytes=graphs,
                      page_bytes=page_bytes, host_weights_bytes=profile.host_weight_bytes,
                      host_budget_bytes=host_checked)
