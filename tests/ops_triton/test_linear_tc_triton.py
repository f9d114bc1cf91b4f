"""The tensor-core bf16/fp16 GEMV (``ninfer.ops.triton.linear_tc``, ``NINFER_GEMV_TC=1``) against the fp64 oracle
with the tensor-core bound (tests/ops_triton/quant_cases.py ``U_TC``): 1 to 16 rows (B operands of 8 and 16 columns), K and N not whole tiles,
split-K with the partials added in the kernel or by the second kernel (the same bits), fp32 logits equal to the
rounded product; and ``linear`` / ``logits`` routing to it only when the setting is on and the CUDA-core GEMV
refuses the call. Runs on CUDA when present, otherwise under TRITON_INTERPRET=1 at tiny sizes."""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import randn  # noqa: E402

from .conftest import CUDA, DEVICE, CountLaunches  # noqa: E402
from .quant_cases import U_OUT, U_TC  # noqa: E402

SHAPES = [(1, 200, 384), (2, 130, 256), (3, 257, 1000), (5, 64, 130), (8, 300, 640), (9, 140, 300),
          (16, 129, 256)]
if CUDA:
    SHAPES += [(4, 4096, 4096), (8, 12288, 4096), (2, 2048, 12288), (4, 248320 // 8, 4096), (16, 12352, 4096)]


def _within_bound(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    xd, wd = x.double().cpu(), w.double().cpu()
    ref = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    n = x.shape[1] + 2                                   # the dot's lanes, the K-run sum, the rounding
    gamma = n * U_TC / (1 - n * U_TC)
    u_out = U_OUT[out.dtype]
    err = (out.double().cpu() - ref).abs()
    bound = u_out * ref.abs() + (1 + u_out) * gamma * mag
    assert (err <= bound).all(), f"{what}: worst excess {float((err - bound).max())}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_within_the_tensor_core_bound(m, n, k, dtype, gen):
    from ninfer.ops.triton import linear_tc

    x = randn(gen, m, k, dtype=dtype, device=DEVICE)
    w = randn(gen, n, k, dtype=dtype, device=DEVICE, scale=k ** -0.5)
    y = linear_tc.gemv_tc(x, w)
    assert y.shape == (m, n) and y.dtype == dtype
    _within_bound(y, x, w, f"tc gemv {m}x{k}->{n} {dtype}")


@pytest.mark.parametrize("split", [1, 2, 3])
def test_split_k_sums_in_the_kernel_equal_the_sum_kernel_and_logits_are_the_rounded_product(split, gen):
    from ninfer.ops.triton import _splitk, linear_tc

    m, n, k = 3, 300, 700                                 # 6 K steps of 128, the last partial
    x = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE)
    w = randn(gen, n, k, dtype=torch.bfloat16, device=DEVICE, scale=k ** -0.5)
    fused = linear_tc.gemv_tc(x, w, split=split)
    second = linear_tc.gemv_tc(x, w, split=split, in_kernel_sum=False)
    assert torch.equal(fused, second)
    assert torch.equal(linear_tc.gemv_tc(x, w, split=split, out_dtype=torch.float32), fused.float())
    _within_bound(fused, x, w, f"split {split}")
    assert int(_splitk.tickets(torch.device(DEVICE), 1).abs().sum()) == 0   # counters reset for the next launch


def test_refusals_are_named():
    from ninfer.ops.triton import linear_tc

    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(32, 64, dtype=torch.bfloat16, device=DEVICE)
    assert linear_tc.takes(x, w)
    for bad_x, bad_w in ((x.float(), w.float()), (torch.zeros(17, 64, dtype=torch.bfloat16, device=DEVICE), w),
                         (x, w.half()), (x[:, :32], w[:, :32].t().contiguous().t())):
        assert not linear_tc.takes(bad_x, bad_w)
    with pytest.raises(ValueError, match="tensor-core gemv: cannot take"):
        linear_tc.gemv_tc(x.float(), w.float())


@pytest.mark.parametrize("enabled", [False, True])
def test_linear_and_logits_route_to_it_only_when_on_and_the_gemv_refuses(enabled, gen, monkeypatch):
    from ninfer.ops.triton import linear, linear_tc

    monkeypatch.setattr(linear_tc, "ENABLED", enabled)
    monkeypatch.setattr(linear, "MAX_ROW_BYTES", 1)      # every call of 2+ rows is left by the CUDA-core GEMV
    counted = CountLaunches(linear_tc._tc_kernel)
    monkeypatch.setattr(linear_tc, "_tc_kernel", counted)
    x = randn(gen, 2, 3, 256, dtype=torch.bfloat16, device=DEVICE)
    w = randn(gen, 200, 256, dtype=torch.bfloat16, device=DEVICE, scale=256 ** -0.5)
    y = linear.linear(x, w)
    lg = linear.logits(x, w)
    assert y.shape == (2, 3, 200) and lg.dtype == torch.float32 and torch.equal(lg, y.float())
    one = linear.linear(x[:1, :1], w)                   # one row: the CUDA-core GEMV either way
    assert counted.launches == (2 if enabled else 0)
    _within_bound(y.reshape(6, 200), x.reshape(6, 256), w, "linear")
    assert one.shape == (1, 1, 200)


def test_an_unknown_setting_is_named():
    import os
    import subprocess
    import sys

    env = dict(os.environ, NINFER_GEMV_TC="yes")
    run = subprocess.run([sys.executable, "-c", "import ninfer.ops.triton.linear"], capture_output=True, text=True,
                         env=env)
    assert run.returncode != 0 and "NINFER_GEMV_TC='yes': expected 0 or 1" in run.stderr


@pytest.mark.parametrize("m", [2, 5, 8, 12])
def test_the_norm_prologue_multiplies_the_rows_it_stores(m, gen):
    """``norm``: every program forms ``add_rms_norm_unit_offset`` of x and the residual; the product is the plain
    kernel's of the stored normed rows, bit for bit, and those rows and the new residual are the Triton norm
    kernel's to the last bit of bf16 (another reduction order for the sum of squares)."""
    from ninfer.ops.triton import linear_tc
    from ninfer.ops.triton import norm as tnorm

    k, n = 640, 300
    x = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE)
    res = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE, scale=4.0)
    nw = randn(gen, k, dtype=torch.bfloat16, device=DEVICE, scale=0.3)
    w = randn(gen, n, k, dtype=torch.bfloat16, device=DEVICE, scale=k ** -0.5)
    h, ro = torch.empty_like(x), torch.empty_like(x)
    y = linear_tc.gemv_tc(x, w, norm=(res, nw, 1e-6, h, ro), split=2)
    assert torch.equal(y, linear_tc.gemv_tc(h, w, split=2))
    want_h, want_r = tnorm.add_rms_norm_unit_offset(x, res, nw, 1e-6)
    assert torch.equal(ro, want_r)
    assert ((h.float() - want_h.float()).abs() <= want_h.float().abs() * 2.0 ** -7).all()


@pytest.mark.parametrize("m", [3, 12])
@pytest.mark.parametrize("n_out", [256, 200])
def test_swiglu_where_the_partials_are_added(n_out, m, gen):
    """``swiglu``: silu(gate) * up of the plain product's rounded halves, to a bf16 ulp (exp's implementation);
    whole row blocks (I = 256) add them in the kernel, others (I = 200) in the sum kernel: the same bits."""
    from ninfer.ops.triton import linear_tc

    k = 384
    x = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE)
    w = randn(gen, 2 * n_out, k, dtype=torch.bfloat16, device=DEVICE, scale=k ** -0.5)
    fused = linear_tc.gemv_tc(x, w, swiglu=True)
    assert torch.equal(fused, linear_tc.gemv_tc(x, w, swiglu=True, in_kernel_sum=False))
    plain = linear_tc.gemv_tc(x, w).float()
    g, u = plain[:, :n_out], plain[:, n_out:]
    want = (g * torch.sigmoid(g) * u).bfloat16().float()
    assert fused.shape == (m, n_out)
    assert ((fused.float() - want).abs() <= want.abs() * 2.0 ** -7 + 1e-30).all()


def test_the_fused_norm_ops_take_one_launch_when_on(gen, monkeypatch):
    """With ``NINFER_GEMV_TC=1`` and the CUDA-core GEMV refusing, ``add_rms_norm_unit_offset_linear`` and
    ``_swiglu`` of several rows are one tensor-core launch each, with the unfused composition's values."""
    from ninfer.ops.triton import linear, linear_tc

    monkeypatch.setattr(linear_tc, "ENABLED", True)
    monkeypatch.setattr(linear, "MAX_ROW_BYTES", 1)
    counted = CountLaunches(linear_tc._tc_kernel)
    monkeypatch.setattr(linear_tc, "_tc_kernel", counted)
    k = 256
    x = randn(gen, 3, k, dtype=torch.bfloat16, device=DEVICE)
    res = randn(gen, 3, k, dtype=torch.bfloat16, device=DEVICE, scale=4.0)
    nw = randn(gen, k, dtype=torch.bfloat16, device=DEVICE, scale=0.3)
    w = randn(gen, 256, k, dtype=torch.bfloat16, device=DEVICE, scale=k ** -0.5)
    y, h, r = linear.add_rms_norm_unit_offset_linear(x, res, nw, 1e-6, w)
    a, h2, r2 = linear.add_rms_norm_unit_offset_swiglu(x, res, nw, 1e-6, w)
    assert counted.launches == 2
    assert torch.equal(h, h2) and torch.equal(r, r2)
    monkeypatch.setattr(linear_tc, "_tc_kernel", counted.kernel)
    assert torch.equal(y, linear_tc.gemv_tc(h, w))
    assert a.shape == (3, 128) and torch.equal(a, linear_tc.gemv_tc(h, w, swiglu=True))


@pytest.mark.parametrize("m,n,k,split,aligned", [(4, 300, 704, 1, True), (4, 300, 704, 3, True),
                                                 (3, 257, 1000, 2, True), (2, 130, 250, 2, False)])
def test_the_l2_prefetch_changes_no_bit_and_is_asked_only_where_aligned(m, n, k, split, aligned, gen, monkeypatch):
    """``l2_prefetch=True`` (``NINFER_GEMV_TC_L2_PREFETCH``) asks L2 for each program's weight run before the PDL
    wait: the same bits as without it, plain and with the norm prologue and SwiGLU; a K (so a row's byte run) that is
    not a multiple of 16 bytes launches without it."""
    from ninfer.ops.triton import linear_tc

    rec = CountLaunches(linear_tc._tc_kernel)
    monkeypatch.setattr(linear_tc, "_tc_kernel", rec)
    x = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE)
    w = randn(gen, n, k, dtype=torch.bfloat16, device=DEVICE, scale=k ** -0.5)
    assert torch.equal(linear_tc.gemv_tc(x, w, split=split, l2_prefetch=True),
                       linear_tc.gemv_tc(x, w, split=split, l2_prefetch=False))
    res = randn(gen, m, k, dtype=torch.bfloat16, device=DEVICE, scale=4.0)
    nw = randn(gen, k, dtype=torch.bfloat16, device=DEVICE, scale=0.3)
    w2 = w[: n - n % 2]
    outs = []
    for l2 in (True, False):
        h, r = torch.empty_like(x), torch.empty_like(x)
        y = linear_tc.gemv_tc(x, w2, norm=(res, nw, 1e-6, h, r), swiglu=True, split=split, l2_prefetch=l2)
        outs.append((y, h, r))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    assert [c["L2PF"] for c in rec.calls] == [aligned, False, aligned, False]
