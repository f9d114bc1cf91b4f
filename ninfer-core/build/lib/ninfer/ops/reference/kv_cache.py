"""Torch reference ``kv_cache_write``: scatter new K/V rows into the paged pools.

Invariants: token t lands at ``pool[slot // page, slot % page]`` for ``slot = slot_mapping[t]``, copied
bit-exactly (cast only if the pool's dtype differs); every other pool element is untouched. Slots must be
distinct and inside the pool (an out-of-range slot raises, it is never wrapped).
"""

from __future__ import annotations

import torch

from ninfer.ops.registry import OpImpl


def kv_cache_write(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Write ``k[T, Hkv, D]``/``v`` into ``k_pool``/``v_pool`` ``[P, page, Hkv, D]`` in place."""
    page = k_pool.shape[1]
    slots = slot_mapping.to(device=k_pool.device, dtype=torch.long)
    capacity = k_pool.shape[0] * page
    # torch indexing would wrap a negative page index silently and corrupt another sequence's KV.
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= capacity):
        raise IndexError(f"kv_cache_write: slot_mapping outside [0, {capacity})")
    pages, offsets = slots // page, slots % page
    # index_put_ on (page, offset) works for non-contiguous pools too (no view over P * page needed).
    k_pool.index_put_((pages, offsets), k.to(k_pool.dtype))
    v_pool.index_put_((pages, offsets), v.to(v_pool.dtype))


OPS = [OpImpl(op="kv_cache_write", name="torch_reference", fn=kv_cache_write, priority=0)]
