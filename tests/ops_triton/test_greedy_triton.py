"""Triton greedy_tokens (partial kernel over vocabulary slices + final reduction) against the reference op.

Tokens must be identical to the reference's (the argmax is exact): several B and V, V not a multiple of the
slice size, ties inside a slice and across slice boundaries (the lower index wins), NaN / +inf / -inf /
all-NaN rows, fp32 / bf16 / fp16, strided rows and a strided ``out``. The slice size is shrunk for some tests
so tiny vocabularies span many slices under the interpreter. On the GPU: the decode shape (V = 248320,
B in 1, 3, 8), eagerly and replayed from a CUDA graph into a static ``out``.
"""

import pytest
import torch

pytest.importorskip("triton")

from ops.test_greedy import oracle, planted  # noqa: E402

from .conftest import CUDA, DEVICE, reference, triton_ops  # noqa: E402


def _check(ops, logits, out=None):
    tokens = ops.greedy_tokens(logits, out)
    want = reference(logits.dtype).greedy_tokens(logits)
    assert tokens.dtype == torch.int64 and tokens.shape == (logits.shape[0],)
    assert torch.equal(tokens, want), f"rows differ: {(tokens != want).nonzero().flatten().tolist()}"
    return tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(10, 8), (12, 1000), (10, 4096), (11, 9000)])
def test_matches_reference(dtype, shape, gen):
    ops = triton_ops(dtype)
    assert ops.implementation("greedy_tokens").name == "triton"
    logits = planted(gen, *shape, dtype).to(DEVICE)
    tokens = _check(ops, logits)
    assert tokens.cpu().tolist() == oracle(logits)


def test_ties_across_slice_boundaries(gen):
    from ninfer.ops.triton.greedy import _BLOCK

    ops = triton_ops(torch.float32)
    vocab = 2 * _BLOCK + 700                                          # three slices, the last one ragged
    logits = planted(gen, 10, vocab, torch.float32)
    logits[[0, 3]] = 1.0
    logits[0, [_BLOCK - 1, _BLOCK]] = 9.0                             # last of slice 0 vs first of slice 1
    logits[1, [_BLOCK, 2 * _BLOCK + 5]] = float("inf")                # slice 1 vs the ragged slice
    logits[2] = float("nan")
    logits[2, [_BLOCK + 3, vocab - 1]] = -float("inf")                # NaN slices; -inf beats NaN
    logits[3, [2 * _BLOCK + 1, vocab - 1]] = 20.0                     # tie inside the ragged slice
    tokens = _check(ops, logits.to(DEVICE))
    assert tokens[:4].cpu().tolist() == [_BLOCK - 1, _BLOCK, _BLOCK + 3, 2 * _BLOCK + 1]


@pytest.mark.parametrize("block", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab", [(1, 5), (3, 16), (5, 17), (8, 300), (9, 1023)])
def test_many_slices_with_ties_and_specials(monkeypatch, block, dtype, rows, vocab, gen):
    """Small integer logits (ties everywhere) with random NaN/+-inf, over 1 to 64 slices of a shrunk size."""
    from ninfer.ops.triton import greedy

    monkeypatch.setattr(greedy, "_BLOCK", block)
    logits = torch.randint(-3, 3, (rows, vocab), generator=gen).to(dtype)
    special = torch.rand(rows, vocab, generator=gen)
    logits[special < 0.1] = float("nan")
    logits[(special >= 0.1) & (special < 0.12)] = float("inf")
    logits[(special >= 0.12) & (special < 0.2)] = -float("inf")
    logits[0, :] = float("nan")
    _check(triton_ops(dtype), logits.to(DEVICE))


def test_strided_rows_and_out(gen):
    ops = triton_ops(torch.bfloat16)
    wide = planted(gen, 10, 6000, torch.bfloat16).to(DEVICE)
    logits = wide[:, :5000]                                           # row stride 6000
    buf = torch.full((10, 3), -1, dtype=torch.int64, device=DEVICE)
    col = buf[:, 2]                                                   # out with stride 3
    assert _check(ops, logits, col) is col
    assert torch.equal(buf[:, 2], reference(torch.bfloat16).greedy_tokens(logits))
    assert (buf[:, :2] == -1).all()
    column_major = planted(gen, 10, 300, torch.float32).t().contiguous().t().to(DEVICE)
    _check(triton_ops(torch.float32), column_major)                   # last dim not contiguous: copied


def test_bad_arguments_raise():
    ops = triton_ops(torch.float32)
    with pytest.raises(ValueError, match="2-D"):
        ops.greedy_tokens(torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="int64"):
        ops.greedy_tokens(torch.zeros(2, 3, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        ops.greedy_tokens(torch.zeros(2, 3, dtype=torch.float64, device=DEVICE))
    assert ops.greedy_tokens(torch.zeros(0, 7, device=DEVICE)).shape == (0,)


def test_host_ring_row_equals_the_tokens(gen):
    """``host=(ring, row)``: the final kernel stores each token into the ring row read from ``row`` on the device
    too (pinned memory on a GPU); the other rows and the entries past B are untouched."""
    ops = triton_ops(torch.float32)
    assert getattr(ops.greedy_tokens, "host_capturable", False)
    logits = planted(gen, 10, 1000, torch.float32).to(DEVICE)
    ring = torch.full((4, 12), -1, dtype=torch.int64, pin_memory=CUDA)
    out = torch.full((10,), -1, dtype=torch.int64, device=DEVICE)
    ops.greedy_tokens(logits, out, host=(ring, torch.tensor([3], device=DEVICE)))
    if CUDA:
        torch.cuda.synchronize()
    assert ring[3, :10].tolist() == out.cpu().tolist() == oracle(logits)
    assert (ring[:3] == -1).all() and (ring[3, 10:] == -1).all()
    with pytest.raises(ValueError, match="outside|int64"):
        ops.greedy_tokens(logits, host=(ring, torch.tensor([1, 2], device=DEVICE)))
    before = ring.clone()
    for bad in (4, -1):                  # a row index outside the ring (read on the device): nothing is stored
        ops.greedy_tokens(logits, host=(ring, torch.tensor([bad], device=DEVICE)))
    if CUDA:
        torch.cuda.synchronize()
    assert torch.equal(ring, before)


@pytest.mark.gpu
def test_host_ring_must_be_pinned_on_the_gpu():
    ops = triton_ops(torch.float32)
    with pytest.raises(ValueError, match="pinned"):
        ops.greedy_tokens(torch.zeros(2, 3, device="cuda"),
                          host=(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64, device="cuda")))


@pytest.mark.gpu
def test_host_ring_from_a_cuda_graph_follows_the_row_input():
    """Captured once, replayed with the ring row as a graph input: each replay's tokens land in its own row."""
    ops = triton_ops(torch.float32)
    g = torch.Generator(device="cuda").manual_seed(5)
    static = torch.randn(3, 248320, device="cuda", generator=g)
    out = torch.empty(3, dtype=torch.int64, device="cuda")
    row = torch.zeros(1, dtype=torch.int64, device="cuda")
    ring = torch.full((4, 8), -1, dtype=torch.int64, pin_memory=True)
    ops.greedy_tokens(static, out, host=(ring, row))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.greedy_tokens(static, out, host=(ring, row))
    want = []
    for r in range(4):
        static.copy_(torch.randn(3, 248320, device="cuda", generator=g))
        row.fill_(r)
        graph.replay()
        want.append(torch.argmax(static, dim=-1).tolist())
    torch.cuda.synchronize()
    assert ring[:, :3].tolist() == want
    assert (ring[:, 3:] == -1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_decode_shape_eager_and_in_cuda_graph(dtype, rows):
    from ninfer.ops.triton.greedy import _BLOCK

    vocab = 248320
    ops = triton_ops(dtype)
    ref = reference(dtype)
    g = torch.Generator(device="cuda").manual_seed(rows)

    def fresh():
        x = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(dtype)
        x[0, [3 * _BLOCK - 1, 3 * _BLOCK, 9 * _BLOCK]] = 100.0       # a tie across a slice boundary
        x[-1, vocab - 1] = float("inf")
        x[-1, 17] = float("nan")
        return x

    inputs = [fresh() for _ in range(4)]
    inputs[1][0] = float("nan")                                       # an all-NaN row: 0
    for x in inputs:
        _check(ops, x)
    static = inputs[0].clone()
    out = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    ops.greedy_tokens(static, out)                                    # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.greedy_tokens(static, out)
    for x in inputs:
        out.fill_(-1)
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref.greedy_tokens(x))
