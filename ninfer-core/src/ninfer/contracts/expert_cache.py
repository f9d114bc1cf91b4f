"""Contracts of a Program's device cache of host experts (``EngineOptions.host_experts``, docs/memory.md "Host
experts"): the counts it publishes (:class:`ExpertCacheStats`) and the routing it observed, which the expert
routing file stores (:class:`ExpertRouting`). Re-exported by :mod:`ninfer.contracts.program`."""

from __future__ import annotations

from dataclasses import dataclass

from ninfer.errors import NInferError


class ExpertRoutingError(NInferError, ValueError):
    """An :class:`ExpertRouting` that breaks its invariants, or two that cannot be added."""


@dataclass(frozen=True)
class ExpertCacheStats:
    """Monotone counts of a Program's device cache of host experts (``EngineOptions.expert_cache_slots``), one
    entry per MoE layer that has one, in layer order: ``hits[i]`` routed (token, expert) pairs computed from the
    cache, ``misses[i]`` those computed on the host. Empty without such a cache."""

    hits: tuple[int, ...] = ()
    misses: tuple[int, ...] = ()


@dataclass(frozen=True)
class ExpertRouting:
    """Routing observed by a Program's device caches of host experts, one entry per MoE layer that has one, in
    layer order: ``calls[i]`` layer calls counted, ``counts[i][e]`` routed (token, expert) pairs that went to
    expert ``e``. Empty without such a cache. What ``EngineOptions.expert_routing_file`` stores
    (:mod:`ninfer.engine.expert_routing`) and :meth:`Program.warm_expert_caches` takes.

    Invariants: ``calls`` and ``counts`` have one entry per layer; every count is >= 0 and a layer's counts sum
    to at most ``calls[i]`` x the layer's experts per token (not checked here: a Program knows its top-k)."""

    calls: tuple[int, ...] = ()
    counts: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.calls) != len(self.counts):
            raise ExpertRoutingError(f"ExpertRouting has {len(self.calls)} call counts for {len(self.counts)} layers")
        if any(c < 0 for c in self.calls) or any(n < 0 for layer in self.counts for n in layer):
            raise ExpertRoutingError("ExpertRouting counts must be >= 0")

    def __add__(self, other: ExpertRouting) -> ExpertRouting:
        """Layer by layer sums (the same layers and experts, else ExpertRoutingError)."""
        if [len(c) for c in self.counts] != [len(c) for c in other.counts]:
            raise ExpertRoutingError(f"cannot add the routing of {len(other.counts)} layers x experts "
                               f"{[len(c) for c in other.counts][:1]} to {len(self.counts)} x "
                               f"{[len(c) for c in self.counts][:1]}")
        return ExpertRouting(tuple(a + b for a, b in zip(self.calls, other.calls, strict=True)),
                             tuple(tuple(x + y for x, y in zip(a, b, strict=True))
                                   for a, b in zip(self.counts, other.counts, strict=True)))
