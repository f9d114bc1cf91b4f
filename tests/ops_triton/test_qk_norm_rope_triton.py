"""Triton qk_norm_rope_cache (one kernel for q/k norm, both RoPEs and the KV write) against the composition
of the Triton ops ``rms_norm_unit_offset`` -> ``rope`` -> ``kv_cache_write``, the reference suite's fp64 oracle and the
torch reference run in fp32.

Criteria:
- Against the Triton composition: bit-exact q_out, k_out and pools under the interpreter (the same
  arithmetic, and numpy sums each row in one order whatever the tile). On CUDA the fp32 sum of squares may be
  reduced in another order (a [1, D] tile here, the norm kernel's [BLOCK_M, D] there; the contract allows
  it), which moves the statistic by a few fp32 ulps: q_out/k_out within fp32 rtol 4e-6 / atol 1e-6, bf16
  rtol 2^-7 / atol 2^-7 of max|composition| (a one-ulp flip of a rounded normed value, carried <= sqrt(2)
  times by the rotation, plus a flip of the final rounding); the v pool bit-exact, the k pool bit-exact
  against the kernel's own k_out. The kernel reduces in the norm kernel's layout, so on CUDA bit-identity is
  expected as well: asserted separately for the Qwen3.5 head (test_cuda_bit_identical_qwen35_head).
- Against the fp64 oracle and the pool oracle: the reference suite's check (tests/ops/test_qk_norm_rope.py).
- Against the torch reference op in fp32 on the same (widened) inputs: CRIT of the output dtype.
Cases: fp32 and bf16; T = 1 and 3; GQA Hq = 4, Hkv = 2; partial (R = 16 < D = 32) and full (R = D) rotary;
the Qwen3.5 head (D = 256, R = 64, Hq = 16, Hkv = 2); q/k/v column views of one projection row; pools of
several pages written at random slots, every other element checked untouched.
"""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import Pointwise, assert_bits, assert_pointwise, f64  # noqa: E402
from ops.test_qk_norm_rope import (  # noqa: E402
    CRIT,
    GEOMETRIES,
    QWEN35,
    call,
    check_qk_norm_rope_cache,
    expected_pools,
    qk_case,
)

from .conftest import CUDA, DEVICE, reference, triton_ops  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
NEAR_CUDA = {torch.float32: Pointwise(4e-6, 1e-6), torch.bfloat16: Pointwise(2 ** -7, 2 ** -7)}


def composed(ops, case: dict):
    """The five launches of the Triton ops, writing clones of the case's pools.

    Returns (q_out, k_out, k_pool, v_pool)."""
    k_pool, v_pool = case["k_pool"].clone(), case["v_pool"].clone()
    q_out = ops.rope(ops.rms_norm_unit_offset(case["q"], case["q_norm"], case["eps"]), case["cos"], case["sin"])
    k_out = ops.rope(ops.rms_norm_unit_offset(case["k"], case["k_norm"], case["eps"]), case["cos"], case["sin"])
    ops.kv_cache_write(k_out, case["v"], k_pool, v_pool, case["slot_mapping"])
    return q_out, k_out, k_pool, v_pool


def assert_like_composition(case, q_out, k_out, comp, what):
    q_c, k_c, kp_c, vp_c = comp
    if not CUDA:
        assert_bits(q_out.cpu(), q_c.cpu(), f"q_out vs composition {what}")
        assert_bits(k_out.cpu(), k_c.cpu(), f"k_out vs composition {what}")
        assert_bits(case["k_pool"].cpu(), kp_c.cpu(), f"k_pool vs composition {what}")
    else:
        assert_pointwise(q_out, q_c, NEAR_CUDA[q_out.dtype], f"q_out vs composition {what}")
        assert_pointwise(k_out, k_c, NEAR_CUDA[k_out.dtype], f"k_out vs composition {what}")
    assert_bits(case["v_pool"].cpu(), vp_c.cpu(), f"v_pool vs composition {what}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES + [QWEN35])
def test_fused_equals_composition_and_oracle(dtype, geometry, gen):
    ops = triton_ops(dtype)
    assert ops.implementation("qk_norm_rope_cache").name == "triton"
    what = f"{dtype} T,Hq,Hkv,D,R={geometry}"
    case = qk_case(gen, DEVICE, dtype, *geometry)
    if geometry[0] > 1:  # (torch gives a size-1 dim the contiguous stride)
        assert case["q"].stride(0) != case["q"].shape[1] * case["q"].shape[2], "q must be a row-strided view"
    comp = composed(ops, case)
    ref32 = dict(case, **{n: case[n].float() for n in ("q", "k", "v", "q_norm", "k_norm")},
                 k_pool=case["k_pool"].to(torch.float32, copy=True),
                 v_pool=case["v_pool"].to(torch.float32, copy=True))
    q_out, k_out = check_qk_norm_rope_cache(ops, case, what)  # oracle, pools written and untouched
    assert_like_composition(case, q_out, k_out, comp, what)
    q32, k32 = call(reference(torch.float32).qk_norm_rope_cache, ref32)
    assert_pointwise(q_out, q32, CRIT[dtype], f"q_out vs fp32 torch reference {what}")
    assert_pointwise(k_out, k32, CRIT[dtype], f"k_out vs fp32 torch reference {what}")


def test_fused_casts_into_a_bf16_pool_with_int32_slots(gen):
    # fp32 activations into bf16 pools (torch's round-to-nearest-even), slot ids given as int32.
    ops = triton_ops(torch.float32)
    case = qk_case(gen, DEVICE, torch.float32, 3, 4, 2, 32, 16, page=5, pool_dtype=torch.bfloat16)
    case["slot_mapping"] = case["slot_mapping"].to(torch.int32)
    comp = composed(ops, case)
    q_out, k_out = check_qk_norm_rope_cache(ops, case, "fp32 into bf16 pools")
    assert_like_composition(case, q_out, k_out, comp, "fp32 into bf16 pools")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fallbacks_equal_the_composition(dtype, gen):
    """Where the kernel does not apply the op is the composition: R = 0 (nothing rotated), a q/k/v whose last
    dim is strided; an odd R raises rope's error."""
    ops = triton_ops(dtype)
    case = qk_case(gen, DEVICE, dtype, 3, 4, 2, 32, 16)
    no_rot = dict(case, cos=case["cos"][:, :0], sin=case["sin"][:, :0])
    wide = torch.cat([case["q"], case["q"]], dim=-1)  # [T, Hq, 2D]; every other element is q's [T, Hq, D]
    strided = dict(case, q=wide[..., ::2])
    assert strided["q"].stride(-1) == 2
    for variant, what in ((no_rot, "R = 0"), (strided, "strided last dim")):
        variant = dict(variant, k_pool=case["k_pool"].clone(), v_pool=case["v_pool"].clone())
        comp = composed(ops, variant)
        q_out, k_out = call(ops.qk_norm_rope_cache, variant)
        assert_like_composition(variant, q_out, k_out, comp, what)
    with pytest.raises(ValueError, match="rotary dim"):
        call(ops.qk_norm_rope_cache, dict(case, cos=case["cos"][:, :15], sin=case["sin"][:, :15]))


def _bad_inputs(case):
    t, hkv = case["q"].shape[0], case["k"].shape[1]
    return [
        (dict(case, q=case["q"][0]), "q must be"),
        (dict(case, k=case["k"][..., :16], v=case["v"][..., :16]), "k .* must be"),
        (dict(case, k=case["k"][:1]), "k .* must be"),
        (dict(case, v=case["v"][:, :1]), "v .* must have k's shape"),
        (dict(case, q_norm=case["q_norm"][:16]), "q_norm must be"),
        (dict(case, k_norm=case["k_norm"][None]), "k_norm must be"),
        (dict(case, cos=case["cos"][:1], sin=case["sin"][:1]), "cos must be"),
        (dict(case, sin=case["sin"][:, :8]), "sin .* must have cos's shape"),
        (dict(case, k_pool=case["k_pool"][:, :, :1], v_pool=case["v_pool"][:, :, :1]), "k_pool must be"),
        (dict(case, v_pool=case["v_pool"][1:]), "v_pool .* must have k_pool's shape"),
        (dict(case, slot_mapping=case["slot_mapping"][:t - 1]), "slot_mapping must be"),
        (dict(case, slot_mapping=case["slot_mapping"][:, None].expand(t, hkv)), "slot_mapping must be"),
    ]


def test_mismatched_shapes_raise_value_error(gen):
    ops = triton_ops(torch.float32)
    case = qk_case(gen, DEVICE, torch.float32, 3, 4, 2, 32, 16)
    before = case["k_pool"].clone(), case["v_pool"].clone()
    for bad, message in _bad_inputs(case):
        with pytest.raises(ValueError, match=f"qk_norm_rope_cache: {message}"):
            call(ops.qk_norm_rope_cache, bad)
    assert torch.equal(case["k_pool"], before[0]) and torch.equal(case["v_pool"], before[1])


def test_out_of_range_slot_raises_before_any_write(gen):
    ops = triton_ops(torch.float32)
    case = qk_case(gen, DEVICE, torch.float32, 2, 4, 2, 32, 16)
    before = case["k_pool"].clone(), case["v_pool"].clone()
    capacity = case["k_pool"].shape[0] * case["k_pool"].shape[1]
    for bad in (-1, capacity):
        with pytest.raises(IndexError, match="slot_mapping outside"):
            call(ops.qk_norm_rope_cache, dict(case, slot_mapping=torch.tensor([3, bad])))   # host: checked
    assert torch.equal(case["k_pool"], before[0]) and torch.equal(case["v_pool"], before[1]), \
        "nothing may be written when a slot is out of range"


def test_out_of_range_slot_is_dropped_when_the_check_is_skipped(gen, monkeypatch):
    # What a captured graph does (no host check), as kv_cache_write: the kernel's mask drops the bad tokens'
    # pool writes (never wraps: -1 would land on the last page), still writes the good one, and q_out/k_out
    # are computed for every token.
    from ninfer.ops.triton import kv_cache

    monkeypatch.setattr(kv_cache, "capturing", lambda device: True)
    ops = triton_ops(torch.float32)
    case = qk_case(gen, DEVICE, torch.float32, 3, 4, 2, 32, 16, page=4)
    capacity = case["k_pool"].shape[0] * 4
    case["slot_mapping"] = torch.tensor([-1, 5, capacity], device=DEVICE)
    comp = composed(ops, case)
    before = case["k_pool"].clone(), case["v_pool"].clone()
    q_out, k_out = call(ops.qk_norm_rope_cache, case)
    assert_like_composition(case, q_out, k_out, comp, "dropped slots")
    good = dict(case, slot_mapping=torch.tensor([5]), v=case["v"][1:2])
    exp_k, exp_v = expected_pools(good, k_out[1:2], *before)
    assert_bits(case["k_pool"].cpu(), exp_k, "k_pool: only slot 5 written")
    assert_bits(case["v_pool"].cpu(), exp_v, "v_pool: only slot 5 written")
    assert torch.isfinite(f64(q_out)).all() and torch.isfinite(f64(k_out)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("dtype,t_len", [(torch.float32, 1), (torch.bfloat16, 1), (torch.bfloat16, 4)])
def test_cuda_bit_identical_qwen35_head(dtype, t_len, gen):
    """Compiled, the kernel reduces each row's sum of squares in the layout of the rms_norm_unit_offset kernel (the same
    num_warps), so at one token (a decode row) it equals the five launches bit for bit, and in bf16 at any T
    (the output rounding absorbs the last fp32 bits). With several fp32 tokens the rms_norm_unit_offset kernel blocks rows
    differently and the fp32 statistic may differ in its last bit (measured on an H200, allowed by the
    contract): the tolerance test bounds that case, so it is not a case here."""
    ops = triton_ops(dtype)
    case = qk_case(gen, DEVICE, dtype, t_len, 16, 2, 256, 64, page=16)
    q_c, k_c, kp_c, vp_c = composed(ops, case)
    q_out, k_out = call(ops.qk_norm_rope_cache, case)
    assert_bits(q_out.cpu(), q_c.cpu(), "q_out vs composition on CUDA")
    assert_bits(k_out.cpu(), k_c.cpu(), "k_out vs composition on CUDA")
    assert_bits(case["k_pool"].cpu(), kp_c.cpu(), "k_pool vs composition on CUDA")
    assert_bits(case["v_pool"].cpu(), vp_c.cpu(), "v_pool vs composition on CUDA")
