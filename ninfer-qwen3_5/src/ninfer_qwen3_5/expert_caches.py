"""The Program side of host experts' device caches and host calls (docs/memory.md, "Host experts"), shared by the
Qwen3.5 and Qwen4-Exp Programs: the per-layer hit counts (``expert_cache_stats``), the routing the caches observed
and its warm start (``expert_routing`` / ``warm_expert_caches``, the expert routing file), a warm-up that leaves
them counting from zero, and after every forward a check of the host calls' mailboxes, so that a failure of a host
function inside a replayed graph (which cannot raise) is raised by the step after it.

A mixin placed before the Program base in the bases: it needs ``self.model.expert_caches()`` and
``self.model.host_mailboxes()``, the layers' :class:`~ninfer_qwen3_5.layers.expert_cache.ExpertCache` and
:class:`~ninfer_qwen3_5.layers.host_mailbox.HostMailbox` objects in layer order (none without host experts, a
cache or host calls). Only the engine worker calls these, like every Program method."""

from __future__ import annotations

import torch
from ninfer.contracts.program import (
    ExpertCacheStats,
    ExpertRouting,
    ProgramError,
    WarmupLimits,
    WarmupSummary,
)


class HostExpertCaches:
    @property
    def expert_cache_stats(self) -> ExpertCacheStats:
        caches = self.model.expert_caches()
        return ExpertCacheStats(hits=tuple(c.hits for c in caches), misses=tuple(c.misses for c in caches))

    def expert_routing(self) -> ExpertRouting:
        caches = self.model.expert_caches()
        return ExpertRouting(tuple(c.calls for c in caches), tuple(tuple(c.routed.tolist()) for c in caches))

    def warm_expert_caches(self, routing: ExpertRouting) -> None:
        caches = self.model.expert_caches()
        shape = [c.score.numel() for c in caches]
        if [len(c) for c in routing.counts] != shape:
            raise ProgramError(f"the expert routing is for {len(routing.counts)} cached MoE layers of "
                               f"{sorted({len(c) for c in routing.counts})} experts; this model has "
                               f"{len(caches)} of {sorted(set(shape))}")
        for cache, calls, counts in zip(caches, routing.calls, routing.counts, strict=True):
            cache.warm(torch.tensor(counts, dtype=torch.int64), calls)

    def forward(self, batch):
        out = super().forward(batch)
        mailboxes = self.__dict__.get("_host_mailboxes")
        if mailboxes is None:   # the layers' are fixed at build: listed once, not walked every step
            mailboxes = self.__dict__["_host_mailboxes"] = tuple(self.model.host_mailboxes())
        for mailbox in mailboxes:
            mailbox.check()
        return out

    def warm_up(self, limits: WarmupLimits) -> WarmupSummary:
        """The warm-up; afterwards the expert caches count and score from zero (its rows are no serving)."""
        try:
            return super().warm_up(limits)
        finally:
            for cache in self.model.expert_caches():
                cache.reset()
