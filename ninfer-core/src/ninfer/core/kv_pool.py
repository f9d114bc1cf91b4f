"""Paged KV storage: one K and one V pool per attention layer, a free-page allocator, page tables.

Layout: every pool is ``[num_pages, page_size, Hkv, D]`` in the activation dtype; token ``t`` of a
sequence lives at page ``table[t // page_size]``, offset ``t % page_size`` in *every* layer's pool
(all layers share one page table per sequence, so one allocation covers all of them).

Invariants:
- A page id is owned by at most one sequence; free pages are exactly those owned by none.
- :meth:`PagedKVCache.ensure` is atomic: it either extends a sequence's table to cover the asked
  token count or changes nothing.
- Pages are physical only; the logical frontier (how many tokens hold valid K/V) is the Program's
  ``computed`` count, never stored here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ninfer.errors import NInferError


class KVPoolError(NInferError):
    """A page-table operation broke the pool's ownership rules (unknown owner, double free, ...)."""


class PageAllocator:
    """A free list of page ids ``[0, num_pages)``.

    Pages are handed out last-freed-first, so pages released by one sequence are reused by the next:
    after a few open/release cycles a sequence's pages are not contiguous, which is the normal case
    the attention ops must handle.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise KVPoolError(f"a KV pool needs at least one page, got num_pages={num_pages}")
        self.num_pages = num_pages
        # Stack: the end is handed out first. Reversed so a fresh allocator gives 0, 1, 2, ...
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` pages, or None (taking nothing) when fewer than ``n`` are free."""
        if n < 0:
            raise KVPoolError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        for p in pages:
            if p not in self._used:
                raise KVPoolError(f"page {p} is freed but not allocated")
        for p in pages:
            self._used.remove(p)
            self._free.append(p)


class PagedKVCache:
    """KV pools of the attention layers plus per-sequence page tables.

    ``layers`` are the model's layer indices that own a pool (full-attention layers); the pools are
    reached with :meth:`pools`. Sequences are identified by any hashable owner id.
    """

    def __init__(self, layers: Sequence[int], *, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        if page_size < 1:
            raise KVPoolError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages)
        self.device = torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self._pools = {layer: (torch.zeros(shape, dtype=dtype, device=self.device),
                               torch.zeros(shape, dtype=dtype, device=self.device)) for layer in layers}
        self._tables: dict[object, list[int]] = {}

    # -- pools -------------------------------------------------------------------------------------
    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pools[layer]

    @property
    def bytes_per_token(self) -> int:
        return sum(k[0, 0].numel() * k.element_size() * 2 for k, _ in self._pools.values())

    # -- ownership ---------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def capacity(self, owner: object) -> int:
        """Tokens the owner's pages can hold (0 for an owner without pages)."""
        return len(self._tables.get(owner, ())) * self.page_size

    def ensure(self, owner: object, num_tokens: int) -> bool:
        """Make ``owner``'s table cover ``num_tokens`` tokens; atomic, False when pages run out."""
        table = self._tables.get(owner, [])
        need = self.pages_for(num_tokens) - len(table)
        if need <= 0:
            return True
        pages = self.allocator.allocate(need)
        if pages is None:
            return False
        self._tables[owner] = table + pages
        return True

    def release(self, owner: object) -> None:
        """Free every page of ``owner`` (no-op for an owner that never took pages)."""
        self.allocator.free(self._tables.pop(owner, []))

    def table(self, owner: object) -> tuple[int, ...]:
        return tuple(self._tables.get(owner, ()))

    # -- addressing --------------------------------------------------------------------------------
    def slot_mapping(self, owner: object, start: int, end: int) -> list[int]:
        """Flat slot ``page * page_size + offset`` of tokens ``[start, end)``; they must be covered."""
        table = self._tables.get(owner, [])
        if end > len(table) * self.page_size:
            raise KVPoolError(f"tokens [{start}, {end}) of {owner!r} exceed its {len(table)} pages")
        ps = self.page_size
        return [table[t // ps] * ps + t % ps for t in range(start, end)]

    def page_table_tensor(self, owners: Sequence[object], num_tokens: Sequence[int]) -> torch.Tensor:
        """``int32 [len(owners), maxp]``: row b lists the pages covering ``num_tokens[b]`` tokens of
        ``owners[b]``; unused entries are 0 (never read: kernels stop at the row's kv length)."""
        rows = [self._tables.get(o, [])[: self.pages_for(n)] for o, n in zip(owners, num_tokens, strict=True)]
        width = max(1, max((len(r) for r in rows), default=1))
        out = torch.zeros((len(rows), width), dtype=torch.int32)
        for b, r in enumerate(rows):
            if r:
                out[b, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return out.to(self.device)
