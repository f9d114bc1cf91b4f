"""The A8 path as the ops choose it: a packed fp8 row weight marked ``activations="a8"`` makes the Triton
``linear``/``logits``/fused-norm ops run the A8 GEMM for prefill calls (more than MAX_ROWS rows), matching the
torch A8 reference (ninfer.ops.reference.a8) to the GEMM's fp32 summation order and the quantization's last E4M3
step; decode calls keep the A16 GEMV; A16 weights never take the A8 GEMM.
Runs on CUDA when present, otherwise under TRITON_INTERPRET=1 at tiny sizes."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("cuda_core_gemv")

from ops.conftest import randn  # noqa: E402

from .conftest import CUDA, DEVICE, triton_ops  # noqa: E402
from .quant_cases import U_OUT, decoded, gamma, random_packed  # noqa: E402


def _refuse(*a, **kw):
    raise AssertionError("A8 GEMM dispatched")


def _kernel_rows(x):
    from ninfer.ops.triton.quant_gemm import quantize_rows_fp8

    q, s = quantize_rows_fp8(x)
    return q.cpu().view(torch.float8_e4m3fn), s.cpu()


def _a8_weight(gen, n, k):
    return dataclasses.replace(random_packed(gen, "fp8_e4m3fn_row_bf16", n, k, DEVICE), activations="a8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [17, 40])
def test_a8_weight_dispatches_the_a8_gemm(dtype, m, gen, monkeypatch):
    from ninfer.ops.reference.a8 import linear_a8, quantize_rows
    from ninfer.ops.triton import quant_gemm, quant_linear

    calls = []
    real = quant_gemm.gemm_a8
    monkeypatch.setattr(quant_linear, "gemm_a8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    n, k = 24, 130
    w = _a8_weight(gen, n, k)
    x = randn(gen, m, k, dtype=dtype, device=DEVICE)
    ops = triton_ops(dtype)
    out = ops.linear(x, w)
    assert calls, "the A8 GEMM was not dispatched"
    assert out.dtype == dtype and out.shape == (m, n)
    ref = linear_a8(x.cpu(), dataclasses.replace(w, planes=tuple(p.cpu() for p in w.planes)))
    # Each against the fp64 product of its own quantized activations: fp32 sums in any order (tensor cores:
    # u = 2^-23; per-chunk scaling adds a few roundings), then one rounding to dtype. The two quantizations agree
    # to one E4M3 step at most (under the triton interpreter a rare value a hair above a tie rounds down), so
    # out and ref are within that step's effect as well. On CUDA each 128-lane chunk is summed inside Hopper's FP8
    # MMA, whose accumulator keeps about 14 significant bits: 4 * 2^-13 of the magnitude sum (test_fp8_a8_gemm).
    wd = decoded(w)
    uo = U_OUT[dtype]
    mma = 4 * 2.0 ** -13 if CUDA else 0.0
    for got, (codes, scales) in ((out.cpu(), _kernel_rows(x)), (ref, quantize_rows(x.cpu()))):
        xq = codes.double() * scales.double()[:, None]
        exact, mag = xq @ wd.T, xq.abs() @ wd.abs().T
        limit = uo * exact.abs() + (1 + uo) * (mma + gamma(k + 8, 2.0 ** -23)) * mag
        assert ((got.double() - exact).abs() <= limit).all()
    step = x.cpu().double().abs() * 2.0 ** -3 + quantize_rows(x.cpu())[1].double()[:, None] * 2.0 ** -9
    bound = step @ wd.abs().T + 2 * uo * ref.double().abs() + 1e-6
    bound += mma * (x.cpu().double().abs() * (1 + 2.0 ** -3)) @ wd.abs().T  # the kernel's MMA sums, as above
    assert ((out.cpu().double() - ref.double()).abs() <= bound).all()
    lg = ops.logits(x, w)
    assert lg.dtype == torch.float32 and torch.equal(lg.cpu(), out.cpu().float())
    # The fused norm ops take the A8 GEMM after the norm.
    calls.clear()
    res = randn(gen, m, k, dtype=dtype, device=DEVICE)
    nw = randn(gen, k, dtype=dtype, device=DEVICE)
    y, h, _ = ops.add_rms_norm_unit_offset_linear(x, res, nw, 1e-6, w)
    assert calls and torch.equal(y, ops.linear(h, w))


@pytest.mark.parametrize("m", [1, 16])
def test_a8_weight_decodes_with_the_a16_gemv(m, gen, monkeypatch):
    from ninfer.ops.triton import quant_linear
    from ninfer.ops.triton.quant_gemv import MAX_ROWS

    assert m <= MAX_ROWS
    monkeypatch.setattr(quant_linear, "gemm_a8", _refuse)
    w = _a8_weight(gen, 24, 130)
    x = randn(gen, m, 130, dtype=torch.float32, device=DEVICE)
    ops = triton_ops(torch.float32)
    a16 = dataclasses.replace(w, activations="a16")
    assert torch.equal(ops.linear(x, w), ops.linear(x, a16))


def test_a16_weight_never_takes_a8(gen, monkeypatch):
    from ninfer.ops.triton import quant_linear

    monkeypatch.setattr(quant_linear, "gemm_a8", _refuse)
    w = random_packed(gen, "fp8_e4m3fn_row_bf16", 24, 130, DEVICE)
    for m in (1, 40):
        triton_ops(torch.float32).linear(randn(gen, m, 130, dtype=torch.float32, device=DEVICE), w)
