"""Engine statistics: counters the worker keeps and the snapshot any thread may read.

The worker is the only writer of :class:`EngineCounters` and the only caller of ``Program.capacity``;
after each step it publishes an immutable :class:`EngineStats` (one reference store, atomic under
the GIL), so ``Engine.stats()`` never touches worker state from another thread.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
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
    cache_checkpoints: int = 0       # live checkpoints now (pause Snapshots included)
    cache_device_bytes: int = 0      # their Device StateImages + KV pages only they hold
    cache_host_checkpoints: int = 0  # of them, those with content on Host
    cache_host_bytes: int = 0        # Host tier bytes in use (images + KV pages)
    cache_host_budget_bytes: int = 0  # the Host tier's budget (0: no Host tier)

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def counter_values(counters: EngineCounters) -> dict[str, int]:
    return {f.name: getattr(counters, f.name) for f in fields(counters)}
