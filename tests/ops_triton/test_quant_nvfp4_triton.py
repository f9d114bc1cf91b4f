"""The nvfp4 kernels (ninfer.ops.triton.quant_nvfp4): the CUDA-core GEMV and the tensor-core GEMM against the fp64
oracle of the decoded weights (tests/ops_triton/quant_cases.py's bound, two more roundings: the division by the
per-tensor divisor, and the decoded weight's own fp32 rounding in the oracle), every code decoded exactly, a
packed row block inside its parent (its scale tiles start past the parent's first tile), the dense ops by
format (linear, logits, the norm variants), the GEMV/GEMM choice, and the format set the MoE expert kernels share.
Runs on CUDA when present (larger shapes too), otherwise under TRITON_INTERPRET=1 at tiny sizes."""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import randn  # noqa: E402

from .conftest import CUDA, DEVICE, triton_ops  # noqa: E402
from .quant_cases import U_RN, U_TC, assert_dot_bound  # noqa: E402

FMT = "nvfp4"
SHAPES = [(1, 128, 64), (3, 128, 192), (16, 128, 64)]
GEMM_SHAPES = [(17, 128, 128), (40, 256, 64)]
if CUDA:
    SHAPES += [(1, 4096, 4096), (8, 1024, 12288)]
    GEMM_SHAPES += [(300, 4096, 4096)]


def nvfp4_weight(gen: torch.Generator, n: int, k: int, *, skip: int = 128, w: torch.Tensor | None = None):
    """A packed ``[n, K]`` nvfp4 weight: rows ``[skip, skip + n)`` of a stored parent (the artifact's planes), on
    DEVICE. ``w``: the parent's values (default random normals, scale K^-1/2)."""
    from ninfer.quant import nvfp4, packed_view

    rows = n + skip
    if w is None:
        w = torch.randn(rows, k, generator=gen, dtype=torch.float64).float() * k ** -0.5
    codes, scales, divisor = nvfp4.encode(w)
    parent = torch.cat([codes.reshape(-1), nvfp4.tile_scales(scales).reshape(-1),
                        torch.tensor([divisor], dtype=torch.float32).view(torch.uint8)]).to(DEVICE)
    return packed_view(FMT, parent, (rows, k), skip * k, rows * k, (n, k))


def kernel(weight):
    from ninfer.ops.triton._quant import kernel_weight

    return kernel_weight(weight, "test")


CASES = [("gemv", *s) for s in SHAPES] + [("gemm", *s) for s in GEMM_SHAPES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path,m,n,k", CASES)
def test_products_within_fp32_bound(dtype, path, m, n, k, gen):
    """The GEMV's CUDA-core sums round to nearest (u = 2^-24), the GEMM's tensor cores truncate (2^-23)."""
    from ninfer.ops.triton import quant_nvfp4

    w = nvfp4_weight(gen, n, k)
    x = randn(gen, m, k, dtype=dtype, device=DEVICE)
    out = getattr(quant_nvfp4, path)(x, kernel(w))
    assert out.dtype == dtype and out.shape == (m, n)
    assert_dot_bound(out, x, w, u=U_RN if path == "gemv" else U_TC, extra=2,
                     what=f"nvfp4 {path} {dtype} {m}x{k}->{n}")


@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_every_code_and_scale_decodes_exactly(path, gen):
    """x rows one-hot at K positions: each output is one decoded weight, bit for bit the reference's
    ``e2m1 * scale / divisor`` in fp32. The weight holds all 16 codes (zero, the subnormal 0.5, negatives) under
    block scales from E4M3's smallest subnormal to its maximum."""
    from ninfer.ops.triton import quant_nvfp4
    from ninfer.quant import nvfp4

    n, k = 128, 64
    mags = torch.tensor(nvfp4.E2M1_MAGNITUDES)
    values = torch.cat([mags, -mags]).repeat(k // 16)                        # every code in every block
    block_max = 2.0 ** torch.linspace(-15, 8, n * (k // 16)).reshape(n, k // 16)   # scales across E4M3's range
    w = values[None, :] * (block_max / 6.0).repeat_interleave(16, dim=1)
    w = torch.cat([torch.zeros(128, k), w])                                  # a 128-row parent tile before it
    weight = nvfp4_weight(gen, n, k, w=w)
    cols = torch.arange(16) + 16 * (torch.arange(16) % 4)                 # every code position, all 4 blocks
    x = torch.zeros(len(cols), k, dtype=torch.float32)
    x[torch.arange(len(cols)), cols] = 1.0
    run = quant_nvfp4.gemv if path == "gemv" else quant_nvfp4.gemm
    out = run(x.to(DEVICE), kernel(weight)).cpu()
    ref = weight.dequantize(torch.float32).cpu()[:, cols].T
    assert torch.equal(out, ref)


def test_dense_ops_take_the_nvfp4_kernels(gen, monkeypatch):
    """linear/logits/the norm variants reach the nvfp4 kernels by format: the GEMV for decode rows, the GEMM for
    more rows (and, on a wide weight, from GEMM_MIN_ROWS rows); the norm variants equal the Triton norm then
    the product."""
    from ninfer.ops.triton import norm, quant_linear, quant_nvfp4

    ops = triton_ops(torch.bfloat16)
    for op in ("linear", "logits", "add_rms_norm_unit_offset_linear", "add_rms_norm_unit_offset_swiglu"):
        assert ops.implementation(op, FMT).name == "triton_quant"
    w = nvfp4_weight(gen, 128, 128)
    kw = kernel(w)
    x = randn(gen, 17, 128, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(ops.linear(x[:3], w), quant_nvfp4.gemv(x[:3], kw))
    assert torch.equal(ops.linear(x, w), quant_nvfp4.gemm(x, kw))
    assert torch.equal(ops.logits(x[:1], w), quant_nvfp4.gemv(x[:1], kw).float())
    monkeypatch.setattr(quant_linear, "GEMM_MIN_N", 128)
    assert torch.equal(ops.linear(x[:4], w), quant_nvfp4.gemm(x[:4], kw))
    assert torch.equal(ops.linear(x[:3], w), quant_nvfp4.gemv(x[:3], kw))
    res = randn(gen, 1, 128, dtype=torch.bfloat16, device=DEVICE)
    nw = randn(gen, 128, dtype=torch.bfloat16, device=DEVICE)
    y, normed, new_res = ops.add_rms_norm_unit_offset_linear(x[:1], res, nw, 1e-6, w)
    normed2, res2 = norm.add_rms_norm_unit_offset(x[:1], res, nw, 1e-6)
    assert torch.equal(normed, normed2) and torch.equal(new_res, res2)
    assert torch.equal(y, quant_nvfp4.gemv(normed2, kw))
    act, _, _ = ops.add_rms_norm_unit_offset_swiglu(x[:1], res, nw, 1e-6, w)
    assert torch.equal(act, ops.silu_and_mul(quant_nvfp4.gemv(normed2, kw)))


def test_the_dense_ops_and_the_moe_experts_take_nvfp4():
    """One format set for the dense quantized ops and the MoE expert kernels (test_quant_moe_triton.py runs nvfp4
    banks through the MoE kernels), nvfp4 in it."""
    from ninfer.ops.triton import quant_linear, quant_moe
    from ninfer.ops.triton._quant import KERNEL_FORMATS

    assert FMT in KERNEL_FORMATS
    assert all(impl.weight_formats == KERNEL_FORMATS for impl in (*quant_linear.OPS, *quant_moe.OPS))
