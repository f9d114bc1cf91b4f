"""Side pools of the paged KV (ninfer.storage.kv_pool.SidePool): per-token rows of their own geometry under the same
page tables, covered by copy-on-write, Host page copies and the byte counts exactly as a layer's pools are."""

from __future__ import annotations

import pytest
import torch
from ninfer.storage.kv_pool import KVPoolError, PagedKVCache, SidePool


def make_cache(num_pages: int = 8, page_size: int = 4) -> PagedKVCache:
    return PagedKVCache([0, 3], num_pages=num_pages, page_size=page_size, num_kv_heads=2, head_dim=4,
                        dtype=torch.float32, device=torch.device("cpu"), side=(SidePool("layers/3/indexer", 1, 6),))


def fill(cache: PagedKVCache, owner, start: int, end: int, value: float) -> None:
    for key in (0, 3, "layers/3/indexer"):
        k, v = cache.pools(key)
        for s in cache.slot_mapping(owner, start, end):
            k.flatten(0, 1)[s] = value
            v.flatten(0, 1)[s] = -value


def test_side_pool_geometry_and_bytes():
    cache = make_cache()
    k, v = cache.pools("layers/3/indexer")
    assert k.shape == v.shape == (8, 4, 1, 6)
    assert cache.num_pools == 3
    assert cache.bytes_per_token == 2 * 2 * (2 * 4 * 4) + 2 * 6 * 4
    with pytest.raises(KVPoolError, match="side pool name"):
        PagedKVCache([0], num_pages=2, page_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                     device=torch.device("cpu"), side=(SidePool("x", 1, 2), SidePool("x", 1, 2)))


def test_copy_on_write_copies_the_side_pool_too():
    cache = make_cache()
    assert cache.ensure("a", 6, write_from=0)
    fill(cache, "a", 0, 6, 1.0)
    ref = cache.share_prefix("a", 6)
    cache.adopt_prefix("b", ref)
    assert cache.ensure("b", 7, write_from=6)      # the shared tail page is copied before b writes into it
    fill(cache, "b", 6, 7, 2.0)
    k, _ = cache.pools("layers/3/indexer")
    a_tail, b_tail = cache.table("a")[1], cache.table("b")[1]
    assert a_tail != b_tail
    assert torch.equal(k[b_tail, :2], k[a_tail, :2])   # the copied tokens 4, 5
    assert float(k[b_tail, 2, 0, 0]) == 2.0 and float(k[a_tail, 2, 0, 0]) == 0.0


def test_host_page_copies_hold_every_pool_in_its_own_shape():
    cache = make_cache()
    assert cache.ensure("a", 8, write_from=0)
    fill(cache, "a", 0, 8, 3.0)
    pages = list(cache.table("a"))
    data = cache.read_pages(pages)
    assert [tuple(k.shape) for k, _ in data] == [(2, 4, 2, 4), (2, 4, 2, 4), (2, 4, 1, 6)]
    fresh = cache.allocator.allocate(2)
    cache.write_pages(fresh, data)
    for key in (0, 3, "layers/3/indexer"):
        k, v = cache.pools(key)
        assert torch.equal(k[fresh], k[pages]) and torch.equal(v[fresh], v[pages])
