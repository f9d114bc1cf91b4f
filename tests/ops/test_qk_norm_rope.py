"""qk_norm_rope_cache: q/k zero-centred RMSNorm, NeoX RoPE on the first R dims, then the KV-cache write of
the normed, rotated k and the raw v.

Oracle: fp64 RMSNorm (tests/ops/oracles.rms_oracle) of the represented inputs, rotated in fp64 on the first
R dims (pass-through dims are the normed values); pools: a per-token Python loop writing k_out and v into
copies. Criteria: q_out/k_out pointwise, fp32 rtol 4e-6 / atol 2e-6 (the norm's fp32 criterion, plus the
rotation's few fp32 roundings); bf16 rtol 2^-8 / atol 2^-7 of max|oracle| (two roundings to bf16: the normed
values, whose half-ulp errors the rotation carries into an output up to |cos| + |sin| <= sqrt(2) times, then
the rotated value; the reference uses at most ~55% of it over 600 seeded cases). Pools bit-exact: written
slots and every untouched element. The reference is by definition the composition of the three reference
ops: bit-identical to calling them in turn. Case builder, oracle and check are shared with the Triton suite
(tests/ops_triton/test_qk_norm_rope_triton.py).
"""

from __future__ import annotations

import pytest
import torch

from .conftest import DTYPES, Pointwise, assert_bits, assert_pointwise, f64, randn, reference_ops
from .oracles import NORM_EPS as EPS
from .oracles import rms_oracle

CRIT = {torch.float32: Pointwise(4e-6, 2e-6), torch.bfloat16: Pointwise(2 ** -8, 2 ** -7)}

# (T, Hq, Hkv, D, R): GQA with partial and full rotary at tiny sizes, and the Qwen3.5 head geometry.
GEOMETRIES = [(1, 4, 2, 32, 16), (3, 4, 2, 32, 16), (1, 4, 2, 32, 32), (3, 4, 2, 32, 32)]
QWEN35 = (1, 16, 2, 256, 64)


def qk_case(gen, device, dtype, t_len, hq, hkv, d, rot, *, page=4, pool_dtype=None, pad=8):
    """Inputs as the model passes them: q, k, v are column views [T, H, D] of one [T, (Hq + 2 Hkv) D + pad]
    projection output (row stride wider than H*D); cos/sin [T, R] fp32 with distinct halves (not cat(f, f)),
    so reading the wrong half fails; pools of several pages, written at a random permutation of slots."""
    width = (hq + 2 * hkv) * d
    proj = randn(gen, t_len, width + pad, dtype=dtype, device=device, scale=2.0)
    q = proj[:, :hq * d].view(t_len, hq, d)
    k = proj[:, hq * d:(hq + hkv) * d].view(t_len, hkv, d)
    v = proj[:, (hq + hkv) * d:width].view(t_len, hkv, d)
    q_norm = randn(gen, d, dtype=dtype, device=device, scale=0.3)
    k_norm = randn(gen, d, dtype=dtype, device=device, scale=0.3)
    ang = torch.rand(t_len, rot // 2, generator=gen, dtype=torch.float64) * 20 - 10
    ang = torch.cat((ang, ang + 0.5), dim=-1)
    cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    n_pages = -(-t_len // page) + 3  # spare pages: most slots stay untouched
    pool_dtype = pool_dtype or dtype
    k_pool = randn(gen, n_pages, page, hkv, d, dtype=pool_dtype, device=device)
    v_pool = randn(gen, n_pages, page, hkv, d, dtype=pool_dtype, device=device)
    slots = torch.randperm(n_pages * page, generator=gen)[:t_len].to(device)
    return dict(q=q, k=k, v=v, q_norm=q_norm, k_norm=k_norm, eps=EPS, cos=cos, sin=sin, k_pool=k_pool,
                v_pool=v_pool, slot_mapping=slots)


def call(fn, case: dict, **pools):
    """fn on the case; ``pools`` (k_pool=..., v_pool=...) replaces the case's pools (e.g. with clones)."""
    c = dict(case, **pools)
    return fn(c["q"], c["k"], c["v"], c["q_norm"], c["k_norm"], c["eps"], c["cos"], c["sin"], c["k_pool"],
              c["v_pool"], c["slot_mapping"])


def oracle(x, w, cos, sin):
    """fp64: the normed head, its first R dims rotated (pair j with j + R/2, each half its own cos/sin)."""
    n = rms_oracle(x, w)
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    c, s = f64(cos)[:, None], f64(sin)[:, None]
    out = n.clone()
    out[..., :half] = n[..., :half] * c[..., :half] - n[..., half:rot] * s[..., :half]
    out[..., half:rot] = n[..., half:rot] * c[..., half:rot] + n[..., :half] * s[..., half:rot]
    return out


def expected_pools(case, k_out, k_pool_before, v_pool_before):
    """Copies of the pools with k_out and v written at the case's slots (cast to the pool dtype)."""
    page = k_pool_before.shape[1]
    exp_k, exp_v = k_pool_before.cpu().clone(), v_pool_before.cpu().clone()
    for t, s in enumerate(case["slot_mapping"].tolist()):
        exp_k[s // page, s % page] = k_out[t].cpu().to(exp_k.dtype)
        exp_v[s // page, s % page] = case["v"][t].cpu().to(exp_v.dtype)
    return exp_k, exp_v


def check_qk_norm_rope_cache(ops, case: dict, what: str):
    """One call of ops.qk_norm_rope_cache on ``case`` (its pools written in place) against the oracle and the
    pool oracle; returns (q_out, k_out)."""
    before = case["k_pool"].clone(), case["v_pool"].clone()
    q_out, k_out = call(ops.qk_norm_rope_cache, case)
    q, k = case["q"], case["k"]
    assert q_out.dtype == q.dtype and q_out.shape == q.shape and q_out.is_contiguous(), what
    assert k_out.dtype == k.dtype and k_out.shape == k.shape and k_out.is_contiguous(), what
    crit = CRIT[q.dtype]
    assert_pointwise(q_out, oracle(q, case["q_norm"], case["cos"], case["sin"]), crit, f"q_out {what}")
    assert_pointwise(k_out, oracle(k, case["k_norm"], case["cos"], case["sin"]), crit, f"k_out {what}")
    exp_k, exp_v = expected_pools(case, k_out, *before)
    assert_bits(case["k_pool"].cpu(), exp_k, f"k_pool {what}")
    assert_bits(case["v_pool"].cpu(), exp_v, f"v_pool {what}")
    return q_out, k_out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES + [QWEN35])
def test_qk_norm_rope_cache_oracle_and_pools(device, dtype, geometry, gen):
    case = qk_case(gen, device, dtype, *geometry)
    check_qk_norm_rope_cache(reference_ops(device, dtype), case, f"{dtype} T,Hq,Hkv,D,R={geometry}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_reference_is_the_composition(device, dtype, geometry, gen):
    ops = reference_ops(device, dtype)
    case = qk_case(gen, device, dtype, *geometry)
    pools = dict(k_pool=case["k_pool"].clone(), v_pool=case["v_pool"].clone())
    q_out, k_out = call(ops.qk_norm_rope_cache, case)
    q_ref = ops.rope(ops.rms_norm_unit_offset(case["q"], case["q_norm"], EPS), case["cos"], case["sin"])
    k_ref = ops.rope(ops.rms_norm_unit_offset(case["k"], case["k_norm"], EPS), case["cos"], case["sin"])
    ops.kv_cache_write(k_ref, case["v"], pools["k_pool"], pools["v_pool"], case["slot_mapping"])
    assert_bits(q_out.cpu(), q_ref.cpu(), "q_out vs composition")
    assert_bits(k_out.cpu(), k_ref.cpu(), "k_out vs composition")
    assert_bits(case["k_pool"].cpu(), pools["k_pool"].cpu(), "k_pool vs composition")
    assert_bits(case["v_pool"].cpu(), pools["v_pool"].cpu(), "v_pool vs composition")


def test_reference_cast_into_a_bf16_pool(device, gen):
    # fp32 activations, bf16 pools: the stored k/v are torch's round-to-nearest-even casts of k_out and v.
    case = qk_case(gen, device, torch.float32, 3, 4, 2, 32, 16, pool_dtype=torch.bfloat16)
    check_qk_norm_rope_cache(reference_ops(device, torch.float32), case, "fp32 into bf16 pools")


def test_reference_rejects_bad_input(device, gen):
    ops = reference_ops(device, torch.float32)
    case = qk_case(gen, device, torch.float32, 2, 4, 2, 32, 16)
    before = case["k_pool"].clone(), case["v_pool"].clone()
    with pytest.raises(ValueError, match="rotary dim"):  # odd R: rope's own error
        call(ops.qk_norm_rope_cache, dict(case, cos=case["cos"][:, :15], sin=case["sin"][:, :15]))
    for bad in (-1, case["k_pool"].shape[0] * case["k_pool"].shape[1]):
        slots = torch.tensor([0, bad], device=device)
        with pytest.raises(IndexError):
            call(ops.qk_norm_rope_cache, dict(case, slot_mapping=slots))
    assert torch.equal(case["k_pool"], before[0]) and torch.equal(case["v_pool"], before[1]), \
        "nothing may be written when a slot is out of range"
