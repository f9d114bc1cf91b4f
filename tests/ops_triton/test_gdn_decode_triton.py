"""Triton gdn_decode (conv + gates kernel, then recurrent step + gated norm kernel) against the fp64 composed
oracle (the reference suite's check) and against the torch reference op.

Runs on CUDA when present, otherwise under TRITON_INTERPRET=1 at tiny sizes. Criteria: gdn_recurrent_step's
(tests/ops/test_gdn.py); conv states are copies of inputs and must equal the reference's bit for bit; the
lookahead form (out slots) must leave the read slots untouched and give the in-place results bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import assert_bits, assert_normwise  # noqa: E402
from ops.shared_checks import check_gdn_decode, gdn_decode_case  # noqa: E402
from ops.test_gdn import OUT, STATE  # noqa: E402

from .conftest import CUDA, DEVICE, reference, triton_ops  # noqa: E402

SHAPES = [(1, 2, 2, 16, 16), (3, 1, 4, 16, 8), (2, 2, 4, 12, 40)]
if CUDA:
    SHAPES += [(1, 16, 32, 128, 128), (8, 16, 32, 128, 128)]   # the 9B and 35B-A3B heads, B = 1 and 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bsz,hk,hv,dk,dv", SHAPES)
def test_gdn_decode_matches_the_composed_oracles(dtype, bsz, hk, hv, dk, dv, gen):
    ops = triton_ops(dtype)
    assert ops.implementation("gdn_decode").name == "triton"
    check_gdn_decode(ops, DEVICE, dtype, bsz, hk, hv, dk, dv, gen, OUT[dtype], STATE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sigmoid_gate", [False, True])
@pytest.mark.parametrize("one_kernel", [True, False])
def test_gdn_decode_agrees_with_the_reference_op(dtype, sigmoid_gate, one_kernel, gen):
    """Both output gates (SiLU; sigmoid: ``GDNDecodeParams.sigmoid_gate``, Qwen4-Exp) on both launch paths."""
    bsz, hk, hv, dk, dv = (4, 16, 32, 128, 128) if CUDA else (2, 2, 4, 16, 16)
    args, conv_states, states, slots = gdn_decode_case(gen, DEVICE, dtype, bsz, hk, hv, dk, dv)
    args = (*args[:4], dataclasses.replace(args[4], sigmoid_gate=sigmoid_gate))
    conv_ref, states_ref = conv_states.clone(), states.clone()
    o_ref = reference(dtype).gdn_decode(*args, conv_ref, states_ref, slots)
    o = triton_ops(dtype).gdn_decode(*args, conv_states, states, slots, one_kernel=one_kernel)
    assert_normwise(o, o_ref.float(), OUT[dtype], "triton vs reference output")
    assert_bits(conv_states.cpu(), conv_ref.cpu(), "triton vs reference conv states")
    assert_normwise(states, states_ref, STATE, "triton vs reference states")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_out_slots_ping_pong(dtype, gen):
    """Lookahead form: two rows stepped three times, reading slots (a) and writing (b), then back; outputs and
    final states equal the in-place run's bit for bit, and each step leaves the slots it read as they were."""
    ops = triton_ops(dtype)
    hk, hv, dk, dv = (16, 32, 128, 128) if CUDA else (1, 2, 16, 16)
    (mixed, z, a, b, p), conv_states, states, _ = gdn_decode_case(gen, DEVICE, dtype, 2, hk, hv, dk, dv)
    steps = [gdn_decode_case(gen, DEVICE, dtype, 2, hk, hv, dk, dv)[0][:4] for _ in range(3)]
    conv_in_place, states_in_place = conv_states.clone(), states.clone()
    src = torch.tensor([3, 0], dtype=torch.int64, device=DEVICE)
    dst = torch.tensor([1, 4], dtype=torch.int64, device=DEVICE)
    home = src
    for t, inputs in enumerate(steps):
        o_ref = ops.gdn_decode(*inputs, p, conv_in_place, states_in_place, home)
        kept_conv, kept = conv_states[src].clone(), states[src].clone()
        o = ops.gdn_decode(*inputs, p, conv_states, states, src, dst)
        assert_bits(o.cpu(), o_ref.cpu(), f"output step {t} with out_slots")
        assert_bits(states[src].cpu(), kept.cpu(), f"read GDN states unchanged at step {t}")
        assert_bits(conv_states[src].cpu(), kept_conv.cpu(), f"read conv states unchanged at step {t}")
        src, dst = dst, src
    assert_bits(states[src].cpu(), states_in_place[home].cpu(), "final GDN states through out_slots")
    assert_bits(conv_states[src].cpu(), conv_in_place[home].cpu(), "final conv states through out_slots")


def test_gdn_decode_rejects_mismatched_heads(gen):
    (mixed, z, a, b, p), conv_states, states, slots = gdn_decode_case(gen, DEVICE, torch.float32, 1, 2, 4, 16, 16)
    import dataclasses

    with pytest.raises(ValueError, match="not a multiple of key heads"):
        triton_ops(torch.float32).gdn_decode(mixed, z, a, b, dataclasses.replace(p, key_heads=3), conv_states,
                                             states, slots)
    with pytest.raises(ValueError, match="mixed channels"):
        triton_ops(torch.float32).gdn_decode(mixed[:, 1:], z, a, b, p, conv_states, states, slots)
    with pytest.raises(ValueError, match="1 rows need 1 slots"):   # a short slot list would read out of bounds
        triton_ops(torch.float32).gdn_decode(mixed, z, a, b, p, conv_states, states, slots.repeat(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bsz,hk,hv,dk,dv", [(3, 2, 4, 16, 16), (2, 1, 3, 8, 12), (2, 2, 2, 8, 8)] + (
    [(8, 16, 32, 128, 128)] if CUDA else []))
def test_one_kernel_equals_the_two_kernel_path(dtype, bsz, hk, hv, dk, dv, gen):
    """The one-launch decode (default) against the two-launch path over three steps of the same slots (R = 1, 2 and 3
    value heads per key head): conv states bit for bit (copies of inputs; a q/k state written by no program
    would show here, and, under the interpreter, which runs programs in order, one written by a program other
    than the last; on a GPU the R programs read long before any writes, so a wrong election need not show),
    output and GDN states within the step's criteria (the compiler may contract the conv's taps differently in
    the two kernels); the ticket counters are back at zero after every launch (each (slot, key head) elected
    exactly one writer of the q/k conv state)."""
    from ninfer_qwen3_5.ops.triton import gdn_decode as gd

    (mixed, z, a, b, p), conv_states, states, slots = gdn_decode_case(gen, DEVICE, dtype, bsz, hk, hv, dk, dv)
    conv2, states2 = conv_states.clone(), states.clone()
    for t in range(3):
        if t:
            mixed, z, a, b = gdn_decode_case(gen, DEVICE, dtype, bsz, hk, hv, dk, dv)[0][:4]
        o1 = gd.gdn_decode(mixed, z, a, b, p, conv_states, states, slots)
        o2 = gd.gdn_decode(mixed, z, a, b, p, conv2, states2, slots, one_kernel=False)
        assert_normwise(o1, o2.float(), OUT[dtype], f"output step {t}")
        assert_normwise(states, states2, STATE, f"GDN states step {t}")
        assert_bits(conv_states.cpu(), conv2.cpu(), f"conv states step {t}")
        tickets, made_now = gd._tickets(conv_states, hk, hv)
        assert not made_now and not tickets.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_takes_strided_row_views(dtype, gen):
    """A verify step reads every L-th token of a call (``x[j::L]``, ninfer_qwen3_5.speculative_state.VerifyStep):
    strided row views give the gathered (contiguous) rows' outputs and states bit for bit."""
    ops = triton_ops(dtype)
    bsz, hk, hv, dk, dv = (2, 16, 32, 128, 128) if CUDA else (2, 1, 2, 16, 16)
    stride = 3
    (mixed, z, a, b, p), conv_states, states, _ = gdn_decode_case(gen, DEVICE, dtype, bsz * stride, hk, hv, dk, dv)
    slots = torch.tensor([4, 1], dtype=torch.int64, device=DEVICE)
    rows = slice(1, 1 + stride * (bsz - 1) + 1, stride)
    conv_g, states_g = conv_states.clone(), states.clone()
    o_gathered = ops.gdn_decode(mixed[rows].contiguous(), z[rows].contiguous(), a[rows].contiguous(),
                                b[rows].contiguous(), p, conv_g, states_g, slots)
    assert not mixed[rows].is_contiguous()
    o = ops.gdn_decode(mixed[rows], z[rows], a[rows], b[rows], p, conv_states, states, slots)
    assert_bits(o.cpu(), o_gathered.cpu(), "strided vs gathered output")
    assert_bits(states.cpu(), states_g.cpu(), "strided vs gathered states")
    assert_bits(conv_states.cpu(), conv_g.cpu(), "strided vs gathered conv states")
