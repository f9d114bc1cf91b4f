"""Paged KV storage: one K and one V pool per attention layer, a free-page allocator, page tables.

Layout: every pool is ``[num_pages, page_size, Hkv, D]`` in the activation dtype (``Hkv`` and ``D`` the cache's,
or a layer's own: a drafter's layers may have another head geometry); token ``t`` of a
sequence lives at page ``table[t // page_size]``, offset ``t % page_size`` in *every* layer's pool
(all layers share one page table per sequence, so one allocation covers all of them).

Sharing (context cache, docs/design.md section 6): a *KVHistory* is the writable page list of one
owner (a sequence); a :class:`KVPrefixRef` is an exact read-only prefix of a history (a token count
and the pages covering it, the last one possibly partial). Every page carries a reference count:
one per history table and one per prefix ref that lists it.

Invariants:
- A page's reference count is the number of histories and prefix refs listing it; a page is free
  exactly when its count is 0 and it returns to the free list only when its last reference goes.
- A page with more than one reference is immutable: :meth:`PagedKVCache.ensure` copies every shared
  page in the range about to be written onto a fresh private page (copy-on-write) before any write,
  so a write by one history never changes what another history or prefix ref reads.
- :meth:`PagedKVCache.ensure` is atomic: it either extends (and privatises) a sequence's table to
  cover the asked token count or changes nothing.
- Pages are physical only; the logical frontier (how many tokens hold valid K/V) is the Program's
  ``computed`` count, never stored here; a prefix ref's ``num_tokens`` is the frontier it was taken at.

Side pools: an architecture may keep more per-token rows than its attention layers' K and V under the same
page tables (e.g. an attention indexer's keys), declared as side pools (:class:`SidePool`). Each is one more (K, V) pair of
its own ``[num_pages, page_size, heads, dim]`` geometry, reached with :meth:`PagedKVCache.pools` by its name; every
page operation (copy-on-write, Host copies, byte counts) covers it exactly as it covers a layer's pools.

Host tier (context cache): a prefix ref's page may be *detached* (:meth:`PagedKVCache.detach_pages`):
its entry becomes :data:`ON_HOST`, the ref drops its reference to the device page, and the caller
keeps the page's content in a Host copy (same ``[page_size, Hkv, D]`` layout per layer, read with
:meth:`PagedKVCache.read_pages`). :meth:`PagedKVCache.attach_pages` gives every ``ON_HOST`` entry a
fresh device page again (the caller writes the content back with :meth:`PagedKVCache.write_pages`).
A ref with an ``ON_HOST`` entry can never be adopted by a history (it is not on Device).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ninfer.errors import NInferError


class KVPoolError(NInferError):
    """A page-table operation broke the pool's ownership rules (unknown owner, double free, ...)."""


class PageAllocator:
    """A free list of page ids ``[0, num_pages)`` with a reference count per allocated page.

    Pages are handed out last-freed-first, so pages released by one sequence are reused by the next:
    after a few open/release cycles a sequence's pages are not contiguous, which is the normal case
    the attention ops must handle. :meth:`allocate` gives pages with count 1, :meth:`retain` adds a
    reference, :meth:`free` drops one; a page is back on the free list when its count reaches 0.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise KVPoolError(f"a KV pool needs at least one page, got num_pages={num_pages}")
        self.num_pages = num_pages
        # Stack: the end is handed out first. Reversed so a fresh allocator gives 0, 1, 2, ...
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs: dict[int, int] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` pages, or None (taking nothing) when fewer than ``n`` are free."""
        if n < 0:
            raise KVPoolError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """One more reference to each of ``pages`` (all must be allocated)."""
        pages = list(pages)
        for p in pages:
            if p not in self._refs:
                raise KVPoolError(f"page {p} is retained but not allocated")
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each of ``pages``; a page whose last reference goes is free again."""
        pages = list(pages)
        drops: dict[int, int] = {}
        for p in pages:
            drops[p] = drops.get(p, 0) + 1
            if drops[p] > self._refs.get(p, 0):
                raise KVPoolError(f"page {p} is freed but not allocated")
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                del self._refs[p]
                self._free.append(p)


@dataclass(frozen=True)
class SidePool:
    """A per-token (K, V) pair beside the attention layers' pools, ``[num_pages, page_size, num_heads, head_dim]``
    each, in the activation dtype, addressed by the same page tables. ``name`` must not be a layer index."""

    name: str
    num_heads: int
    head_dim: int


ON_HOST = -1  # a prefix ref's page entry whose content lives in a Host copy, not on the device


@dataclass(frozen=True)
class KVPrefixRef:
    """An exact read-only prefix of a KV history: tokens ``[0, num_tokens)`` live in ``pages`` (the
    last page may be partial). Holds one reference to each device page until released; an entry
    :data:`ON_HOST` holds none (its content is in the owner's Host copy)."""

    ref_id: int
    num_tokens: int
    pages: tuple[int, ...]

    @property
    def device_pages(self) -> tuple[int, ...]:
        return tuple(p for p in self.pages if p != ON_HOST)

    @property
    def host_indices(self) -> tuple[int, ...]:
        """Positions (page indices within the prefix) whose content is on Host."""
        return tuple(i for i, p in enumerate(self.pages) if p == ON_HOST)


class PagedKVCache:
    """KV pools of the attention layers plus per-sequence page tables.

    ``layers`` are the model's layer indices that own a pool (full-attention layers), ``side`` the
    side pools (:class:`SidePool`); the pools are reached with :meth:`pools` (a layer index or a side pool's
    name). ``geometry`` gives a layer its own ``(num_kv_heads, head_dim)`` (default: the cache's). Sequences
    are identified by any hashable owner id.
    """

    def __init__(self, layers: Sequence[int], *, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 geometry: Mapping[int, tuple[int, int]] | None = None, side: Sequence[SidePool] = ()) -> None:
        if page_size < 1:
            raise KVPoolError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.allocator = PageAllocator(num_pages)
        self.device = torch.device(device)
        geometry = dict(geometry or {})
        stray = sorted(set(geometry) - set(layers))
        if stray:
            raise KVPoolError(f"KV geometry given for layers {stray} that own no pool")

        def shape(layer: int) -> tuple[int, int, int, int]:
            return (num_pages, page_size, *geometry.get(layer, (num_kv_heads, head_dim)))

        self._pools: dict[int | str, tuple[torch.Tensor, torch.Tensor]] = {
            layer: (torch.zeros(shape(layer), dtype=dtype, device=self.device),
                    torch.zeros(shape(layer), dtype=dtype, device=self.device)) for layer in layers}
        for sp in side:
            if sp.name in self._pools or not isinstance(sp.name, str):
                raise KVPoolError(f"side pool name {sp.name!r} is not a new string key")
            side_shape = (num_pages, page_size, sp.num_heads, sp.head_dim)
            self._pools[sp.name] = (torch.zeros(side_shape, dtype=dtype, device=self.device),
                                    torch.zeros(side_shape, dtype=dtype, device=self.device))
        self._tables: dict[object, list[int]] = {}
        self._prefixes: dict[int, KVPrefixRef] = {}
        self._prefix_ids = itertools.count(1)

    # -- pools -------------------------------------------------------------------------------------
    def pools(self, layer: int | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The (K, V) pools of attention layer ``layer``, or of the side pool named ``layer``."""
        return self._pools[layer]

    @property
    def num_pools(self) -> int:
        """(K, V) pairs: the layers owning one, then the side pools."""
        return len(self._pools)

    @property
    def bytes_per_token(self) -> int:
        return sum(k[0, 0].numel() * k.element_size() * 2 for k, _ in self._pools.values())

    # -- ownership ---------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def capacity(self, owner: object) -> int:
        """Tokens the owner's pages can hold (0 for an owner without pages)."""
        return len(self._tables.get(owner, ())) * self.page_size

    def ensure(self, owner: object, num_tokens: int, write_from: int | None = None) -> bool:
        """Make ``owner``'s table cover ``num_tokens`` tokens, with every page holding a token of
        ``[write_from, num_tokens)`` private (shared ones are copied first: copy-on-write). Atomic:
        False, changing nothing, when pages run out. ``write_from`` None: no page is written."""
        table = self._tables.get(owner, [])
        need = self.pages_for(num_tokens) - len(table)
        cow: list[int] = []
        if write_from is not None and write_from < num_tokens:
            last = min(len(table), self.pages_for(num_tokens))
            cow = [i for i in range(write_from // self.page_size, last) if self.allocator.refcount(table[i]) > 1]
        total = max(0, need) + len(cow)
        if total == 0:
            return True
        pages = self.allocator.allocate(total)
        if pages is None:
            return False
        table = list(table)
        for i, new in zip(cow, pages, strict=False):
            old = table[i]
            for k, v in self._pools.values():
                k[new].copy_(k[old])
                v[new].copy_(v[old])
            table[i] = new
            self.allocator.free([old])
        self._tables[owner] = table + pages[len(cow):]
        return True

    def release(self, owner: object) -> None:
        """Drop ``owner``'s references to its pages (no-op for an owner that never took pages)."""
        self.allocator.free(self._tables.pop(owner, []))

    def writable(self, owner: object, start: int, end: int) -> bool:
        """Whether every page holding tokens ``[start, end)`` of ``owner`` is covered and private (an empty
        range needs no page: always)."""
        if end <= start:
            return True
        table = self._tables.get(owner, [])
        if end > len(table) * self.page_size:
            return False
        return all(self.allocator.refcount(table[i]) == 1
                   for i in range(start // self.page_size, self.pages_for(end)))

    # -- sharing -----------------------------------------------------------------------------------
    def share_prefix(self, owner: object, num_tokens: int) -> KVPrefixRef:
        """A read-only ref to ``owner``'s first ``num_tokens`` tokens (no copy: the pages are retained)."""
        table = self._tables.get(owner, [])
        if not 1 <= num_tokens <= len(table) * self.page_size:
            raise KVPoolError(f"prefix of {num_tokens} tokens of {owner!r} exceeds its {len(table)} pages")
        ref = KVPrefixRef(next(self._prefix_ids), num_tokens, tuple(table[: self.pages_for(num_tokens)]))
        self.allocator.retain(ref.pages)
        self._prefixes[ref.ref_id] = ref
        return ref

    def release_prefix(self, ref: KVPrefixRef) -> None:
        self._check_live(ref)
        del self._prefixes[ref.ref_id]
        self.allocator.free(ref.device_pages)

    def _check_live(self, ref: KVPrefixRef) -> None:
        if self._prefixes.get(ref.ref_id) != ref:
            raise KVPoolError(f"prefix ref {ref.ref_id} is not live")

    # -- Host tier ---------------------------------------------------------------------------------
    def private_indices(self, ref: KVPrefixRef) -> tuple[int, ...]:
        """Positions of ``ref``'s device pages that nothing else references (detaching them frees
        device pages; detaching a shared page would free nothing)."""
        self._check_live(ref)
        return tuple(i for i, p in enumerate(ref.pages) if p != ON_HOST and self.allocator.refcount(p) == 1)

    def cache_only_indices(self, ref: KVPrefixRef) -> tuple[int, ...]:
        """Positions of ``ref``'s device pages that no history (live sequence) holds: dropping every
        prefix ref listing them would free them."""
        self._check_live(ref)
        in_tables = {p for t in self._tables.values() for p in t}
        return tuple(i for i, p in enumerate(ref.pages) if p != ON_HOST and p not in in_tables)

    def detach_pages(self, ref: KVPrefixRef, indices: Sequence[int]) -> KVPrefixRef:
        """Replace ``ref`` by a live ref whose entries at ``indices`` are :data:`ON_HOST`, dropping
        its references to those device pages (the caller copied them out first). ``ref`` dies."""
        self._check_live(ref)
        pages = list(ref.pages)
        for i in indices:
            if pages[i] == ON_HOST:
                raise KVPoolError(f"page {i} of prefix ref {ref.ref_id} is already on Host")
        dropped = [pages[i] for i in indices]
        for i in indices:
            pages[i] = ON_HOST
        new = KVPrefixRef(next(self._prefix_ids), ref.num_tokens, tuple(pages))
        del self._prefixes[ref.ref_id]
        self._prefixes[new.ref_id] = new
        self.allocator.free(dropped)
        return new

    def attach_pages(self, ref: KVPrefixRef) -> tuple[KVPrefixRef, tuple[int, ...]] | None:
        """Give every :data:`ON_HOST` entry of ``ref`` a fresh device page. Returns the new live ref
        and the new pages (in ``ref.host_indices`` order) for the caller to fill, or None, changing
        nothing, when too few pages are free. ``ref`` dies on success."""
        self._check_live(ref)
        holes = ref.host_indices
        fresh = self.allocator.allocate(len(holes))
        if fresh is None:
            return None
        pages = list(ref.pages)
        for i, p in zip(holes, fresh, strict=True):
            pages[i] = p
        new = KVPrefixRef(next(self._prefix_ids), ref.num_tokens, tuple(pages))
        del self._prefixes[ref.ref_id]
        self._prefixes[new.ref_id] = new
        return new, tuple(fresh)

    def read_pages(self, pages: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per pool (in the order of the ``layers`` given at construction, then the side pools), copies ``(K, V)``
        of ``pages``, each ``[len(pages), page_size, heads, dim]`` of that pool, on the pools' device."""
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        return [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self._pools.values()]

    def write_pages(self, pages: Sequence[int], data: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write ``data`` (as :meth:`read_pages` returns it, on any device) into ``pages``."""
        if len(data) != len(self._pools):
            raise KVPoolError(f"page data for {len(data)} layers, the cache has {len(self._pools)}")
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        for (k, v), (hk, hv) in zip(self._pools.values(), data, strict=True):
            if hk.shape[0] != len(pages) or hk.shape[1:] != k.shape[1:] or hv.shape != hk.shape:
                raise KVPoolError(f"page data of shape {tuple(hk.shape)} does not fit {len(pages)} pages of "
                                  f"{tuple(k.shape[1:])}")
            k.index_copy_(0, idx, hk.to(self.device))
            v.index_copy_(0, idx, hv.to(self.device))

    def page_shape(self) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of one page of one pool (what a Host copy of a page holds per K/V)."""
        k, _ = next(iter(self._pools.values()))
        return tuple(k.shape[1:]), k.dtype

    def adopt_prefix(self, owner: object, ref: KVPrefixRef) -> None:
        """Start ``owner``'s history as ``ref``'s pages (shared; the first write copies the tail)."""
        if owner in self._tables:
            raise KVPoolError(f"{owner!r} already has a KV history")
        self._check_live(ref)
        if ON_HOST in ref.pages:
            raise KVPoolError(f"prefix ref {ref.ref_id} has pages on Host: restore them before adopting it")
        self.allocator.retain(ref.pages)
        self._tables[owner] = list(ref.pages)

    @property
    def num_prefixes(self) -> int:
        return len(self._prefixes)

    def pages_only_in_prefixes(self) -> int:
        """Pages that only prefix refs hold (what dropping every prefix ref would free)."""
        in_tables = {p for t in self._tables.values() for p in t}
        return len({p for r in self._prefixes.values() for p in r.device_pages} - in_tables)

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.bytes_per_token

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

    def page_rows(self, owners: Sequence[object], num_tokens: Sequence[int]) -> list[list[int]]:
        """Row b: the pages covering ``num_tokens[b]`` tokens of ``owners[b]`` (host lists)."""
        return [self._tables.get(o, [])[: self.pages_for(n)] for o, n in zip(owners, num_tokens, strict=True)]

    def page_table_tensor(self, owners: Sequence[object], num_tokens: Sequence[int], *,
                          non_blocking: bool = False) -> torch.Tensor:
        """``int32 [len(owners), maxp]``: row b lists the pages covering ``num_tokens[b]`` tokens of
        ``owners[b]``; unused entries are 0 (never read: kernels stop at the row's kv length).
        ``non_blocking``: copy through pinned memory without waiting for the stream (CUDA)."""
        rows = self.page_rows(owners, num_tokens)
        width = max(1, max((len(r) for r in rows), default=1))
        # One tensor from padded lists: a per-row tensor and slice assignment cost ~2 torch calls per row.
        table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32).reshape(len(rows), width)
        if non_blocking and self.device.type == "cuda":
            return table.pin_memory().to(self.device, non_blocking=True)
        return table.to(self.device)
