"""Triton moe_experts vs the fp64 oracle and the torch reference op.

Runs on CUDA when present, otherwise on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set
below before the kernels are defined) at tiny sizes.

Criteria (normwise, cap relative to max|ref|), as in the reference suite: fp32 rel 2e-6 / cap 2e-5 (IEEE
dots); bf16 rel 1.5e-2 / cap 5e-2 (bf16 operands, the SwiGLU intermediate rounded to bf16 before the down
GEMM, the output rounding).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ninfer.ops.reference import moe as ref  # noqa: E402
from ninfer.ops.triton import moe as tm  # noqa: E402
from ops.conftest import assert_normwise, randn  # noqa: E402
from ops.oracles import moe_experts_oracle  # noqa: E402
from ops.test_moe import EXPERTS  # noqa: E402

if not _CUDA and type(tm._moe_sum_kernel).__name__ != "InterpretedFunction":
    tm = importlib.reload(tm)  # imported earlier without the interpreter: re-define the kernels

DEVICE = "cuda" if _CUDA else "cpu"


def make(gen, t_len, hidden, inter, n_exp, top_k, dtype, ids=None):
    x = randn(gen, t_len, hidden, dtype=dtype, device=DEVICE)
    gate_up = randn(gen, n_exp, 2 * inter, hidden, dtype=dtype, device=DEVICE, scale=hidden ** -0.5)
    down = randn(gen, n_exp, hidden, inter, dtype=dtype, device=DEVICE, scale=inter ** -0.5)
    if ids is None:
        ids = torch.stack([torch.randperm(n_exp, generator=gen)[:top_k] for _ in range(t_len)])
    ids = ids.to(DEVICE)
    weights = (0.1 + 0.9 * torch.rand(t_len, top_k, generator=gen)).to(DEVICE)
    return x, weights, ids, gate_up, down


SIZES = [(1, 32, 24, 6, 2), (11, 32, 24, 6, 2), (40, 48, 40, 5, 3), (7, 64, 16, 40, 4)]
if _CUDA:
    SIZES += [(200, 256, 128, 16, 4), (64, 2048, 512, 256, 8)]


@pytest.mark.parametrize("path", ["grouped", "gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t_len,hidden,inter,n_exp,top_k", SIZES)
def test_experts_match_oracle(dtype, t_len, hidden, inter, n_exp, top_k, path, gen):
    # Sizes cover: a single token, dims that are not multiples of the tiles, more experts than pairs (most
    # idle), and (on CUDA) 40 pairs/expert (several row blocks) and the 35B-A3B expert geometry. Both paths
    # run every size (the decode GEMV path is chosen by size only up to moe_gemv.MAX_PAIRS pairs).
    args = make(gen, t_len, hidden, inter, n_exp, top_k, dtype)
    out = tm.moe_experts(*args, gemv=path == "gemv")
    assert out.dtype == dtype and out.shape == (t_len, hidden)
    assert_normwise(out, moe_experts_oracle(*args), EXPERTS[dtype], f"triton moe_experts {dtype} T={t_len}")


@pytest.mark.parametrize("path", ["grouped", "gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skewed_routing_many_blocks_one_expert(dtype, path, gen):
    # Every token routes to expert 2 first (a group of T rows spanning several row blocks, with a partial last
    # block), its second choice spread over the rest; experts 0 and 4 stay idle.
    t_len = 70 if _CUDA else 37
    second = torch.tensor([1, 3, 5])[torch.randint(0, 3, (t_len,), generator=gen)]
    ids = torch.stack((torch.full((t_len,), 2), second), dim=1)
    args = make(gen, t_len, 32, 24, 6, 2, dtype, ids=ids)
    assert_normwise(tm.moe_experts(*args, gemv=path == "gemv"), moe_experts_oracle(*args), EXPERTS[dtype],
                    f"skewed routing {dtype} {path}")


def test_agrees_with_reference_op_and_tile_choices(gen):
    t_len, hidden, inter, n_exp, top_k = (300, 512, 256, 32, 8) if _CUDA else (13, 40, 24, 8, 3)
    args = make(gen, t_len, hidden, inter, n_exp, top_k, torch.bfloat16)
    ref_out = ref.moe_experts(*args)
    outs = [tm.moe_experts(*args, block_n=bn) for bn in ((32, 64), (64, 128))]
    for out in outs:
        assert_normwise(out, ref_out.float(), EXPERTS[torch.bfloat16], "triton vs reference moe")
    # The N tiling changes no sum order (K loops and the j-ordered reduction are tile-independent).
    assert torch.equal(outs[0], outs[1])
    # Deterministic: no atomics, fixed reduction order.
    assert torch.equal(tm.moe_experts(*args), tm.moe_experts(*args))


@pytest.mark.parametrize("tiles", [tm.PrefillTiles(), tm.PrefillTiles(128, (128, 128), 64, 8, 3),
                                   tm.PrefillTiles(128, (64, 64), 32, 4, 4), tm.PrefillTiles(32, (32, 256), 64, 8, 2),
                                   tm.LARGE_TILES],
                         ids=["default", "m128-n128-w8", "m128-k32-s4", "m32-n256", "large"])
def test_prefill_tile_choices_agree(tiles, gen):
    # Whatever the launch shape (tools/gpu_moe_prefill_sweep.py's candidates), the grouped path's result is the
    # reference's within bf16. Row blocks and column tiles change no sum order in the dots' K steps (only block_k
    # does); under the interpreter that makes the results equal, while on the GPU the MMA instruction shape that
    # the compiler picks for a tile may order a step's products differently, so there the bound alone holds.
    t_len, hidden, inter, n_exp, top_k = (600, 512, 256, 16, 8) if _CUDA else (40, 40, 24, 4, 3)
    args = make(gen, t_len, hidden, inter, n_exp, top_k, torch.bfloat16)
    out = tm.moe_experts(*args, gemv=False, tiles=tiles)
    assert_normwise(out, moe_experts_oracle(*args), EXPERTS[torch.bfloat16], f"tiles {tiles}")
    if not _CUDA:
        assert torch.equal(out, tm.moe_experts(*args, gemv=False, tiles=tm.PrefillTiles(block_k=tiles.block_k)))


def test_large_calls_take_the_large_tiles(gen, monkeypatch):
    # A call of at least LARGE_PAIRS pairs (a long prefill chunk) launches LARGE_TILES; lowered here so a small call
    # is "large": its result is the explicit LARGE_TILES launch's, bitwise (one launch shape, one program).
    t_len, hidden, inter, n_exp, top_k = (600, 512, 256, 16, 8) if _CUDA else (40, 40, 24, 4, 3)
    args = make(gen, t_len, hidden, inter, n_exp, top_k, torch.bfloat16)
    monkeypatch.setattr(tm, "LARGE_PAIRS", t_len * top_k)
    assert torch.equal(tm.moe_experts(*args, gemv=False), tm.moe_experts(*args, gemv=False, tiles=tm.LARGE_TILES))
    assert_normwise(tm.moe_experts(*args, gemv=False), moe_experts_oracle(*args), EXPERTS[torch.bfloat16], "large")


@pytest.mark.parametrize("with_shared", [False, True], ids=["routed", "shared"])
def test_the_grouped_mm_candidate_matches_the_oracle(with_shared, gen, monkeypatch):
    # NINFER_MOE_GROUPED_MM's path: torch._grouped_mm for both GEMMs, then the same j-ordered fp32 sum. Within the
    # bf16 bound of the oracle, deterministic run to run, and taken by default for large bf16 calls when enabled.
    t_len, hidden, inter, n_exp, top_k = (600, 512, 256, 16, 8) if _CUDA else (40, 48, 32, 5, 3)
    args = make(gen, t_len, hidden, inter, n_exp, top_k, torch.bfloat16)
    shared = shared_expert(gen, t_len, hidden, 32, torch.bfloat16) if with_shared else None
    out = tm.moe_experts(*args, shared=shared, gemv=False, grouped_mm=True)
    assert_normwise(out, moe_experts_oracle(*args, shared=shared), EXPERTS[torch.bfloat16], "grouped_mm")
    assert torch.equal(out, tm.moe_experts(*args, shared=shared, gemv=False, grouped_mm=True))
    monkeypatch.setattr(tm, "GROUPED_MM", True)
    monkeypatch.setattr(tm, "LARGE_PAIRS", t_len * top_k)
    assert torch.equal(tm.moe_experts(*args, shared=shared, gemv=False), out)
    monkeypatch.setattr(tm, "LARGE_PAIRS", t_len * top_k + 1)   # below the size: the Triton kernels
    assert torch.equal(tm.moe_experts(*args, shared=shared, gemv=False),
                       tm.moe_experts(*args, shared=shared, gemv=False, grouped_mm=False))


def test_mixed_dtypes_fall_back_to_reference(gen):
    x, weights, ids, gate_up, down = make(gen, 5, 32, 24, 6, 2, torch.float32)
    out = tm.moe_experts(x.to(torch.bfloat16), weights, ids, gate_up, down)
    expect = ref.moe_experts(x.to(torch.bfloat16), weights, ids, gate_up, down)
    assert torch.equal(out, expect)


@pytest.mark.parametrize("align", ["torch", "fused"])
def test_align_covers_every_pair_once(align, gen):
    ids = torch.stack([torch.randperm(9, generator=gen)[:3] for _ in range(21)]).to(DEVICE)
    bm = 16
    pairs, block_expert, max_blocks = (tm._align if align == "torch" else tm._align_fused)(ids, 9, bm)
    flat = ids.reshape(-1).cpu()
    pairs, block_expert = pairs.cpu(), block_expert.cpu()
    real = pairs[pairs < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))
    for b in range(max_blocks):
        rows = pairs[b * bm:(b + 1) * bm]
        rows = rows[rows < flat.numel()]
        if int(block_expert[b]) == 9:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and (flat[rows] == block_expert[b]).all()


def _group_keys(pairs: torch.Tensor, block_expert: torch.Tensor, bm: int, tk: int) -> torch.Tensor:
    """Each row as (its block's expert, its pair), sorted: equal for two layouts iff every expert's group
    (which may span several blocks) holds the same pairs and padding rows, whatever the order inside it."""
    row_expert = block_expert.repeat_interleave(bm)
    return (row_expert * (tk + 1) + pairs).sort().values


def test_group_keys_ignore_order_inside_a_group_only(gen):
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(40)])   # 80 pairs, ~20 per expert
    pairs, bexp, _ = tm._align(ids, 4, 8)                                          # groups span several blocks
    tk = ids.numel()
    keys = _group_keys(pairs, bexp, 8, tk)
    shuffled = pairs.clone()
    row_expert = bexp.repeat_interleave(8)
    for e in range(4):                     # the GPU's atomics: any order inside a group, across its blocks
        rows = (row_expert == e).nonzero().flatten()
        real = rows[pairs[rows] < tk]
        shuffled[real] = pairs[real[torch.randperm(real.numel(), generator=gen)]]
    assert not torch.equal(shuffled, pairs) and torch.equal(_group_keys(shuffled, bexp, 8, tk), keys)
    a = (row_expert == 0).nonzero()[0, 0]
    b = (row_expert == 1).nonzero()[0, 0]
    swapped = pairs.clone()
    swapped[a], swapped[b] = pairs[b], pairs[a]   # a pair moved to another expert's group
    assert not torch.equal(_group_keys(swapped, bexp, 8, tk), keys)


@pytest.mark.parametrize("t_len,n_exp,top_k,bm", [(21, 9, 3, 16), (1, 6, 2, 16), (37, 40, 8, 16), (300, 256, 8, 64)]
                         + ([(8192, 256, 8, 64), (2048, 256, 8, 64)] if _CUDA else []))
def test_fused_align_matches_the_torch_layout(t_len, n_exp, top_k, bm, gen):
    """The two-launch alignment gives the torch one's layout: the same block experts, padding rows and max_blocks,
    and each expert's group the same pairs (inside a group, in any order: the GPU's atomics pick it; at 8,192
    tokens a group spans several blocks)."""
    ids = torch.stack([torch.randperm(n_exp, generator=gen)[:top_k] for _ in range(t_len)]).to(DEVICE)
    ref_pairs, ref_bexp, ref_max = tm._align(ids, n_exp, bm)
    pairs, bexp, max_blocks = tm._align_fused(ids, n_exp, bm)
    tk = t_len * top_k
    assert max_blocks == ref_max and torch.equal(bexp, ref_bexp)
    assert torch.equal(_group_keys(pairs, bexp, bm, tk), _group_keys(ref_pairs, ref_bexp, bm, tk))
    assert torch.equal(pairs == tk, ref_pairs == tk)   # each group's first rows, then padding
    real = pairs < tk
    flat = ids.reshape(-1)
    assert torch.equal(flat[pairs[real]], bexp.repeat_interleave(bm)[real])   # every row in its expert's block


def test_ops_are_registered_for_cuda_only():
    assert [impl.op for impl in tm.OPS] == ["moe_experts"]
    impl = tm.OPS[0]
    assert impl.priority == 10 and impl.devices == frozenset({"cuda"})


def test_resolved_through_the_plugin():
    from .conftest import triton_ops

    impl = triton_ops(torch.bfloat16).implementation("moe_experts")
    assert impl.name == "triton" and impl.fn.__module__ == "ninfer.ops.triton.moe"


def shared_expert(gen, t_len, hidden, s_inter, dtype):
    from ninfer.ops.contracts import SharedExpert

    # As the model passes it: columns of one fused [router | shared gate_up | shared gate] projection.
    fused = randn(gen, t_len, 5 + 2 * s_inter + 1, dtype=dtype, device=DEVICE, scale=2.0)
    down = randn(gen, hidden, s_inter, dtype=dtype, device=DEVICE, scale=s_inter ** -0.5)
    return SharedExpert(projected=fused[:, 5:5 + 2 * s_inter], down=down, gate_logit=fused[:, -1])


@pytest.mark.parametrize("path", ["grouped", "gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t_len,s_inter", [(1, 24), (9, 20)] + ([(8, 512), (300, 512)] if _CUDA else []))
def test_shared_expert_joins_the_sum(dtype, t_len, s_inter, path, gen):
    hidden, inter, n_exp, top_k = (2048, 512, 256, 8) if s_inter == 512 else (32, 24, 6, 2)
    args = make(gen, t_len, hidden, inter, n_exp, top_k, dtype)
    shared = shared_expert(gen, t_len, hidden, s_inter, dtype)
    out = tm.moe_experts(*args, shared=shared, gemv=path == "gemv")
    ref = moe_experts_oracle(*args, shared)
    assert_normwise(out, ref, EXPERTS[dtype], f"moe_experts + shared {dtype} {path} T={t_len}")
    assert_normwise(out, ref_moe(*args, shared).float(), EXPERTS[dtype], "triton vs reference op")


def ref_moe(*args):
    x, weights, ids, gate_up, down, shared = args
    return ref.moe_experts(x, weights, ids, gate_up, down, shared=shared)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_tiles_narrower_than_a_row(dtype, gen, monkeypatch):
    """Expert rows wider than the GEMV tiles: the K loops of both kernels (the model's widths fit one tile)."""
    from ninfer.ops.triton import moe_gemv

    monkeypatch.setattr(moe_gemv, "_BK_GATE_UP", 16)
    monkeypatch.setattr(moe_gemv, "_BK_DOWN_MAX", 16)
    args = make(gen, 3, 40, 24, 6, 2, dtype)
    shared = shared_expert(gen, 3, 40, 20, dtype)
    out = tm.moe_experts(*args, shared=shared, gemv=True)
    assert_normwise(out, moe_experts_oracle(*args, shared), EXPERTS[dtype], f"narrow gemv tiles {dtype}")


@pytest.mark.parametrize("down", ["one_shot", "loop"])
@pytest.mark.parametrize("with_shared", [False, True])
@pytest.mark.parametrize("top_k", [2, 3])
def test_both_down_kernels_match_oracle(down, with_shared, top_k, gen):
    """The one-shot down kernel (default: every expert's rows in one load) and the per-expert loop kernel; k = 3
    pads the one-shot kernel's expert axis to 4 (the padded lane must add nothing)."""
    from ninfer.ops.triton.moe_gemv import moe_experts_gemv

    args = make(gen, 2, 40, 24, 7, top_k, torch.float32)
    shared = shared_expert(gen, 2, 40, 20, torch.float32) if with_shared else None
    out = moe_experts_gemv(*args, shared, tune={"down": down})
    assert_normwise(out, moe_experts_oracle(*args, shared), EXPERTS[torch.float32], f"down={down} k={top_k}")


def test_gemv_path_is_deterministic_and_taken_by_size(gen, monkeypatch):
    from ninfer.ops.triton import moe_gemv

    args = make(gen, 3, 32, 24, 6, 2, torch.bfloat16)
    calls = []
    real = moe_gemv.moe_experts_gemv
    monkeypatch.setattr(moe_gemv, "moe_experts_gemv", lambda *a: calls.append(1) or real(*a))
    first = tm.moe_experts(*args)
    assert calls == [1]                                   # 6 pairs <= MAX_PAIRS: the decode path
    assert torch.equal(first, tm.moe_experts(*args))
    monkeypatch.setattr(moe_gemv, "MAX_PAIRS", 4)
    tm.moe_experts(*args)
    assert calls == [1, 1]                                # 6 pairs > 4: the grouped path


# --- moe_router ---

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t_len,n_exp,top_k", [(1, 12, 3), (9, 40, 8), (5, 256, 8)])
def test_router_matches_reference_on_strided_logits(dtype, t_len, n_exp, top_k, gen):
    from ninfer.ops.triton import moe_router as tr

    if not _CUDA and type(tr._router_kernel).__name__ != "InterpretedFunction":
        tr = importlib.reload(tr)
    # Distinct values per row (a permutation of k/8, |k| <= 128: exact in bf16), so the top-k order is unambiguous.
    base = (torch.stack([torch.randperm(n_exp, generator=gen) for _ in range(t_len)]).float() - n_exp // 2) * 0.125
    wide = torch.cat((base, torch.zeros(t_len, 7)), dim=1).to(dtype).to(DEVICE)
    logits = wide[:, :n_exp]                              # row stride n_exp + 7
    w, ids = tr.moe_router(logits, top_k)
    w_ref, ids_ref = ref.moe_router(logits, top_k)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (t_len, top_k)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(w.sum(1).cpu(), torch.ones(t_len), rtol=1e-6, atol=1e-6)


def test_router_registered_and_resolved():
    from ninfer.ops.triton import moe_router as tr

    from .conftest import triton_ops

    assert [i.op for i in tr.OPS] == ["moe_router"] and tr.OPS[0].devices == frozenset({"cuda"})
    assert triton_ops(torch.bfloat16).implementation("moe_router").name == "triton"


@pytest.mark.parametrize("experts", [16, 13])
def test_router_gives_valid_ids_for_nan_logits(experts):
    """A row of NaN (or partly NaN) logits must not route out of range: the expert kernels would read out of bounds
    and fail the engine, not just the row."""
    from ninfer.ops.triton.moe_router import moe_router

    logits = torch.randn(3, experts, device=DEVICE)
    logits[0] = float("nan")
    logits[1, ::3] = float("nan")
    _, ids = moe_router(logits, 4)
    assert ids.dtype == torch.int64 and bool(((ids >= 0) & (ids < experts)).all())
    _, clean = ref.moe_router(logits[2:], 4)
    assert torch.equal(ids[2:].sort(-1).values, clean.sort(-1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_ties_pick_the_lowest_index_and_share_the_weight(dtype):
    """Equal logits (-0.0 and +0.0 among them) rank by index: the reference's topk leaves tie order open, so the
    ids are compared as sets and the weights per rank; a row of one value gives ids 0..k-1 and weights 1/k."""
    from ninfer.ops.triton.moe_router import moe_router

    rows = torch.tensor([[0.5, -0.0, 0.5, 0.0, 2.0, 0.5, -1.0, 0.0],
                         [1.0] * 8], dtype=dtype, device=DEVICE)
    w, ids = moe_router(rows, 4)
    assert ids[0].tolist() == [4, 0, 2, 5] and ids[1].tolist() == [0, 1, 2, 3]
    w_ref, ids_ref = ref.moe_router(rows, 4)
    assert ids[0].sort().values.tolist() == ids_ref[0].sort().values.tolist()
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=2e-6, atol=1e-7)
    assert torch.equal(w[1].cpu(), torch.full((4,), 0.25))
