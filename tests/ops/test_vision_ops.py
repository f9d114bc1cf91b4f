"""The vision tower's ops (layer_norm, linear_bias, gelu_tanh, gelu_erf, segment_attention) against fp64 oracles.

Criteria: elementwise ops pointwise -- fp32 rtol 1e-6 (a few ulps), bf16 rtol 2^-8 (one output rounding);
reductions (norm, linear, attention) normwise -- fp32 1e-6 with a pointwise cap of 1e-5 of the largest value,
bf16 2^-8 / cap 2^-7 (one output rounding of inputs that are exact in bf16).
"""

import math

import pytest
import torch

from .conftest import (
    DTYPES,
    Normwise,
    Pointwise,
    assert_normwise,
    assert_pointwise,
    f64,
    randn,
    reference_ops,
)

POINT = {torch.float32: Pointwise(1e-6, 1e-6), torch.bfloat16: Pointwise(2 ** -8, 1e-6)}
NORM = {torch.float32: Normwise(1e-6, 1e-5), torch.bfloat16: Normwise(2 ** -8, 2 ** -7)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_matches_fp64(device, dtype, gen):
    ops = reference_ops(device, dtype)
    x = randn(gen, 7, 48, dtype=dtype, device=device, scale=3.0) + 2.0   # a mean far from zero
    w = randn(gen, 48, dtype=dtype, device=device)
    b = randn(gen, 48, dtype=dtype, device=device)
    out = ops.layer_norm(x, w, b, 1e-6)
    xd = f64(x)
    mean = xd.mean(-1, keepdim=True)
    var = ((xd - mean) ** 2).mean(-1, keepdim=True)
    ref = (xd - mean) / torch.sqrt(var + 1e-6) * f64(w) + f64(b)
    assert out.dtype == dtype and out.shape == x.shape
    assert_normwise(out, ref, NORM[dtype], f"layer_norm {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_bias_matches_fp64(device, dtype, gen):
    ops = reference_ops(device, dtype)
    x = randn(gen, 2, 5, 24, dtype=dtype, device=device)
    w = randn(gen, 40, 24, dtype=dtype, device=device, scale=0.2)
    b = randn(gen, 40, dtype=dtype, device=device)
    out = ops.linear_bias(x, w, b)
    ref = f64(x) @ f64(w).T + f64(b)
    assert out.dtype == dtype and out.shape == (2, 5, 40)
    assert_normwise(out, ref, NORM[dtype], f"linear_bias {dtype}")


def test_linear_bias_refuses_a_bias_of_the_wrong_width(device, gen):
    ops = reference_ops(device, torch.float32)
    with pytest.raises(ValueError, match="bias"):
        ops.linear_bias(randn(gen, 3, 4, device=device), randn(gen, 5, 4, device=device), randn(gen, 4, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelus_match_fp64(device, dtype, gen):
    ops = reference_ops(device, dtype)
    x = randn(gen, 4, 33, dtype=dtype, device=device, scale=3.0)
    xd = f64(x)
    tanh_ref = 0.5 * xd * (1 + torch.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    erf_ref = 0.5 * xd * (1 + torch.erf(xd / math.sqrt(2)))
    assert_pointwise(ops.gelu_tanh(x), tanh_ref, POINT[dtype], f"gelu_tanh {dtype}")
    assert_pointwise(ops.gelu_erf(x), erf_ref, POINT[dtype], f"gelu_erf {dtype}")
    # The two differ (else one test could pass for the other's formula).
    assert (tanh_ref - erf_ref).abs().max() > 1e-4


def _attention_oracle(q, k, v, cu, scale):
    qd, kd, vd = f64(q), f64(k), f64(v)
    out = torch.zeros_like(qd)
    for a, b in zip(cu, cu[1:], strict=False):
        for h in range(q.shape[1]):
            p = torch.softmax(qd[a:b, h] @ kd[a:b, h].T * scale, dim=-1)
            out[a:b, h] = p @ vd[a:b, h]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cu", [[0, 13], [0, 4, 4, 21, 30], [0, 1, 2, 3]])
def test_segment_attention_attends_within_each_segment_only(device, dtype, cu, gen):
    ops = reference_ops(device, dtype)
    t, h, d = cu[-1], 3, 8
    q, k, v = (randn(gen, t, h, d, dtype=dtype, device=device) for _ in range(3))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    out = ops.segment_attention(q, k, v, cu_t, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_normwise(out, _attention_oracle(q, k, v, cu, d ** -0.5), NORM[dtype], f"segment_attention {cu} {dtype}")
    if len(cu) > 2:
        # Changing the last segment's keys and values leaves every other segment's output bit-identical.
        k2, v2 = k.clone(), v.clone()
        k2[cu[-2]:] += 1.0
        v2[cu[-2]:] += 1.0
        again = ops.segment_attention(q, k2, v2, cu_t, d ** -0.5)
        assert torch.equal(again[:cu[-2]], out[:cu[-2]])
        assert not torch.equal(again[cu[-2]:], out[cu[-2]:])


def test_segment_attention_refuses_bounds_that_do_not_cover_the_tokens(device, gen):
    ops = reference_ops(device, torch.float32)
    q = randn(gen, 6, 1, 4, device=device)
    for cu in ([0, 5], [1, 6], [0, 4, 3, 6]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            ops.segment_attention(q, q, q, torch.tensor(cu, dtype=torch.int32, device=device), 0.5)


SDPA_NORM = {torch.float32: NORM[torch.float32], torch.bfloat16: Normwise(2 ** -7, 2 ** -6)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cu", [[0, 13], [0, 4, 4, 21, 30], [0, 1, 2, 3]])
def test_segment_attention_sdpa_matches_fp64(device, dtype, cu, gen):
    """The fused implementation (chosen on CUDA for half precision) against the same fp64 oracle. Its bf16 bound
    is one rounding looser than the reference's: the fused kernel may round the probabilities to bf16 before P·V
    (the contract allows it)."""
    from ninfer_qwen3_5.ops.reference.segment_attention_sdpa import segment_attention_sdpa

    t, h, d = cu[-1], 3, 8
    q, k, v = (randn(gen, t, h, d, dtype=dtype, device=device) for _ in range(3))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    out = segment_attention_sdpa(q, k, v, cu_t, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_normwise(out, _attention_oracle(q, k, v, cu, d ** -0.5), SDPA_NORM[dtype], f"sdpa {cu} {dtype}")
    with pytest.raises(ValueError, match="cu_seqlens"):
        segment_attention_sdpa(q, k, v, torch.tensor([0, t - 1], dtype=torch.int32, device=device), 0.5)


def test_the_fused_segment_attention_is_chosen_for_half_precision_on_cuda_only():
    from ninfer.ops import resolve_ops
    from ninfer.plugins import get_registry

    ops = get_registry().ops
    assert resolve_ops(ops, "cuda", torch.bfloat16).implementation("segment_attention").name == "torch_sdpa"
    assert resolve_ops(ops, "cuda", torch.float32).implementation("segment_attention").name == "torch_reference"
    assert resolve_ops(ops, "cpu", torch.bfloat16).implementation("segment_attention").name == "torch_reference"
