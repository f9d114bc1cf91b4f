"""nvfp4 encoder/decoder against an fp64 oracle."""

import math

import pytest
import torch
from ninfer.quant import nvfp4
from ninfer.quant.errors import QuantizationError


def _oracle(w: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 reconstruction per element, computed in fp64 from the encoder's own scales."""
    codes, scales, div = nvfp4.encode(w)
    s = scales.view(torch.float8_e4m3fn).double().repeat_interleave(16, dim=1)
    mags = torch.tensor(nvfp4.E2M1_MAGNITUDES, dtype=torch.float64)
    scaled = (w.double() * div / torch.where(s > 0, s, torch.ones_like(s))).clamp(-6, 6)
    best = mags[(scaled.abs()[..., None] - mags).abs().argmin(dim=-1)]
    return torch.where(s > 0, torch.sign(scaled) * best * s / div, torch.zeros_like(s))


def test_round_trip_matches_nearest_and_bounds():
    torch.manual_seed(0)
    w = torch.randn(8, 64) * 0.05
    codes, scales, div = nvfp4.encode(w)
    assert codes.shape == (8, 32) and scales.shape == (8, 4)
    got = nvfp4.decode(codes, scales, div, torch.float64)
    want = _oracle(w)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    # error per element is at most half the widest E2M1 gap (1.0 at the top) times the block scale
    s = scales.view(torch.float8_e4m3fn).double().repeat_interleave(16, dim=1) / div
    assert bool(((got - w.double()).abs() <= s + 1e-12).all())
    assert abs(div - 448 * 6 / float(w.abs().max())) < 1e-6 * div


def test_exact_codes_hand_built_block():
    vals = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -6.0, 0.25, 0.75, 2.5, 5.0, -1.25, 6.0]
    w = torch.tensor([vals])
    codes, scales, div = nvfp4.encode(w)
    assert div == pytest.approx(448.0)
    assert scales.view(torch.float8_e4m3fn).float().item() == 448.0
    nib = nvfp4.unpack_codes(codes)[0].tolist()
    # ties go to the even magnitude index: 0.25->0, 0.75->1.0, 2.5->2.0, 5.0->4.0, -1.25->-1.0
    assert nib == [0, 1, 2, 3, 4, 5, 6, 7, 9, 15, 0, 2, 4, 6, 10, 7]
    assert nvfp4.decode(codes, scales, div)[0, :8].tolist() == vals[:8]


def test_zero_negative_zero_and_one_huge_value():
    z = torch.zeros(2, 32)
    codes, scales, div = nvfp4.encode(z)
    assert div == 1.0 and int(codes.sum()) == 0 and int(scales.sum()) == 0
    nz = torch.full((1, 16), -0.0)
    nz[0, 0] = 1.0
    assert nvfp4.unpack_codes(nvfp4.encode(nz)[0])[0, 1:].eq(0).all()
    big = torch.full((1, 32), 1e-3)
    big[0, 3] = 1e4
    codes, scales, div = nvfp4.encode(big)
    out = nvfp4.decode(codes, scales, div, torch.float64)
    assert out[0, 3].item() == pytest.approx(1e4, rel=1e-6)
    # a block 1e7 below the tensor max is past E4M3's range: its scale is the smallest subnormal and it
    # flushes to zero rather than failing
    assert scales[0, 1].item() == 1 and out[0, 16:].eq(0).all()


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_refused(bad):
    w = torch.ones(1, 16)
    w[0, 5] = bad
    with pytest.raises(QuantizationError, match="not finite"):
        nvfp4.encode(w, what="layers.0.mlp.up")


def test_shape_refused():
    with pytest.raises(QuantizationError, match="K % 16"):
        nvfp4.encode(torch.ones(2, 24))


def test_largest_block_scale_is_e4m3_max_and_error_is_small():
    torch.manual_seed(1)
    w = torch.randn(128, 256) * 0.02
    codes, scales, div = nvfp4.encode(w)
    s = scales.view(torch.float8_e4m3fn).float()
    assert s.max().item() == 448.0 and bool((s <= 448).all())
    got = nvfp4.decode(codes, scales, div, torch.float64)
    rel = ((got - w.double()).norm() / w.double().norm()).item()
    assert rel < 0.12  # E2M1 with a per-16 scale: about 9% RMS on Gaussian weights
    assert nvfp4.decode(codes, scales, div, torch.bfloat16).dtype == torch.bfloat16
