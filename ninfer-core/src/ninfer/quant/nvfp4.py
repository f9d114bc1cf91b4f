"""``nvfp4``: E2M1 codes, one E4M3FN scale per 16 weights along K, one FP32 per-tensor divisor.

Definition: for a weight ``[N, K]``, ``value[n, k] = e2m1(code[n, k]) * fp32(block_scale[n, k // 16]) /
divisor``. E2M1 magnitudes are ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (index 0..7, bit 3 is the sign).

Round-to-nearest encoder (``RTN_BLOCKMAX_E4M3``): ``divisor = 448 * 6 / amax(tensor)`` (1.0 for an all-zero
tensor) so the largest block scale lands on E4M3's maximum; ``block_scale = e4m3fn(min(amax(block) / 6 *
divisor, 448))`` rounded to nearest even (a non-zero block whose scale underflows takes E4M3's smallest
subnormal); ``code = e2m1(x * divisor / block_scale)`` rounded to nearest, ties to the even magnitude index,
saturating at 6. Zero (also negative zero) encodes as code 0. A non-finite weight fails.

Block-scale search encoder (``SEARCH_MSE_E4M3``, needs no data beyond the weights): per block, the same rounding
for each candidate ``block_scale = e4m3fn(min(amax(block) / 6 * divisor * f, 448))``, ``f`` in
:data:`SEARCH_FACTORS` (1, then 0.95 and 1.05, 0.90 and 1.10, ... 0.50 and 1.50; ``f = 1`` is round to nearest),
keeping the first candidate with the least squared reconstruction error. Candidates on both sides pay because
E2M1's values are uneven (a smaller scale saturates the block's largest weights at 6 for finer steps elsewhere; a
larger one can move many weights onto values closer to them), and E4M3's coarse steps make neighbouring ``f``
give the same scale. The divisor is the tensor's, as for round to nearest.

Codes are packed two per byte along K, the even ``k`` in the low nibble (``[N, K / 2]`` uint8, row-major);
block scales are ``[N, K / 16]`` E4M3FN bytes, row-major, in memory as the encoder returns them.

Layout ``block_scale_k16_m128x4_v1`` of a weight ``[..., N, K]`` (``rows = prod(leading dims)``; ``N % 128 == 0``,
``K % 64 == 0``, so a bank's experts and 128-row blocks are whole scale tiles), three planes, no padding between
them (each size is already a multiple of 256 bytes but the last):

- codes: ``rows * K / 2`` bytes, row-major as above;
- block scales: ``rows * K / 16`` bytes in tiles of 128 rows x 4 scales (64 weights of K), tiles row-major over
  (row tile, K tile), 512 bytes each; inside a tile the scale of row ``r`` (0..127) and column ``c`` (0..3) is
  byte ``(r % 32) * 16 + (r // 32) * 4 + c`` (the block-scale tiling of NVIDIA's FP4 GEMMs);
- the divisor: one little-endian fp32.

So an object is ``rows * K * 9 / 16 + 4`` bytes. A row block ``[r0, r1)`` (multiples of 128) is the codes' rows, the
scale tiles' rows ``[r0 / 128, r1 / 128)`` and the same divisor: a view, never a copy.
"""

from __future__ import annotations

import torch

from ninfer.quant.errors import QuantizationError

FORMAT = "nvfp4"
ENCODER = "RTN_BLOCKMAX_E4M3"
SEARCH_ENCODER = "SEARCH_MSE_E4M3"
SEARCH_FACTORS: tuple[float, ...] = (1.0, *(f for i in range(1, 11) for f in (1 - 0.05 * i, 1 + 0.05 * i)))
BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E4M3_TINY = 2.0 ** -9


def _round_e2m1(a: torch.Tensor) -> torch.Tensor:
    """Magnitudes ``a >= 0`` -> E2M1 magnitude index, nearest, ties to the even index."""
    mids = torch.tensor(_MIDPOINTS, dtype=a.dtype, device=a.device)
    a = a.clamp(max=E2M1_MAX)
    lo = torch.bucketize(a, mids, right=False)
    hi = torch.bucketize(a, mids, right=True)
    return torch.where(lo == hi, lo, torch.where(lo % 2 == 0, lo, hi))


def divisor_for(amax: float) -> float:
    """The encoder's per-tensor divisor for a tensor whose largest magnitude is ``amax``."""
    return E4M3_MAX * E2M1_MAX / amax if amax > 0 else 1.0


def encode(w: torch.Tensor, what: str = "weight", divisor: float | None = None, *, search: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``w[N, K]`` (K % 16 == 0) -> ``(codes[N, K/2] uint8, block_scales[N, K/16] uint8 E4M3FN bits, divisor)``.
    ``divisor`` None: the tensor's own (:func:`divisor_for` its amax); given: the whole tensor's, when ``w`` is a
    block of its rows (encoding blocks with it equals encoding the tensor whole). ``search`` selects the block-scale
    search encoder instead of round to nearest."""
    x = w.detach().to(torch.float32)
    if x.dim() != 2:
        raise QuantizationError(f"{what}: the {FORMAT} encoder takes [N, K], got shape {list(x.shape)}")
    n, k = x.shape
    if k % BLOCK:
        raise QuantizationError(f"{what}: {FORMAT} needs K % {BLOCK} == 0, got K = {k}")
    if not bool(torch.isfinite(x).all()):
        raise QuantizationError(f"{what}: a weight is not finite; {FORMAT} cannot encode it")
    if divisor is None:
        divisor = divisor_for(float(x.abs().max()) if x.numel() else 0.0)
    blocks = x.reshape(n, k // BLOCK, BLOCK)
    bmax = blocks.abs().amax(dim=-1)
    scale, idx, neg = _round_blocks(blocks, bmax, divisor, 1.0)
    if search:
        best = _block_error(blocks, scale, idx, neg, divisor)
        for f in SEARCH_FACTORS[1:]:
            s, i, ng = _round_blocks(blocks, bmax, divisor, f)
            err = _block_error(blocks, s, i, ng, divisor)
            better = err < best
            best = torch.where(better, err, best)
            scale = torch.where(better, s, scale)
            idx = torch.where(better[..., None], i, idx)
            neg = torch.where(better[..., None], ng, neg)
    nib = (idx | (neg.to(torch.int64) << 3)).reshape(n, k).to(torch.uint8)
    codes = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return codes.contiguous(), scale.view(torch.uint8).contiguous(), float(divisor)


def _round_blocks(blocks: torch.Tensor, bmax: torch.Tensor, divisor: float, factor: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(E4M3 block scales, E2M1 magnitude indices, negative flags)`` of ``blocks`` ``[N, K/16, 16]`` for the
    scale ``e4m3fn(min(bmax / 6 * divisor * factor, 448))`` (factor 1.0: round to nearest)."""
    scale = (bmax / E2M1_MAX * divisor * factor).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    tiny = torch.tensor(_E4M3_TINY, dtype=torch.float32).to(torch.float8_e4m3fn)
    scale = torch.where((bmax > 0) & (scale.float() == 0), tiny, scale)
    s32 = scale.float()
    inv = torch.where(s32 > 0, divisor / s32.double(), torch.zeros((), dtype=torch.float64))
    scaled = blocks.double() * inv[..., None]
    idx = _round_e2m1(scaled.abs())
    return scale, idx, (scaled < 0) & (idx > 0)


def _block_error(blocks: torch.Tensor, scale: torch.Tensor, idx: torch.Tensor, neg: torch.Tensor,
                 divisor: float) -> torch.Tensor:
    """Squared reconstruction error of each block, in fp64."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=blocks.device)[idx]
    vals = torch.where(neg, -mags, mags) * scale.double()[..., None] / divisor
    return ((vals - blocks.double()) ** 2).sum(-1)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K/2]`` packed bytes -> ``[N, K]`` 4-bit codes (int64)."""
    c = codes.to(torch.int64)
    return torch.stack((c & 0xF, c >> 4), dim=-1).reshape(c.shape[0], c.shape[1] * 2)


def decode(codes: torch.Tensor, block_scales: torch.Tensor, divisor: float,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[N, K]`` values ``e2m1(code) * block_scale / divisor`` in ``dtype`` (computed in at least fp32)."""
    wide = torch.promote_types(dtype, torch.float32)
    nib = unpack_codes(codes)
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=wide, device=codes.device)[nib & 7]
    vals = torch.where((nib & 8) != 0, -mags, mags)
    s = block_scales.view(torch.float8_e4m3fn).to(wide).repeat_interleave(BLOCK, dim=1)
    return (vals * s / divisor).to(dtype)


# -- the block_scale_k16_m128x4_v1 layout ---------------------------------------------------------------------
LAYOUT_ROWS = 128
LAYOUT_K = 64
TILE_BYTES = 512


def check_shape(shape: tuple[int, ...], what: str = "weight") -> int:
    """The rows of a weight of ``shape`` in this layout, or a QuantizationError naming the constraint it breaks."""
    if len(shape) < 2:
        raise QuantizationError(f"{what}: {FORMAT} stores weights of rank >= 2 ([..., N, K]), got {list(shape)}")
    if not fits(shape):
        raise QuantizationError(f"{what}: {FORMAT} needs N % {LAYOUT_ROWS} == 0 and K % {LAYOUT_K} == 0, got shape "
                                f"{list(shape)}")
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows


def fits(shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2 and shape[-2] % LAYOUT_ROWS == 0 and shape[-1] % LAYOUT_K == 0


def plane_offsets(rows: int, k: int) -> tuple[int, int, int]:
    """``(scales offset, divisor offset, total bytes)`` of ``rows`` rows of ``k`` weights."""
    codes = rows * k // 2
    scales = rows * k // BLOCK
    return codes, codes + scales, codes + scales + 4


def encoded_size(shape: tuple[int, ...]) -> int:
    rows = check_shape(tuple(shape))
    return plane_offsets(rows, shape[-1])[2]


def tile_scales(scales: torch.Tensor) -> torch.Tensor:
    """Row-major block scales ``[rows, K/16]`` (rows % 128 == 0, K % 64 == 0) -> the layout's tiles
    ``[rows/128, (K/64) * 512]`` (module docstring)."""
    rows, cols = scales.shape
    t = scales.reshape(rows // LAYOUT_ROWS, 4, 32, cols // 4, 4)          # [mt, r // 32, r % 32, kt, c]
    return t.permute(0, 3, 2, 1, 4).reshape(rows // LAYOUT_ROWS, cols // 4 * TILE_BYTES).contiguous()


def untile_scales(tiles: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of :func:`tile_scales`: ``[rows/128, (K/64) * 512]`` -> ``[rows, K/16]``."""
    mt, cols = tiles.shape[0], k // BLOCK
    t = tiles.reshape(mt, cols // 4, 32, 4, 4)                            # [mt, kt, r % 32, r // 32, c]
    return t.permute(0, 3, 2, 1, 4).reshape(mt * LAYOUT_ROWS, cols)
