"""Triton Qwen4-Exp norms and hyper-connection steps (``ninfer_qwen4exp.ops.triton.norm`` and ``.hyper``) against the
torch references of their contracts, on the same inputs.

Criteria: fp32 pointwise within rtol 4e-6 / atol 1e-6 of the largest value (the fp32 statistic's and the
sigmoid's last bits); bf16: the references' roundings reproduced, so at most 1% of the results differ and each by at
most one bf16 ulp (``hc_write``: bit for bit, its arithmetic has no transcendental). Cases: the published stream
count 4 and an odd 3, widths that are and are not powers of two, a strided (column view) input, and T = 0.
"""

import pytest
import torch

pytest.importorskip("triton")

from ninfer_qwen4exp.ops.reference import hyper as ref_hc  # noqa: E402
from ninfer_qwen4exp.ops.reference import norm as ref_norm  # noqa: E402
from ninfer_qwen4exp.ops.triton import hyper as tri_hc  # noqa: E402
from ninfer_qwen4exp.ops.triton import norm as tri_norm  # noqa: E402
from ops.conftest import Pointwise, assert_pointwise  # noqa: E402
from ops.oracles import assert_bf16_within_one_ulp  # noqa: E402

from .conftest import DEVICE  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def _close(out, ref, what):
    assert out.shape == ref.shape and out.dtype == ref.dtype, what
    if out.dtype == torch.float32:
        assert_pointwise(out, ref, Pointwise(4e-6, 1e-6), what)
    else:
        assert_bf16_within_one_ulp(out, ref, what)


def _randn(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "streams", "h"), [(5, 4, 96), (3, 3, 40), (1, 4, 256)])
def test_grouped_norm(gen, dtype, t, streams, h):
    x = _randn(gen, t, streams * h, dtype=dtype, scale=3.0)
    w = _randn(gen, streams * h, dtype=dtype, scale=0.2)
    want = ref_norm.rms_norm_unit_offset_grouped(x.cpu(), w.cpu(), h, EPS)
    _close(tri_norm.rms_norm_unit_offset_grouped(x, w, h, EPS).cpu(), want, f"{dtype} {t}x{streams}x{h}")


def test_grouped_norm_refuses_a_width_that_does_not_split(gen):
    x = _randn(gen, 2, 10, dtype=torch.float32)
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        tri_norm.rms_norm_unit_offset_grouped(x, torch.zeros(10, device=DEVICE), 4, EPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_norm_sigmoid(gen, dtype):
    x = _randn(gen, 7, 3, 64, dtype=dtype, scale=2.0)
    gate = _randn(gen, 7, 3, 64, dtype=dtype, scale=2.0)
    w = _randn(gen, 64, dtype=dtype, scale=0.5) + 1.0
    want = ref_norm.gated_rms_norm_sigmoid(x.cpu(), gate.cpu(), w.cpu(), EPS)
    _close(tri_norm.gated_rms_norm_sigmoid(x, gate, w, EPS).cpu(), want, f"{dtype} gated sigmoid")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "streams", "r"), [(6, 4, 320), (2, 3, 40), (1, 4, 8)])
def test_hc_act(gen, dtype, t, streams, r):
    wide = _randn(gen, t, r + 7, dtype=dtype, scale=6.0)
    d = wide[:, 7:]   # a column view of the fused down projection, as the model passes it
    _close(tri_hc.hc_act(d, streams).cpu(), ref_hc.hc_act(d.cpu(), streams), f"{dtype} hc_act")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "streams", "h"), [(6, 4, 96), (2, 3, 40), (1, 4, 2048)])
@pytest.mark.parametrize("with_g", [True, False])
def test_hc_mix(gen, dtype, t, streams, h, with_g):
    z = _randn(gen, t, streams * h, dtype=dtype, scale=3.0)
    xn = _randn(gen, t, streams * h, dtype=dtype)
    # g as a column view of a wider projection output, as the model passes it
    wide = _randn(gen, t, streams + 5, dtype=dtype, scale=4.0)
    g = wide[:, 5:] if with_g else None
    u, inject = tri_hc.hc_mix(z, xn, g, streams)
    want_u, want_inject = ref_hc.hc_mix(z.cpu(), xn.cpu(), None if g is None else g.cpu(), streams)
    _close(u.cpu(), want_u, f"{dtype} u")
    if with_g:
        _close(inject.cpu(), want_inject, f"{dtype} inject")
    else:
        assert inject is None and want_inject is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "streams", "h"), [(6, 4, 96), (2, 3, 40), (1, 4, 2048)])
def test_hc_write_is_bitwise(gen, dtype, t, streams, h):
    x = _randn(gen, t, streams * h, dtype=dtype, scale=3.0)
    y = _randn(gen, t, h, dtype=dtype)
    inject = _randn(gen, t, streams, dtype=dtype).abs() * 2
    got = tri_hc.hc_write(x, y, inject).cpu()
    assert torch.equal(got, ref_hc.hc_write(x.cpu(), y.cpu(), inject.cpu()))


def test_empty_calls_and_bad_banks(gen):
    z = torch.zeros(0, 8, device=DEVICE)
    u, inject = tri_hc.hc_mix(z, z, torch.zeros(0, 2, device=DEVICE), 2)
    assert u.shape == (0, 4) and inject.shape == (0, 2)
    assert tri_hc.hc_write(z, torch.zeros(0, 4, device=DEVICE), torch.zeros(0, 2, device=DEVICE)).shape == (0, 8)
    with pytest.raises(ValueError, match="does not hold 3 streams"):
        tri_hc.hc_mix(torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 8, device=DEVICE), None, 3)
    with pytest.raises(ValueError, match="do not match"):
        tri_hc.hc_write(torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 5, device=DEVICE),
                        torch.zeros(2, 2, device=DEVICE))
