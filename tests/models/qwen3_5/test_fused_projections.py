"""layers.fused.row_groups: row-adjacent weights become one zero-copy view, anything else stays apart, and
``project`` gives the same columns as one linear per weight."""

import torch
from ninfer.ops.reference.plugin import ninfer_ops as reference_ops
from ninfer.ops.registry import resolve_ops
from ninfer_qwen3_5.layers.fused import project, row_groups


def _ops():
    return resolve_ops(reference_ops(), "cpu", torch.float32, force="reference")


def test_adjacent_rows_fuse_without_a_copy_and_project_the_same():
    g = torch.Generator().manual_seed(0)
    parent_a = torch.randn(10 + 6, 8, generator=g)       # like the converter's [qkv | z] parent
    parent_b = torch.randn(3 + 3, 8, generator=g)        # and its [b | a] parent
    qkv, z = parent_a[:10], parent_a[10:]
    b, a = parent_b[:3], parent_b[3:]
    groups = row_groups([qkv, z, b, a])
    assert [gr.sizes for gr in groups] == [(10, 6), (3, 3)]
    assert groups[0].weight.data_ptr() == parent_a.data_ptr() and groups[0].weight.shape == (16, 8)
    assert groups[1].weight.untyped_storage().data_ptr() == parent_b.untyped_storage().data_ptr()
    h = torch.randn(5, 8, generator=g)
    outs = project(_ops(), h, groups)
    for out, w in zip(outs, (qkv, z, b, a), strict=True):
        torch.testing.assert_close(out, h @ w.t(), rtol=1e-6, atol=1e-6)


def test_separate_or_reordered_weights_stay_apart():
    g = torch.Generator().manual_seed(1)
    parent = torch.randn(12, 8, generator=g)
    first, second = parent[:5], parent[5:]
    other = torch.randn(4, 8, generator=g)               # its own storage, even if allocated next to it
    assert [gr.sizes for gr in row_groups([second, first])] == [(7,), (5,)]   # adjacent only in reverse order
    assert [gr.sizes for gr in row_groups([first, other])] == [(5,), (4,)]
    cast = second.to(torch.bfloat16)                     # a cast copy is never adjacent
    assert [gr.sizes for gr in row_groups([first, cast])] == [(5,), (7,)]
