"""Triton gdn_verify (every verify row's tokens in one launch) against what it stands for: the staging copy of each
row's live state into its first snapshot, then one gdn_decode per token index (the Triton decode kernel, so bit for
bit), and against the torch reference op (within the decode tolerances).

Runs on CUDA when present, otherwise under TRITON_INTERPRET=1 at tiny sizes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import assert_bits, assert_normwise  # noqa: E402
from ops.shared_checks import gdn_decode_case  # noqa: E402
from ops.test_gdn import OUT, STATE  # noqa: E402

from .conftest import CUDA, DEVICE, reference, triton_ops  # noqa: E402

HEADS = (16, 32, 128, 128) if CUDA else (2, 4, 16, 16)
# (packed rows, verify rows as (start, count)): other rows sit between them, counts differ, one row of one token.
LAYOUTS = [(4, [(0, 4)]), (9, [(1, 3), (4, 1), (5, 4)]), (8, [(0, 2), (2, 2), (4, 2), (6, 2)])]


def _case(gen, dtype, n, rows):
    (mixed, z, a, b, p), conv, states, _ = gdn_decode_case(gen, DEVICE, dtype, n, *HEADS)
    width = max(c for _, c in rows)
    snap_conv = torch.randn((len(rows) * width + 1, *conv.shape[1:]), generator=gen).to(DEVICE, dtype)
    snap_states = torch.randn((len(rows) * width + 1, *states.shape[1:]), generator=gen).to(DEVICE)
    live = torch.randperm(conv.shape[0], generator=gen)[:len(rows)]
    # Row i owns snapshot slots i * width + 1 .. (slot 0 and the unused ones must stay as they are).
    snaps = torch.tensor([[i * width + 1 + j for j in range(width)] for i in range(len(rows))])
    index = dict(starts=torch.tensor([s for s, _ in rows]), counts=torch.tensor([c for _, c in rows]),
                 live_slots=live, snapshots=snaps)
    return (mixed, z, a, b, p), conv, states, snap_conv, snap_states, {k: v.to(DEVICE) for k, v in index.items()}


def _stepwise(ops, args, conv, states, snap_conv, snap_states, index, out):
    """The composition: stage the live images, then gdn_decode over token j of every row with more than j."""
    mixed, z, a, b, p = args
    starts, counts = index["starts"].tolist(), index["counts"].tolist()
    snaps, live = index["snapshots"].tolist(), index["live_slots"].tolist()
    for i, l_slot in enumerate(live):
        snap_conv[snaps[i][0]] = conv[l_slot]
        snap_states[snaps[i][0]] = states[l_slot]
    for j in range(max(counts)):
        rows = [i for i, c in enumerate(counts) if c > j]
        r = torch.tensor([starts[i] + j for i in rows], device=DEVICE)
        src = torch.tensor([snaps[i][max(j - 1, 0)] for i in rows], device=DEVICE)
        dst = torch.tensor([snaps[i][j] for i in rows], device=DEVICE)
        out[r] = ops.gdn_decode(mixed[r], z[r], a[r], b[r], p, snap_conv, snap_states, src, dst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,rows", LAYOUTS)
def test_gdn_verify_equals_the_stepwise_decode_bitwise(dtype, n, rows, gen):
    ops = triton_ops(dtype)
    assert ops.implementation("gdn_verify").name == "triton"
    args, conv, states, snap_conv, snap_states, index = _case(gen, dtype, n, rows)
    live_before = conv.clone(), states.clone()
    want_conv, want_states = snap_conv.clone(), snap_states.clone()
    want = torch.full((n, HEADS[1], HEADS[3]), 7.0, dtype=dtype, device=DEVICE)
    _stepwise(ops, args, conv, states, want_conv, want_states, index, want)
    got = torch.full_like(want, 7.0)
    ops.gdn_verify(*args, conv, states, snap_conv, snap_states, **index, out=got)
    assert_bits(got.cpu(), want.cpu(), "outputs (rows outside the verify rows untouched)")
    assert_bits(snap_conv.cpu(), want_conv.cpu(), "snapshot conv windows")
    assert_bits(conv.cpu(), live_before[0].cpu(), "live conv states never written")
    assert_bits(states.cpu(), live_before[1].cpu(), "live states never written")
    snaps = index["snapshots"].cpu()
    written = snaps[torch.arange(snaps.shape[1])[None, :] < index["counts"].cpu()[:, None]]
    unused = torch.ones(snap_states.shape[0], dtype=torch.bool)
    unused[written] = False
    assert_bits(snap_states.cpu()[unused], want_states.cpu()[unused], "unused snapshot slots untouched")
    if dtype == torch.float32 or not CUDA:
        assert_bits(snap_states.cpu(), want_states.cpu(), "snapshot states")
    else:
        # Compiled for bf16 inputs the loop's fp32 state arithmetic may be contracted differently from the one-step
        # kernel's (H200: a few thousand of ~2M state elements in their last bits); the outputs stay bitwise.
        assert_normwise(snap_states, want_states, STATE, "snapshot states")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sigmoid_gate", [False, True])
def test_gdn_verify_agrees_with_the_reference_op(dtype, sigmoid_gate, gen):
    """Both output gates: SiLU (Qwen3.5) and sigmoid (``GDNDecodeParams.sigmoid_gate``, Qwen4-Exp)."""
    n, rows = LAYOUTS[1]
    args, conv, states, snap_conv, snap_states, index = _case(gen, dtype, n, rows)
    args = (*args[:4], dataclasses.replace(args[4], sigmoid_gate=sigmoid_gate))
    ref_conv, ref_states = snap_conv.clone(), snap_states.clone()
    want = torch.zeros((n, HEADS[1], HEADS[3]), dtype=dtype, device=DEVICE)
    reference(dtype).gdn_verify(*args, conv, states, ref_conv, ref_states, **index, out=want)
    got = torch.zeros_like(want)
    triton_ops(dtype).gdn_verify(*args, conv, states, snap_conv, snap_states, **index, out=got)
    assert_normwise(got, want.float(), OUT[dtype], "triton vs reference outputs")
    assert_bits(snap_conv.cpu(), ref_conv.cpu(), "triton vs reference conv windows (copies of inputs)")
    assert_normwise(snap_states, ref_states, STATE, "triton vs reference snapshot states")


def test_gdn_verify_rejects_mismatched_inputs(gen):
    n, rows = LAYOUTS[1]
    args, conv, states, snap_conv, snap_states, index = _case(gen, torch.float32, n, rows)
    ops = triton_ops(torch.float32)
    out = torch.empty((n, HEADS[1], HEADS[3]), device=DEVICE)
    with pytest.raises(ValueError, match="3 verify rows need 3 counts"):
        ops.gdn_verify(*args, conv, states, snap_conv, snap_states, **dict(index, counts=index["counts"][:2]),
                       out=out)
    with pytest.raises(ValueError, match="snapshot conv states are"):
        ops.gdn_verify(*args, conv, states, snap_conv.double(), snap_states, **index, out=out)
    with pytest.raises(ValueError, match="out must be"):
        ops.gdn_verify(*args, conv, states, snap_conv, snap_states, **index, out=out[:-1])
