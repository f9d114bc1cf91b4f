"""Core storage primitives shared by every architecture's Program: paged KV pools and StateImage slots."""

from ninfer.storage.kv_pool import KVPoolError, PageAllocator, PagedKVCache, SidePool
from ninfer.storage.state_image import StateField, StateImageError, StateImageStorage, StateLayout

__all__ = [
    "KVPoolError", "PageAllocator", "PagedKVCache", "SidePool",
    "StateField", "StateImageError", "StateImageStorage", "StateLayout",
]
