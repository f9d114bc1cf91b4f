"""Triton sample / apply_penalties.

- sample: tokens must equal the torch reference op's on the same device for the same inputs (same filtering
  expressions, same normative hash, fp64 Gumbel), over random per-row parameters with greedy rows mixed in,
  vocabularies that span several draw chunks (ties across chunk boundaries go to the lowest id), and the
  reference suite's pure-Python oracle (hash written with Python integers). With CUDA, they must also equal
  the CPU reference's tokens, and the call must be capturable in a CUDA graph (which fails on any host sync).
- apply_penalties: the reference suite's fp64 oracle, pointwise rtol 1e-6 / atol 1e-7; neutral rows
  bit-exact; inputs untouched.
"""

import pytest
import torch

pytest.importorskip("triton")

from ops.conftest import assert_pointwise, rand, randn  # noqa: E402
from ops.oracles import oracle_token, penalty_inputs, uniform  # noqa: E402
from ops.shared_checks import PENALTY_CRIT, call_sample, check_apply_penalties  # noqa: E402

from .conftest import CUDA, DEVICE, reference, triton_ops  # noqa: E402


def random_params(gen, rows, vocab):
    temperature = rand(gen, rows, lo=0.3, hi=2.0)
    temperature[::7] = 0.0
    top_k = torch.randint(0, vocab + 2, (rows,), generator=gen, dtype=torch.int32)
    top_k[::4] = 0
    top_p = rand(gen, rows, lo=0.05, hi=1.0)
    top_p[::3] = 1.0
    min_p = rand(gen, rows, lo=0.0, hi=0.3)
    min_p[::2] = 0.0
    seeds = torch.randint(-2 ** 63, 2 ** 63 - 1, (rows,), generator=gen)
    seeds[:3] = torch.tensor([0, -1, 2 ** 63 - 1])
    steps = torch.randint(0, 2 ** 40, (rows,), generator=gen)
    return [temperature, top_k, top_p, min_p, seeds, steps]


@pytest.mark.parametrize("vocab", [9, 300, 4096 + 1000])
def test_sample_equals_reference_op(vocab, gen):
    ops = triton_ops(torch.bfloat16)  # sample accepts any activation dtype: logits are fp32
    assert ops.implementation("sample").name == "triton"
    rows = 64 if vocab < 1000 else 12
    logits = randn(gen, rows, vocab, scale=3.0)
    logits[1, 5 % vocab] = float("nan")
    params = random_params(gen, rows, vocab)
    mine = call_sample(ops, DEVICE, logits, *params)
    ref = call_sample(reference(torch.float32), DEVICE, logits, *params)
    assert mine.dtype == torch.int64 and mine.shape == (rows,)
    assert torch.equal(mine, ref), f"rows differ: {(mine != ref).nonzero().flatten().tolist()}"
    if CUDA:
        cpu = call_sample(_cpu_reference(), "cpu", logits, *params)
        assert torch.equal(mine, cpu), "CUDA kernel vs CPU reference"


def _cpu_reference():
    from ninfer.ops import resolve_ops
    from ninfer.ops.reference.plugin import ninfer_ops

    return resolve_ops(ninfer_ops(), "cpu", torch.float32, force="reference")


def test_sample_matches_python_oracle(gen):
    ops = triton_ops(torch.float32)
    rows, vocab = 200, 9
    logits = (torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2).float()
    params = random_params(gen, rows, vocab)
    params[4] = params[4].abs()  # the oracle takes non-negative Python seeds
    tokens = call_sample(ops, DEVICE, logits, *params)
    compared = 0
    for b in range(rows):
        want = oracle_token(logits[b].double().tolist(), *(float(p[b]) if p.is_floating_point() else int(p[b])
                                                           for p in params))
        if want is None:
            continue
        compared += 1
        assert int(tokens[b]) == want, f"row {b}"
    assert compared >= 0.9 * rows


def test_hash_pins_the_uniform_draw():
    # Equal logits, no filters: the token is argmax_i u(seed, step, i) exactly (Gumbel is monotone in u),
    # so every draw pins the kernel's uint64 hash to the Python-integer oracle.
    ops = triton_ops(torch.float32)
    vocab, n = 50, 40
    seeds = [0, 1, 2 ** 63 - 1, 12345] * 10
    steps = list(range(n))
    tokens = call_sample(ops, DEVICE, torch.zeros(n, vocab), [1.0] * n, [0] * n, [1.0] * n, [0.0] * n, seeds, steps)
    for b in range(n):
        us = [uniform(seeds[b], steps[b], i) for i in range(vocab)]
        assert int(tokens[b]) == max(range(vocab), key=lambda i: us[i]), f"row {b}"


def test_ties_across_chunks_pick_lowest_id():
    # Greedy: equal maxima in different draw chunks (4096 tokens each) and inside one; all -inf/NaN rows.
    ops = triton_ops(torch.float32)
    vocab = 3 * 4096 + 7
    logits = torch.full((4, vocab), -1.0)
    logits[0, [5000, 9000, 12000]] = 2.0
    logits[1, [4095, 4096]] = 7.0
    logits[2] = float("-inf")
    logits[3] = float("nan")
    tokens = call_sample(ops, DEVICE, logits, [0.0] * 4, [0] * 4, [1.0] * 4, [0.0] * 4, [1] * 4, [2] * 4)
    assert tokens.tolist() == [5000, 4095, 0, 0]
    # Sampling rows where the filter leaves a single token in a late chunk, and an all -inf row.
    logits = torch.full((2, vocab), -30.0)
    logits[0, vocab - 1] = 10.0
    logits[1] = float("-inf")
    tokens = call_sample(ops, DEVICE, logits, [1.0] * 2, [1, 0], [1.0] * 2, [0.0] * 2, [9] * 2, [3] * 2)
    assert tokens.tolist() == [vocab - 1, 0]


def test_row_independent_of_batch(gen):
    ops = triton_ops(torch.float32)
    rows, vocab = 6, 5000
    logits = randn(gen, rows, vocab, scale=2.0)
    params = random_params(gen, rows, vocab)
    alone = [int(call_sample(ops, DEVICE, logits[b:b + 1], *(p[b:b + 1] for p in params))[0]) for b in range(rows)]
    perm = torch.randperm(rows, generator=gen)
    together = call_sample(ops, DEVICE, logits[perm], *(p[perm] for p in params))
    assert together.tolist() == [alone[i] for i in perm.tolist()]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_sample_graph_capture(gen):
    ops = triton_ops(torch.bfloat16)
    rows, vocab = 8, 248320
    logits = randn(gen, rows, vocab, scale=3.0, device="cuda")
    params = [p.cuda() for p in random_params(gen, rows, vocab)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.sample(logits, *params)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.sample(logits, *params)
    for _ in range(2):
        logits.copy_(randn(gen, rows, vocab, scale=3.0))
        params[5].add_(1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, reference(torch.float32).sample(logits, *params))


def test_apply_penalties(gen):
    ops = triton_ops(torch.bfloat16)
    assert ops.implementation("apply_penalties").name == "triton"
    inputs = penalty_inputs(gen, 3000)
    # The fp64 oracle is a Python loop: it covers the first 200 ids, the torch op all of them.
    out = check_apply_penalties(ops, DEVICE, inputs, 200)
    torch_out = reference(torch.float32).apply_penalties(*(t.to(DEVICE) for t in inputs))
    assert_pointwise(out, torch_out, PENALTY_CRIT, "vs torch reference op")
