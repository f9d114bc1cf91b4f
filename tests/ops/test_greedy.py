"""greedy_tokens reference: each row's argmax of nan_to_num(logits, nan=-inf), lowest index on ties.

Oracle: a pure-Python per-row scan over the represented values (NaN -> -inf, +inf -> the dtype's largest
finite value, -inf -> its negation; first index of the maximum), independent of torch's argmax; the op must
also equal ``torch.argmax(torch.nan_to_num(logits, nan=-inf))`` exactly, as the contract says. Inputs plant
ties, NaN, +inf, -inf and all-NaN rows. Tokens must match exactly.
"""

import math

import pytest
import torch
from ninfer.ops.reference.greedy import greedy_tokens

from .conftest import randn, reference_ops
from .shared_checks import call_sample


def oracle(logits: torch.Tensor) -> list[int]:
    big = torch.finfo(logits.dtype).max
    tokens = []
    for row in logits.detach().cpu().double().tolist():
        mapped = [-math.inf if math.isnan(v) else big if v == math.inf else -big if v == -math.inf else v
                  for v in row]
        tokens.append(mapped.index(max(mapped)))
    return tokens


def planted(gen: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random logits with the contract's edge cases planted row by row (rows >= 10, vocab >= 8)."""
    x = randn(gen, rows, vocab, dtype=dtype, scale=3.0)
    big = torch.finfo(dtype).max
    x[0, [2, vocab - 1]] = 50.0                          # a tie: the lower index wins
    x[1, :] = float("nan")                               # all NaN: 0
    x[2, 1] = float("nan")
    x[2, 5] = float("inf")                               # +inf is the maximum ...
    x[3, 4] = big
    x[3, 6] = float("inf")                               # ... but only ties with the largest finite value
    x[4, :] = float("-inf")                              # all -inf: 0
    x[5, :] = float("nan")
    x[5, 3] = float("-inf")                              # -inf beats NaN
    x[6, :] = 7.0                                        # a constant row: 0
    x[7, 0] = float("nan")
    x[7, vocab - 1] = 60.0                               # NaN first, the maximum last
    x[8, :3] = float("-inf")
    x[8, 3:] = float("nan")                              # -inf and NaN only: the first -inf
    x[9, [1, 3]] = float("inf")                          # two +inf: the first
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(10, 8), (12, 1000), (16, 4099)])
def test_matches_oracle_and_torch_argmax(device, dtype, shape, gen):
    ops = reference_ops(device, dtype)
    assert ops.implementation("greedy_tokens").name == "torch_reference"
    logits = planted(gen, *shape, dtype).to(device)
    tokens = ops.greedy_tokens(logits)
    assert tokens.dtype == torch.int64 and tokens.shape == (shape[0],) and tokens.device == logits.device
    assert tokens.cpu().tolist() == oracle(logits)
    assert torch.equal(tokens, torch.argmax(torch.nan_to_num(logits, nan=float("-inf")), dim=-1))
    assert tokens[:10].cpu().tolist() == [2, 0, 5, 4, 0, 3, 0, shape[1] - 1, 0, 1]


def test_single_column_and_empty_batch(device):
    assert greedy_tokens(torch.tensor([[float("nan")], [3.0]], device=device)).tolist() == [0, 0]
    empty = greedy_tokens(torch.empty(0, 5, device=device))
    assert empty.dtype == torch.int64 and empty.shape == (0,)


def test_out_is_written_and_returned(device, gen):
    logits = planted(gen, 10, 64, torch.float32).to(device)
    want = greedy_tokens(logits)
    out = torch.full((10,), -1, dtype=torch.int64, device=device)
    assert greedy_tokens(logits, out=out) is out
    assert torch.equal(out, want)
    buf = torch.full((10, 2), -1, dtype=torch.int64, device=device)
    col = buf[:, 1]                                      # a strided view (a static token buffer's column)
    assert greedy_tokens(logits, col) is col
    assert torch.equal(buf[:, 1], want) and (buf[:, 0] == -1).all()


def test_equals_sample_at_temperature_zero(device, gen):
    """Where the two contracts agree (no +-inf: sample keeps infinities unmapped), greedy is sample at T=0."""
    rows, vocab = 10, 300
    logits = planted(gen, rows, vocab, torch.float32)
    logits = torch.where(logits.isinf(), torch.zeros_like(logits), logits)
    zeros = torch.zeros(rows)
    sampled = call_sample(reference_ops(device, torch.float32), device, logits, zeros, zeros.int(),
                          torch.ones(rows), zeros, zeros.long(), zeros.long())
    assert torch.equal(greedy_tokens(logits.to(device)).cpu(), sampled)


@pytest.mark.parametrize("logits, out, match", [
    (torch.zeros(4), None, "2-D"),
    (torch.zeros(2, 3, 4), None, "2-D"),
    (torch.zeros(2, 3, dtype=torch.int64), None, "float"),
    (torch.zeros(2, 0), None, "empty vocabulary"),
    (torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32), "int64"),
    (torch.zeros(2, 3), torch.zeros(3, dtype=torch.int64), r"shape \(2,\)"),
    (torch.zeros(2, 3), torch.zeros(2, 1, dtype=torch.int64), r"shape \(2,\)"),
])
def test_bad_arguments_raise(logits, out, match):
    with pytest.raises(ValueError, match=match):
        greedy_tokens(logits, out)


@pytest.mark.gpu
def test_out_on_another_device_raises():
    with pytest.raises(ValueError, match="out is on"):
        greedy_tokens(torch.zeros(2, 3, device="cuda"), torch.zeros(2, dtype=torch.int64))


def test_host_ring_row_is_written(device, gen):
    """``host=(ring, row)``: the tokens also land in ring row ``row[0]`` (its first B entries); nothing else moves."""
    logits = planted(gen, 10, 64, torch.float32).to(device)
    ring = torch.full((3, 12), -1, dtype=torch.int64)
    tokens = greedy_tokens(logits, host=(ring, torch.tensor([2], device=device)))
    assert ring[2, :10].tolist() == tokens.cpu().tolist() == oracle(logits)
    assert (ring[:2] == -1).all() and (ring[2, 10:] == -1).all()


@pytest.mark.parametrize("ring, row, match", [
    (torch.zeros(3, 1, dtype=torch.int64), torch.tensor([0]), r"int64 \[R, >= 2\]"),
    (torch.zeros(3, 4, dtype=torch.int32), torch.tensor([0]), r"int64 \[R, >= 2\]"),
    (torch.zeros(4, dtype=torch.int64), torch.tensor([0]), r"int64 \[R, >= 2\]"),
    (torch.zeros(4, 3, dtype=torch.int64).t(), torch.tensor([0]), "contiguous"),
    (torch.zeros(3, 4, dtype=torch.int64), torch.tensor([0, 1]), r"int64 \[1\]"),
    (torch.zeros(3, 4, dtype=torch.int64), torch.tensor([0], dtype=torch.int32), r"int64 \[1\]"),
    (torch.zeros(3, 4, dtype=torch.int64), torch.tensor([3]), "outside the ring's 3 rows"),
])
def test_bad_host_ring_raises(ring, row, match):
    with pytest.raises(ValueError, match=match):
        greedy_tokens(torch.zeros(2, 3), host=(ring, row))
