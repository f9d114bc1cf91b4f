"""Packed weights and the fp64 oracle with its error bound, for the quantized-weight kernel tests.

Weights are random normals encoded by the formats' own round-to-nearest encoders (ninfer.quant) and stored in a
parent byte buffer in the artifact's plane layout, then taken back as a packed view of a row block of it (what
the loader hands over: planes at offsets inside one buffer, rows not starting at 0).

Oracle: ``x @ decode(w).T`` in fp64 from the represented inputs (the decode is exact). Criterion: elementwise
``|out - ref| <= u_out * |ref| + (1 + u_out) * gamma(n, u) * sum_k |x_k| |w_nk|`` with ``gamma(n, u) =
n u / (1 - n u)``, the worst-case bound of any fp32 evaluation of an n-term dot product whose every product and
sum rounds with relative error at most u, followed by one rounding to the output dtype (unit roundoff u_out;
0 for an fp32 output). The kernels decode ``code * scale`` exactly in fp32, so n counts the dot's lanes
(padding included) plus the extra roundings of the kernel (a scale applied after a partial sum). u is 2^-24
(round to nearest) for the CUDA-core GEMV and 2^-23 for tensor-core products: tensor cores accumulate their
fp32 sums with truncation (an error below one ulp), not round to nearest.
"""

from __future__ import annotations

import torch
from ninfer.quant import QUANTIZED_FORMATS, PackedWeight, encoded_size, fp8_row, nvfp4, packed_view
from ninfer.quant.groupwise import GROUPWISE

# The formats the groupwise/fp8 Triton kernels read (nvfp4 has its own kernels: test_quant_nvfp4_triton.py).
FORMATS = tuple(f for f in QUANTIZED_FORMATS if f != "nvfp4")
U_RN = 2.0 ** -24
U_TC = 2.0 ** -23
U_OUT = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _put(buf: torch.Tensor, offset: int, plane: torch.Tensor) -> None:
    raw = plane.contiguous().view(torch.uint8).reshape(-1)
    buf[offset:offset + raw.numel()] = raw


def parent_bytes(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """The stored bytes of ``w[rows, K]`` in ``fmt`` (the artifact's object layout), as a uint8 tensor."""
    rows, k = w.shape
    buf = torch.zeros(encoded_size(fmt, (rows, k)), dtype=torch.uint8)
    if fmt == nvfp4.FORMAT:   # codes, the block scales in their 128 x 4 tiles, the whole tensor's divisor
        codes, scales, divisor = nvfp4.encode(w)
        scale_off, div_off, _ = nvfp4.plane_offsets(rows, k)
        _put(buf, 0, codes)
        _put(buf, scale_off, nvfp4.tile_scales(scales))
        _put(buf, div_off, torch.tensor([divisor], dtype=torch.float32))
        return buf
    if fmt == fp8_row.FORMAT:
        codes, scales = fp8_row.encode(w)
        _put(buf, 0, codes)
        _put(buf, fp8_row.scale_offset(rows, k), scales)
        return buf
    spec = GROUPWISE[fmt]
    base, high, scales = spec.encode(w)
    high_off, scale_off, _, _ = spec.plane_offsets(rows, k)
    _put(buf, 0, base)
    _put(buf, high_off, high)
    _put(buf, scale_off, scales)
    return buf


def random_packed(gen: torch.Generator, fmt: str, n: int, k: int, device, *, skip: int = 3) -> PackedWeight:
    """A packed ``[n, K]`` weight of random normals (scale K^-1/2): rows ``[skip, skip + n)`` of a stored parent
    of ``n + skip + 2`` rows, on ``device``."""
    rows = n + skip + 2
    w = torch.randn(rows, k, generator=gen, dtype=torch.float64).float() * k ** -0.5
    parent = parent_bytes(fmt, w).to(device)
    return packed_view(fmt, parent, (rows, k), skip * k, (skip + n) * k, (n, k))


def decoded(w: PackedWeight) -> torch.Tensor:
    """The weight's exact values, fp64 on CPU."""
    return PackedWeight(w.format, w.shape, tuple(p.cpu() for p in w.planes)).dequantize(torch.float64)


def lanes(w: PackedWeight) -> int:
    """Lanes a kernel's dot runs over: K padded to 128 for the groupwise formats."""
    k = w.shape[-1]
    return k if w.format == fp8_row.FORMAT else -(-k // 128) * 128


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def oracle(x: torch.Tensor, w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x @ decode(w).T, |x| @ |decode(w)|.T)`` in fp64 on CPU."""
    x64 = x.detach().to("cpu", torch.float64)
    wd = decoded(w)
    return x64 @ wd.T, x64.abs() @ wd.abs().T


def assert_dot_bound(out: torch.Tensor, x: torch.Tensor, w: PackedWeight, *, u: float, extra: int, what: str,
                     out_dtype: torch.dtype | None = None) -> None:
    """``out`` (x's dtype rounding, unless ``out_dtype`` says otherwise) within the module's bound of the oracle,
    for a dot of ``lanes(w) + extra`` roundings of unit u."""
    ref, mag = oracle(x, w)
    o = out.detach().to("cpu", torch.float64)
    assert o.shape == ref.shape, f"{what}: shape {tuple(o.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(o).all(), f"{what}: non-finite output"
    uo = U_OUT[out_dtype or x.dtype]
    limit = uo * ref.abs() + (1 + uo) * gamma(lanes(w) + extra, u) * mag
    excess = (o - ref).abs() - limit
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"{what}: {int((excess > 0).sum())} of {excess.numel()} outputs outside the bound; worst at "
        f"{divmod(worst, ref.shape[-1])}: out {o.flatten()[worst]:.9g}, ref {ref.flatten()[worst]:.9g}, "
        f"limit {limit.flatten()[worst]:.3g}")
