"""Torch reference of the A8 product: 8-bit (E4M3) activations with dynamic per-token scales times an fp8 row
weight, in fp32.

Definition (the Triton A8 GEMM, :func:`~ninfer.ops.triton.quant_gemm.gemm_a8`, has the same one): each row
(token) ``x`` of the activations has ``amax = max |x|`` in fp32, ``scale = amax / 448`` and
``code = e4m3fn(clamp(x * (448 / amax), -448, 448))`` (divisions correctly rounded in fp32, E4M3 round to
nearest even); a row with ``amax <`` :data:`A8_MIN_AMAX` (zero included) has zero codes. The product is
``(code * scale) @ (wcode * wscale).T`` accumulated in fp32 and rounded once to x's dtype. Only fp8 row weights
take it (their codes are E4M3 as well, so on FP8 tensor cores every product is exact).
"""

from __future__ import annotations

import torch

from ninfer.errors import NotSupportedError
from ninfer.quant import PackedWeight
from ninfer.quant.fp8_row import FORMAT as FP8_ROW

# Rows whose largest |x| is below this quantize to zero codes: 448 / amax would overflow fp32 (x ~ 1e-36).
A8_MIN_AMAX = 2.0 ** -118


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [M, K] float8_e4m3fn, scales [M] fp32)`` of the rows of ``x2 [M, K]`` (definition above)."""
    xf = x2.to(torch.float32)
    amax = xf.abs().amax(-1) if xf.shape[-1] else torch.zeros(xf.shape[:-1], dtype=torch.float32,
                                                              device=xf.device)
    inv = torch.where(amax >= A8_MIN_AMAX, 448.0 / amax.clamp_min(A8_MIN_AMAX), torch.zeros((), device=xf.device))
    codes = (xf * inv[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, amax / 448.0


def linear_a8(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``x[..., K] @ decode(weight).T`` with x's rows quantized to E4M3 per token, fp32 accumulation, the
    result rounded to x.dtype."""
    if weight.format != FP8_ROW:
        raise NotSupportedError(f"A8 linear: only {FP8_ROW} weights take 8-bit activations, got {weight.format}")
    k = weight.shape[-1]
    if x.shape[-1] != k:
        raise ValueError(f"linear: x has {x.shape[-1]} input features, weight expects {k}")
    x2 = x.reshape(-1, k)
    codes, scales = quantize_rows(x2)
    xq = codes.to(torch.float32) * scales[:, None]
    y = xq @ weight.dequantize(torch.float32).T
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
