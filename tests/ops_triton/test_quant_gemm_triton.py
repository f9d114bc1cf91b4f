"""The quantized-weight tensor-core GEMM (prefill rows): A16 for every stored format against the fp64 oracle of
the decoded weights with the bound of tests/ops_triton/quant_cases.py (tensor-core sums: u = 2^-23; a group's
scale and its addition to the accumulator are two more roundings), at odd K and M above the GEMV's limit; and
the A8 fp8 path: the per-row activation quantization bit for bit against torch's E4M3 rounding, the FP8 GEMM
against the fp64 product of the quantized activations.
Runs on CUDA when present (larger shapes too), otherwise under TRITON_INTERPRET=1 at tiny sizes."""

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("cuda_core_gemv")

from ops.conftest import randn  # noqa: E402

from .conftest import CUDA, DEVICE, triton_ops  # noqa: E402
from .quant_cases import FORMATS, U_OUT, U_RN, U_TC, assert_dot_bound, decoded, gamma, random_packed  # noqa: E402

SHAPES = [(17, 20, 100), (33, 9, 257), (70, 65, 130)]
if CUDA:
    SHAPES += [(64, 2048, 4096), (300, 1000, 2500), (1000, 512, 1024)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_linear_gemm_within_bound(fmt, dtype, m, n, k, gen):
    from ninfer.ops.triton.quant_gemv import MAX_ROWS

    ops = triton_ops(dtype)
    assert m > MAX_ROWS
    w = random_packed(gen, fmt, n, k, DEVICE)
    x = randn(gen, m, k, dtype=dtype, device=DEVICE)
    out = ops.linear(x, w)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_dot_bound(out, x, w, u=U_TC, extra=2, what=f"{fmt} gemm {dtype} {m}x{k}->{n}")


@pytest.mark.parametrize("fmt", ["q5_g64_fp16", "fp8_e4m3fn_row_bf16"])
def test_gemm_logits_and_fused_norm_rows(fmt, gen):
    """Prefill rows of logits (fp32 stores of the rounded product) and of the fused norm ops (the Triton norm,
    then the GEMM; then silu_and_mul)."""
    ops = triton_ops(torch.bfloat16)
    w = random_packed(gen, fmt, 24, 96, DEVICE)
    x = randn(gen, 20, 96, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(ops.logits(x, w), ops.linear(x, w).float())
    res = randn(gen, 20, 96, dtype=torch.bfloat16, device=DEVICE)
    nw = randn(gen, 96, dtype=torch.bfloat16, device=DEVICE, scale=0.3)
    y, h, new_res = ops.add_rms_norm_unit_offset_linear(x, res, nw, 1e-6, w)
    h_sep, res_sep = ops.add_rms_norm_unit_offset(x, res, nw, 1e-6)
    assert torch.equal(h, h_sep) and torch.equal(new_res, res_sep)
    assert torch.equal(y, ops.linear(h, w))
    act, h2, _ = ops.add_rms_norm_unit_offset_swiglu(x, res, nw, 1e-6, w)
    assert torch.equal(h2, h) and torch.equal(act, ops.silu_and_mul(y))


def _e4m3_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantization's definition in torch (fp32, on CPU): codes and scales."""
    from ninfer.ops.triton.quant_gemm import A8_MIN_AMAX

    xf = x.detach().to("cpu", torch.float32)
    amax = xf.abs().amax(-1)
    inv = torch.where(amax >= A8_MIN_AMAX, 448.0 / amax.clamp_min(A8_MIN_AMAX), torch.zeros(()))
    codes = (xf * inv[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, amax / 448.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_matches_torch_e4m3(dtype, gen):
    """Codes and scales bit for bit (E4M3 round to nearest even, including values that round up into the next
    binade and subnormals), a zero row and a row below A8_MIN_AMAX quantize to zero codes."""
    from ninfer.ops.triton.quant_gemm import quantize_rows_fp8

    k = 300
    x = randn(gen, 6, k, dtype=torch.float32) * torch.tensor([1.0, 1e-3, 50.0, 1.0, 1.0, 1.0])[:, None]
    x[3] = 0.0
    x[4] = 2.0 ** -125
    # Row 5: amax 448 (inv = 1), values just below binade edges (round up to 2^e), ties, and subnormals.
    edge = torch.tensor([448.0, 127.9, 31.99, 15.5, 0.0155, 0.0016, 0.0039, -240.0, -0.002, 13.0, 7.25, 3.375])
    x[5, :edge.numel()] = edge
    x = x.to(dtype).to(DEVICE)
    q, s = quantize_rows_fp8(x)
    q_ref, s_ref = _e4m3_rows(x)
    assert q.dtype == torch.uint8 and s.dtype == torch.float32
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu(), q_ref)
    assert not q[3].any() and not q[4].any()
    # code * scale is x to E4M3 precision: 2^-4 relative for normals, half a subnormal step (2^-10 scale) below.
    back = q.cpu().view(torch.float8_e4m3fn).double() * s.cpu().double()[:, None]
    xd = x.cpu().double()
    ok = (back - xd).abs() <= xd.abs() * 2.0 ** -4 + s.cpu().double()[:, None] * 2.0 ** -10
    assert ok[[0, 1, 2, 5]].all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 9, 100), (17, 20, 257), (40, 65, 130)] + (
    [(300, 1024, 4096)] if CUDA else []))
def test_fp8_a8_gemm(dtype, m, n, k, gen):
    """The FP8 GEMM against the fp64 product of its quantized activations (its own codes and scales, checked
    above) and the decoded weights. FP8 products are exact in fp32; each 128-lane chunk is summed inside the
    tensor cores, whose FP8 MMA on Hopper keeps only about 14 significant bits of its accumulator (DeepSeek-V3
    report, sec. 3.3.2): each of a chunk's four K = 32 MMA steps errs by at most 2^-13 of the magnitude sum so
    far, so a chunk by 4 * 2^-13 of its magnitude sum on CUDA; the interpreter sums in fp32 (gamma(128, 2^-24)).
    The chunks are then scaled and added in fp32. Also the A16 result is within the activation rounding of this
    one."""
    from ninfer.ops.triton._quant import kernel_weight
    from ninfer.ops.triton.quant_gemm import gemm_a8, quantize_rows_fp8

    w = random_packed(gen, "fp8_e4m3fn_row_bf16", n, k, DEVICE)
    x = randn(gen, m, k, dtype=dtype, device=DEVICE)
    out = gemm_a8(x, kernel_weight(w, "linear"))
    assert out.dtype == dtype and out.shape == (m, n)
    q, s = quantize_rows_fp8(x)
    xq = q.cpu().view(torch.float8_e4m3fn).double() * s.cpu().double()[:, None]
    wd = decoded(w)
    ref, mag = xq @ wd.T, xq.abs() @ wd.abs().T
    uo = U_OUT[dtype]
    chunks = -(-k // 128)
    inner = 4 * 2.0 ** -13 if CUDA else gamma(128, U_RN)
    limit = uo * ref.abs() + (1 + uo) * (inner + gamma(chunks + 2, U_RN)) * mag
    assert ((out.cpu().double() - ref).abs() <= limit).all(), f"A8 fp8 gemm {dtype} {m}x{k}->{n}"
    # Against the A16 oracle the difference is the activations' E4M3 rounding (2^-4 relative, or half a
    # subnormal step) times |w|, plus the same GEMM error.
    xd = x.cpu().double()
    dx = xd.abs() * 2.0 ** -4 + s.cpu().double()[:, None] * 2.0 ** -10
    ref16 = xd @ wd.T
    assert ((out.cpu().double() - ref16).abs() <= limit + dx @ wd.abs().T * (1 + uo) + uo * ref16.abs()).all()


def test_a8_refuses_integer_weights(gen):
    from ninfer.ops.triton._quant import kernel_weight
    from ninfer.ops.triton.quant_gemm import gemm_a8

    w = random_packed(gen, "q8_g32_fp16", 4, 64, DEVICE)
    with pytest.raises(ValueError, match="only fp8 weights"):
        gemm_a8(randn(gen, 20, 64, dtype=torch.bfloat16, device=DEVICE), kernel_weight(w, "linear"))
