"""Triton rms_norm_unit_offset / add_rms_norm_unit_offset / gated_rms_norm against the reference suite's fp64 oracles and criteria,
plus the bf16 cast-chain check, wide and non-power-of-two rows, and weight-dtype promotion.

Criteria (from tests/ops/test_norm.py): pointwise fp32 rtol 4e-6 / atol 1e-6; bf16 rtol 2^-8 (gated 2^-7).
Against the torch reference op in bf16: at most 1% of elements differ, each by at most one bf16 ulp (fp32
summation order and rsqrt/exp implementations may straddle a rounding boundary, nothing more).
"""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import Pointwise, assert_bits, assert_pointwise, randn  # noqa: E402
from ops.oracles import (  # noqa: E402
    assert_bf16_within_one_ulp,
    gated_rms_bf16_cast_chain,
    gated_rms_oracle,
    rms_oracle,  # noqa: E402
)
from ops.shared_checks import check_add_rms_norm  # noqa: E402
from ops.test_norm import CRIT, CRIT_GATED, EPS  # noqa: E402

from .conftest import DEVICE, reference, triton_ops  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def close_to_reference(out, ref, what):
    if out.dtype == torch.float32:
        assert_pointwise(out, ref, Pointwise(4e-6, 1e-6), what)
    else:
        assert_bf16_within_one_ulp(out, ref, what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 3, 96), (5, 1000), (2, 2048)])
def test_rms_norm(dtype, shape, gen):
    ops = triton_ops(dtype)
    assert ops.implementation("rms_norm_unit_offset").name == "triton"
    x = randn(gen, *shape, dtype=dtype, device=DEVICE, scale=2.5)
    w = randn(gen, shape[-1], dtype=dtype, device=DEVICE, scale=0.3)
    out = ops.rms_norm_unit_offset(x, w, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    assert_pointwise(out, rms_oracle(x, w), CRIT[dtype], f"rms_norm_unit_offset {dtype} {shape}")
    close_to_reference(out, reference(dtype).rms_norm_unit_offset(x, w, EPS), "rms_norm_unit_offset vs torch reference")


def test_rms_norm_strided_rows(gen):
    # Per-head q-norm on a view [T, H, D] taken out of a wider projection (row stride != D).
    ops = triton_ops(torch.float32)
    wide = randn(gen, 6, 3, 40, device=DEVICE)
    x = wide[:, :, 4:36]
    w = randn(gen, 32, device=DEVICE, scale=0.3)
    assert_pointwise(ops.rms_norm_unit_offset(x, w, EPS), rms_oracle(x, w), CRIT[torch.float32], "strided rms_norm_unit_offset")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [1, 3, 4])
def test_rms_norm_groups_is_the_plain_norm_of_each_group(dtype, groups, gen):
    # The grouped launch (a weight slice per group, for plugins' per-stream norms) gives each group the bits the
    # plain kernel gives that group alone with its slice of the weight.
    from ninfer.ops.triton.norm import rms_norm_groups, rms_norm_unit_offset
    n = 48
    x = randn(gen, 5, groups * n, dtype=dtype, device=DEVICE, scale=2.5)
    w = randn(gen, groups * n, dtype=dtype, device=DEVICE, scale=0.3)
    out = rms_norm_groups(x, w, n, EPS)
    for g in range(groups):
        cols = slice(g * n, (g + 1) * n)
        assert_bits(out[:, cols], rms_norm_unit_offset(x[:, cols].contiguous(), w[cols].contiguous(), EPS),
                    f"group {g} of {groups}")
    with pytest.raises(ValueError, match="groups of 7"):
        rms_norm_groups(x, w, 7, EPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype, gen):
    ops = triton_ops(dtype)
    x, res, w, y, new_res = check_add_rms_norm(ops, DEVICE, dtype, 640, gen, CRIT[dtype], EPS)
    ref_y, ref_res = reference(dtype).add_rms_norm_unit_offset(x, res, w, EPS)
    assert_bits(new_res.cpu(), ref_res.cpu(), "residual vs torch reference")
    close_to_reference(y, ref_y, "add_rms_norm_unit_offset vs torch reference")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", [None, torch.float32])
def test_gated_rms_norm(dtype, w_dtype, gen):
    ops = triton_ops(dtype)
    x = randn(gen, 6, 4, 128, dtype=dtype, device=DEVICE, scale=2.0)
    gate = randn(gen, 6, 4, 128, dtype=dtype, device=DEVICE, scale=2.0)
    w = (1.0 + randn(gen, 128, scale=0.2)).to(w_dtype or dtype).to(DEVICE)
    out = ops.gated_rms_norm(x, gate, w, EPS)
    assert out.dtype == dtype
    assert_pointwise(out, gated_rms_oracle(x, gate, w, dtype), CRIT_GATED[dtype], f"gated {dtype}")
    close_to_reference(out, reference(dtype).gated_rms_norm(x, gate, w, EPS), "gated vs torch reference")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_gate_as_a_column_view(dtype, gen):
    """The GDN's gate z is [T, H, N] columns of a wider projection (row stride != H * N): read in place,
    the result equals the contiguous gate's bit for bit."""
    ops = triton_ops(dtype)
    x = randn(gen, 5, 4, 32, dtype=dtype, device=DEVICE, scale=2.0)
    wide = randn(gen, 5, 300, dtype=dtype, device=DEVICE, scale=2.0)
    gate = wide[:, 70:70 + 4 * 32].reshape(5, 4, 32)
    assert gate.stride() == (300, 32, 1)
    w = (1.0 + randn(gen, 32, scale=0.2)).to(dtype).to(DEVICE)
    out = ops.gated_rms_norm(x, gate, w, EPS)
    assert torch.equal(out, ops.gated_rms_norm(x, gate.contiguous(), w, EPS))
    close_to_reference(out, reference(dtype).gated_rms_norm(x, gate, w, EPS), "strided gate vs torch reference")


def test_gated_rms_norm_plain_weight():
    ops = triton_ops(torch.float32)
    g = torch.Generator().manual_seed(3)
    out = ops.gated_rms_norm(randn(g, 3, 16, device=DEVICE), randn(g, 3, 16, device=DEVICE),
                             torch.zeros(16, device=DEVICE), EPS)
    assert torch.count_nonzero(out) == 0


def test_gated_rms_norm_bf16_cast_chain_bitwise(gen):
    # Same check as the reference suite: every declared bf16 rounding modelled exactly in fp64.
    ops = triton_ops(torch.bfloat16)
    x = randn(gen, 64, 64, dtype=torch.bfloat16, device=DEVICE, scale=2.0)
    gate = randn(gen, 64, 64, dtype=torch.bfloat16, device=DEVICE, scale=2.0)
    w = (1.0 + randn(gen, 64, scale=0.2)).to(torch.bfloat16).to(DEVICE)
    out = ops.gated_rms_norm(x, gate, w, EPS)
    assert_bf16_within_one_ulp(out, gated_rms_bf16_cast_chain(x, gate, w), "gated_rms_norm bf16 cast chain")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [[7], [3, 49, 0, 3, 17], list(range(40))])
def test_embed_rms_norm_equals_gather_then_rms_norm_bitwise(dtype, tokens, gen):
    """One launch: the gathered rows exactly, and normed bit for bit the Triton rms_norm_unit_offset of them (same blocks,
    same reduction); ids outside the table are clamped instead of faulting the device."""
    ops = triton_ops(dtype)
    assert ops.implementation("embed_rms_norm_unit_offset").name == "triton"
    table = randn(gen, 50, 96, dtype=dtype, device=DEVICE, scale=2.5)
    w = randn(gen, 96, dtype=dtype, device=DEVICE, scale=0.3)
    ids = torch.tensor(tokens, device=DEVICE)
    normed, rows = ops.embed_rms_norm_unit_offset(ids, table, w, EPS)
    assert torch.equal(rows, table[ids])
    assert_bits(normed, ops.rms_norm_unit_offset(table[ids], w, EPS), "embed_rms_norm_unit_offset vs rms_norm_unit_offset")
    close_to_reference(normed, reference(dtype).embed_rms_norm_unit_offset(ids, table, w, EPS)[0], "embed_rms_norm_unit_offset vs reference")
    bad, _ = ops.embed_rms_norm_unit_offset(torch.tensor([-4, 50, 900], device=DEVICE), table, w, EPS)
    assert_bits(bad, ops.rms_norm_unit_offset(table[[0, 49, 49]], w, EPS), "clamped ids")
    assert ops.embed_rms_norm_unit_offset(ids[:0], table, w, EPS)[0].shape == (0, 96)


@pytest.mark.skipif(DEVICE != "cuda", reason="a page-locked host table read by the GPU needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_rms_norm_reads_a_pinned_host_table(gen, dtype):
    """A page-locked table in host memory (host experts place the input embedding there): the kernel reads its rows
    over the bus, the same bits as from a device copy of the table, inside a CUDA graph too."""
    ops = triton_ops(dtype)
    table = randn(gen, 50, 96, dtype=dtype, device="cpu", scale=2.5).pin_memory()
    w = randn(gen, 96, dtype=dtype, device=DEVICE, scale=0.3)
    ids = torch.tensor([3, 49, 0, 3, 17], device=DEVICE)
    normed, rows = ops.embed_rms_norm_unit_offset(ids, table, w, EPS)
    want, want_rows = ops.embed_rms_norm_unit_offset(ids, table.to(DEVICE), w, EPS)
    assert normed.device.type == "cuda" and rows.device.type == "cuda"
    assert_bits(rows, want_rows, "rows from the host table")
    assert_bits(normed, want, "normed from the host table")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = ops.embed_rms_norm_unit_offset(ids, table, w, EPS)
    ids.copy_(torch.tensor([1, 2, 3, 4, 5], device=DEVICE))
    graph.replay()
    assert_bits(captured, ops.embed_rms_norm_unit_offset(ids, table.to(DEVICE), w, EPS)[0], "replayed")
    with pytest.raises(ValueError, match="page-locked"):
        ops.embed_rms_norm_unit_offset(ids, table.clone(), w, EPS)


def test_embed_rms_norm_rejects_bad_arguments():
    ops = triton_ops(torch.float32)
    table, w = torch.zeros(10, 8, device=DEVICE), torch.zeros(8, device=DEVICE)
    with pytest.raises(ValueError, match="tokens must be int64"):
        ops.embed_rms_norm_unit_offset(torch.tensor([1], dtype=torch.int32, device=DEVICE), table, w, EPS)
    with pytest.raises(ValueError, match="do not match"):
        ops.embed_rms_norm_unit_offset(torch.tensor([1], device=DEVICE), table, torch.zeros(9, device=DEVICE), EPS)
