"""Engine statistics: counters the worker keeps and the snapshot any thread may read.

The worker is the only writer of :class:`EngineCounters` and the only caller of ``Program.capacity``;
after each step it publishes an immutable :class:`EngineStats` (one reference store, atomic under
the GIL), so ``Engine.stats()`` never touches worker state from another thread.

Speculative acceptance per draft position (:func:`count_verify`): entry ``j - 1`` of
``spec_drafted_by_position`` counts the verify rows that drafted at least ``j`` tokens, the same entry of
``spec_accepted_by_position`` those of them whose acceptance rule kept draft ``j`` (which needs drafts
``1..j-1`` kept too). Both have one entry per position up to the deepest one verified so far (empty
without speculation); the acceptance rate at position ``j`` is ``accepted[j-1] / drafted[j-1]``, and the
sums over positions are ``spec_drafted`` and ``spec_accepted``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

EngineStatus = Literal["running", "closing", "closed", "failed"]


@dataclass
class EngineCounters:
    """Monotone totals (and high-water marks) since start (worker-owned)."""

    admitted: int = 0
    finished: int = 0           # GenerationResult with stop or length
    cancelled: int = 0
    deadline: int = 0           # ended by deadline, before or after admission
    rejected: int = 0           # rejected by the worker (queue timeout, closed)
    preemptions: int = 0
    resumes: int = 0
    units: int = 0              # Program.run calls
    decode_tokens: int = 0      # decode rows run
    prefill_tokens: int = 0     # fresh prompt tokens computed
    replay_tokens: int = 0      # ledger tokens recomputed after a pause
    chunks: int = 0             # prefill/Replay chunks run (several may share a unit)
    max_unit_chunks: int = 0    # the most chunks one unit ran
    completion_tokens: int = 0  # accepted output tokens
    encode_units: int = 0       # media encode units (an image, a video's temporal patch) scheduled for encoding
    encode_rows: int = 0        # their encoder input rows (image patches)
    max_step_encode_rows: int = 0  # the most encoder input rows one unit encoded
    cache_lookups: int = 0      # context cache: admissions that looked for a checkpoint
    cache_hits: int = 0         # admissions bound to a checkpoint
    cache_hit_tokens: int = 0   # prompt tokens those checkpoints covered
    cache_saved_prefill_tokens: int = 0  # prefill tokens not computed thanks to them (== hit tokens)
    cache_captures: int = 0     # checkpoints taken
    cache_evictions: int = 0    # checkpoints dropped under pressure (slot, page or Host budget)
    cache_host_evictions: int = 0  # of which dropped from Host to fit the Host budget
    cache_demotions: int = 0    # checkpoints moved Device -> Host (snapshots included)
    cache_restores: int = 0     # checkpoints moved Host -> Device for a bind
    snapshot_pauses: int = 0    # preemptions that kept a Snapshot (on Host)
    snapshot_resumes: int = 0   # resumes from their Snapshot (nothing recomputed)
    snapshot_revocations: int = 0  # Snapshots dropped under pressure before their resume
    replays: int = 0            # resumes by Replay (no Snapshot, or it was revoked)
    lookahead_launched: int = 0  # decode steps launched ahead (ninfer.program.lookahead; Program-owned)
    lookahead_adopted: int = 0   # of them, adopted by the next unit
    lookahead_dropped: int = 0   # of them, dropped (the next unit asked for other work)
    spec_verifies: int = 0       # speculative verify rows run (Program-owned, SpeculationStats)
    spec_drafted: int = 0        # drafts they verified
    spec_accepted: int = 0       # drafts the acceptance rule kept
    # Per draft position (module docstring); counted at commit from each verify row (PendingRow.drafted).
    spec_drafted_by_position: list[int] = field(default_factory=list)
    spec_accepted_by_position: list[int] = field(default_factory=list)
    # Per MoE layer with a device cache of host experts (Program-owned, ExpertCacheStats).
    expert_cache_hits: list[int] = field(default_factory=list)
    expert_cache_misses: list[int] = field(default_factory=list)


def count_verify(counters: EngineCounters, drafted: int, accepted: int) -> None:
    """Count one verify row that verified ``drafted >= 1`` drafts and kept the first ``accepted`` of them
    (``0 <= accepted <= drafted``): positions ``1..drafted`` were drafted, ``1..accepted`` accepted."""
    if isinstance(drafted, bool) or isinstance(accepted, bool) or not 0 <= accepted <= drafted or drafted < 1:
        raise ValueError(f"a verify row drafts >= 1 tokens and accepts 0..drafted of them; got drafted={drafted!r}, "
                         f"accepted={accepted!r}")
    d, a = counters.spec_drafted_by_position, counters.spec_accepted_by_position
    if len(d) < drafted:
        d.extend([0] * (drafted - len(d)))
        a.extend([0] * (drafted - len(a)))
    for j in range(drafted):
        d[j] += 1
    for j in range(accepted):
        a[j] += 1


@dataclass(frozen=True)
class EngineStats:
    """One consistent view after a worker step (``outstanding`` and ``submitted`` are live)."""

    status: EngineStatus
    queue_depth: int
    running: int
    paused: int
    outstanding: int
    submitted: int
    pages_used: int
    pages_total: int
    state_slots_used: int
    state_slots_total: int
    page_size: int
    admitted: int = 0
    finished: int = 0
    cancelled: int = 0
    deadline: int = 0
    rejected: int = 0
    preemptions: int = 0
    resumes: int = 0
    units: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    replay_tokens: int = 0
    chunks: int = 0
    max_unit_chunks: int = 0
    completion_tokens: int = 0
    encode_units: int = 0
    encode_rows: int = 0
    max_step_encode_rows: int = 0
    cache_lookups: int = 0
    cache_hits: int = 0
    cache_hit_tokens: int = 0
    cache_saved_prefill_tokens: int = 0
    cache_captures: int = 0
    cache_evictions: int = 0
    cache_host_evictions: int = 0
    cache_demotions: int = 0
    cache_restores: int = 0
    snapshot_pauses: int = 0
    snapshot_resumes: int = 0
    snapshot_revocations: int = 0
    replays: int = 0
    lookahead_launched: int = 0
    lookahead_adopted: int = 0
    lookahead_dropped: int = 0
    spec_verifies: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_drafted_by_position: tuple[int, ...] = ()   # module docstring
    spec_accepted_by_position: tuple[int, ...] = ()
    expert_cache_hits: tuple[int, ...] = ()     # per MoE layer with a device cache of host experts
    expert_cache_misses: tuple[int, ...] = ()
    cache_checkpoints: int = 0       # live checkpoints now (pause Snapshots included)
    cache_device_bytes: int = 0      # their Device StateImages + KV pages only they hold
    cache_host_checkpoints: int = 0  # of them, those with content on Host
    cache_host_bytes: int = 0        # Host tier bytes in use (images + KV pages)
    cache_host_budget_bytes: int = 0  # the Host tier's budget (0: no Host tier)

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def expert_cache_hit_rate_by_layer(self) -> tuple[float, ...]:
        """Per MoE layer with a device expert cache: the share of its routed pairs computed from the cache (0.0
        before any pair)."""
        return tuple(h / (h + m) if h + m else 0.0 for h, m in zip(self.expert_cache_hits, self.expert_cache_misses,
                                                                   strict=True))

    def spec_acceptance_by_position(self) -> tuple[float, ...]:
        """Entry ``j - 1``: of the verify rows that drafted at least ``j`` tokens, the share whose draft ``j``
        was accepted (empty without speculation)."""
        return tuple(a / d for a, d in zip(self.spec_accepted_by_position, self.spec_drafted_by_position,
                                            strict=True))


def counter_values(counters: EngineCounters) -> dict[str, int | tuple[int, ...]]:
    """The counters' values to publish: lists become tuples (the snapshot must not share the worker's lists)."""
    out: dict[str, int | tuple[int, ...]] = {}
    for f in fields(counters):
        v = getattr(counters, f.name)
        out[f.name] = tuple(v) if isinstance(v, list) else v
    return out
