"""Triton kv_cache_write: an exact scatter (oracle: a per-token Python loop into copies of the pools).

Criterion: bit-exact pools, written slots and every untouched slot. Also: strided sources, a dtype cast into
the pool equal to torch's ``.to``, out-of-range slots raising before any write, and (CUDA) graph capture.
"""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import assert_bits, randn  # noqa: E402

from .conftest import CUDA, DEVICE, triton_ops  # noqa: E402


def expected(k_pool, v_pool, k, v, slots, page):
    exp_k, exp_v = k_pool.cpu().clone(), v_pool.cpu().clone()
    for t, s in enumerate(slots.tolist()):
        exp_k[s // page, s % page] = k[t].cpu().to(exp_k.dtype)
        exp_v[s // page, s % page] = v[t].cpu().to(exp_v.dtype)
    return exp_k, exp_v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16, 5])
def test_kv_cache_write_exact(dtype, page, gen):
    ops = triton_ops(dtype)
    assert ops.implementation("kv_cache_write").name == "triton"
    hkv, d, t_len = 2, 8, 11
    n_pages = -(-t_len // page) + 3
    k_pool = randn(gen, n_pages, page, hkv, d, dtype=dtype, device=DEVICE)
    v_pool = randn(gen, n_pages, page, hkv, d, dtype=dtype, device=DEVICE)
    k = randn(gen, t_len, hkv, d, dtype=dtype, device=DEVICE)
    v = randn(gen, t_len, hkv, d, dtype=dtype, device=DEVICE)
    slots = torch.randperm(n_pages * page, generator=gen)[:t_len]
    exp_k, exp_v = expected(k_pool, v_pool, k, v, slots, page)
    ops.kv_cache_write(k, v, k_pool, v_pool, slots.to(DEVICE))
    assert_bits(k_pool.cpu(), exp_k, "k_pool")
    assert_bits(v_pool.cpu(), exp_v, "v_pool")


def test_kv_cache_write_strided_source_and_cast(gen):
    # k/v as slices of a fused [T, 3, Hkv, D] projection (non-contiguous), fp32 written into a bf16 pool:
    # the stored bits must equal torch's round-to-nearest-even cast.
    ops = triton_ops(torch.float32)
    page, hkv, d, t_len = 4, 3, 24, 9
    fused = randn(gen, t_len, 3, hkv, d, device=DEVICE, scale=3.0)
    k, v = fused[:, 1], fused[:, 2]
    assert not k.is_contiguous()
    k_pool = randn(gen, 6, page, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    v_pool = randn(gen, 6, page, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.randperm(24, generator=gen)[:t_len]
    exp_k, exp_v = expected(k_pool, v_pool, k, v, slots, page)
    ops.kv_cache_write(k, v, k_pool, v_pool, slots.to(DEVICE))
    assert_bits(k_pool.cpu(), exp_k, "k_pool (cast)")
    assert_bits(v_pool.cpu(), exp_v, "v_pool (cast)")


def test_kv_cache_write_rejects_out_of_range_slot(gen):
    ops = triton_ops(torch.float32)
    pool = torch.zeros(2, 4, 1, 2, device=DEVICE)
    before = pool.clone()
    k = randn(gen, 2, 1, 2, device=DEVICE)
    for bad in (-1, 8):
        with pytest.raises(IndexError):
            ops.kv_cache_write(k, k, pool, pool.clone(), torch.tensor([3, bad]))   # on the host: checked
    assert torch.equal(pool, before), "nothing may be written when a slot is out of range"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_kv_cache_write_graph_capture(gen):
    # Under capture the range check (a sync) is skipped; replays write the slots present at replay time.
    ops = triton_ops(torch.bfloat16)
    page, hkv, d = 16, 2, 256
    k_pool = randn(gen, 8, page, hkv, d, dtype=torch.bfloat16, device="cuda")
    v_pool = randn(gen, 8, page, hkv, d, dtype=torch.bfloat16, device="cuda")
    k = randn(gen, 4, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = randn(gen, 4, hkv, d, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([0, 1, 2, 3], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.kv_cache_write(k, v, k_pool, v_pool, slots)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.kv_cache_write(k, v, k_pool, v_pool, slots)
    new_slots = torch.randperm(8 * page, generator=gen)[:4]
    slots.copy_(new_slots)
    exp_k, exp_v = expected(k_pool, v_pool, k, v, new_slots, page)
    graph.replay()
    torch.cuda.synchronize()
    assert_bits(k_pool.cpu(), exp_k, "k_pool after replay")
    assert_bits(v_pool.cpu(), exp_v, "v_pool after replay")


def test_out_of_range_slot_is_dropped_when_the_check_is_skipped(gen, monkeypatch):
    # What a captured graph does (no host check): the kernel's own mask drops the bad token, never wraps
    # (-1 would otherwise land on the last page) and still writes the good ones.
    from ninfer.ops.triton import kv_cache

    monkeypatch.setattr(kv_cache, "capturing", lambda device: True)
    ops = triton_ops(torch.float32)
    k_pool = randn(gen, 2, 4, 1, 2, device=DEVICE)
    v_pool = randn(gen, 2, 4, 1, 2, device=DEVICE)
    k = randn(gen, 3, 1, 2, device=DEVICE)
    exp_k, exp_v = expected(k_pool, v_pool, k[1:2], k[1:2], torch.tensor([5]), 4)
    ops.kv_cache_write(k, k, k_pool, v_pool, torch.tensor([-1, 5, 8], device=DEVICE))
    assert_bits(k_pool.cpu(), exp_k, "k_pool")
    assert_bits(v_pool.cpu(), exp_v, "v_pool")
