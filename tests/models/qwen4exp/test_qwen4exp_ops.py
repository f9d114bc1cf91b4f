"""Qwen4-Exp's op references against plain fp64 / pure-Python definitions of their contracts, and the n-gram hash
against transformers' own module."""

from __future__ import annotations

import math
import random

import pytest
import torch
from ninfer_qwen4exp.ops.reference.ngram import ngram_hash, ple_gather
from ninfer_qwen4exp.ops.reference.norm import gated_rms_norm_sigmoid, rms_norm_unit_offset_grouped
from ninfer_qwen4exp.ops.reference.qsa import qsa_attention, qsa_select
from ninfer_qwen4exp.ple_hash import ngram_hash as hash_constants

EPS = 1e-6


def test_grouped_norm_is_the_unit_offset_norm_of_each_group():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3 * 8, generator=g), torch.randn(3 * 8, generator=g)
    ref = torch.cat([(x[:, k * 8:(k + 1) * 8].double() * torch.rsqrt(x[:, k * 8:(k + 1) * 8].double().square()
                     .mean(-1, keepdim=True) + EPS)) * (1 + w[k * 8:(k + 1) * 8].double()) for k in range(3)], dim=1)
    assert torch.allclose(rms_norm_unit_offset_grouped(x, w, 8, EPS).double(), ref, atol=1e-6)
    xb = x.bfloat16()
    out = rms_norm_unit_offset_grouped(xb, w, 8, EPS)   # fp32 maths, rounded once to the input's dtype
    assert out.dtype == torch.bfloat16 and torch.equal(out, rms_norm_unit_offset_grouped(xb.float(), w, 8, EPS)
                                                       .to(torch.bfloat16))
    with pytest.raises(ValueError, match="do not split into groups of 7"):
        rms_norm_unit_offset_grouped(x, w, 7, EPS)


def test_gated_norm_with_a_sigmoid_gate():
    g = torch.Generator().manual_seed(1)
    x, z, w = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g), torch.rand(16, generator=g)
    n = x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + EPS)
    ref = n * w.double() * torch.sigmoid(z.double())
    assert torch.allclose(gated_rms_norm_sigmoid(x, z, w, EPS).double(), ref, atol=1e-6)


def _python_ids(window: list[int], mult, sizes, offsets, eos: int, per: int) -> list[int]:
    """The contract, one token, in Python integers."""
    n = len(window)
    shifted = [window[-1]]
    for s in range(1, n):
        cut = any(window[n - 1 - j] == eos for j in range(1, s + 1))
        shifted.append(eos if cut else window[n - 1 - s])
    out = []
    for m in range(2, n + 1):
        mixed = 0
        for s in range(m):
            mixed ^= shifted[s] * mult[s]
        for j in range(per):
            h = (m - 2) * per + j
            out.append(mixed % sizes[h] + offsets[h])
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ngram_hash_is_the_contract(n):
    rng = random.Random(n)
    eos, per = 7, 3
    h = hash_constants(248320, n, per, 20_000_000, 128, 1234, 1)
    windows = [[rng.choice([eos, rng.randrange(248320)]) for _ in range(n)] for _ in range(64)]
    ids = ngram_hash(torch.tensor(windows), torch.tensor(h.multipliers), torch.tensor(h.sizes),
                     torch.tensor(h.offsets), eos, per)
    assert ids.tolist() == [_python_ids(w, h.multipliers, h.sizes, h.offsets, eos, per) for w in windows]
    assert int(ids.max()) < h.rows


def test_ngram_ids_equal_transformers_module(q4x_case):
    """transformers' n-gram embedding of a sequence with EOS tokens, read through a table whose rows hold their own
    index, gives exactly our ids of the EOS-padded windows."""
    case = q4x_case("dense")
    emb = case.hf.model.layers[2].ple.ple_embedding   # PLE index 1 of the "dense" case
    ids = [1, 2, 3, 258, 4, 5, 258, 258, 6, 7, 8, 9, 10]
    with torch.no_grad():
        saved = emb.ngram_embedding.weight.clone()
        emb.ngram_embedding.weight.zero_()
        emb.ngram_embedding.weight[:, 0] = torch.arange(saved.shape[0], dtype=torch.float32)
        out = emb(torch.tensor([ids]), None)[0]
        emb.ngram_embedding.weight.copy_(saved)
    dh = saved.shape[1]
    theirs = out[:, ::dh].long()
    n = 4
    history = torch.tensor([258] * (n - 1) + ids)
    ours = ngram_hash(history.unfold(0, n, 1), emb.layer_multipliers, emb.ngram_heads_vocab_sizes,
                      emb.ngram_heads_offsets, 258, 2)
    assert torch.equal(ours, theirs)


def test_ple_gather_reads_the_rows_and_casts():
    table = torch.randn(50, 4, dtype=torch.bfloat16)
    ids = torch.tensor([[3, 49], [0, 3]])
    out = ple_gather(table, ids, torch.float32)
    assert out.dtype == torch.float32 and out.shape == (2, 8)
    assert torch.equal(out, torch.cat([table[ids[:, 0]], table[ids[:, 1]]], dim=1).float())


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def _paged(rows: list[torch.Tensor], page: int, num_pages: int, width: int, seed: int):
    """Rows ``[n_b, width]`` per sequence scattered over shuffled pages: (pool [P, page, 1, W], page tables)."""
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    pool = torch.zeros(num_pages, page, 1, width)
    tables, at = [], 0
    for r in rows:
        pages = perm[at:at + -(-r.shape[0] // page)]
        at += len(pages)
        for t in range(r.shape[0]):
            pool[pages[t // page], t % page, 0] = r[t]
        tables.append(pages)
    width_t = max(len(t) for t in tables)
    return pool, torch.tensor([t + [0] * (width_t - len(t)) for t in tables], dtype=torch.int32)


def _expected_selection(q, keys, angles, k_norm, r, topk, rot, p):
    """The contract for one query position ``p``, in fp64 with a stable sort (the scores are kept tie-free)."""
    n_vis = (p + 1) // r
    if n_vis <= topk:
        return set(range(p + 1))
    d = keys.shape[1]
    scores = []
    for j in range(n_vis):
        pooled = keys[j * r:(j + 1) * r].double().mean(0)
        normed = pooled * torch.rsqrt(pooled.square().mean() + EPS) * (1 + k_norm.double())
        cos, sin = angles[j * r, :rot].double(), angles[j * r, rot:2 * rot].double()
        x1, x2 = normed[:rot // 2], normed[rot // 2:rot]
        key = torch.cat((x1 * cos[:rot // 2] - x2 * sin[:rot // 2], x2 * cos[rot // 2:] + x1 * sin[rot // 2:],
                         normed[rot:]))
        scores.append(float(torch.relu(q.double() @ key).sum()) / math.sqrt(d))
    best = sorted(range(n_vis), key=lambda j: -scores[j])[:topk]
    return {j * r + i for j in best for i in range(r)} | set(range(n_vis * r, p + 1))


@pytest.mark.parametrize(("r", "topk"), [(2, 3), (4, 2), (3, 50)])
def test_qsa_select_is_the_contract(r, topk):
    g = torch.Generator().manual_seed(r * 10 + topk)
    h, d, rot, page = 3, 8, 4, 4
    lens, q_lens = [23, 9, 14], [5, 1, 14]
    # Positive keys and queries keep every score positive: no relu zeros, so no ties decide the top-k.
    keys = [torch.rand(n, d, generator=g) + 0.1 for n in lens]
    angles = []
    for n in lens:
        theta = torch.arange(n).float()[:, None] * torch.rand(rot // 2, generator=g)[None, :]
        angles.append(torch.cat((theta.cos(), theta.cos(), theta.sin(), theta.sin()), dim=1))
    key_pool, tables = _paged([_pad(k, 8) for k in keys], page, 32, 8, seed=1)
    rope_pool, tables2 = _paged([_pad(a, 8) for a in angles], page, 32, 8, seed=1)
    assert torch.equal(tables, tables2)
    k_norm = torch.rand(d, generator=g) * 0.2
    q = torch.rand(sum(q_lens), h, d, generator=g)
    cu = torch.tensor([0, 5, 6, 20], dtype=torch.int32)
    sel = qsa_select(q, key_pool, rope_pool, k_norm, EPS, cu, torch.tensor(lens, dtype=torch.int32), tables, r,
                     topk, rot)
    assert sel.shape == (20, topk * r + r - 1)
    for b, (n, m) in enumerate(zip(lens, q_lens, strict=True)):
        for i in range(m):
            row = sel[int(cu[b]) + i]
            got = [int(x) for x in row if x >= 0]
            assert len(got) == len(set(got))
            want = _expected_selection(q[int(cu[b]) + i], keys[b], angles[b], k_norm, r, topk, rot, n - m + i)
            assert set(got) == want, (b, i)


def test_qsa_attention_attends_exactly_the_selected_positions():
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, page = 4, 2, 8, 4
    lens = [11, 6]
    ks = [torch.randn(n, hkv * d, generator=g) for n in lens]
    vs = [torch.randn(n, hkv * d, generator=g) for n in lens]
    k_pool, tables = _paged(ks, page, 16, hkv * d, seed=2)
    v_pool, _ = _paged(vs, page, 16, hkv * d, seed=2)
    k_pool, v_pool = k_pool.view(16, page, hkv, d), v_pool.view(16, page, hkv, d)
    q = torch.randn(9, hq, d, generator=g)
    sel = torch.full((9, 5), -1, dtype=torch.int64)
    picks = [[0, 3, 10], [1, 2], [4, 5, 6, 7, 8], [0], [0, 1], [2], [0, 1, 2, 3], [4], [5, 1]]
    for i, p in enumerate(picks):
        sel[i, :len(p)] = torch.tensor(p)
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    out = qsa_attention(q, k_pool, v_pool, sel, cu, torch.tensor(lens, dtype=torch.int32), tables, 0.3)
    for i, p in enumerate(picks):
        b = 0 if i < 3 else 1
        k = ks[b][p].view(len(p), hkv, d).double().repeat_interleave(hq // hkv, dim=1)
        v = vs[b][p].view(len(p), hkv, d).double().repeat_interleave(hq // hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,khd->hk", q[i].double(), k) * 0.3, dim=-1)
        assert torch.allclose(out[i].double(), torch.einsum("hk,khd->hd", w, v), atol=1e-6)
