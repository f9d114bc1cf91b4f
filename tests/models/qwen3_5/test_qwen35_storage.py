"""Core storage used by the Qwen Program: the paged KV pool and the StateImage slots."""

from __future__ import annotations

import pytest
import torch
from ninfer.storage import (
    KVPoolError,
    PagedKVCache,
    StateField,
    StateImageError,
    StateImageStorage,
    StateLayout,
)


def _kv(num_pages=6, page_size=4):
    return PagedKVCache([3, 7], num_pages=num_pages, page_size=page_size, num_kv_heads=2, head_dim=4,
                        dtype=torch.float32, device=torch.device("cpu"))


def test_page_tables_slot_mapping_and_atomic_growth():
    kv = _kv()
    assert kv.ensure("a", 5) and kv.table("a") == (0, 1)
    assert kv.ensure("b", 4) and kv.table("b") == (2,)
    assert kv.slot_mapping("a", 3, 6) == [3, 4, 5]
    assert not kv.ensure("b", 17)                 # needs 4 more pages, 3 free: nothing taken
    assert kv.table("b") == (2,) and kv.allocator.free_pages == 3
    kv.release("a")
    assert kv.ensure("b", 9) and kv.table("b") == (2, 1, 0)    # last freed first: not contiguous
    assert kv.slot_mapping("b", 4, 6) == [4, 5] and kv.slot_mapping("b", 8, 9) == [0]
    pt = kv.page_table_tensor(["b", "c"], [9, 0])
    assert pt.dtype == torch.int32 and pt.tolist() == [[2, 1, 0], [0, 0, 0]]
    with pytest.raises(KVPoolError):
        kv.slot_mapping("b", 0, 13)
    with pytest.raises(KVPoolError):
        kv.allocator.free([5])
    assert kv.pools(3)[0].shape == (6, 4, 2, 4) and kv.bytes_per_token == 2 * 2 * (2 * 4 * 4)


def test_state_images_are_contiguous_typed_and_native_initialised():
    layout = StateLayout((StateField("conv", (5, 3), torch.bfloat16), StateField("rec", (2, 4, 4), torch.float32)))
    assert layout.offsets() == {"conv": 0, "rec": 256} and layout.image_bytes == 512
    st = StateImageStorage(layout, 3, torch.device("cpu"))
    a, b = st.allocate(), st.allocate()
    st.field("rec")[torch.tensor([b])] = 2.0       # indexed writes through the field view land in slot b
    st.slot_field("conv", a).fill_(1.5)
    assert st.field("rec")[a].abs().sum() == 0 and st.field("rec")[b].eq(2.0).all()
    image = st.image(b)
    assert image.is_contiguous() and image.numel() == 512
    assert torch.equal(image[256:384].view(torch.float32), torch.full((32,), 2.0))
    st.copy_image(b, a)
    assert st.field("rec")[a].eq(2.0).all() and st.field("conv")[a].abs().sum() == 0
    st.free(a)
    c = st.allocate()
    assert c == a and st.field("rec")[c].abs().sum() == 0 and st.field("conv")[c].abs().sum() == 0
    st.allocate()
    assert st.allocate() is None
    with pytest.raises(StateImageError):
        StateLayout((StateField("x", (1,), torch.float32), StateField("x", (1,), torch.float32)))
    st.free(c)
    with pytest.raises(StateImageError):
        st.free(c)
