"""The quantized-weight dequant-GEMV (decode rows, A16) for every stored format, against the fp64 oracle of the
decoded weights with the worst-case fp32 bound of tests/ops_triton/quant_cases.py (CUDA-core sums, round to
nearest: u = 2^-24; the fp8 row scale is one more rounding): odd K (not a multiple of the tile, the group or
128), M from 1 to the GEMV's limit, split-K, a packed row block inside its parent. Also the fused
norm/SwiGLU variants, logits, registration by format, and rows independent of the batch.
Runs on CUDA when present (larger shapes too), otherwise under TRITON_INTERPRET=1 at tiny sizes."""

import threading

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("cuda_core_gemv")

from ops.conftest import randn  # noqa: E402

from .conftest import CUDA, DEVICE, CountLaunches, triton_ops  # noqa: E402
from .quant_cases import FORMATS, U_RN, assert_dot_bound, random_packed  # noqa: E402

SHAPES = [(1, 7, 100), (2, 9, 64), (3, 13, 200), (5, 4, 257), (16, 6, 130)]
if CUDA:
    SHAPES += [(1, 2048, 4096), (4, 1000, 2500), (1, 24, 8192)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_linear_gemv_within_fp32_bound(fmt, dtype, m, n, k, gen):
    from ninfer.ops.triton.quant_gemv import MAX_ROWS

    ops = triton_ops(dtype)
    w = random_packed(gen, fmt, n, k, DEVICE)
    assert ops.implementation("linear", fmt).name == "triton_quant"
    assert m <= MAX_ROWS
    x = randn(gen, m, k, dtype=dtype, device=DEVICE)
    out = ops.linear(x, w)
    assert out.dtype == dtype and out.shape == (m, n) and out.device.type == DEVICE
    assert_dot_bound(out, x, w, u=U_RN, extra=1, what=f"{fmt} gemv {dtype} {m}x{k}->{n}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("split,lanes", [(2, 64), (3, 128), (None, 64)])
def test_split_k_and_small_tiles(fmt, split, lanes, gen):
    """Several K tiles (the prefetch loop), split-K partials summed in the kernel, and the automatic split (few
    rows: ``None``) all stay within the bound."""
    from ninfer.ops.triton._quant import kernel_weight
    from ninfer.ops.triton.quant_gemv import gemv

    w = random_packed(gen, fmt, 5, 300, DEVICE)
    x = randn(gen, 2, 300, dtype=torch.bfloat16, device=DEVICE)
    out = gemv(x, kernel_weight(w, "linear"), split=split, lanes=lanes)
    assert_dot_bound(out, x, w, u=U_RN, extra=1, what=f"{fmt} split {split} lanes {lanes}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3])
def test_split_k_sum_in_the_kernel_equals_the_sum_kernel(fmt, rows, gen, monkeypatch):
    """With several row blocks and three K runs, the last program of each row block adds the partials (no second
    launch) and gets the sum kernel's bits; the ticket counters are zero again afterwards."""
    from ninfer.ops.triton import _splitk
    from ninfer.ops.triton._quant import kernel_weight
    from ninfer.ops.triton.quant_gemv import gemv

    w = kernel_weight(random_packed(gen, fmt, 70, 600, DEVICE), "linear")
    x = randn(gen, rows, 600, dtype=torch.bfloat16, device=DEVICE)
    counted = CountLaunches(_splitk._sum_kernel)
    monkeypatch.setattr(_splitk, "_sum_kernel", counted)
    fused = gemv(x, w, split=3, lanes=128, block_n=16)
    assert counted.launches == 0 and not _splitk._TICKETS[x.device, threading.get_ident()].any()
    monkeypatch.setattr(_splitk, "_MAX_BLOCKS", 0)
    assert torch.equal(gemv(x, w, split=3, lanes=128, block_n=16), fused) and counted.launches == 1


def test_each_thread_has_its_own_ticket_counters():
    """Two threads (two Engines' workers, whose streams may run at once) never share counters; one thread's
    launches do, and more output blocks than counters is None (the sum kernel then runs)."""
    from ninfer.ops.triton import _splitk

    dev = torch.device(DEVICE)
    got = {}
    t = threading.Thread(target=lambda: got.update(other=_splitk.tickets(dev, 4)))
    t.start()
    t.join()
    mine = _splitk.tickets(dev, 4)
    assert mine is _splitk.tickets(dev, 8) and got["other"] is not mine
    assert _splitk.tickets(dev, _splitk._MAX_BLOCKS + 1) is None


def test_auto_split_fills_the_device_only_for_few_rows():
    from ninfer.ops.triton.quant_gemv import _MIN_PROGRAMS, auto_split

    assert auto_split(_MIN_PROGRAMS, 8) == 1
    assert auto_split(1, 8) == 8                    # at most one split per tile
    assert auto_split(_MIN_PROGRAMS // 4, 100) == 4


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_independent_of_the_batch(fmt, gen):
    """A row's result is the same bits alone or beside other rows, and for 1-D or 3-D x."""
    from ninfer.ops.triton.quant_gemv import MAX_ROWS

    ops = triton_ops(torch.bfloat16)
    w = random_packed(gen, fmt, 11, 150, DEVICE)
    x = randn(gen, MAX_ROWS, 150, dtype=torch.bfloat16, device=DEVICE)
    full = ops.linear(x, w)
    for m in (1, 3, 8):
        assert torch.equal(ops.linear(x[:m], w), full[:m])
    assert torch.equal(ops.linear(x[2], w), full[2])
    assert torch.equal(ops.linear(x.view(2, MAX_ROWS // 2, 150), w), full.view(2, MAX_ROWS // 2, 11))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3])
def test_logits_are_linear_as_fp32(fmt, rows, gen):
    ops = triton_ops(torch.bfloat16)
    assert ops.implementation("logits", fmt).name == "triton_quant"
    w = random_packed(gen, fmt, 37, 96, DEVICE)
    x = randn(gen, rows, 96, dtype=torch.bfloat16, device=DEVICE)
    out = ops.logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, 37)
    assert torch.equal(out, ops.linear(x, w).float())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 100), (1, 64), (3, 72)])
def test_add_rms_norm_linear(fmt, dtype, rows, hidden, gen):
    """One row: every program forms the row's pre-norm (the GEMV's prologue); more rows: the Triton norm then the
    product. The residual equals the Triton add_rms_norm_unit_offset's bit for bit, the normed row is within one
    ulp of it (another summation order of the sum of squares), and the product of the returned normed row is
    within the GEMV's bound."""
    ops = triton_ops(dtype)
    assert ops.implementation("add_rms_norm_unit_offset_linear", fmt).name == "triton_quant"
    x = randn(gen, rows, hidden, dtype=dtype, device=DEVICE)
    res = randn(gen, rows, hidden, dtype=dtype, device=DEVICE, scale=4.0)
    nw = randn(gen, hidden, dtype=dtype, device=DEVICE, scale=0.3)
    w = random_packed(gen, fmt, 19, hidden, DEVICE)
    y, h, new_res = ops.add_rms_norm_unit_offset_linear(x, res, nw, 1e-6, w)
    h_sep, res_sep = ops.add_rms_norm_unit_offset(x, res, nw, 1e-6)
    assert torch.equal(new_res, res_sep)
    # bf16: one ulp near the top of the row; fp32: two summation orders of the K squares (2 gamma_K relative,
    # halved by the rsqrt) plus the roundings of rsqrt (a few ulp on the GPU) and of the normed value.
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else (hidden + 8) * 2.0 ** -24
    assert (h.float() - h_sep.float()).abs().max() <= h_sep.float().abs().max() * ulp
    assert_dot_bound(y, h, w, u=U_RN, extra=1, what=f"{fmt} norm+gemv {dtype} rows {rows}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,hidden,inter", [(1, 100, 9), (1, 64, 16), (2, 64, 5)])
def test_add_rms_norm_swiglu(fmt, rows, hidden, inter, gen):
    """The SwiGLU epilogue (one row) is exactly silu_and_mul of the plain GEMV of the normed row it stored (same
    tiles: each dot rounded to x's dtype first); more rows are the composition. Residual and normed rows as in
    test_add_rms_norm_linear."""
    from ninfer.ops.triton._quant import kernel_weight
    from ninfer.ops.triton.quant_gemv import gemv

    ops = triton_ops(torch.bfloat16)
    assert ops.implementation("add_rms_norm_unit_offset_swiglu", fmt).name == "triton_quant"
    x = randn(gen, rows, hidden, dtype=torch.bfloat16, device=DEVICE)
    res = randn(gen, rows, hidden, dtype=torch.bfloat16, device=DEVICE, scale=4.0)
    nw = randn(gen, hidden, dtype=torch.bfloat16, device=DEVICE, scale=0.3)
    gate_up = random_packed(gen, fmt, 2 * inter, hidden, DEVICE)
    act, h, new_res = ops.add_rms_norm_unit_offset_swiglu(x, res, nw, 1e-6, gate_up)
    assert act.shape == (rows, inter) and act.dtype == torch.bfloat16
    y, h2, res2 = ops.add_rms_norm_unit_offset_linear(x, res, nw, 1e-6, gate_up)
    assert torch.equal(new_res, res2)
    assert (h.float() - h2.float()).abs().max() <= h2.float().abs().max() * 2.0 ** -7
    assert torch.equal(act, ops.silu_and_mul(gemv(h, kernel_weight(gate_up, "t"))))
    if rows == 1:  # the plain GEMV's rows against the oracle: the epilogue's inputs are within the bound
        assert_dot_bound(gemv(h, kernel_weight(gate_up, "t")), h, gate_up, u=U_RN, extra=1, what=f"{fmt} gate/up")


def test_packed_weights_reach_the_kernels_by_format(gen):
    """The dispatcher sends a packed weight to the quantized kernels and a dense one to the dense GEMV; bad
    inputs are errors naming the problem."""
    ops = triton_ops(torch.bfloat16)
    assert ops.implementation("linear").name == "triton"
    w = random_packed(gen, "q4_g64_fp16", 8, 64, DEVICE)
    x = randn(gen, 1, 64, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(ops.linear(x, w), ops.implementation("linear", "q4_g64_fp16").fn(x, w))
    with pytest.raises(ValueError, match="input features"):
        ops.linear(randn(gen, 1, 65, dtype=torch.bfloat16, device=DEVICE), w)
    with pytest.raises(ValueError, match="not \\[2I, N\\]"):
        ops.add_rms_norm_unit_offset_swiglu(x, x, x[0], 1e-6, random_packed(gen, "q8_g32_fp16", 7, 64, DEVICE))
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm_unit_offset_linear(x, x[:, :32], x[0], 1e-6, w)


def test_other_activation_dtypes_take_the_reference(gen):
    """fp64 activations (no kernel dtype) through the Triton op give the reference op's result."""
    from ninfer.ops.reference import quantized
    from ninfer.ops.triton.quant_linear import linear

    w = random_packed(gen, "q6_g64_fp16", 5, 80, DEVICE)
    x = randn(gen, 2, 80, dtype=torch.float64, device=DEVICE)
    assert torch.equal(linear(x, w), quantized.linear(x, w))


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q8_g32_fp16", "fp8_e4m3fn_row_bf16"])
def test_wide_weights_take_the_gemm_from_four_rows(fmt, gen, monkeypatch):
    """Decode calls of 4 to 16 rows on a weight of at least GEMM_MIN_N rows run the tensor-core GEMM (bit for bit
    its result, within its bound); fewer rows, or a narrower weight, the GEMV. Rows stay independent of the
    batch within each kernel's range. The threshold is lowered so that the interpreter runs a small weight."""
    from ninfer.ops.triton import quant_linear
    from ninfer.ops.triton._quant import kernel_weight
    from ninfer.ops.triton.quant_gemm import gemm
    from ninfer.ops.triton.quant_gemv import MAX_ROWS, gemv

    from .quant_cases import U_TC

    monkeypatch.setattr(quant_linear, "GEMM_MIN_N", 64)
    ops = triton_ops(torch.bfloat16)
    wide = random_packed(gen, fmt, 70, 130, DEVICE)
    narrow = random_packed(gen, fmt, 63, 130, DEVICE)
    x = randn(gen, MAX_ROWS, 130, dtype=torch.bfloat16, device=DEVICE)
    kw_wide, kw_narrow = kernel_weight(wide, "t"), kernel_weight(narrow, "t")
    assert quant_linear.GEMM_MIN_ROWS == 4
    for m in (1, 3):
        assert quant_linear.takes_gemv(m, kw_wide)
        assert torch.equal(ops.linear(x[:m], wide), gemv(x[:m], kw_wide))
    full = gemm(x, kw_wide)
    for m in (4, 9, MAX_ROWS):
        assert not quant_linear.takes_gemv(m, kw_wide) and quant_linear.takes_gemv(m, kw_narrow)
        out = ops.linear(x[:m], wide)
        assert torch.equal(out, full[:m])
        assert_dot_bound(out, x[:m], wide, u=U_TC, extra=1, what=f"{fmt} gemm dispatch {m} rows")
        assert torch.equal(ops.linear(x[:m], narrow), gemv(x[:m], kw_narrow))
