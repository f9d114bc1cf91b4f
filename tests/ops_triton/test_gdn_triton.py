"""Triton gdn_chunk_prefill / gdn_recurrent_step vs the naive fp64 token loop and the torch reference ops.

Runs on CUDA when present, otherwise on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set
below before the kernels are defined) at tiny sizes.

Oracle (per token t, value head j, key head j // r):
    q, k <- x / sqrt(sum x^2 + 1e-6);  q <- scale q;  S <- e^{g} S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
Criteria (normwise, cap relative to max|ref|) -- the same as the reference suite's, since the kernels do all
math in fp32 with IEEE dots:
- output fp32: rel 2e-6, cap 2e-5;  output bf16: rel 8e-3, cap 3e-2 (the output's own bf16 rounding);
- final state (fp32 whatever the input dtype): rel 2e-6, cap 2e-5.
Untouched decode slots must be bit-identical.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ninfer.ops.reference import gdn as ref  # noqa: E402
from ninfer.ops.triton import gdn as tg  # noqa: E402
from ops.conftest import Normwise, assert_normwise, rand, randn  # noqa: E402
from ops.oracles import gdn_inputs, gdn_oracle  # noqa: E402
from ops.shared_checks import (  # noqa: E402
    check_gdn_prefill,
    check_gdn_recurrent_slots,
    check_gdn_strong_decay_split,
)
from ops.test_gdn import OUT, STATE  # noqa: E402

if not _CUDA and type(tg._gdn_step_kernel).__name__ != "InterpretedFunction":
    # The module was imported earlier in this process without the interpreter (e.g. by the plugin
    # registry); re-define its kernels as interpreted ones.
    tg = importlib.reload(tg)

DEVICE = "cuda" if _CUDA else "cpu"
# Compiled 16-bit prefill runs its dots in tf32 (see ninfer.ops.triton.gdn); the interpreter multiplies in fp32.
STATE_16 = Normwise(2e-3, 1e-2) if _CUDA else STATE  # H200, tf32: 1.07e-3 to 1.21e-3 measured (T = 63..1000)


def state_crit(dtype):
    return STATE if dtype == torch.float32 else STATE_16


# (T, Hk, Hv, Dk, Dv): around the chunk size 64 and its multiples; GQA ratio 1, 2, 4; Dk != Dv; dims that are
# not powers of two (padded tiles).
CASES = [(1, 2, 2, 16, 16), (63, 1, 4, 16, 8), (64, 2, 2, 8, 12), (65, 2, 4, 16, 16), (130, 1, 2, 16, 8)]
if _CUDA:
    CASES += [(300, 2, 4, 128, 128), (1000, 1, 2, 128, 128)]   # the model's head dims


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t_len,hk,hv,dk,dv", CASES)
def test_chunk_prefill_matches_token_loop(dtype, t_len, hk, hv, dk, dv, gen):
    check_gdn_prefill(tg.gdn_chunk_prefill, DEVICE, dtype, t_len, hk, hv, dk, dv, gen, OUT[dtype], state_crit(dtype))


def test_chunk_prefill_strong_decay_and_split(gen):
    check_gdn_strong_decay_split(tg.gdn_chunk_prefill, DEVICE, gen, OUT[torch.float32], STATE)


def test_chunk_prefill_segments_and_strided_views(gen, monkeypatch):
    # One segment per chunk (the state round-trips through the caller's tensor between segments), and q/k/v
    # as strided views of one fused [T, 2*Hk*Dk + Hv*Dv] projection, as the model passes them.
    monkeypatch.setattr(tg, "_SEG_CHUNKS", 1)
    t_len, hk, hv, dk, dv = 150, 1, 2, 16, 16
    fused = randn(gen, t_len, 2 * hk * dk + hv * dv, device=DEVICE)
    q = fused[:, :hk * dk].view(t_len, hk, dk)
    k = fused[:, hk * dk:2 * hk * dk].view(t_len, hk, dk)
    v = fused[:, 2 * hk * dk:].view(t_len, hv, dv)
    g_full = rand(gen, t_len, 2 * hv, lo=-2.0, hi=0.0, device=DEVICE)
    g = g_full[:, ::2]                                   # a non-unit head stride for g
    beta = rand(gen, t_len, hv, device=DEVICE)
    state = randn(gen, hv, dk, dv, device=DEVICE)
    ref_o, ref_s = gdn_oracle(q, k, v, g, beta, state, 0.3)
    out = tg.gdn_chunk_prefill(q, k, v, g, beta, state, 0.3)
    assert_normwise(out, ref_o, OUT[torch.float32], "segmented strided output")
    assert_normwise(state, ref_s, STATE, "segmented strided state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_prefill_agrees_with_reference_op(dtype, gen):
    # The reference op is an independent implementation of the same chunked algebra: both must land on the
    # same function within the oracle criteria (a loose check that catches a misreading of the contract
    # only if the two differ, hence the fp64 oracle tests above are the primary ones).
    t_len, hk, hv, dk, dv = (257, 2, 4, 128, 128) if _CUDA else (97, 1, 2, 16, 16)
    q, k, v, g, beta = gdn_inputs(gen, t_len, hk, hv, dk, dv, dtype, DEVICE)
    state = randn(gen, hv, dk, dv, scale=0.5, device=DEVICE)
    s_ref, s_tri = state.clone(), state.clone()
    o_ref = ref.gdn_chunk_prefill(q, k, v, g, beta, s_ref, dk ** -0.5)
    o_tri = tg.gdn_chunk_prefill(q, k, v, g, beta, s_tri, dk ** -0.5)
    assert_normwise(o_tri, o_ref.float(), OUT[dtype], "triton vs reference output")
    assert_normwise(s_tri, s_ref, state_crit(dtype), "triton vs reference state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 8), (1, 4, 16, 16), (2, 4, 12, 40)]
                         + ([(16, 32, 128, 128)] if _CUDA else []))
def test_recurrent_step_slots(dtype, hk, hv, dk, dv, gen):
    check_gdn_recurrent_slots(tg.gdn_recurrent_step, DEVICE, dtype, hk, hv, dk, dv, gen, OUT[dtype], STATE)


def test_recurrent_step_agrees_with_reference_op_and_block_sizes(gen):
    hk, hv, dk, dv, bsz = (4, 8, 128, 128, 6) if _CUDA else (2, 4, 16, 32, 3)
    q, k, v, g, beta = gdn_inputs(gen, bsz, hk, hv, dk, dv, torch.bfloat16, DEVICE)
    states = randn(gen, 9, hv, dk, dv, device=DEVICE)
    slots = torch.tensor([7, 2, 5, 0, 8, 1][:bsz], dtype=torch.int64, device=DEVICE)
    s_ref = states.clone()
    o_ref = ref.gdn_recurrent_step(q, k, v, g, beta, s_ref, slots, dk ** -0.5)
    for bv in (None, 16, 32, 64):  # the Dv tiling (default: by batch size) must not change the result
        s_tri = states.clone()
        o_tri = tg.gdn_recurrent_step(q, k, v, g, beta, s_tri, slots, dk ** -0.5, block_v=bv)
        assert_normwise(o_tri, o_ref.float(), OUT[torch.bfloat16], f"step vs reference o BV={bv}")
        assert_normwise(s_tri, s_ref, STATE, f"step vs reference states BV={bv}")


def test_ops_are_registered_for_cuda_only():
    by_op = {impl.op: impl for impl in tg.OPS}
    assert set(by_op) == {"gdn_chunk_prefill", "gdn_recurrent_step"}
    for impl in tg.OPS:
        assert impl.priority == 10 and impl.devices == frozenset({"cuda"})
        assert impl.supports("cuda", torch.bfloat16) and not impl.supports("cpu", torch.bfloat16)



def test_resolved_through_the_plugin():
    # The engine reaches these kernels through the triton plugin (on CPU the conftest moves them to "cpu").
    from .conftest import triton_ops

    ops = triton_ops(torch.bfloat16)
    for name in ("gdn_chunk_prefill", "gdn_recurrent_step"):
        impl = ops.implementation(name)
        assert impl.name == "triton" and impl.fn.__module__ == "ninfer.ops.triton.gdn", name
