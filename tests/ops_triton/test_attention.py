"""Triton paged_attention / paged_decode_attention against the reference suite's fp64 oracle.

Same cases and criteria as tests/ops/test_attention.py (NaN-poisoned pools, out-of-pool page-table entries
past each row's pages, three page layouts that must agree bit for bit), plus what is specific to the kernels:
the decode split-K path (rows long enough for several splits), batch invariance (a row's output does not
depend on the rest of the batch or the page-table width), the prefill block search over many rows, agreement
with the torch reference op, and CUDA-graph capture with changed lengths and tables between replays.
Criteria (normwise, cap relative to max|ref|): fp32 rel 2e-6 / cap 2e-5; bf16 rel 8e-3 / cap 3e-2.
"""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import assert_bits, assert_normwise, randn  # noqa: E402
from ops.shared_checks import check_paged_attention  # noqa: E402
from ops.test_attention import CRIT, GEOMETRIES, ROWS  # noqa: E402

from .conftest import CUDA, DEVICE, reference, triton_ops  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def run_case(dtype, page, hq, hkv, d, rows, gen, decode, *, compare_reference=True):
    ops = triton_ops(dtype)
    assert ops.implementation("paged_decode_attention" if decode else "paged_attention").name == "triton"

    def vs_torch_reference(layout, out, call, what):
        # Once per case (the fragmented layout): the kernel and the torch op land on the same function.
        if compare_reference and layout == "fragmented":
            torch_out = call(reference(dtype))
            assert_normwise(out, torch_out.double().cpu(), CRIT[dtype], f"{what} vs torch reference op")

    return check_paged_attention(ops, DEVICE, dtype, CRIT[dtype], page, hq, hkv, d, rows, gen, decode,
                                 also=vs_torch_reference)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page,hq,hkv,d", GEOMETRIES)
def test_paged_attention(dtype, page, hq, hkv, d, gen):
    run_case(dtype, page, hq, hkv, d, ROWS, gen, decode=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page,hq,hkv,d", [(1, 2, 2, 8), (16, 8, 2, 8), (7, 4, 1, 256), (16, 8, 2, 256)])
def test_paged_decode_attention(dtype, page, hq, hkv, d, gen):
    run_case(dtype, page, hq, hkv, d, [(1, n) for n in (1, 2, 15, 16, 17, 33)], gen, decode=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_split_k_long_rows(dtype, gen):
    # 128-token minimum splits: 300 and 700 keys take 3 and 6 splits; 1 and 129 keys sit at the edges.
    run_case(dtype, 16, 8, 2, 32, [(1, 700), (1, 1), (1, 300), (1, 129)], gen, decode=True,
             compare_reference=False)


def test_prefill_many_rows_and_long_blocks(gen):
    # 9 rows (block search over a padded BLOCK_B = 16), a row of 70 queries x GQA 4 = several blocks of
    # (query, head) pairs, several empty rows, a decode-like row, a whole-sequence prefill.
    rows = [(70, 90), (0, 3), (1, 40), (3, 3), (0, 1), (17, 64), (2, 9), (0, 5), (33, 33)]
    run_case(torch.float32, 8, 8, 2, 16, rows, gen, decode=False, compare_reference=False)


def _pools_for(rows_kv, hkv, d, page, dtype, gen, n_pool):
    """Random pools and a fragmented table for rows of the given kv lengths (pages spread over the pool)."""
    k_pool = randn(gen, n_pool, page, hkv, d, dtype=dtype)
    v_pool = randn(gen, n_pool, page, hkv, d, dtype=dtype)
    need = [-(-n // page) for n in rows_kv]
    order = torch.randperm(n_pool, generator=gen)[:sum(need)].tolist()
    table = torch.full((len(rows_kv), max(need)), n_pool + 7, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(order[at:at + n], dtype=torch.int32)
        at += n
    return k_pool, v_pool, table


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_row_is_batch_invariant(dtype, gen):
    # A row alone (narrow page table: one split, direct store) and inside a batch with a 1000-key row (wide
    # table: a split grid and the combine kernel) must be bit-identical.
    ops = triton_ops(dtype)
    page, hq, hkv, d = 16, 8, 2, 64
    k_pool, v_pool, table = _pools_for([100, 1000, 37], hkv, d, page, dtype, gen, 90)
    q = randn(gen, 3, hq, d, dtype=dtype)
    kv_lens = torch.tensor([100, 1000, 37], dtype=torch.int32)
    dev = [t.to(DEVICE) for t in (q, k_pool, v_pool)]
    together = ops.paged_decode_attention(*dev, kv_lens.to(DEVICE), table.to(DEVICE), 0.125).cpu()
    for b in (0, 2):
        need = -(-int(kv_lens[b]) // page)
        alone = ops.paged_decode_attention(dev[0][b:b + 1], dev[1], dev[2], kv_lens[b:b + 1].to(DEVICE),
                                           table[b:b + 1, :need].to(DEVICE), 0.125).cpu()
        assert_bits(alone[0], together[b], f"row {b} alone vs batched")


def test_decode_zero_length_row_outputs_zeros(gen):
    # kv_len = 0 is outside the contract (a decode query sees itself); CUDA-graph padding rows use it, so
    # the kernel defines it as zeros rather than NaN, without touching the other rows.
    ops = triton_ops(torch.float32)
    k_pool, v_pool, table = _pools_for([20, 20], 1, 16, 4, torch.float32, gen, 12)
    q = randn(gen, 2, 2, 16)
    out = ops.paged_decode_attention(q.to(DEVICE), k_pool.to(DEVICE), v_pool.to(DEVICE),
                                     torch.tensor([0, 20], dtype=torch.int32, device=DEVICE),
                                     table.to(DEVICE), 0.25).cpu()
    assert torch.count_nonzero(out[0]) == 0
    ref = reference(torch.float32).paged_decode_attention(q[1:], k_pool, v_pool, torch.tensor([20]), table[1:],
                                                          0.25)
    assert_normwise(out[1:], ref.double(), CRIT[torch.float32], "row next to a zero-length row")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("decode", [True, False])
def test_cuda_graph_capture_and_replay(decode, gen):
    # Capturing fails on any host sync; replays with new lengths, tables and queries in the same buffers
    # must equal eager calls (the kernels read every row parameter from device memory).
    dtype, page, hq, hkv, d = torch.bfloat16, 16, 8, 2, 256
    ops = triton_ops(dtype)
    k_pool, v_pool, _ = _pools_for([600, 40], hkv, d, page, dtype, gen, 64)
    # Every entry a valid page (rows may share pages), so swapping the rows' tables between replays is safe.
    table = torch.stack([torch.randperm(64, generator=gen)[:40] for _ in range(2)]).to(torch.int32)
    k_pool, v_pool, table = k_pool.cuda(), v_pool.cuda(), table.cuda()
    n_q = 2 if decode else 9
    q = randn(gen, n_q, hq, d, dtype=dtype, device="cuda")
    kv_lens = torch.tensor([600, 40], dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, 1, 2] if decode else [0, 5, 9], dtype=torch.int32, device="cuda")

    def call():
        if decode:
            return ops.paged_decode_attention(q, k_pool, v_pool, kv_lens, table, d ** -0.5)
        return ops.paged_attention(q, k_pool, v_pool, cu_q, kv_lens, table, d ** -0.5)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for lens, new_cu in (([333, 17], [0, 4, 9]), ([1, 40], [0, 1, 9]), ([600, 40], [0, 5, 9])):
        kv_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        if not decode:
            cu_q.copy_(torch.tensor(new_cu, dtype=torch.int32))
        q.copy_(randn(gen, n_q, hq, d, dtype=dtype))
        table.copy_(table[torch.tensor([1, 0])])  # swap the rows' pages
        graph.replay()
        torch.cuda.synchronize()
        assert_bits(captured, call(), f"replay with kv_lens {lens}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra_pages", [0, 64])
def test_decode_output_gate(dtype, extra_pages, gen):
    """The gate applied at the output store: in the split kernel when a launch has one split (narrow table), in
    the combine otherwise (64 extra table entries: several splits). Equal to the ungated kernel followed by torch's
    o * sigmoid(gate) up to the sigmoid's last fp32 bit (exp implementations differ): within one ulp of dtype."""
    from ops.shared_checks import check_gated_decode_attention

    gated, composed = check_gated_decode_attention(triton_ops(dtype), DEVICE, dtype, gen, extra_pages=extra_pages)
    _within_one_ulp(gated, composed, dtype)


def _within_one_ulp(gated, composed, dtype):
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -22
    assert (gated.double() - composed.double()).abs().max() <= ulp * composed.double().abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_output_gate(dtype, gen):
    """The gate applied at the prefill kernel's output store: the ungated kernel followed by torch's
    o * sigmoid(gate), within one ulp of dtype (the sigmoid's exp may differ in its last fp32 bit); both kernels
    refuse a gate of the wrong shape."""
    from ops.shared_checks import check_a_wrong_gate_is_refused, check_gated_prefill_attention

    gated, composed = check_gated_prefill_attention(triton_ops(dtype), DEVICE, dtype, gen)
    _within_one_ulp(gated, composed, dtype)
    check_a_wrong_gate_is_refused(triton_ops(dtype), DEVICE, dtype)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_prefill_kv_split(splits, gen, monkeypatch):
    """The KV-split candidate (NINFER_ATTN_SPLIT): each block's keys cut into parts, their partials merged by the
    combine kernel. Against the oracle on the many-rows case (empty rows, parts with no key tile, a decode-like row,
    blocks of several rows) and a D = 256 GQA geometry in bf16; gated, it equals the unsplit kernel followed by the
    gate's composition within one ulp."""
    from ninfer.ops.triton import attention_parts

    monkeypatch.setattr(attention_parts, "kv_splits", lambda n_prog, hkv, device: splits)
    rows = [(70, 90), (0, 3), (1, 40), (3, 3), (0, 1), (17, 64), (2, 9), (0, 5), (33, 33)]
    run_case(torch.float32, 8, 8, 2, 16, rows, gen, decode=False, compare_reference=False)
    run_case(torch.bfloat16, 16, 8, 2, 256, [(5, 150), (1, 77), (40, 40)], gen, decode=False,
             compare_reference=False)
    from ops.shared_checks import check_gated_prefill_attention

    gated, composed = check_gated_prefill_attention(triton_ops(torch.bfloat16), DEVICE, torch.bfloat16, gen)
    _within_one_ulp(gated, composed, torch.bfloat16)


@pytest.mark.parametrize("tile", [(64, 32), (128, 32)])
def test_prefill_tiles_the_ab_tool_may_choose(tile, gen, monkeypatch):
    """tools/gpu_prefill_kernels_ab.py swaps the D > 128 16-bit tile for these (the default is 128 x 64): against the
    oracle on a D = 256 GQA geometry in bf16, rows of several blocks and a decode-like row included."""
    from ninfer.ops.triton import attention

    base = attention._prefill_config
    monkeypatch.setattr(attention, "_prefill_config", lambda d, dtype: (
        dict(BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=8, num_stages=2) if d > 128 and dtype != torch.float32
        else base(d, dtype)))
    run_case(torch.bfloat16, 16, 8, 2, 256, [(5, 150), (1, 77), (40, 40)], gen, decode=False,
             compare_reference=False)


def test_prefill_kv_split_is_a_candidate(monkeypatch):
    """Off by default (NINFER_ATTN_SPLIT unset): one part. On, a launch that fills the device is not split; a small
    one is cut into enough parts for two programs per SM, at most MAX_KV_SPLITS."""
    from ninfer.ops.triton import attention_parts as parts

    cuda = torch.device("cuda", 0)
    assert parts.kv_splits(2, 4, cuda) == 1 or parts.SPLIT_ENABLED
    monkeypatch.setattr(parts, "SPLIT_ENABLED", True)
    monkeypatch.setattr(parts, "_sm_count", lambda index: 132)
    assert parts.kv_splits(25, 4, cuda) == 2             # 264 // 100
    assert parts.kv_splits(8, 4, cuda) == 8
    assert parts.kv_splits(1, 1, cuda) == parts.MAX_KV_SPLITS
    assert parts.kv_splits(300, 4, cuda) == 1
    assert parts.kv_splits(1, 1, torch.device("cpu")) == 1
