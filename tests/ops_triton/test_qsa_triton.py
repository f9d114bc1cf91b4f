"""Triton QSA (``ninfer_qwen4exp.ops.triton.indexer`` and ``.sparse_attention``): the indexer's selection and the
attention over it, against the contract's fp64 oracles and the torch reference.

Criteria:
- ``qsa_select``: on tie-free scores (positive keys and queries) exactly the fp64 oracle's set for every query,
  in fp32 and bf16, for prefill chunks, decode rows and rows of both kinds; on scores that all tie (relu zeros) the
  lowest block ids (the kernel's documented tie rule, which a stable fp64 sort reproduces). Every row is the kept
  positions in ascending order, then ``-1``; each position at most once. Several score chunks give the same rows
  as one.
- ``qsa_attention``: within 1e-5 (fp32) / 2^-8 relative to the largest output (bf16) of the fp64 softmax over
  exactly the listed positions, with ``-1`` entries and entries past the row's KV length ignored; a decode call
  (one query per row, cut into runs and combined) and a prefill call (one run); bit-identical per query whether a
  query is computed alone or beside others; several partial chunks give the same output as one.
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from ninfer_qwen4exp.ops.reference import qsa as ref  # noqa: E402
from ninfer_qwen4exp.ops.triton import indexer, sparse_attention  # noqa: E402

from .conftest import DEVICE  # noqa: E402

EPS = 1e-6


def _paged(rows: list[torch.Tensor], page: int, pages: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[n_b, width]`` per sequence on shuffled pages: (pool [P, page, 1, width], page tables)."""
    perm = torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).tolist()
    pool = torch.zeros(pages, page, 1, width)
    tables, at = [], 0
    for r in rows:
        own = perm[at:at + -(-r.shape[0] // page)]
        at += len(own)
        for t in range(r.shape[0]):
            pool[own[t // page], t % page, 0, :r.shape[1]] = r[t]
        tables.append(own)
    wide = max(len(t) for t in tables) + 1   # one spare entry: the table describes more than any row holds
    return pool, torch.tensor([t + [0] * (wide - len(t)) for t in tables], dtype=torch.int32)


def _select_case(g: torch.Generator, lens: list[int], q_lens: list[int], *, d=8, h=3, rot=4, negative=False):
    keys = [torch.rand(n, d, generator=g) + 0.1 for n in lens]
    angles = []
    for n in lens:
        theta = torch.arange(n).float()[:, None] * torch.rand(rot // 2, generator=g)[None, :]
        angles.append(torch.cat((theta.cos(), theta.cos(), theta.sin(), theta.sin()), dim=1))
    key_pool, tables = _paged(keys, 4, 40, 12, seed=1)
    rope_pool, _ = _paged(angles, 4, 40, 12, seed=1)
    q = torch.rand(sum(q_lens), h, d, generator=g) * (-1.0 if negative else 1.0)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return dict(q=q, keys=keys, angles=angles, key_pool=key_pool, rope_pool=rope_pool, tables=tables, cu=cu,
                lens=lens, q_lens=q_lens, k_norm=torch.rand(d, generator=g) * 0.2, rot=rot)


def _oracle(q, keys, angles, k_norm, r, topk, rot, p, dtype):
    """The contract's selection for position ``p``: fp64 math rounded to ``dtype`` where the contract rounds (the
    block mean, the normed key, the rotated key); ties broken by the lower block id (a stable sort)."""
    n_vis = (p + 1) // r
    if n_vis <= topk:
        return list(range(p + 1))
    d = keys.shape[1]
    rnd = lambda x: x.to(dtype).double()   # noqa: E731
    scores = []
    for j in range(n_vis):
        pooled = rnd(keys[j * r:(j + 1) * r].double().mean(0))
        normed = rnd(pooled * torch.rsqrt(pooled.square().mean() + EPS) * (1 + k_norm.double()))
        cos, sin = angles[j * r, :rot].double(), angles[j * r, rot:2 * rot].double()
        x1, x2 = normed[:rot // 2], normed[rot // 2:rot]
        key = torch.cat((rnd(x1 * cos[:rot // 2] - x2 * sin[:rot // 2]), rnd(x2 * cos[rot // 2:] + x1 * sin[rot // 2:]),
                         normed[rot:]))
        scores.append(float(torch.relu(q.double() @ key).sum()) / math.sqrt(d))
    best = sorted(sorted(range(n_vis), key=lambda j: -scores[j])[:topk])
    return [j * r + i for j in best for i in range(r)] + list(range(n_vis * r, p + 1))


def _run_select(c: dict, dtype: torch.dtype, r: int, topk: int) -> torch.Tensor:
    dev = dict(device=DEVICE, dtype=dtype)
    return indexer.qsa_select(c["q"].to(**dev), c["key_pool"].to(**dev), c["rope_pool"].to(**dev),
                          c["k_norm"].to(**dev), EPS, c["cu"].to(DEVICE), torch.tensor(c["lens"], dtype=torch.int32,
                                                                                   device=DEVICE),
                          c["tables"].to(DEVICE), r, topk, c["rot"]).cpu()


def _check_rows(sel: torch.Tensor, c: dict, dtype: torch.dtype, r: int, topk: int) -> None:
    assert sel.shape == (sum(c["q_lens"]), topk * r + r - 1)
    rd = lambda x: x.to(dtype).double()   # noqa: E731 (the inputs as the kernel saw them)
    for b, (n, m) in enumerate(zip(c["lens"], c["q_lens"], strict=True)):
        for i in range(m):
            t = int(c["cu"][b]) + i
            want = _oracle(rd(c["q"][t]), rd(c["keys"][b]), rd(c["angles"][b]), rd(c["k_norm"]), r, topk, c["rot"],
                           n - m + i, dtype)
            row = sel[t].tolist()
            assert row == want + [-1] * (len(row) - len(want)), (b, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("r", "topk"), [(2, 3), (4, 2), (3, 50)])
def test_select_is_the_oracle_for_prefill_and_decode_rows(gen, dtype, r, topk):
    # Rows: a prefill chunk after a cached prefix, a decode row, a whole prompt, an empty row.
    c = _select_case(gen, [23, 9, 14, 5], [5, 1, 14, 0])
    _check_rows(_run_select(c, dtype, r, topk), c, dtype, r, topk)


def test_select_on_decode_rows(gen):
    c = _select_case(gen, [17, 30, 4], [1, 1, 1])
    _check_rows(_run_select(c, torch.float32, 2, 3), c, torch.float32, 2, 3)


def test_ties_keep_the_lowest_blocks(gen):
    # Negative queries against positive keys: every score is relu(<0) = 0, so every block ties.
    c = _select_case(gen, [26, 21], [6, 1], negative=True)
    sel = _run_select(c, torch.float32, 2, 4)
    _check_rows(sel, c, torch.float32, 2, 4)
    assert sel[0, :8].tolist() == list(range(8))   # blocks 0..3 of the first query (position 20)


@pytest.mark.parametrize("n_vis,levels", [(1000, 7), (700, 1000000), (300, 2)])
def test_the_selection_of_many_blocks_is_the_stable_top_k(gen, n_vis, levels):
    """The selection kernel alone on one query that sees ``n_vis`` blocks (several 256-block tiles) with scores drawn
    from ``levels`` values (many exact ties, a few, or two levels): the kept blocks are those a stable sort by
    descending score puts first (ties to the lowest ids), then the tail, in ascending order."""
    r, topk = 4, 64
    p = n_vis * r + 2                                 # a tail of 3 positions
    scores = torch.randint(0, levels, (1, n_vis + 5), generator=gen).float() * 0.25
    scores[0, n_vis:] = 1e9                            # past what the query sees: must never be read
    width = topk * r + r - 1
    sel = torch.full((1, width), -7, dtype=torch.int64, device=DEVICE)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    kv = torch.tensor([p + 1], dtype=torch.int32, device=DEVICE)
    indexer._select_kernel[(1,)](scores.to(DEVICE), cu, kv, sel, 1, 0, scores.stride(0), sel.stride(0), RATIO=r,
                             TOPK=topk, WIDTH=width, SPARSE=True, BLOCK_B=1, BLOCK_J=256, BLOCK_R=4, BLOCK_W=256)
    vis = scores[0, :n_vis].tolist()
    best = sorted(sorted(range(n_vis), key=lambda j: -vis[j])[:topk])
    want = [j * r + i for j in best for i in range(r)] + list(range(n_vis * r, p + 1))
    assert sel[0].cpu().tolist() == want + [-1] * (width - len(want))


def test_score_chunks_give_the_same_rows(gen, monkeypatch):
    c = _select_case(gen, [23, 9, 14], [5, 1, 14])
    whole = _run_select(c, torch.float32, 2, 3)
    monkeypatch.setattr(indexer, "SCORE_ELEMENTS", 16)   # a chunk of one query at a time (16 blocks a row)
    assert torch.equal(_run_select(c, torch.float32, 2, 3), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_side_pool_write_is_the_reference_bitwise(gen, dtype):
    """``indexer_cache_write`` writes each token's key and cos | sin, zero-padded, at its slot, exactly as the
    reference's ``kv_cache_write`` of the padded rows; every other pool row stays as it was."""
    t, d, r, width, page, pages = 5, 12, 4, 16, 4, 6
    key = (torch.randn(t, d + 3, generator=gen) * 2).to(dtype)[:, 3:]   # a column view, as the layer passes it
    theta = torch.randn(t, r, generator=gen)
    cos, sin = theta.cos(), theta.sin()
    slots = torch.tensor([3, 17, 0, 22, 9])
    pools = [torch.randn(pages, page, 1, width, generator=gen).to(dtype) for _ in range(2)]
    want = [p.clone() for p in pools]
    ref.indexer_cache_write(key, cos, sin, *want, slots)
    got = [p.to(DEVICE) for p in pools]
    indexer.indexer_cache_write(key.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), *got, slots.to(DEVICE))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)
    assert torch.equal(want[0].flatten(0, 1)[slots, 0, d:], torch.zeros(t, width - d, dtype=dtype))


def test_the_side_pool_write_refuses_or_drops_slots_out_of_range(gen):
    key, cos = torch.zeros(2, 8), torch.zeros(2, 4)
    pools = [torch.zeros(2, 4, 1, 8, device=DEVICE) for _ in range(2)]
    if DEVICE == "cpu":   # a host mapping is checked before the launch
        with pytest.raises(IndexError, match=r"outside \[0, 8\)"):
            indexer.indexer_cache_write(key, cos, cos, *pools, torch.tensor([1, 8]))
    indexer.indexer_cache_write((key + 1).to(DEVICE), cos.to(DEVICE), cos.to(DEVICE), *pools,
                            torch.tensor([1, -1], device=DEVICE) if DEVICE != "cpu" else torch.tensor([1, 3]))
    assert float(pools[0].sum()) == (8 if DEVICE != "cpu" else 16)


def _attention_case(g: torch.Generator, lens: list[int], q_lens: list[int], *, hq=6, hkv=2, d=16, width=9):
    ks = [torch.randn(n, hkv * d, generator=g) for n in lens]
    vs = [torch.randn(n, hkv * d, generator=g) for n in lens]
    k_pool, tables = _paged(ks, 4, 24, hkv * d, seed=2)
    v_pool, _ = _paged(vs, 4, 24, hkv * d, seed=2)
    shape = (24, 4, hkv, d)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    sel = torch.full((sum(q_lens), width), -1, dtype=torch.int64)
    t = 0
    for n, m in zip(lens, q_lens, strict=True):
        for _ in range(m):
            k = int(torch.randint(1, width + 1, (1,), generator=g))
            picks = torch.randperm(n, generator=g)[:k]
            sel[t, :picks.numel()] = picks
            if picks.numel() < width:
                sel[t, -1] = n + 3        # past the row's KV length: must be ignored
            t += 1
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return dict(q=q, ks=ks, vs=vs, k_pool=k_pool.view(shape), v_pool=v_pool.view(shape), tables=tables, sel=sel,
                cu=cu, lens=lens, q_lens=q_lens, hkv=hkv, d=d)


def _run_attention(c: dict, dtype: torch.dtype, rows=None) -> torch.Tensor:
    dev = dict(device=DEVICE, dtype=dtype)
    return sparse_attention.qsa_attention(c["q"].to(**dev), c["k_pool"].to(**dev), c["v_pool"].to(**dev), c["sel"].to(DEVICE),
                             c["cu"].to(DEVICE), torch.tensor(c["lens"], dtype=torch.int32, device=DEVICE),
                             c["tables"].to(DEVICE), 0.3).cpu()


def _attention_oracle(c: dict, dtype: torch.dtype) -> torch.Tensor:
    hq, hkv, d = c["q"].shape[1], c["hkv"], c["d"]
    out = torch.zeros(c["q"].shape, dtype=torch.float64)
    for b, n in enumerate(c["lens"]):
        for t in range(int(c["cu"][b]), int(c["cu"][b + 1])):
            p = [x for x in c["sel"][t].tolist() if 0 <= x < n]
            k = c["ks"][b][p].to(dtype).double().view(len(p), hkv, d).repeat_interleave(hq // hkv, dim=1)
            v = c["vs"][b][p].to(dtype).double().view(len(p), hkv, d).repeat_interleave(hq // hkv, dim=1)
            w = torch.softmax(torch.einsum("hd,khd->hk", c["q"][t].to(dtype).double(), k) * 0.3, dim=-1)
            out[t] = torch.einsum("hk,khd->hd", w, v)
    return out


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8 * float(want.abs().max())
    assert float((got.double() - want).abs().max()) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_prefill_call_is_the_oracle(gen, dtype):
    c = _attention_case(gen, [11, 6, 9], [3, 6, 4])
    _close(_run_attention(c, dtype), _attention_oracle(c, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_decode_call_is_the_oracle_in_runs(gen, dtype, monkeypatch):
    monkeypatch.setattr(sparse_attention, "SPLIT_ENTRIES", 4)    # 3 runs of a 9-entry row, combined
    c = _attention_case(gen, [11, 6, 9], [1, 1, 1])
    _close(_run_attention(c, dtype), _attention_oracle(c, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens", [[3, 2], [1, 1]], ids=["prefill", "decode"])
def test_the_output_gate_is_the_reference_ops(gen, dtype, q_lens, monkeypatch):
    """``gate[T, Hq*D]`` (a column view of a wider projection, as the layer passes it) applied where the output is
    stored, in the one-run (prefill) and the combined (decode) calls: within one ulp of the reference op's
    ``o * sigmoid(gate)`` on the same selection."""
    monkeypatch.setattr(sparse_attention, "SPLIT_ENTRIES", 4)
    c = _attention_case(gen, [11, 6], q_lens)
    t, hq, d = c["q"].shape
    wide = torch.randn(t, hq * d + 8, generator=gen) * 3
    gate = wide[:, 8:].to(DEVICE, dtype)
    sel = torch.where(c["sel"] < torch.tensor([[11]] * q_lens[0] + [[6]] * q_lens[1]), c["sel"], -1)
    dev = dict(device=DEVICE, dtype=dtype)
    args = (c["q"].to(**dev), c["k_pool"].to(**dev), c["v_pool"].to(**dev), sel.to(DEVICE), c["cu"].to(DEVICE),
            torch.tensor(c["lens"], dtype=torch.int32, device=DEVICE), c["tables"].to(DEVICE), 0.3)
    got = sparse_attention.qsa_attention(*args, gate).cpu()
    want = ref.qsa_attention(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args), gate.cpu())
    plain = sparse_attention.qsa_attention(*args).cpu()
    assert not torch.equal(got, plain)
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-5)
    else:
        assert float((got.float() - want.float()).abs().max()) <= 2 ** -7 * float(want.float().abs().max())


def test_attention_matches_the_reference_op(gen):
    c = _attention_case(gen, [11, 6], [3, 2])
    got = _run_attention(c, torch.float32)
    want = ref.qsa_attention(c["q"], c["k_pool"], c["v_pool"], torch.where(c["sel"] < torch.tensor(
        [[11]] * 3 + [[6]] * 2), c["sel"], -1), c["cu"], torch.tensor(c["lens"], dtype=torch.int32), c["tables"], 0.3)
    assert torch.allclose(got, want, atol=1e-5)


def test_a_decode_query_is_the_same_alone_or_batched(gen, monkeypatch):
    monkeypatch.setattr(sparse_attention, "SPLIT_ENTRIES", 4)
    c = _attention_case(gen, [11, 6, 9], [1, 1, 1])
    batched = _run_attention(c, torch.bfloat16)
    alone = dict(c, q=c["q"][1:2], sel=c["sel"][1:2], cu=torch.tensor([0, 1], dtype=torch.int32), lens=[6],
                 tables=c["tables"][1:2])
    assert torch.equal(_run_attention(alone, torch.bfloat16)[0], batched[1])


def test_partial_chunks_give_the_same_output(gen, monkeypatch):
    monkeypatch.setattr(sparse_attention, "SPLIT_ENTRIES", 4)
    c = _attention_case(gen, [11, 6, 9], [1, 1, 1])
    whole = _run_attention(c, torch.float32)
    monkeypatch.setattr(sparse_attention, "PARTIAL_ELEMENTS", 6 * 3 * 16)   # one query's partials a launch
    assert torch.equal(_run_attention(c, torch.float32), whole)


def test_bad_shapes_are_refused_with_the_problem(gen):
    c = _attention_case(gen, [11], [2])
    with pytest.raises(ValueError, match="not a multiple"):
        sparse_attention.qsa_attention(c["q"][:, :5].to(DEVICE), c["k_pool"].to(DEVICE), c["v_pool"].to(DEVICE),
                          c["sel"].to(DEVICE), c["cu"].to(DEVICE), torch.tensor([11], dtype=torch.int32,
                                                                                device=DEVICE),
                          c["tables"].to(DEVICE), 0.3)
    with pytest.raises(ValueError, match="do not describe the same rows"):
        sparse_attention.qsa_attention(c["q"].to(DEVICE), c["k_pool"].to(DEVICE), c["v_pool"].to(DEVICE), c["sel"].to(DEVICE),
                          torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
                          torch.tensor([11], dtype=torch.int32, device=DEVICE), c["tables"].to(DEVICE), 0.3)
