"""kv_cache_write: an exact scatter. Oracle: a per-token Python loop writing into a copy of the pools.
Criterion: bit-exact pools (written slots and every untouched slot)."""

import pytest
import torch

from .conftest import DTYPES, assert_bits, randn, reference_ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page", [1, 16, 5])
def test_kv_cache_write_exact(device, dtype, page, gen):
    ops = reference_ops(device, dtype)
    hkv, d, t_len = 2, 8, 11
    n_pages = -(-t_len // page) + 3  # spare pages so some slots stay untouched
    k_pool = randn(gen, n_pages, page, hkv, d, dtype=dtype, device=device)
    v_pool = randn(gen, n_pages, page, hkv, d, dtype=dtype, device=device)
    k = randn(gen, t_len, hkv, d, dtype=dtype, device=device)
    v = randn(gen, t_len, hkv, d, dtype=dtype, device=device)
    slots = torch.randperm(n_pages * page, generator=gen)[:t_len]
    exp_k, exp_v = k_pool.cpu().clone(), v_pool.cpu().clone()
    for t, s in enumerate(slots.tolist()):
        exp_k[s // page, s % page] = k[t].cpu()
        exp_v[s // page, s % page] = v[t].cpu()
    ops.kv_cache_write(k, v, k_pool, v_pool, slots.to(device))
    assert_bits(k_pool.cpu(), exp_k, "k_pool")
    assert_bits(v_pool.cpu(), exp_v, "v_pool")


def test_kv_cache_write_rejects_out_of_range_slot(device, gen):
    ops = reference_ops(device, torch.float32)
    pool = torch.zeros(2, 4, 1, 2, device=device)
    before = pool.clone()
    k = randn(gen, 1, 1, 2, device=device)
    for bad in (-1, 8):
        with pytest.raises(IndexError):
            ops.kv_cache_write(k, k, pool, pool.clone(), torch.tensor([bad], device=device))
    assert torch.equal(pool, before)
