"""The SDPA prefill candidate (``NINFER_ATTN_SDPA=1``, ``ninfer/ops/triton/attention_sdpa.py``) against the reference
suite's fp64 oracle, on the same cases as the kernels (tests/ops/test_attention.py: NaN-poisoned pools, out-of-pool
table entries past each row's pages, rows after a cached prefix, an empty row, GQA, D = 256), the three page layouts
bit for bit; the gate as the reference applies it; and the switch: taken only when enabled, for 16-bit CUDA calls
outside graph capture."""

import types

import pytest
import torch

pytest.importorskip("triton")

from ninfer.ops.reference import attention as ref_attention  # noqa: E402
from ninfer.ops.triton import attention_sdpa  # noqa: E402
from ops.conftest import assert_normwise, randn  # noqa: E402
from ops.shared_checks import check_paged_attention  # noqa: E402
from ops.test_attention import CRIT, GEOMETRIES, ROWS  # noqa: E402

from .conftest import CUDA, DEVICE  # noqa: E402

SDPA = types.SimpleNamespace(paged_attention=attention_sdpa.paged_attention_sdpa)


# On CUDA the candidate takes 16-bit calls only (fp32 SDPA may use TF32 products; the switch test below checks that
# it refuses fp32), so fp32 is checked on the CPU alone.
DTYPES = [torch.bfloat16] if CUDA else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page,hq,hkv,d", GEOMETRIES)
def test_sdpa_prefill_matches_the_oracle(dtype, page, hq, hkv, d, gen):
    check_paged_attention(SDPA, DEVICE, dtype, CRIT[dtype], page, hq, hkv, d, ROWS, gen, decode=False)


def test_the_gate_is_applied_as_the_reference_does(gen):
    rows = [(5, 9), (3, 3)]
    hq, hkv, d, page = 4, 2, 16, 4
    q = randn(gen, 8, hq, d, dtype=torch.bfloat16).to(DEVICE)
    gate = randn(gen, 8, hq * d, dtype=torch.bfloat16).to(DEVICE)
    k_pool = randn(gen, 6, page, hkv, d, dtype=torch.bfloat16).to(DEVICE)
    v_pool = randn(gen, 6, page, hkv, d, dtype=torch.bfloat16).to(DEVICE)
    table = torch.tensor([[3, 0, 5], [1, 2, 4]], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([kv for _, kv in rows], dtype=torch.int32, device=DEVICE)
    got = attention_sdpa.paged_attention_sdpa(q, k_pool, v_pool, cu, lens, table, d ** -0.5, gate)
    want = ref_attention.paged_attention(q, k_pool, v_pool, cu, lens, table, d ** -0.5, gate)
    assert_normwise(got, want.double().cpu(), CRIT[torch.bfloat16], "gated sdpa vs reference")


def test_taken_only_when_enabled_for_16_bit_cuda_calls(monkeypatch):
    q = torch.zeros(2, 2, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(attention_sdpa, "ENABLED", False)
    assert not attention_sdpa.usable(q)
    monkeypatch.setattr(attention_sdpa, "ENABLED", True)
    assert not attention_sdpa.usable(q)                       # a CPU tensor
    assert not attention_sdpa.usable(q.float())
    if CUDA:
        assert attention_sdpa.usable(q.cuda()) and not attention_sdpa.usable(q.cuda().float())


def test_more_queries_than_positions_is_refused():
    q = torch.zeros(3, 2, 8)
    pool = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="3 queries but only 2 KV positions"):
        attention_sdpa.paged_attention_sdpa(q, pool, pool, torch.tensor([0, 3]), torch.tensor([2]),
                                            torch.tensor([[0]]), 0.3)
