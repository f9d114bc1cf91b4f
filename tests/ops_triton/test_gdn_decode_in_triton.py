"""Triton gdn_decode_in (pre-norm + fused input projection + conv + gates in one GEMV for one row) and
gdn_decode_step (the recurrent step + gated norm kernel alone).

The contract defines gdn_decode_in as a composition; the fused kernel forms every value the way the composed
Triton ops do, so it is held to their results bit for bit: outputs, the new residual, and the conv states (the
lookahead form included). Two rows take the two-launch path, compared the same way. gdn_decode_in followed by
gdn_decode_step is compared with add_rms_norm_linear followed by gdn_decode (the whole step), and with the torch
reference op. Runs on CUDA when present, otherwise under TRITON_INTERPRET=1 at tiny sizes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import assert_bits, assert_normwise, randn  # noqa: E402
from ops.shared_checks import gdn_decode_case  # noqa: E402
from ops.test_gdn import OUT, STATE  # noqa: E402

from .conftest import CUDA, DEVICE, reference, triton_ops  # noqa: E402

# (B, H, Hk, Hv, Dk, Dv); on CUDA also the 35B-A3B layer (H 2048, 16/32 heads x 128) at B = 1 and 2.
SHAPES = [(1, 32, 1, 2, 16, 16), (2, 32, 1, 2, 16, 16), (1, 24, 2, 4, 8, 8)]
if CUDA:
    SHAPES += [(1, 2048, 16, 32, 128, 128), (2, 2048, 16, 32, 128, 128)]


def _case(gen, dtype, bsz, hidden, hk, hv, dk, dv):
    (mixed, _, _, _, p), conv_states, states, slots = gdn_decode_case(gen, DEVICE, dtype, bsz, hk, hv, dk, dv)
    c, vd = mixed.shape[1], hv * dv
    x = randn(gen, bsz, hidden, dtype=dtype, device=DEVICE)
    residual = randn(gen, bsz, hidden, dtype=dtype, device=DEVICE)
    norm_w = randn(gen, hidden, dtype=dtype, device=DEVICE, scale=0.1)
    weight = randn(gen, c + vd + 2 * hv, hidden, dtype=dtype, device=DEVICE, scale=hidden ** -0.5)
    return (x, residual, norm_w, 1e-6, weight, p), conv_states, states, slots


def _composed(ops, x, residual, norm_w, eps, weight, p, conv_states, slots, out_slots=None):
    """The contract's composition with the same backend's ops: (y, z, g, beta, new_residual)."""
    c = 2 * p.key_heads * p.key_dim + p.value_heads * p.value_dim
    vd, hv = p.value_heads * p.value_dim, p.value_heads
    proj, _, new_residual = ops.add_rms_norm_linear(x, residual, norm_w, eps, weight)
    mixed, z, b, a = proj.split([c, vd, hv, hv], dim=-1)
    g, beta = ops.gdn_gates(a, b, p.neg_a, p.dt_bias)
    y = ops.causal_conv1d_update(mixed, p.conv_weight, conv_states, slots, out_slots)
    return y, z.reshape(-1, hv, p.value_dim), g, beta, new_residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bsz,hidden,hk,hv,dk,dv", SHAPES)
def test_gdn_decode_in_equals_the_composed_triton_ops(dtype, bsz, hidden, hk, hv, dk, dv, gen):
    ops = triton_ops(dtype)
    assert ops.implementation("gdn_decode_in").name == "triton"
    args, conv_states, _, slots = _case(gen, dtype, bsz, hidden, hk, hv, dk, dv)
    conv_ref = conv_states.clone()
    want = _composed(ops, *args, conv_ref, slots)
    got = ops.gdn_decode_in(*args, conv_states, slots)
    for name, a, b in zip(("y", "z", "g", "beta", "new_residual"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert_bits(a.cpu(), b.cpu(), f"gdn_decode_in {name}")
    assert_bits(conv_states.cpu(), conv_ref.cpu(), "gdn_decode_in conv states (read and untouched slots)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_in_out_slots_leave_the_read_slots(dtype, gen):
    """Lookahead form: the new conv state goes to the out slot, the read slot stays as it was, and the values
    equal the in-place run's."""
    ops = triton_ops(dtype)
    args, conv_states, _, _ = _case(gen, dtype, 1, 32, 1, 2, 16, 16)
    src, dst = torch.tensor([3], device=DEVICE), torch.tensor([5], device=DEVICE)
    in_place = conv_states.clone()
    want = ops.gdn_decode_in(*args, in_place, src)
    kept = conv_states[src].clone()
    got = ops.gdn_decode_in(*args, conv_states, src, dst)
    for a, b in zip(got, want, strict=True):
        assert_bits(a.cpu(), b.cpu(), "out-slot outputs")
    assert_bits(conv_states[src].cpu(), kept.cpu(), "read slot unchanged")
    assert_bits(conv_states[dst].cpu(), in_place[src].cpu(), "out slot holds the new state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bsz", [1, 2])
def test_in_then_step_is_the_whole_decode_step(dtype, bsz, gen):
    """gdn_decode_in -> gdn_decode_step equals add_rms_norm_linear -> gdn_decode bit for bit (Triton), and the
    torch reference op within the decode criteria."""
    ops = triton_ops(dtype)
    hidden, hk, hv, dk, dv = (2048, 16, 32, 128, 128) if CUDA else (32, 1, 2, 16, 16)
    args, conv_states, states, slots = _case(gen, dtype, bsz, hidden, hk, hv, dk, dv)
    x, residual, norm_w, eps, weight, p = args
    conv2, states2 = conv_states.clone(), states.clone()
    conv3, states3 = conv_states.clone(), states.clone()
    y, z, g, beta, res = ops.gdn_decode_in(*args, conv_states, slots)
    o = ops.gdn_decode_step(y, z, g, beta, p, states, slots)
    c, vd = y.shape[1], hv * dv
    proj, _, res2 = ops.add_rms_norm_linear(x, residual, norm_w, eps, weight)
    mixed, z2, b2, a2 = proj.split([c, vd, hv, hv], dim=-1)
    o2 = ops.gdn_decode(mixed, z2.reshape(bsz, hv, dv), a2, b2, p, conv2, states2, slots)
    assert_bits(o.cpu(), o2.cpu(), "in + step vs gdn_decode output")
    assert_bits(states.cpu(), states2.cpu(), "in + step vs gdn_decode states")
    assert_bits(conv_states.cpu(), conv2.cpu(), "in + step vs gdn_decode conv states")
    assert_bits(res.cpu(), res2.cpu(), "new residual")
    ref = reference(dtype)
    y3, z3, g3, beta3, _ = ref.gdn_decode_in(*args, conv3, slots)
    o3 = ref.gdn_decode_step(y3, z3, g3, beta3, p, states3, slots)
    assert_normwise(o, o3.float(), OUT[dtype], "triton vs reference output")
    assert_normwise(states, states3, STATE if dtype == torch.float32 else OUT[dtype], "triton vs reference states")


def test_bad_inputs_are_named(gen):
    ops = triton_ops(torch.float32)
    (x, residual, norm_w, eps, weight, p), conv_states, states, slots = _case(gen, torch.float32, 1, 32, 1, 2, 16, 16)
    with pytest.raises(ValueError, match=r"gdn_decode_in: .*weight \(.*\): the layer needs weight \[\d+, 32\]"):
        ops.gdn_decode_in(x, residual, norm_w, eps, weight[:-1], p, conv_states, slots)
    with pytest.raises(ValueError, match=r"gdn_decode_in: 1 rows need 1 slots"):
        ops.gdn_decode_in(x, residual, norm_w, eps, weight, p, conv_states, slots.repeat(2))
    y, z, g, beta, _ = ops.gdn_decode_in(x, residual, norm_w, eps, weight, p, conv_states, slots)
    with pytest.raises(ValueError, match=r"gdn_decode_step: g and beta must be fp32"):
        ops.gdn_decode_step(y, z, g.double(), beta, p, states, slots)
    with pytest.raises(ValueError, match=r"gdn_decode_step: z \(1, 2, 8\)"):
        ops.gdn_decode_step(y, z[..., :8], g, beta, p, states, slots)
