"""A device cache of host experts (``EngineOptions.expert_cache_slots``, docs/memory.md "Host experts").

One MoE layer whose routed banks live in host memory keeps copies of ``slots`` of its experts on the run device,
in the run dtype, or as stored for a quantized bank (its planes, which the device's quantized ``moe_experts``
reads: a quarter of the bytes of bf16 at 4 bits, per slot and per copy).

Policy: every routed (token, expert) pair the layer sees adds one to its expert's score, and all scores decay by
:data:`DECAY` per call; when the layer is called next, the best-scored experts that are not cached
(score above zero) fill the empty slots, then each replaces the worst-scored cached expert when its score beats
that one's by :data:`ADMIT_MARGIN`, at most :data:`MAX_ADMITS` replacements a call (one host-to-device copy of its
two matrices each). So the cache follows the routing of recent steps, and routing with no favourites (every
expert about as likely) does not make it copy at every call: a copy costs about what computing a few pairs on the
host does, so a near-tie is not worth one. The layer refreshes its cache at the end of a call
(:meth:`ExpertCache.refresh_behind`): on a GPU the copies run on a side stream while the other layers compute, and
the layer's next call waits for them (:meth:`ExpertCache.ready`). An expert that a call's copy path brings to the
device anyway enters the cache when its score beats a cached one's (:meth:`ExpertCache.admit`), so misses that
are copied also teach the cache, at no extra copy.

Invariants (who may mutate what): only the layer's forward, on the engine worker, calls :meth:`observe`,
:meth:`refresh` (or :meth:`refresh_behind`), :meth:`admit` and :meth:`ready`; :meth:`admit` never replaces an
expert the same call reads; ``slot_of[e]`` is the slot holding expert ``e`` or -1, and for every read queued
after :meth:`ready` the device buffers' slot ``s`` holds exactly the expert ``expert_in[s]`` (a refresh or an
admission queues the copies before it records them). Which experts are cached changes where a pair is computed
(and so the order of the fp32 sum), never which experts or weights are summed.
"""

from __future__ import annotations

import torch
from ninfer.quant import PackedWeight, copy_expert, empty_bank

#: Per-call decay of the routing scores: a pair's weight halves after about 70 calls of the layer.
DECAY = 0.99
#: How many (decayed) routed pairs an uncached expert's score must exceed a cached one's by to replace it.
ADMIT_MARGIN = 2.0
#: Most cached experts one refresh replaces (empty slots fill without this bound): a cap on one call's copies.
MAX_ADMITS = 2


class ExpertCache:
    """``slots`` experts of the host banks ``gate_up[E, 2I, H]`` / ``down[E, H, I]`` (float tensors, kept on
    ``device`` in ``dtype``, or :class:`~ninfer.quant.PackedWeight` banks, kept as stored) on ``device`` (module
    docstring). ``hits`` / ``misses`` count routed pairs computed on the device / on the host."""

    def __init__(self, gate_up: torch.Tensor | PackedWeight, down: torch.Tensor | PackedWeight, slots: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        experts = gate_up.shape[0]
        if not 0 < slots <= experts:
            raise ValueError(f"an expert cache needs 1..{experts} slots, got {slots}")
        self.host_gate_up, self.host_down = gate_up, down
        self.gate_up, self.down = (device_bank(b, slots, device, dtype) for b in (gate_up, down))
        self.slot_of = torch.full((experts,), -1, dtype=torch.int64)   # host: expert -> slot
        self.expert_in = [-1] * slots                                  # slot -> expert
        self.score = torch.zeros(experts, dtype=torch.float64)
        self.routed = torch.zeros(experts, dtype=torch.int64)   # pairs per expert since the last reset
        self.calls = 0                                           # layer calls since the last reset
        self.hits = self.misses = 0
        self.copies = 0   # experts copied in so far
        self._side: torch.cuda.Stream | None = None       # where refresh_behind's copies run (CUDA)
        self._copied: torch.cuda.Event | None = None      # their completion, until ready() waits for it

    @property
    def slots(self) -> int:
        return len(self.expert_in)

    def observe(self, ids: torch.Tensor) -> None:
        """Count the routed pairs ``ids[T, k]`` (host int64) of one call."""
        counts = torch.bincount(ids.reshape(-1), minlength=self.score.numel())
        self.score.mul_(DECAY)
        self.score += counts.to(torch.float64)
        self.routed += counts
        self.calls += 1

    def settled(self) -> bool:
        """Whether :meth:`refresh` would change nothing: no slot is empty and no uncached expert's score beats the
        worst-scored cached one's by :data:`ADMIT_MARGIN`. A few tensor ops, where a refresh walks every expert in
        Python: with routing without favourites most calls of a full cache are settled."""
        cached = self.slot_of >= 0
        if self.expert_in.count(-1):   # an empty slot takes any uncached expert routed lately
            return not bool(((self.score > 0) & ~cached).any())
        worst = self.score.masked_fill(~cached, float("inf")).min()
        best = self.score.masked_fill(cached, float("-inf")).max()
        return not bool(best > 0) or bool(best < worst + ADMIT_MARGIN)

    def refresh(self, max_replacements: int = MAX_ADMITS) -> None:
        """Bring the cache towards the best-scored experts (module docstring)."""
        if not self.settled():
            self._replace(max_replacements)

    def _replace(self, max_replacements: int) -> None:
        """:meth:`refresh`'s walk, for a cache that is not settled."""
        score = self.score.tolist()   # host lists: the loops below index them, not the tensors
        slot_of = self.slot_of.tolist()
        order = torch.argsort(self.score, descending=True, stable=True)[: self.slots].tolist()
        incoming = [e for e in order if score[e] > 0 and slot_of[e] < 0]
        if not incoming:
            return
        empty = [s for s, e in enumerate(self.expert_in) if e < 0]
        held = sorted((s for s, e in enumerate(self.expert_in) if e >= 0), key=lambda s: score[self.expert_in[s]])
        replaced = 0
        for expert in incoming:       # best first; the worst-scored cached expert goes first
            if empty:
                slot = empty.pop(0)
            elif replaced < max_replacements and held and score[expert] >= score[self.expert_in[held[0]]] + ADMIT_MARGIN:
                slot = held.pop(0)
                replaced += 1
                self.slot_of[self.expert_in[slot]] = -1
            else:
                break
            self._load(expert, slot)

    def admit(self, experts: list[int], keep: set[int]) -> list[int]:
        """Take uncached ``experts`` that a call copies to the device anyway (its copy path) into the cache rather
        than a staging buffer: each fills an empty slot, or replaces the worst-scored cached expert outside
        ``keep`` (the call's own cached experts, whose pairs read their slots) when its score is higher. No margin:
        the copy is made either way. The copies are queued on the current stream, behind the reads queued on it
        so far. Returns the experts admitted, in ``experts``' order."""
        score = self.score.tolist()
        empty = [s for s, e in enumerate(self.expert_in) if e < 0]
        held = sorted((s for s, e in enumerate(self.expert_in) if e >= 0 and e not in keep),
                      key=lambda s: score[self.expert_in[s]])
        admitted = []
        for expert in experts:
            if empty:
                slot = empty.pop(0)
            elif held and score[expert] > score[self.expert_in[held[0]]]:
                slot = held.pop(0)   # an admitted expert's slot is not in ``held``: the call reads it
                self.slot_of[self.expert_in[slot]] = -1
            else:
                continue
            self._load(expert, slot)
            admitted.append(expert)
        return admitted

    def _load(self, expert: int, slot: int) -> None:
        # The banks are immutable (pinned on a GPU host): the copies need not hold the host back.
        load_expert(self.gate_up, slot, self.host_gate_up, expert)
        load_expert(self.down, slot, self.host_down, expert)
        self.expert_in[slot], self.slot_of[expert] = expert, slot
        self.copies += 1

    def refresh_behind(self) -> None:
        """:meth:`refresh` with its copies on a side stream, behind the work queued on the current stream so far
        (the call's reads of the slots it overwrites): on a GPU they overlap the layers that run until this layer's
        next call, which :meth:`ready` makes wait for them. Elsewhere a plain refresh."""
        if self.settled():   # no copies to queue: no stream switch either
            return
        device = self.gate_up.device
        if device.type != "cuda":
            self._replace(MAX_ADMITS)
            return
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        self._side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._side):
            before = self.copies
            self._replace(MAX_ADMITS)
            self._copied = self._side.record_event() if self.copies != before else self._copied

    def ready(self) -> None:
        """The current stream waits for the copies of the last :meth:`refresh_behind` (before the slots are read)."""
        if self._copied is not None:
            torch.cuda.current_stream(self.gate_up.device).wait_event(self._copied)
            self._copied = None

    def reset(self) -> None:
        """Scores and counts back to zero (what the cache holds stays until routing replaces it)."""
        self.score.zero_()
        self.routed.zero_()
        self.hits = self.misses = self.calls = 0

    def warm(self, counts: torch.Tensor, calls: int) -> None:
        """Score each expert as the steady state of a run that routed ``counts[e]`` pairs to it in ``calls``
        calls (its mean pairs a call over ``1 - DECAY``), and fill the cache with the best, replacing whatever it
        holds. Hit and routing counts stay as they are (they count this run)."""
        if counts.shape != self.score.shape:
            raise ValueError(f"routing of {counts.numel()} experts for a cache of {self.score.numel()}")
        self.score.copy_(counts.to(torch.float64) / max(1, calls) / (1.0 - DECAY))
        self.refresh(max_replacements=self.slots)

    def split(self, ids: torch.Tensor, count: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """For host ``ids[T, k]``: (cached ``[T, k]`` bool, the pair's slot or 0 where not cached), and with
        ``count`` the hit and miss counts updated."""
        slot = self.slot_of[ids]
        cached = slot >= 0
        if count:
            hits = int(cached.sum())
            self.hits += hits
            self.misses += cached.numel() - hits
        return cached, slot.clamp(min=0)


def device_bank(like: torch.Tensor | PackedWeight, slots: int, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor | PackedWeight:
    """A zeroed device bank of ``slots`` experts for the host bank ``like``: in ``dtype``, or as stored when packed."""
    if isinstance(like, PackedWeight):
        return empty_bank(like, slots, device)
    return torch.zeros((slots, *like.shape[1:]), dtype=dtype, device=device)


def load_expert(dst: torch.Tensor | PackedWeight, slot: int, src: torch.Tensor | PackedWeight, expert: int) -> None:
    """Queue the copy of host expert ``expert`` of ``src`` into ``dst``'s slot (non-blocking from pinned memory)."""
    if isinstance(dst, PackedWeight):
        copy_expert(dst, slot, src, expert, non_blocking=True)
    else:
        dst[slot].copy_(src[expert], non_blocking=True)
