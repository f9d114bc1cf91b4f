"""The Host tier: Host copies of StateImages and KV pages under one byte budget.

A :class:`HostCopy` holds what a demoted checkpoint no longer keeps on the device: optionally its
StateImage (``uint8 [image_bytes]``, the StateImage layout byte for byte) and some of its KV pages
(per pool, ``(K, V)`` each ``[n, page_size, Hkv, D]``: the pool's page layout), plus the page
positions (indices within the checkpoint's KV prefix) they belong to.

Memory is pinned when the device is CUDA (so copies can be DMA'd; they are synchronous here) and
ordinary pageable memory on the CPU. Buffers are allocated on demand and freed when the copy is
released: the budget bounds what the tier may hold, it is not reserved up front.

Invariants:
- ``used_bytes`` is the sum of the ``nbytes`` of the live copies, and never exceeds ``budget_bytes``:
  :meth:`HostTier.store` refuses (taking nothing) a copy that would not fit.
- A copy is released exactly once (:meth:`HostTier.release` of an unknown copy raises).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ninfer.errors import NInferError


class HostTierError(NInferError):
    """A Host copy was released twice or is not this tier's."""


@dataclass(frozen=True)
class HostCopy:
    copy_id: int
    image: torch.Tensor | None = field(repr=False)                                  # uint8 [image_bytes]
    positions: tuple[int, ...]                                                      # page indices in the prefix
    pages: tuple[tuple[torch.Tensor, torch.Tensor], ...] = field(repr=False)        # per pool (K, V) [n, ...]
    nbytes: int = 0


def host_bytes(image_bytes: int, num_pages: int, page_bytes: int) -> int:
    """What a copy of an image (``image_bytes``, 0 for none) and ``num_pages`` KV pages costs."""
    return image_bytes + num_pages * page_bytes


class HostTier:
    def __init__(self, budget_bytes: int, *, pin: bool) -> None:
        if budget_bytes < 0:
            raise HostTierError(f"the Host budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.pin = pin
        self.used_bytes = 0
        self._live: dict[int, int] = {}  # copy_id -> nbytes
        self._ids = itertools.count(1)

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    @property
    def count(self) -> int:
        return len(self._live)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
        out.copy_(t)  # synchronous: the source may be reused right after
        return out

    def store(self, image: torch.Tensor | None, positions: Sequence[int],
              pages: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> HostCopy | None:
        """Copy ``image`` and the pages (as ``PagedKVCache.read_pages`` gives them) to Host memory.
        None, taking nothing, when they do not fit the budget."""
        nbytes = (0 if image is None else image.numel() * image.element_size()) + sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in pages) * bool(positions)
        if nbytes > self.free_bytes:
            return None
        copy = HostCopy(next(self._ids), None if image is None else self._host(image), tuple(positions),
                        tuple((self._host(k), self._host(v)) for k, v in pages) if positions else (), nbytes)
        self._live[copy.copy_id] = nbytes
        self.used_bytes += nbytes
        return copy

    def extend(self, copy: HostCopy, image: torch.Tensor | None, positions: Sequence[int],
               pages: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> HostCopy | None:
        """A copy holding ``copy``'s content plus ``image`` (only if ``copy`` has none) and more pages;
        ``copy`` is released. None, changing nothing, when the added bytes do not fit."""
        if copy.copy_id not in self._live:
            raise HostTierError(f"Host copy {copy.copy_id} is not live in this tier")
        if image is not None and copy.image is not None:
            raise HostTierError(f"Host copy {copy.copy_id} already holds an image")
        if set(positions) & set(copy.positions):
            raise HostTierError(f"Host copy {copy.copy_id} already holds pages {sorted(set(positions) & set(copy.positions))}")
        added = self.store(image, positions, pages)
        if added is None:
            return None
        if copy.positions and added.positions:
            merged = tuple((self._host(torch.cat([k0, k1])), self._host(torch.cat([v0, v1])))
                           for (k0, v0), (k1, v1) in zip(copy.pages, added.pages, strict=True))
        else:
            merged = copy.pages or added.pages
        out = HostCopy(next(self._ids), copy.image if copy.image is not None else added.image,
                       copy.positions + added.positions, merged, copy.nbytes + added.nbytes)
        self.release(copy)
        self.release(added)
        self._live[out.copy_id] = out.nbytes
        self.used_bytes += out.nbytes
        return out

    def release(self, copy: HostCopy) -> None:
        nbytes = self._live.pop(copy.copy_id, None)
        if nbytes is None or nbytes != copy.nbytes:
            raise HostTierError(f"Host copy {copy.copy_id} is not live in this tier")
        self.used_bytes -= nbytes
