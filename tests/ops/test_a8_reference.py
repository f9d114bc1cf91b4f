"""The torch A8 reference (ninfer.ops.reference.a8): per-token E4M3 activation quantization against its
definition computed independently in fp64, the product against the fp64 oracle of the quantized operands, the
quantized ``linear`` op choosing it exactly for weights marked ``activations="a8"``, and the marking's rules."""

import dataclasses

import pytest
import torch
from ninfer.errors import NotSupportedError
from ninfer.ops.reference import a8, quantized
from ninfer.quant import PackedWeight, fp8_row


def _fp8_weight(n: int, k: int, activations: str = "a16") -> PackedWeight:
    w = torch.randn(n, k, dtype=torch.float64).float() * k ** -0.5
    codes, scales = fp8_row.encode(w)
    return PackedWeight(fp8_row.FORMAT, (n, k), (codes, scales), activations)


def _gamma(n: int, u: float = 2.0 ** -24) -> float:
    return n * u / (1 - n * u)


def test_quantize_rows_definition():
    torch.manual_seed(1)
    x = torch.randn(5, 70) * torch.tensor([1.0, 1e-3, 40.0, 0.0, 1.0])[:, None]
    x[4] = 2.0 ** -125  # below A8_MIN_AMAX: zero codes
    codes, scales = a8.quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert not codes[3].float().any() and not codes[4].float().any()
    xd = x.double()
    amax = xd.abs().amax(-1)
    assert torch.equal(scales, (amax / 448).float())
    back = codes.double() * scales.double()[:, None]
    # E4M3 keeps 3 mantissa bits: half an ulp is 2^-4 relative for normals; subnormal steps are 2^-9 * scale.
    assert ((back - xd).abs()[:3] <= xd.abs()[:3] * 2.0 ** -4 + scales.double()[:3, None] * 2.0 ** -10).all()
    assert back.abs().amax(-1)[:3].allclose(amax[:3], rtol=2.0 ** -20)  # the row max maps to 448 exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_a8_against_fp64_oracle(dtype):
    torch.manual_seed(2)
    w = _fp8_weight(33, 100, "a8")
    x = torch.randn(3, 4, 100).to(dtype)
    out = quantized.linear(x, w)
    assert out.shape == (3, 4, 33) and out.dtype == dtype
    codes, scales = a8.quantize_rows(x.reshape(-1, 100))
    xq = codes.double() * scales.double()[:, None]
    wd = w.dequantize(torch.float64)
    exact, mag = xq @ wd.T, xq.abs() @ wd.abs().T
    uo = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8}[dtype]
    err = (out.reshape(-1, 33).double() - exact).abs()
    assert (err <= uo * exact.abs() + (1 + uo) * _gamma(100) * mag).all()
    # And it differs from the A16 op by the activation rounding only (2^-4 relative per lane, times |w|).
    a16 = quantized.linear(x, dataclasses.replace(w, activations="a16")).reshape(-1, 33).double()
    dx = x.reshape(-1, 100).double().abs() * 2.0 ** -4 + scales.double()[:, None] * 2.0 ** -10
    assert ((a16 - exact).abs() <= dx @ wd.abs().T + 2 * uo * exact.abs() + 1e-5).all()


def test_a8_marking_rules():
    w = _fp8_weight(8, 16, "a8")
    bank = PackedWeight(w.format, (2, 4, 16), w.planes, "a8")
    assert bank[1].activations == "a8"  # expert views keep it
    with pytest.raises(ValueError, match="activations"):
        _fp8_weight(8, 16, "a4")
    with pytest.raises(NotSupportedError, match="fp8"):
        PackedWeight("q8_g32_fp16", (8, 32), w.planes, "a8")
    with pytest.raises(NotSupportedError, match="only"):
        a8.linear_a8(torch.zeros(1, 16), dataclasses.replace(w, activations="a16", format="q8_g32_fp16"))
