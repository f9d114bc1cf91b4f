"""moe_router / moe_experts vs fp64 oracles.

Criteria:
- router weights (fp32 output from fp32 softmax): pointwise rtol 2e-6 / atol 1e-7; ids exact (inputs are
  random with well-separated values, so no near-ties exist to blur the order).
- experts (normwise, cap relative to max|ref|): fp32 rel 2e-6 / cap 2e-5; bf16 rel 1.5e-2 / cap 5e-2 -- the
  SwiGLU intermediate is rounded to bf16 (as the model does) before the down GEMM, plus the output rounding.
"""

import pytest
import torch

from .conftest import Normwise, Pointwise, assert_normwise, assert_pointwise, f64, rand, randn, reference_ops
from .oracles import moe_experts_oracle

EXPERTS = {torch.float32: Normwise(2e-6, 2e-5), torch.bfloat16: Normwise(1.5e-2, 5e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_softmax_topk_renormalised(device, dtype, gen):
    ops = reference_ops(device, dtype)
    t_len, n_exp, top_k = 9, 12, 3
    # A permutation of well-spaced values per row: ranks are unambiguous even after bf16 rounding.
    base = torch.stack([torch.randperm(n_exp, generator=gen) for _ in range(t_len)]).double() * 0.37
    logits = (base + rand(gen, t_len, n_exp, hi=0.05, dtype=torch.float64)).to(dtype).to(device)
    weights, ids = ops.moe_router(logits, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (t_len, top_k)
    lg = f64(logits)
    for t in range(t_len):
        p = torch.exp(lg[t] - lg[t].max())
        p = p / p.sum()
        order = sorted(range(n_exp), key=lambda e: -float(p[e]))[:top_k]
        assert ids[t].tolist() == order, f"token {t}"
        ref_w = p[order] / p[order].sum()
        assert_pointwise(weights[t], ref_w, Pointwise(2e-6, 1e-7), f"router weights token {t}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_grouped(device, dtype, gen):
    ops = reference_ops(device, dtype)
    t_len, hidden, inter, n_exp, top_k = 11, 32, 24, 6, 2
    x = randn(gen, t_len, hidden, dtype=dtype, device=device)
    gate_up = randn(gen, n_exp, 2 * inter, hidden, dtype=dtype, device=device, scale=hidden ** -0.5)
    down = randn(gen, n_exp, hidden, inter, dtype=dtype, device=device, scale=inter ** -0.5)
    # Distinct experts per token, with expert 5 unused (an idle expert must be skipped cleanly).
    ids = torch.stack([torch.randperm(n_exp - 1, generator=gen)[:top_k] for _ in range(t_len)]).to(device)
    weights = rand(gen, t_len, top_k, lo=0.1, hi=1.0, device=device)
    out = ops.moe_experts(x, weights, ids, gate_up, down)
    assert out.dtype == dtype
    ref = moe_experts_oracle(x, weights, ids, gate_up, down)
    assert_normwise(out, ref, EXPERTS[dtype], f"moe_experts {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_with_shared_expert(device, dtype, gen):
    """The shared expert joins the fp32 sum (its projection given as a row-strided view, its gate logit a
    strided column), and the total is rounded once."""
    from ninfer.ops.contracts import SharedExpert

    ops = reference_ops(device, dtype)
    t_len, hidden, inter, n_exp, top_k, s_inter = 7, 32, 24, 6, 2, 20
    x = randn(gen, t_len, hidden, dtype=dtype, device=device)
    gate_up = randn(gen, n_exp, 2 * inter, hidden, dtype=dtype, device=device, scale=hidden ** -0.5)
    down = randn(gen, n_exp, hidden, inter, dtype=dtype, device=device, scale=inter ** -0.5)
    ids = torch.stack([torch.randperm(n_exp, generator=gen)[:top_k] for _ in range(t_len)]).to(device)
    weights = rand(gen, t_len, top_k, lo=0.1, hi=1.0, device=device)
    fused = randn(gen, t_len, 3 + 2 * s_inter + 1, dtype=dtype, device=device, scale=2.0)
    shared = SharedExpert(projected=fused[:, 3:3 + 2 * s_inter],
                          down=randn(gen, hidden, s_inter, dtype=dtype, device=device, scale=s_inter ** -0.5),
                          gate_logit=fused[:, -1])
    out = ops.moe_experts(x, weights, ids, gate_up, down, shared=shared)
    ref = moe_experts_oracle(x, weights, ids, gate_up, down, shared)
    assert_normwise(out, ref, EXPERTS[dtype], f"moe_experts + shared {dtype}")
    # The shared term is really there: without it the result is far from the oracle.
    alone = ops.moe_experts(x, weights, ids, gate_up, down)
    assert (f64(alone) - ref).norm() > 0.1 * ref.norm()
