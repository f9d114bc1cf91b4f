"""Triton rope (NeoX rotate-half on the first R dims) against the reference suite's fp64 oracle.

Criteria (tests/ops/test_rope.py): rotated dims pointwise fp32 rtol 1e-6 / atol 2e-7, bf16 rtol 2^-8 /
atol 2^-9; pass-through dims bit-exact. cos/sin halves are distinct (not cat(f, f)) so reading the wrong half
fails. Also: Qwen3.5 geometry (D=256, R=64, many heads), a strided input, and the real mrope table.
"""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import assert_bits, assert_pointwise, f64, randn  # noqa: E402
from ops.test_rope import CRIT  # noqa: E402

from .conftest import DEVICE, reference, triton_ops  # noqa: E402


def oracle(x, cos, sin, rot):
    xd, c, s = f64(x), f64(cos)[:, None], f64(sin)[:, None]
    h = rot // 2
    ref = torch.empty(x.shape[0], x.shape[1], rot, dtype=torch.float64)
    for j in range(h):
        ref[..., j] = xd[..., j] * c[..., j] - xd[..., j + h] * s[..., j]
        ref[..., j + h] = xd[..., j + h] * c[..., j + h] + xd[..., j] * s[..., j + h]
    return ref


def tables(gen, t_len, rot):
    ang = torch.rand(t_len, rot // 2, generator=gen, dtype=torch.float64) * 20 - 10
    ang = torch.cat((ang, ang + 0.5), dim=-1)
    return ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t_len,heads,head_dim,rot", [(7, 3, 256, 64), (7, 3, 16, 16), (7, 3, 12, 8),
                                                     (5, 10, 256, 64)])
def test_rope_rotate_half(dtype, t_len, heads, head_dim, rot, gen):
    ops = triton_ops(dtype)
    assert ops.implementation("rope").name == "triton"
    x = randn(gen, t_len, heads, head_dim, dtype=dtype, device=DEVICE)
    cos, sin = tables(gen, t_len, rot)
    out = ops.rope(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    assert_pointwise(out[..., :rot], oracle(x, cos, sin, rot), CRIT[dtype], f"rope {dtype} D={head_dim} R={rot}")
    if rot < head_dim:
        assert_bits(out[..., rot:].cpu(), x[..., rot:].cpu(), "pass-through dims")
    ref = reference(dtype).rope(x, cos, sin)
    assert_bits(out[..., rot:].cpu(), ref[..., rot:].cpu(), "pass-through vs torch reference")


def test_rope_strided_input(gen):
    # k taken as a slice of a fused projection: head stride != D.
    ops = triton_ops(torch.float32)
    fused = randn(gen, 4, 2, 3, 32, device=DEVICE)
    x = fused[:, 1]
    cos, sin = tables(gen, 4, 16)
    out = ops.rope(x, cos, sin)
    assert_pointwise(out[..., :16], oracle(x, cos, sin, 16), CRIT[torch.float32], "strided rope")
    assert_bits(out[..., 16:].cpu(), x[..., 16:].cpu(), "strided pass-through")


def test_rope_with_qwen35_mrope_table(gen):
    ops = triton_ops(torch.bfloat16)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    positions = torch.randint(0, 100_000, (3, 6), generator=gen)
    cos, sin = ops.mrope_cos_sin(positions.to(DEVICE), inv_freq.to(DEVICE), (11, 11, 10), True)
    x = randn(gen, 6, 8, 256, dtype=torch.bfloat16, device=DEVICE)
    out = ops.rope(x, cos, sin)
    assert_pointwise(out[..., :64], oracle(x, cos, sin, 64), CRIT[torch.bfloat16], "rope with mrope table")


def test_mrope_cos_sin_kernel_interleaved_sections(gen):
    """The Triton table against the reference suite's fp64 oracle check (one fp32 rounding of cos/sin of the fp64
    angle), and against the reference op."""
    from ops.test_rope import check_mrope_interleaved

    ops = triton_ops(torch.bfloat16)
    assert ops.implementation("mrope_cos_sin").name == "triton"
    positions, inv_freq, cos, sin = check_mrope_interleaved(ops, DEVICE, gen)
    ref_cos, ref_sin = reference(torch.bfloat16).mrope_cos_sin(positions.to(DEVICE), inv_freq.to(DEVICE),
                                                               (11, 11, 10), True)
    # Both round the same fp64 value once: they may differ only where fp64 cos/sin implementations differ
    # across a rounding boundary (at most one fp32 ulp, in rare elements).
    ulp = 2.0 ** -23
    assert (cos.cpu() - ref_cos.cpu()).abs().max() <= ulp and (sin.cpu() - ref_sin.cpu()).abs().max() <= ulp


def test_mrope_cos_sin_kernel_layouts(gen):
    """Contiguous sections and plain RoPE (the reference suite's check); an expanded [3, T] view of one row
    (stride 0 over the axes, as the model passes text positions) gives the same table as its contiguous copy."""
    from ops.test_rope import check_mrope_sections_and_plain

    ops = triton_ops(torch.float32)
    positions, inv_freq = check_mrope_sections_and_plain(ops, DEVICE, gen)
    row = positions[0].to(DEVICE)
    expanded = row.unsqueeze(0).expand(3, -1)
    a = ops.mrope_cos_sin(expanded, inv_freq.to(DEVICE), (3, 3, 2), True)
    b = ops.mrope_cos_sin(expanded.contiguous(), inv_freq.to(DEVICE), (3, 3, 2), True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="3 position axes"):
        ops.mrope_cos_sin(row[None], inv_freq.to(DEVICE), (3, 3, 2), True)
