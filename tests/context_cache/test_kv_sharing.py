"""Page refcounts, prefix refs and copy-on-write of shared pages (ninfer.storage.kv_pool)."""

from __future__ import annotations

import pytest
import torch
from ninfer.storage.kv_pool import KVPoolError, PageAllocator, PagedKVCache


def make_cache(num_pages: int = 8, page_size: int = 4) -> PagedKVCache:
    return PagedKVCache([0, 3], num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=2,
                        dtype=torch.float32, device=torch.device("cpu"))


def write(cache: PagedKVCache, owner, start: int, end: int, value: float) -> None:
    """What an attention op does: store token t's K/V at its flat slot, in every layer."""
    for layer in (0, 3):
        k, v = cache.pools(layer)
        for s in cache.slot_mapping(owner, start, end):
            k.view(-1, 1, 2)[s] = value
            v.view(-1, 1, 2)[s] = -value


def read(cache: PagedKVCache, pages, num_tokens: int) -> list[float]:
    """Tokens [0, num_tokens) of a page list, as their layer-3 K values."""
    k, _ = cache.pools(3)
    ps = cache.page_size
    return [float(k[pages[t // ps], t % ps, 0, 0]) for t in range(num_tokens)]


def test_allocator_refcounts():
    a = PageAllocator(3)
    pages = a.allocate(2)
    a.retain(pages[:1])
    assert a.refcount(pages[0]) == 2 and a.free_pages == 1
    a.free(pages)
    assert a.refcount(pages[0]) == 1 and a.free_pages == 2  # the shared page stays
    a.free(pages[:1])
    assert a.free_pages == 3
    with pytest.raises(KVPoolError):
        a.free(pages[:1])
    with pytest.raises(KVPoolError):
        a.retain([0])
    b = a.allocate(1)
    with pytest.raises(KVPoolError):  # two drops of a page held once
        a.free(b + b)
    assert a.refcount(b[0]) == 1


def test_write_into_shared_tail_page_never_changes_other_readers():
    cache = make_cache()
    assert cache.ensure("a", 6, write_from=0)
    for t in range(6):
        write(cache, "a", t, t + 1, float(t + 1))
    ref = cache.share_prefix("a", 6)          # 1 full page + a tail page holding 2 tokens
    assert len(ref.pages) == 2 and cache.allocator.free_pages == 6
    cache.adopt_prefix("b", ref)
    assert cache.table("b") == ref.pages
    assert not cache.writable("b", 6, 7)      # the tail page is shared: no write yet
    # b's next write starts mid tail page: ensure copies it first (copy-on-write), a full page stays shared.
    assert cache.ensure("b", 8, write_from=6)
    assert cache.table("b")[0] == ref.pages[0] and cache.table("b")[1] != ref.pages[1]
    assert cache.writable("b", 6, 8)
    write(cache, "b", 6, 8, 100.0)
    # a also continues in its own (still shared with the ref) tail page: it must copy too.
    assert cache.ensure("a", 7, write_from=6)
    assert cache.table("a")[1] not in (ref.pages[1], cache.table("b")[1])
    write(cache, "a", 6, 7, 50.0)
    assert read(cache, ref.pages, 6) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert read(cache, cache.table("b"), 8) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0, 100.0]
    assert read(cache, cache.table("a"), 7) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 50.0]
    # Freeing: a page returns only when its last reference goes.
    cache.release("a")
    assert cache.allocator.refcount(ref.pages[0]) == 2
    cache.release_prefix(ref)
    assert cache.allocator.refcount(ref.pages[0]) == 1 and cache.allocator.refcount(ref.pages[1]) == 0
    cache.release("b")
    assert cache.allocator.free_pages == 8 and cache.num_prefixes == 0


def test_ensure_is_atomic_with_copy_on_write():
    cache = make_cache(num_pages=3)
    assert cache.ensure("a", 6, write_from=0)  # 2 pages
    ref = cache.share_prefix("a", 6)
    cache.adopt_prefix("b", ref)
    # b needs one copy of the tail page and one new page: only 1 is free, so nothing changes.
    assert not cache.ensure("b", 9, write_from=6)
    assert cache.table("b") == ref.pages and cache.allocator.free_pages == 1
    assert cache.ensure("b", 8, write_from=6)  # the copy alone fits
    assert cache.allocator.free_pages == 0


def test_page_aligned_prefix_needs_no_copy():
    cache = make_cache()
    assert cache.ensure("a", 8, write_from=0)
    ref = cache.share_prefix("a", 8)
    cache.adopt_prefix("b", ref)
    free = cache.allocator.free_pages
    assert cache.ensure("b", 9, write_from=8)   # a fresh page, no copy
    assert cache.allocator.free_pages == free - 1 and cache.table("b")[:2] == ref.pages


def test_prefix_rules():
    cache = make_cache()
    assert cache.ensure("a", 4, write_from=0)
    with pytest.raises(KVPoolError):
        cache.share_prefix("a", 5)
    ref = cache.share_prefix("a", 4)
    cache.adopt_prefix("b", ref)
    with pytest.raises(KVPoolError):
        cache.adopt_prefix("b", ref)
    cache.release_prefix(ref)
    with pytest.raises(KVPoolError):
        cache.release_prefix(ref)
    with pytest.raises(KVPoolError):
        cache.adopt_prefix("c", ref)
    assert cache.pages_only_in_prefixes() == 0


def test_a_layer_may_have_its_own_head_geometry():
    """A drafter's pools (``geometry``) share the page tables: copy-on-write, Host reads and writes cover them."""
    cache = PagedKVCache([0, 7], num_pages=6, page_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                         device=torch.device("cpu"), geometry={7: (3, 4)})
    assert cache.pools(0)[0].shape == (6, 4, 1, 2) and cache.pools(7)[1].shape == (6, 4, 3, 4)
    assert cache.bytes_per_token == 4 * (2 * 2 + 2 * 12)
    assert cache.ensure("a", 6, write_from=0)
    k7, _ = cache.pools(7)
    page = cache.table("a")[1]
    k7[page].fill_(5.0)
    ref = cache.share_prefix("a", 6)
    assert cache.ensure("a", 7, write_from=5)   # the shared tail page is copied, drafter pool included
    assert cache.table("a")[1] != page and torch.equal(k7[cache.table("a")[1]], k7[page])
    data = cache.read_pages([page])
    assert data[1][0].shape == (1, 4, 3, 4)
    cache.write_pages([page], [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in data])
    assert not k7[page].any()
    cache.release_prefix(ref)
    with pytest.raises(KVPoolError, match="own no pool"):
        PagedKVCache([0], num_pages=2, page_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                     device=torch.device("cpu"), geometry={5: (1, 2)})
