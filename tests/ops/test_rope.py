"""rope and mrope_cos_sin against fp64 oracles; mrope also cross-checked with transformers' Qwen3.5 rotary
embedding (supplementary evidence only, the fp64 oracle is the criterion).

Criteria:
- rope (pointwise over rotated dims): fp32 rtol 1e-6 / atol 2e-7 (two fp32 products and a sum, so an
  absolute term relative to max|ref| covers cancellation); bf16 rtol 2^-8 / atol 2^-9 (one output
  rounding). Pass-through dims: bit-exact.
- mrope_cos_sin: |err| <= 2^-24 + 2^-53 * |angle| absolute per element (one fp32 rounding of cos/sin of an
  fp64 angle).
"""

import math

import pytest
import torch

from .conftest import DTYPES, Pointwise, assert_bits, assert_pointwise, f64, randn, reference_ops

CRIT = {torch.float32: Pointwise(1e-6, 2e-7), torch.bfloat16: Pointwise(2 ** -8, 2 ** -9)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rot", [(256, 64), (16, 16), (12, 8)])
def test_rope_rotate_half(device, dtype, head_dim, rot, gen):
    ops = reference_ops(device, dtype)
    t_len, heads = 7, 3
    x = randn(gen, t_len, heads, head_dim, dtype=dtype, device=device)
    ang = torch.rand(t_len, rot // 2, generator=gen, dtype=torch.float64) * 20 - 10
    # Distinct cos/sin halves (not cat(f, f)) so a kernel that reads the wrong half fails.
    ang = torch.cat((ang, ang + 0.5), dim=-1)
    cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    out = ops.rope(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    xd, c, s = f64(x), f64(cos)[:, None], f64(sin)[:, None]
    h = rot // 2
    ref = torch.empty(t_len, heads, rot, dtype=torch.float64)
    for j in range(h):  # pair (j, j + h) per the NeoX rotate-half convention
        ref[..., j] = xd[..., j] * c[..., j] - xd[..., j + h] * s[..., j]
        ref[..., j + h] = xd[..., j + h] * c[..., j + h] + xd[..., j] * s[..., j + h]
    assert_pointwise(out[..., :rot], ref, CRIT[dtype], f"rope {dtype} D={head_dim} R={rot}")
    if rot < head_dim:
        assert_bits(out[..., rot:].cpu(), x[..., rot:].cpu(), "pass-through dims")


def mrope_oracle(positions, inv_freq, axis_of):
    half = inv_freq.shape[0]
    t_len = positions.shape[1]
    f = torch.empty(t_len, half, dtype=torch.float64)
    for i in range(half):
        f[:, i] = positions[axis_of(i)].double() * float(inv_freq[i])
    f = torch.cat((f, f), dim=-1)
    return f.cos(), f.sin(), f


def check_table(out, ref, angle, what):
    err = (f64(out) - ref).abs()
    limit = 2.0 ** -24 + 2.0 ** -53 * angle.abs()
    assert out.dtype == torch.float32
    assert (err <= limit).all(), f"{what}: worst excess {(err - limit).max().item():.3e}"


def interleaved_axis(i):
    # Qwen3.5 [11, 11, 10]: H takes 1,4,...,31; W takes 2,5,...,29; T the rest.
    if i % 3 == 1 and i <= 31:
        return 1
    if i % 3 == 2 and i <= 29:
        return 2
    return 0


def check_mrope_interleaved(ops, device, gen):
    """Qwen3.5's interleaved [11, 11, 10] sections at positions 0 to 2e5, distinct axes so every frequency
    index's source axis is observable. Returns (positions, inv_freq, cos, sin)."""
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    positions = torch.randint(0, 200_000, (3, 11), generator=gen)
    positions[:, 0] = torch.tensor([0, 1, 2])
    cos, sin = ops.mrope_cos_sin(positions.to(device), inv_freq.to(device), (11, 11, 10), True)
    rc, rs, ang = mrope_oracle(positions, inv_freq, interleaved_axis)
    check_table(cos, rc, ang, "mrope cos")
    check_table(sin, rs, ang, "mrope sin")
    return positions, inv_freq, cos, sin


def check_mrope_sections_and_plain(ops, device, gen):
    """Contiguous sections (Qwen2-VL layout) and plain RoPE from 1-D positions. Returns (positions, inv_freq)."""
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    positions = torch.randint(0, 5000, (3, 6), generator=gen)
    cos, sin = ops.mrope_cos_sin(positions.to(device), inv_freq.to(device), (3, 3, 2), False)
    rc, rs, ang = mrope_oracle(positions, inv_freq, lambda i: 0 if i < 3 else 1 if i < 6 else 2)
    check_table(cos, rc, ang, "contiguous cos")
    check_table(sin, rs, ang, "contiguous sin")
    cos, sin = ops.mrope_cos_sin(positions[0].to(device), inv_freq.to(device), None, False)
    rc, rs, ang = mrope_oracle(positions, inv_freq, lambda i: 0)
    check_table(cos, rc, ang, "plain cos")
    check_table(sin, rs, ang, "plain sin")
    return positions, inv_freq


def test_mrope_interleaved_sections(device, gen):
    check_mrope_interleaved(reference_ops(device, torch.float32), device, gen)
    counts = [sum(interleaved_axis(i) == a for i in range(32)) for a in range(3)]
    assert counts == [11, 11, 10]


def test_mrope_contiguous_sections_and_plain(device, gen):
    check_mrope_sections_and_plain(reference_ops(device, torch.float32), device, gen)


def test_mrope_matches_transformers_qwen3_5(gen):
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    Qwen3_5TextRotaryEmbedding = modeling.Qwen3_5TextRotaryEmbedding

    cfg = transformers.Qwen3_5TextConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=256, num_hidden_layers=1,
        intermediate_size=64, vocab_size=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    rotary = Qwen3_5TextRotaryEmbedding(cfg)
    positions = torch.randint(0, 4096, (3, 1, 9), generator=gen)
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    ops = reference_ops("cpu", torch.float32)
    cos, sin = ops.mrope_cos_sin(positions[:, 0], rotary.inv_freq, (11, 11, 10), True)
    assert cos.shape == hf_cos[0].shape == (9, 64)
    # transformers forms the angle in fp32: allow its rounding (|angle| * 2^-24) on top of ours.
    slack = 4096 * 2.0 ** -23 + 2.0 ** -22
    assert (cos - hf_cos[0]).abs().max().item() <= slack
    assert (sin - hf_sin[0]).abs().max().item() <= slack
    assert math.isclose(float(rotary.inv_freq[1]), 1e7 ** (-2 / 64), rel_tol=1e-6)
