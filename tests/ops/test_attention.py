"""paged_attention / paged_decode_attention vs an fp64 dense causal GQA oracle.

Every case runs under three page-table layouts -- identity, contiguous with an offset, and fragmented (a random
permutation of the pool) -- which must give bit-identical outputs. Pools start as NaN so reading any slot
past a row's length poisons the output, and page-table entries past a row's pages point outside the pool so
reading them raises.
Criteria (normwise, cap relative to max|ref|): fp32 rel 2e-6 / cap 2e-5 (fp32 softmax and two GEMMs over
<= 33 keys); bf16 rel 8e-3 / cap 3e-2 (one bf16 rounding of the output dominates).
"""

import math

import pytest
import torch

from .conftest import Normwise, assert_bits, assert_normwise, f64, randn, reference_ops

CRIT = {torch.float32: Normwise(2e-6, 2e-5), torch.bfloat16: Normwise(8e-3, 3e-2)}

# (q_len, kv_len) per row: last positions 0, 1, 14, 15, 16, 32 and prefill over a prefix; one empty row.
ROWS = [(1, 1), (2, 2), (1, 17), (16, 16), (5, 33), (0, 4), (2, 15)]


def oracle(q, ks, vs, rows, scale):
    """q[T, Hq, D]; ks/vs: per-row dense [L, Hkv, D]. Plain per-query, per-head softmax in fp64."""
    q = f64(q)
    hq, hkv = q.shape[1], ks[0].shape[1]
    out = torch.empty_like(q)
    t0 = 0
    for (n, kv_len), k, v in zip(rows, ks, vs, strict=True):
        k, v = f64(k), f64(v)
        kv_head = torch.arange(hq) // (hq // hkv)       # query head h reads KV head h // r
        kh, vh = k[:, kv_head], v[:, kv_head]            # [L, Hq, D]
        for i in range(n):
            pos = kv_len - n + i                         # sees keys 0..pos inclusive
            s = (kh[:pos + 1] * q[t0 + i]).sum(-1) * scale   # [pos+1, Hq]
            p = torch.exp(s - s.max(0).values)
            out[t0 + i] = ((p / p.sum(0))[..., None] * vh[:pos + 1]).sum(0)
        t0 += n
    return out


def layouts(rows, page, gen):
    """Yields (name, page_tables[B, maxp] int32, pool_pages) for identity / offset / fragmented layouts."""
    need = [math.ceil(kv_len / page) for _, kv_len in rows]
    total, maxp = sum(need), max(need) + 2
    for name in ("identity", "offset", "fragmented"):
        n_pool = total + (5 if name != "identity" else 0)
        if name == "identity":
            order = list(range(total))
        elif name == "offset":
            order = list(range(5, 5 + total))
        else:
            order = torch.randperm(n_pool, generator=gen)[:total].tolist()
        table = torch.full((len(rows), maxp), n_pool + 1000, dtype=torch.int32)  # never to be read
        at = 0
        for b, n_pages in enumerate(need):
            table[b, :n_pages] = torch.tensor(order[at:at + n_pages], dtype=torch.int32)
            at += n_pages
        yield name, table, n_pool


def fill_pools(ks, vs, table, n_pool, page, dtype):
    hkv, d = ks[0].shape[1:]
    k_pool = torch.full((n_pool, page, hkv, d), float("nan"), dtype=dtype)
    v_pool = torch.full((n_pool, page, hkv, d), float("nan"), dtype=dtype)
    for b, (k, v) in enumerate(zip(ks, vs, strict=True)):
        for p in range(k.shape[0]):  # position p -> page table[b, p // page], offset p % page
            k_pool[table[b, p // page], p % page] = k[p]
            v_pool[table[b, p // page], p % page] = v[p]
    return k_pool, v_pool


def run_case(device, dtype, page, hq, hkv, d, rows, gen, decode):
    ops = reference_ops(device, dtype)
    ks = [randn(gen, kv_len, hkv, d, dtype=dtype) for _, kv_len in rows]
    vs = [randn(gen, kv_len, hkv, d, dtype=dtype) for _, kv_len in rows]
    q = randn(gen, sum(n for n, _ in rows), hq, d, dtype=dtype)
    scale = d ** -0.5
    kv_lens = torch.tensor([kv_len for _, kv_len in rows], dtype=torch.int32)
    cu_q = torch.tensor([0] + [n for n, _ in rows], dtype=torch.int32).cumsum(0).to(torch.int32)
    ref = oracle(q, ks, vs, rows, scale)
    results = {}
    for name, table, n_pool in layouts(rows, page, gen):
        k_pool, v_pool = fill_pools(ks, vs, table, n_pool, page, dtype)
        args = [t.to(device) for t in (q, k_pool, v_pool)]
        if decode:
            out = ops.paged_decode_attention(*args, kv_lens.to(device), table.to(device), scale)
        else:
            out = ops.paged_attention(*args, cu_q.to(device), kv_lens.to(device), table.to(device), scale)
        assert out.dtype == dtype and out.shape == q.shape
        assert_normwise(out, ref, CRIT[dtype], f"{'decode' if decode else 'paged'} {name} page={page} "
                                              f"Hq={hq} Hkv={hkv} D={d} {dtype}")
        results[name] = out.cpu()
    assert_bits(results["offset"], results["identity"], "offset layout vs identity")
    assert_bits(results["fragmented"], results["identity"], "fragmented layout vs identity")


GEOMETRIES = [(page, hq, hkv, 8) for page in (1, 16, 7) for hq, hkv in ((2, 2), (8, 2))] + [(16, 4, 1, 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page,hq,hkv,d", GEOMETRIES)
def test_paged_attention(device, dtype, page, hq, hkv, d, gen):
    run_case(device, dtype, page, hq, hkv, d, ROWS, gen, decode=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page,hq,hkv,d", [(1, 2, 2, 8), (16, 8, 2, 8), (7, 4, 1, 256)])
def test_paged_decode_attention(device, dtype, page, hq, hkv, d, gen):
    run_case(device, dtype, page, hq, hkv, d, [(1, n) for n in (1, 2, 15, 16, 17, 33)], gen, decode=True)
