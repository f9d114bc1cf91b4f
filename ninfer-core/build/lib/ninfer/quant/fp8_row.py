"""``fp8_e4m3fn_row_bf16`` in the ``row_scale_v1`` layout (docs/artifact-v3.md, "Quantized formats").

Definition: a weight ``[..., K]`` is ``rows = prod(leading dims)`` rows; ``value = fp32(code) * fp32(scale)``
with one E4M3FN code per element and one bf16 multiplier per row.

Round-to-nearest encoder (``RTN_ROWMAX_BF16``): ``scale = bf16(amax(row) / 448)`` (round to nearest even; a
row with amax > 0 whose scale rounds to zero takes the smallest bf16 subnormal), ``code =
e4m3fn(clamp(x * fp32(1 / scale), -448, 448))`` rounded to nearest even; a zero row has scale 0 and codes 0.
A non-finite weight fails.

Layout: the codes, C order (``rows * K`` bytes), then, from the next multiple of 256 bytes, the row scales
as little-endian bf16 words.
"""

from __future__ import annotations

import torch

from ninfer.quant.errors import QuantizationError

FORMAT = "fp8_e4m3fn_row_bf16"
E4M3_MAX = 448.0
PLANE_ALIGN = 256
ENCODER = "RTN_ROWMAX_BF16"


def scale_offset(rows: int, k: int) -> int:
    return -(-rows * k // PLANE_ALIGN) * PLANE_ALIGN


def encoded_size(shape: tuple[int, ...]) -> int:
    if len(shape) < 2:
        raise QuantizationError(f"{FORMAT} stores weights of rank >= 2 ([..., N, K]), got shape {list(shape)}")
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return scale_offset(rows, shape[-1]) + rows * 2


def encode(w: torch.Tensor, what: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``w[r, K]`` -> ``(codes[r, K] uint8 (E4M3FN bits), scales[r] bf16)``."""
    x = w.detach().to(torch.float32)
    if x.dim() != 2:
        raise QuantizationError(f"{what}: the {FORMAT} encoder takes rows [r, K], got shape {list(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise QuantizationError(f"{what}: a weight is not finite; {FORMAT} cannot encode it")
    amax = x.abs().amax(dim=-1)
    scale = (amax / E4M3_MAX).to(torch.bfloat16)
    tiny = torch.tensor(2.0 ** -133, dtype=torch.bfloat16)
    scale = torch.where((amax > 0) & (scale == 0), tiny, scale)
    inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros((), dtype=torch.float32))
    codes = (x * inv[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scale


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[r, K]`` values ``code * scale`` in ``dtype`` (computed in at least fp32)."""
    wide = torch.promote_types(dtype, torch.float32)
    vals = codes.view(torch.float8_e4m3fn).to(wide) * scales.to(wide)[:, None]
    return vals.to(dtype)
