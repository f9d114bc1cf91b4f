"""Groupwise symmetric integer weights: ``q4_g64_fp16``, ``q5_g64_fp16``, ``q6_g64_fp16``, ``q8_g32_fp16`` in
the ``row_split_k128_v1`` layout (docs/artifact-v3.md, "Quantized formats").

Definition (zero-point free, weight only): a weight ``[..., K]`` is a matrix of ``rows = prod(leading dims)``
rows; each row is padded with zeros to ``K_pad = align_up(K, 128)`` and cut into groups of ``G`` lanes (64 for
q4/q5/q6, 32 for q8) that never cross rows. ``value = fp32(scale) * code`` with one fp16 multiplier per group
and signed codes in ``[qmin, qmax]`` (q4 [-8, 7], q5 [-16, 15], q6 [-32, 31], q8 [-127, 127]).

Round-to-nearest encoder (``RTN_MAXABS_F16_RECIP``): ``amax`` per group, ``scale = fp16(amax / qmax)`` (round to
nearest even; an amax > 0 whose scale rounds to zero takes the smallest fp16 subnormal; an overflow fails),
``code = clamp(round_half_even(x * fp32(1 / scale)), qmin, qmax)``; a zero group has scale 0 and codes 0.
A non-finite weight fails.

Scale-search encoder (``SEARCH_MSE_F16_RECIP``, needs no data beyond the weights): per group, the same
rounding for each candidate ``scale = fp16(amax * f / qmax)``, ``f`` in :data:`SEARCH_FACTORS` (f = 1 is the
round-to-nearest scale), keeping the candidate with the least squared reconstruction error (ties: the larger
f). Codes still clamp to ``[qmin, qmax]``, so a smaller scale trades clipped outliers for finer steps.

Layout: three planes, each row-major over (row, group), each starting at a multiple of 256 bytes:
``base`` (32 bytes a group: q8 one two's-complement byte a lane; q4/q5/q6 the low 4 bits of each code, two
lanes a byte, the even lane in the low nibble), ``high`` (q5: 8 bytes, q6: 16 bytes a group: the code bits
above the low four, lane-major, least significant first, packed into bytes least significant bit first; q4
and q8 have none) and ``scales`` (little-endian fp16 words). Padding lanes hold code 0; a group of padding only
has scale 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.quant.errors import QuantizationError

PLANE_ALIGN = 256
K_ALIGN = 128
BASE_BYTES = 32           # per group, every groupwise format
ENCODER = "RTN_MAXABS_F16_RECIP"
SEARCH_ENCODER = "SEARCH_MSE_F16_RECIP"
SEARCH_FACTORS: tuple[float, ...] = tuple(1.0 - 0.02 * i for i in range(16))   # 1.00, 0.98, ..., 0.70


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class GroupwiseFormat:
    """One groupwise format: ``bits`` per code, ``group`` lanes per fp16 scale."""

    name: str
    bits: int
    group: int

    @property
    def qmax(self) -> int:
        return 127 if self.bits == 8 else (1 << (self.bits - 1)) - 1

    @property
    def qmin(self) -> int:
        return -127 if self.bits == 8 else -(1 << (self.bits - 1))

    @property
    def high_bits(self) -> int:
        return 0 if self.bits in (4, 8) else self.bits - 4

    @property
    def high_bytes(self) -> int:
        return self.group * self.high_bits // 8

    def groups_per_row(self, k: int) -> int:
        return _align(k, K_ALIGN) // self.group

    def plane_offsets(self, rows: int, k: int) -> tuple[int, int, int, int]:
        """``(high offset, scale offset, total bytes, groups per row)`` of a ``rows x k`` weight."""
        gpr = self.groups_per_row(k)
        base = rows * gpr * BASE_BYTES
        high = rows * gpr * self.high_bytes
        high_off = _align(base, PLANE_ALIGN)
        scale_off = high_off + _align(high, PLANE_ALIGN)
        return high_off, scale_off, scale_off + rows * gpr * 2, gpr

    def encoded_size(self, shape: tuple[int, ...]) -> int:
        rows, k = _rows_k(self.name, shape)
        return self.plane_offsets(rows, k)[2]

    # -- encoding --------------------------------------------------------------------------------
    def encode(self, w: torch.Tensor, what: str = "weight", *, search: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``w[r, K]`` (any float dtype) -> ``(base[r, gpr*32] u8, high[r, gpr*H] u8, scales[r, gpr] fp16)``;
        ``search`` selects the scale-search encoder instead of round to nearest."""
        if w.dim() != 2:
            raise QuantizationError(f"{what}: the {self.name} encoder takes rows [r, K], got shape {list(w.shape)}")
        x = w.detach().to(torch.float32)
        if not bool(torch.isfinite(x).all()):
            raise QuantizationError(f"{what}: a weight is not finite; {self.name} cannot encode it")
        r, k = x.shape
        gpr = self.groups_per_row(k)
        x = torch.nn.functional.pad(x, (0, gpr * self.group - k)).view(r, gpr, self.group)
        amax = x.abs().amax(dim=-1)
        scale, codes = self._round(x, amax, 1.0, what)
        if search:
            best = ((codes * scale.float()[..., None] - x) ** 2).sum(-1)
            for f in SEARCH_FACTORS[1:]:
                s, c = self._round(x, amax, f, what)
                err = ((c * s.float()[..., None] - x) ** 2).sum(-1)
                better = err < best
                best = torch.where(better, err, best)
                scale = torch.where(better, s, scale)
                codes = torch.where(better[..., None], c, codes)
        return (*self._pack(codes.to(torch.int32)), scale)

    def _round(self, x: torch.Tensor, amax: torch.Tensor, factor: float, what: str
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp16 scales, fp32 codes)`` of groups ``x`` for ``scale = fp16(amax * factor / qmax)``."""
        scale = (amax * factor / self.qmax).to(torch.float16)   # factor 1.0: exactly amax / qmax
        if bool(torch.isinf(scale).any()):
            raise QuantizationError(f"{what}: a group's scale overflows fp16 ({self.name})")
        tiny = torch.tensor(2.0 ** -24, dtype=torch.float16)
        scale = torch.where((amax > 0) & (scale == 0), tiny, scale)
        inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros((), dtype=torch.float32))
        return scale, torch.round(x * inv[..., None]).clamp(self.qmin, self.qmax)

    def _pack(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r, gpr, g = codes.shape
        if self.bits == 8:
            base = codes.to(torch.int8).view(torch.uint8).reshape(r, gpr * BASE_BYTES)
            return base, torch.empty((r, 0), dtype=torch.uint8, device=codes.device)
        u = codes & ((1 << self.bits) - 1)
        low = u & 0xF
        base = (low[..., 0::2] | (low[..., 1::2] << 4)).to(torch.uint8).reshape(r, gpr * BASE_BYTES)
        if not self.high_bits:
            return base, torch.empty((r, 0), dtype=torch.uint8, device=codes.device)
        hi = u >> 4                                                    # [r, gpr, g], high_bits wide
        bits = torch.stack([(hi >> b) & 1 for b in range(self.high_bits)], dim=-1).reshape(r, gpr, -1, 8)
        weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32, device=codes.device)
        high = (bits * weights).sum(-1).to(torch.uint8).reshape(r, gpr * self.high_bytes)
        return base, high

    # -- decoding --------------------------------------------------------------------------------
    def codes(self, base: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """Signed codes ``[r, gpr, group]`` (int32) of the base and high planes."""
        r = base.shape[0]
        b = base.reshape(r, -1, BASE_BYTES).to(torch.int32)
        if self.bits == 8:
            return base.reshape(r, -1, BASE_BYTES).view(torch.int8).to(torch.int32)
        u = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(r, b.shape[1], self.group)
        if self.high_bits:
            h = high.reshape(r, -1, self.high_bytes).to(torch.int32)
            bits = torch.stack([(h >> i) & 1 for i in range(8)], dim=-1).reshape(r, h.shape[1], self.group,
                                                                                self.high_bits)
            hi = sum(bits[..., i] << i for i in range(self.high_bits))
            u = u | (hi << 4)
        half = 1 << (self.bits - 1)
        return torch.where(u >= half, u - (1 << self.bits), u)

    def decode(self, base: torch.Tensor, high: torch.Tensor, scales: torch.Tensor, k: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[r, k]`` values ``scale * code`` in ``dtype`` (computed in at least fp32)."""
        wide = torch.promote_types(dtype, torch.float32)
        codes = self.codes(base, high).to(wide)
        vals = codes * scales.reshape(codes.shape[0], -1, 1).to(wide)
        return vals.reshape(codes.shape[0], -1)[:, :k].to(dtype)


def _rows_k(name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) < 2:
        raise QuantizationError(f"{name} stores weights of rank >= 2 ([..., N, K]), got shape {list(shape)}")
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, shape[-1]


GROUPWISE: dict[str, GroupwiseFormat] = {f.name: f for f in (
    GroupwiseFormat("q4_g64_fp16", 4, 64),
    GroupwiseFormat("q5_g64_fp16", 5, 64),
    GroupwiseFormat("q6_g64_fp16", 6, 64),
    GroupwiseFormat("q8_g32_fp16", 8, 32),
)}
