"""A device cache of host experts (``EngineOptions.expert_cache_slots``, docs/memory.md "Host experts").

One MoE layer whose routed banks live in host memory keeps copies of ``slots`` of its experts on the run device,
in the run dtype. Policy: every routed (token, expert) pair the layer sees adds one to its expert's score, and all
scores decay by :data:`DECAY` per call; when the layer is called next, the ``slots`` best-scored experts (score
above zero) are what the cache should hold, and each one missing replaces the worst-scored cached expert that is
no longer wanted (one host-to-device copy of its two matrices). So the cache follows the routing of recent steps,
and it changes only between two calls of its layer.

Invariants (who may mutate what): only the layer's forward, on the engine worker, calls :meth:`observe` and
:meth:`refresh`; ``slot_of[e]`` is the slot holding expert ``e`` or -1, and the device buffers' slot ``s`` holds
exactly the expert ``expert_in[s]`` (refresh copies before it records). Which experts are cached changes where a
pair is computed (and so the order of the fp32 sum), never which experts or weights are summed.
"""

from __future__ import annotations

import torch

#: Per-call decay of the routing scores: a pair's weight halves after about 70 calls of the layer.
DECAY = 0.99


class ExpertCache:
    """``slots`` experts of the host banks ``gate_up[E, 2I, H]`` / ``down[E, H, I]`` (float tensors) on
    ``device`` in ``dtype`` (module docstring). ``hits`` / ``misses`` count routed pairs computed on the device /
    on the host."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, slots: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        experts = gate_up.shape[0]
        if not 0 < slots <= experts:
            raise ValueError(f"an expert cache needs 1..{experts} slots, got {slots}")
        self.host_gate_up, self.host_down = gate_up, down
        self.gate_up = torch.zeros((slots, *gate_up.shape[1:]), dtype=dtype, device=device)
        self.down = torch.zeros((slots, *down.shape[1:]), dtype=dtype, device=device)
        self.slot_of = torch.full((experts,), -1, dtype=torch.int64)   # host: expert -> slot
        self.expert_in = [-1] * slots                                  # slot -> expert
        self.score = torch.zeros(experts, dtype=torch.float64)
        self.hits = self.misses = 0

    @property
    def slots(self) -> int:
        return len(self.expert_in)

    def observe(self, ids: torch.Tensor) -> None:
        """Count the routed pairs ``ids[T, k]`` (host int64) of one call."""
        self.score.mul_(DECAY)
        self.score += torch.bincount(ids.reshape(-1), minlength=self.score.numel()).to(torch.float64)

    def refresh(self) -> None:
        """Bring the cache to the best-scored experts (module docstring)."""
        score = self.score.tolist()   # one host list: the loops below index it, not the tensor
        order = torch.argsort(self.score, descending=True, stable=True)[: self.slots].tolist()
        want = [e for e in order if score[e] > 0]
        wanted = set(want)
        cached = set(self.expert_in)
        free = [s for s, e in enumerate(self.expert_in) if e < 0 or e not in wanted]
        free.sort(key=lambda s: -1.0 if self.expert_in[s] < 0 else score[self.expert_in[s]])
        for expert in (e for e in want if e not in cached):
            slot = free.pop(0)
            old = self.expert_in[slot]
            if old >= 0:
                self.slot_of[old] = -1
            self.gate_up[slot].copy_(self.host_gate_up[expert])
            self.down[slot].copy_(self.host_down[expert])
            self.expert_in[slot], self.slot_of[expert] = expert, slot

    def reset(self) -> None:
        """Scores and counts back to zero (what the cache holds stays until routing replaces it)."""
        self.score.zero_()
        self.hits = self.misses = 0

    def split(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For host ``ids[T, k]``: (cached ``[T, k]`` bool, the pair's slot or 0 where not cached), and the hit
        and miss counts updated."""
        slot = self.slot_of[ids]
        cached = slot >= 0
        hits = int(cached.sum())
        self.hits += hits
        self.misses += cached.numel() - hits
        return cached, slot.clamp(min=0)
