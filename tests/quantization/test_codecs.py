"""Quantized formats against their definition (docs/artifact-v3.md, "Quantized formats"), in fp64.

The oracle below re-derives scales, codes and byte planes from the written definition with plain Python
integers and floats, independently of ninfer.quant's vectorised code."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from ninfer.quant import QuantizationError, encoded_size, fp8_row, packed_view
from ninfer.quant.groupwise import GROUPWISE

BITS = {"q4_g64_fp16": (4, 64), "q5_g64_fp16": (5, 64), "q6_g64_fp16": (6, 64), "q8_g32_fp16": (8, 32)}


def _f16(x: float) -> float:
    return struct.unpack("<e", struct.pack("<e", x))[0]


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def oracle_groupwise(fmt: str, w: torch.Tensor) -> tuple[bytes, list[list[float]], list[list[int]]]:
    """(stored bytes, fp64 values [rows][K], codes) by the definition, element by element."""
    bits, g = BITS[fmt]
    qmax = 127 if bits == 8 else (1 << (bits - 1)) - 1
    qmin = -qmax if bits == 8 else -(1 << (bits - 1))
    rows = w.reshape(-1, w.shape[-1]).tolist()
    k = len(rows[0])
    kpad = -(-k // 128) * 128
    base, high, scales, values, all_codes = bytearray(), bytearray(), bytearray(), [], []
    for row in rows:
        row = [_f32(x) for x in row] + [0.0] * (kpad - k)
        vals, codes_row = [], []
        for g0 in range(0, kpad, g):
            grp = row[g0:g0 + g]
            amax = max(abs(x) for x in grp)
            scale = _f16(_f32(amax / qmax)) if amax else 0.0
            if amax and scale == 0.0:
                scale = 2.0 ** -24
            inv = _f32(1.0 / scale) if scale else 0.0
            codes = [max(qmin, min(qmax, round(_f32(x * inv)))) for x in grp]   # round(): half to even
            scales += struct.pack("<e", scale)
            if bits == 8:
                base += bytes(c & 0xFF for c in codes)
            else:
                u = [c & ((1 << bits) - 1) for c in codes]
                base += bytes((u[i] & 0xF) | ((u[i + 1] & 0xF) << 4) for i in range(0, g, 2))
                hb = bits - 4
                if hb:
                    stream = 0
                    for lane, v in enumerate(u):
                        stream |= (v >> 4) << (lane * hb)
                    high += stream.to_bytes(g * hb // 8, "little")
            vals += [scale * c for c in codes]
            codes_row += codes
        values.append(vals[:k])
        all_codes.append(codes_row)
    pad = lambda b: bytes(b) + bytes(-len(b) % 256)  # noqa: E731
    stored = pad(base) + pad(high) + bytes(scales)
    return stored, values, all_codes


def _stored(fmt: str, w: torch.Tensor) -> bytes:
    spec = GROUPWISE[fmt]
    b, h, s = spec.encode(w.reshape(-1, w.shape[-1]))
    rows, k = b.shape[0], w.shape[-1]
    high_off, scale_off, total, _ = spec.plane_offsets(rows, k)
    out = bytearray(total)
    out[:b.numel()] = b.numpy().tobytes()
    out[high_off:high_off + h.numel()] = h.numpy().tobytes()
    out[scale_off:] = s.view(torch.uint8).numpy().tobytes()
    return bytes(out)


SHAPES = [(1, 1), (3, 64), (2, 130), (5, 257), (2, 3, 96)]


@pytest.mark.parametrize("fmt", list(BITS))
@pytest.mark.parametrize("shape", SHAPES)
def test_groupwise_matches_definition(fmt, shape):
    g = torch.Generator().manual_seed(hash((fmt, shape)) % 1000)
    w = torch.randn(shape, generator=g, dtype=torch.float32) * 0.1
    w.view(-1)[0] = 0.0
    if shape[-1] >= 64:
        w.reshape(-1, shape[-1])[0, :32] = 0.0          # a zero group (q8) / a partly zero one
    stored, values, codes = oracle_groupwise(fmt, w)
    got = _stored(fmt, w)
    assert len(got) == encoded_size(fmt, shape) == len(stored)
    assert got == stored
    parent = torch.frombuffer(bytearray(got), dtype=torch.uint8)
    pw = packed_view(fmt, parent, shape, 0, w.numel(), shape)
    assert torch.equal(pw.dequantize(torch.float64).reshape(-1, shape[-1]), torch.tensor(values, dtype=torch.float64))
    if fmt == "q8_g32_fp16":
        assert min(min(r) for r in codes) >= -127


@pytest.mark.parametrize("fmt", list(BITS))
def test_groupwise_error_bound_and_padding(fmt):
    spec = GROUPWISE[fmt]
    w = torch.randn(4, 200, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    base, high, scales = spec.encode(w)
    # fully padded groups (K 200 -> 256) have scale 0 and code 0
    first_pad = -(-200 // spec.group)
    assert torch.all(scales[:, first_pad:] == 0)
    deq = spec.decode(base, high, scales, 200, torch.float64)
    err = (deq - w).abs().reshape(4, -1)
    step = scales.double().repeat_interleave(spec.group, dim=1)[:, :200]
    assert torch.all(err <= step / 2 * (1 + 1e-3) + 1e-12)


def test_fp8_row_matches_definition():
    w = torch.randn(5, 70, generator=torch.Generator().manual_seed(2)) * 3.0
    w[1] = 0.0
    codes, scales = fp8_row.encode(w)
    assert encoded_size("fp8_e4m3fn_row_bf16", (5, 70)) == 512 + 10
    for r in range(5):
        amax = float(w[r].abs().max())
        scale = float(torch.tensor(_f32(amax / 448.0)).to(torch.bfloat16))
        assert float(scales[r]) == scale
        inv = _f32(1.0 / scale) if scale else 0.0
        want = torch.tensor([max(-448.0, min(448.0, _f32(float(x) * inv))) for x in w[r]]).to(torch.float8_e4m3fn)
        assert torch.equal(codes[r], want.view(torch.uint8))
    stored = bytearray(encoded_size("fp8_e4m3fn_row_bf16", (5, 70)))
    stored[:350] = codes.numpy().tobytes()
    stored[512:] = scales.view(torch.uint8).numpy().tobytes()
    pw = packed_view("fp8_e4m3fn_row_bf16", torch.frombuffer(stored, dtype=torch.uint8), (5, 70), 0, 350, (5, 70))
    want = codes.view(torch.float8_e4m3fn).double() * scales.double()[:, None]
    assert torch.equal(pw.dequantize(torch.float64), want)
    assert float((pw.dequantize(torch.float64) - w.double()).abs().max()) <= 0.07 * float(w.abs().max())


@pytest.mark.parametrize("fmt", [*BITS, "fp8_e4m3fn_row_bf16"])
def test_bad_inputs_are_named(fmt):
    with pytest.raises(QuantizationError, match="rank >= 2"):
        encoded_size(fmt, (64,))
    encode = fp8_row.encode if fmt.startswith("fp8") else GROUPWISE[fmt].encode
    bad = torch.ones(2, 64)
    bad[1, 3] = math.inf
    with pytest.raises(QuantizationError, match="w1.*not finite"):
        encode(bad, "w1")


def test_views_must_be_whole_rows():
    fmt = "q4_g64_fp16"
    parent = torch.zeros(encoded_size(fmt, (4, 64)), dtype=torch.uint8)
    with pytest.raises(QuantizationError, match="whole rows"):
        packed_view(fmt, parent, (4, 64), 32, 96, (1, 64))
    pw = packed_view(fmt, parent, (4, 64), 64, 192, (2, 64))
    assert pw.planes[0].data_ptr() == parent.data_ptr() + 64   # row 1 of the base plane (K pads to 128), no copy


@pytest.mark.parametrize("fmt", list(BITS))
def test_scale_search_never_worse_than_round_to_nearest(fmt):
    spec = GROUPWISE[fmt]
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(4)) ** 3    # heavy tails: clipping pays
    rtn = spec.decode(*spec.encode(w), 256, torch.float64)
    b, h, s = spec.encode(w, search=True)
    found = spec.decode(b, h, s, 256, torch.float64)
    err = lambda d: ((d - w.double()) ** 2).reshape(16, -1, spec.group).sum(-1)   # noqa: E731
    assert torch.all(err(found) <= err(rtn) * (1 + 1e-6) + 1e-12)   # per group: f = 1 is a candidate
    if fmt == "q4_g64_fp16":
        assert float(err(found).sum()) < 0.9 * float(err(rtn).sum())
    codes = spec.codes(b, h)
    assert int(codes.min()) >= spec.qmin and int(codes.max()) <= spec.qmax
