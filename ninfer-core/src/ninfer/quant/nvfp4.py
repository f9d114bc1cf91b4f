"""``nvfp4``: E2M1 codes, one E4M3FN scale per 16 weights along K, one FP32 per-tensor divisor.

Definition: for a weight ``[N, K]``, ``value[n, k] = e2m1(code[n, k]) * fp32(block_scale[n, k // 16]) /
divisor``. E2M1 magnitudes are ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (index 0..7, bit 3 is the sign).

Round-to-nearest encoder (``RTN_BLOCKMAX_E4M3``): ``divisor = 448 * 6 / amax(tensor)`` (1.0 for an all-zero
tensor) so the largest block scale lands on E4M3's maximum; ``block_scale = e4m3fn(min(amax(block) / 6 *
divisor, 448))`` rounded to nearest even (a non-zero block whose scale underflows takes E4M3's smallest
subnormal); ``code = e2m1(x * divisor / block_scale)`` rounded to nearest, ties to the even magnitude index,
saturating at 6. Zero (also negative zero) encodes as code 0. A non-finite weight fails.

Codes are packed two per byte along K, the even ``k`` in the low nibble (``[N, K / 2]`` uint8, row-major);
block scales are ``[N, K / 16]`` E4M3FN bytes, row-major.
"""

from __future__ import annotations

import torch

from ninfer.quant.errors import QuantizationError

FORMAT = "nvfp4"
ENCODER = "RTN_BLOCKMAX_E4M3"
BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E4M3_TINY = 2.0 ** -9


def _round_e2m1(a: torch.Tensor) -> torch.Tensor:
    """Magnitudes ``a >= 0`` -> E2M1 magnitude index, nearest, ties to the even index."""
    mids = torch.tensor(_MIDPOINTS, dtype=a.dtype)
    a = a.clamp(max=E2M1_MAX)
    lo = torch.bucketize(a, mids, right=False)
    hi = torch.bucketize(a, mids, right=True)
    return torch.where(lo == hi, lo, torch.where(lo % 2 == 0, lo, hi))


def encode(w: torch.Tensor, what: str = "weight") -> tuple[torch.Tensor, torch.Tensor, float]:
    """``w[N, K]`` (K % 16 == 0) -> ``(codes[N, K/2] uint8, block_scales[N, K/16] uint8 E4M3FN bits, divisor)``."""
    x = w.detach().to(torch.float32)
    if x.dim() != 2:
        raise QuantizationError(f"{what}: the {FORMAT} encoder takes [N, K], got shape {list(x.shape)}")
    n, k = x.shape
    if k % BLOCK:
        raise QuantizationError(f"{what}: {FORMAT} needs K % {BLOCK} == 0, got K = {k}")
    if not bool(torch.isfinite(x).all()):
        raise QuantizationError(f"{what}: a weight is not finite; {FORMAT} cannot encode it")
    amax = float(x.abs().max()) if x.numel() else 0.0
    divisor = E4M3_MAX * E2M1_MAX / amax if amax > 0 else 1.0
    blocks = x.reshape(n, k // BLOCK, BLOCK)
    bmax = blocks.abs().amax(dim=-1)
    scale = (bmax / E2M1_MAX * divisor).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    tiny = torch.tensor(_E4M3_TINY, dtype=torch.float32).to(torch.float8_e4m3fn)
    scale = torch.where((bmax > 0) & (scale.float() == 0), tiny, scale)
    s32 = scale.float()
    inv = torch.where(s32 > 0, divisor / s32.double(), torch.zeros((), dtype=torch.float64))
    scaled = blocks.double() * inv[..., None]
    idx = _round_e2m1(scaled.abs())
    sign = ((scaled < 0) & (idx > 0)).to(torch.int64) << 3
    nib = (idx | sign).reshape(n, k).to(torch.uint8)
    codes = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return codes.contiguous(), scale.view(torch.uint8).contiguous(), float(divisor)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K/2]`` packed bytes -> ``[N, K]`` 4-bit codes (int64)."""
    c = codes.to(torch.int64)
    return torch.stack((c & 0xF, c >> 4), dim=-1).reshape(c.shape[0], c.shape[1] * 2)


def decode(codes: torch.Tensor, block_scales: torch.Tensor, divisor: float,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` values ``e2m1(code) * block_scale / divisor`` in ``dtype`` (computed in at least fp32)."""
    wide = torch.promote_types(dtype, torch.float32)
    nib = unpack_codes(codes)
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=wide)[nib & 7]
    vals = torch.where((nib & 8) != 0, -mags, mags)
    s = block_scales.view(torch.float8_e4m3fn).to(wide).repeat_interleave(BLOCK, dim=1)
    return (vals * s / divisor).to(dtype)
