"""Triton linear (the decode GEMV) vs the fp64 oracle and criteria of tests/ops/test_linear.py: one to MAX_ROWS
rows, K that fills the tile or not, K above one tile (the chunk loop), row-strided x, 1-D and 3-D x; rows are
independent of each other (bit-equal whatever M); shapes it does not take go to the reference unchanged."""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import assert_normwise, randn  # noqa: E402
from ops.test_linear import CRIT, oracle  # noqa: E402

from .conftest import DEVICE, reference, triton_ops  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n_in,n_out", [(1, 64, 24), (2, 48, 33), (3, 100, 7), (4, 256, 40), (8, 40, 9)])
def test_gemv_matches_fp64(dtype, rows, n_in, n_out, gen):
    from ninfer.ops.triton.linear import use_gemv

    ops = triton_ops(dtype)
    assert ops.implementation("linear").name == "triton"
    x = randn(gen, rows, n_in, dtype=dtype, device=DEVICE)
    w = randn(gen, n_out, n_in, dtype=dtype, device=DEVICE, scale=n_in ** -0.5)
    assert use_gemv(x, w)
    out = ops.linear(x, w)
    assert out.dtype == dtype and out.shape == (rows, n_out)
    assert_normwise(out, oracle(x, w), CRIT[dtype], f"gemv {dtype} {rows}x{n_in}->{n_out}")


@pytest.mark.parametrize("n_in", [96, 100])
def test_k_above_one_tile_loops(monkeypatch, n_in, gen):
    from ninfer.ops.triton import linear as mod

    monkeypatch.setattr(mod, "_TILE", 32)       # BK = 32: three or four K chunks (each prefetched one ahead)
    x = randn(gen, 2, n_in, device=DEVICE)
    w = randn(gen, 9, n_in, device=DEVICE, scale=n_in ** -0.5)
    assert_normwise(mod.linear(x, w), oracle(x, w), CRIT[torch.float32], f"gemv K loop {n_in}")


def test_rows_are_independent_of_the_batch(gen):
    # A row's result is the same bits whether it is computed alone or beside other rows.
    ops = triton_ops(torch.bfloat16)
    x = randn(gen, 8, 80, dtype=torch.bfloat16, device=DEVICE)
    w = randn(gen, 19, 80, dtype=torch.bfloat16, device=DEVICE, scale=80 ** -0.5)
    full = ops.linear(x, w)
    for m in range(1, 8):
        assert torch.equal(ops.linear(x[:m], w), full[:m])
    assert torch.equal(ops.linear(x[2], w), full[2])


def test_strided_and_batched_inputs(gen):
    ops = triton_ops(torch.float32)
    wide = randn(gen, 3, 70, device=DEVICE)
    x = wide[:, 5:5 + 48]                                      # row stride 70
    w = randn(gen, 16, 48, device=DEVICE, scale=48 ** -0.5)
    assert_normwise(ops.linear(x, w), oracle(x, w), CRIT[torch.float32], "row-strided gemv")
    x3 = randn(gen, 2, 2, 48, device=DEVICE)                  # 4 rows over two leading dims
    out = ops.linear(x3, w)
    assert out.shape == (2, 2, 16)
    assert_normwise(out, oracle(x3, w), CRIT[torch.float32], "3-D gemv")


def test_other_shapes_take_the_reference(gen):
    from ninfer.ops.triton.linear import MAX_ROWS, use_gemv

    ops, ref = triton_ops(torch.float32), reference(torch.float32)
    w = randn(gen, 12, 40, device=DEVICE)
    many = randn(gen, MAX_ROWS + 1, 40, device=DEVICE)
    assert not use_gemv(many, w)
    assert torch.equal(ops.linear(many, w), ref.linear(many, w))
    mixed = w.to(torch.bfloat16)                              # mixed dtypes: the reference promotes
    one = randn(gen, 1, 40, device=DEVICE)
    assert not use_gemv(one, mixed)
    assert torch.equal(ops.linear(one, mixed), ref.linear(one, mixed))
    with pytest.raises(ValueError, match="input features"):
        ops.linear(one, randn(gen, 12, 41, device=DEVICE))


def test_rows_times_weight_bytes_bounds_the_gemv(monkeypatch, gen):
    # One row always streams through the GEMV; more rows only while rows * weight bytes <= MAX_ROW_BYTES.
    from ninfer.ops.triton import linear as mod

    w = randn(gen, 16, 64, device=DEVICE)                    # 4 KB of fp32
    monkeypatch.setattr(mod, "MAX_ROW_BYTES", 2 * 4096)
    assert mod.use_gemv(randn(gen, 1, 64, device=DEVICE), w)
    assert mod.use_gemv(randn(gen, 2, 64, device=DEVICE), w)
    assert not mod.use_gemv(randn(gen, 3, 64, device=DEVICE), w)
    monkeypatch.setattr(mod, "MAX_ROW_BYTES", 0)   # one row streams whatever the weight's size (the LM head)
    assert mod.use_gemv(randn(gen, 1, 64, device=DEVICE), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 9])
def test_logits_are_linear_as_fp32(dtype, rows, gen):
    """``logits`` stores fp32 from the GEMV (rows it takes) or casts the reference's result (rows it does not):
    either way bit for bit ``linear(x, w).float()`` of the same implementation."""
    ops = triton_ops(dtype)
    assert ops.implementation("logits").name == "triton"
    x = randn(gen, rows, 64, dtype=dtype, device=DEVICE)
    w = randn(gen, 37, 64, dtype=dtype, device=DEVICE, scale=0.125)
    out = ops.logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, 37)
    assert torch.equal(out, ops.linear(x, w).float())
    assert torch.equal(reference(dtype).logits(x, w), reference(dtype).linear(x, w).float())
    with pytest.raises(ValueError, match="input features"):
        ops.logits(x, w[:, :63])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,n_out", [(1, 64, 24), (2, 48, 33), (8, 40, 9), (9, 64, 16)])
def test_add_rms_norm_linear(dtype, rows, hidden, n_out, gen):
    """The GEMV with the norm prologue (one row; more rows take add_rms_norm_unit_offset + linear) against the reference
    suite's check; its residual equals the Triton add_rms_norm_unit_offset's bit for bit, its normed rows within one
    bf16 ulp (the norm's reduction order differs)."""
    from ninfer.ops.triton.linear import use_gemv
    from ops.shared_checks import check_add_rms_norm_linear
    from ops.test_norm import CRIT as NORM_CRIT
    from ops.test_norm import EPS

    ops = triton_ops(dtype)
    assert ops.implementation("add_rms_norm_unit_offset_linear").name == "triton"
    x, res, w, weight, y, h, new_res = check_add_rms_norm_linear(ops, DEVICE, dtype, rows, hidden, n_out, gen,
                                                                 NORM_CRIT[dtype], CRIT[dtype], EPS)
    assert use_gemv(x, weight) == (rows <= 8)   # the plain GEMV's range; the fused one is rows == 1
    h_sep, res_sep = ops.add_rms_norm_unit_offset(x, res, w, EPS)
    assert torch.equal(new_res, res_sep)
    assert (h.float() - h_sep.float()).abs().max() <= h_sep.float().abs().max() * 2 ** -7


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("block_n", [2, 4])
def test_norm_prologue_kernel_rows_and_block_sizes(rows, block_n, gen):
    """The prologue kernel itself (the op takes it for one row) at several rows and row blocks: every program
    forms the same normed rows, and program 0's stored copies equal the unfused add_rms_norm_unit_offset's residual."""
    from ninfer.ops.triton import linear as mod
    from ninfer.ops.triton import norm

    x = randn(gen, rows, 64, dtype=torch.bfloat16, device=DEVICE)
    res = randn(gen, rows, 64, dtype=torch.bfloat16, device=DEVICE)
    w = randn(gen, 64, dtype=torch.bfloat16, device=DEVICE, scale=0.3)
    weight = randn(gen, 12, 64, dtype=torch.bfloat16, device=DEVICE, scale=0.125)
    h, ro = torch.empty_like(x), torch.empty_like(x)
    y = mod.gemv(x, weight, norm=(res, w, 1e-6, h, ro), block_n=block_n)
    h_sep, res_sep = norm.add_rms_norm_unit_offset(x, res, w, 1e-6)
    assert torch.equal(ro, res_sep)
    assert (h.float() - h_sep.float()).abs().max() <= h_sep.float().abs().max() * 2 ** -7
    assert torch.equal(y, mod.gemv(h, weight, block_n=block_n))   # y is the GEMV of the normed rows it stored


def test_add_rms_norm_linear_rejects_mismatched_shapes(gen):
    ops = triton_ops(torch.float32)
    x = randn(gen, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm_unit_offset_linear(x, x[:1], torch.zeros(64, device=DEVICE), 1e-6, randn(gen, 8, 64, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,inter", [(1, 64, 24), (1, 48, 33), (2, 64, 16)])
def test_add_rms_norm_swiglu(dtype, rows, hidden, inter, gen):
    """One row: the GEMV computes gate row n and up row I + n and stores silu(g) * u (each dot rounded first);
    more rows: add_rms_norm_unit_offset_linear + silu_and_mul. Against the Triton composition: the residual bit for bit, the
    activation within linear's criteria of silu_and_mul over the composition's (bitwise when the dots agree)."""
    from ninfer.ops.triton.linear import gemv

    ops = triton_ops(dtype)
    assert ops.implementation("add_rms_norm_unit_offset_swiglu").name == "triton"
    x = randn(gen, rows, hidden, dtype=dtype, device=DEVICE)
    res = randn(gen, rows, hidden, dtype=dtype, device=DEVICE, scale=4.0)
    w = randn(gen, hidden, dtype=dtype, device=DEVICE, scale=0.3)
    gate_up = randn(gen, 2 * inter, hidden, dtype=dtype, device=DEVICE, scale=hidden ** -0.5)
    act, h, new_res = ops.add_rms_norm_unit_offset_swiglu(x, res, w, 1e-6, gate_up)
    assert act.shape == (rows, inter) and act.dtype == dtype
    y, h2, res2 = ops.add_rms_norm_unit_offset_linear(x, res, w, 1e-6, gate_up)
    assert torch.equal(new_res, res2)
    expect = ops.silu_and_mul(y)
    assert_normwise(act, expect.double(), CRIT[dtype], f"add_rms_norm_unit_offset_swiglu {dtype}")
    # The epilogue alone on the normed rows: exactly silu_and_mul of the plain GEMV of the same rows and tiles.
    plain = gemv(h, gate_up, block_n=2)
    assert torch.equal(gemv(h, gate_up, swiglu=True, block_n=2), ops.silu_and_mul(plain))
