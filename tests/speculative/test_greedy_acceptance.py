"""Greedy acceptance (ninfer.program.speculation.greedy_acceptance).

Oracle: a plain-Python loop per row: walk the drafts while each equals the target's argmax at the previous
position (only the row's first num_drafts drafts count), then append the argmax at the first mismatch or after
the last draft. Exhaustive small cases pin the edges (all accepted, none, partial, per-row draft counts, k = 0,
logits with ties and NaN); a seeded property test compares random inputs with the loop exactly.
"""

import pytest
import torch
from ninfer.program.speculation import PAD, Acceptance, greedy_acceptance


def reference(drafts: list[list[int]], argmax: list[list[int]], num_drafts: list[int]) -> list[list[int]]:
    out = []
    for row_drafts, row_target, m in zip(drafts, argmax, num_drafts, strict=False):
        committed = []
        i = 0
        while i < m and row_drafts[i] == row_target[i]:
            committed.append(row_drafts[i])
            i += 1
        committed.append(row_target[i])
        out.append(committed)
    return out


def check(result: Acceptance, expected: list[list[int]], k: int) -> None:
    assert result.to_host() == expected
    assert result.accepted.tolist() == [len(row) - 1 for row in expected]
    assert result.produced.tolist() == [len(row) for row in expected]
    assert result.tokens.shape == (len(expected), k + 1)
    assert result.tokens.tolist() == [row + [PAD] * (k + 1 - len(row)) for row in expected]


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def test_all_none_and_partial():
    drafts = t([[5, 6, 7], [1, 6, 7], [5, 6, 9], [5, 0, 7]])
    target = t([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    check(greedy_acceptance(drafts, target), [[5, 6, 7, 8], [5], [5, 6, 7], [5, 6]], 3)


def test_later_matches_after_a_mismatch_do_not_count():
    # d_2 and d_3 equal the target's argmaxes, but d_1 does not: nothing is accepted.
    check(greedy_acceptance(t([[4, 6, 7]]), t([[5, 6, 7, 8]])), [[5]], 3)


def test_per_row_draft_counts_ignore_padding():
    drafts = t([[5, 6, 7], [5, 6, 7], [5, 6, -1], [-1, -1, -1], [5, 9, 7]])
    target = t([[5, 6, 7, 8]] * 5)
    num = t([3, 1, 2, 0, 1])
    # Row 1 accepts its one draft and gets the argmax after it (6) even though d_2 would match too.
    check(greedy_acceptance(drafts, target, num), [[5, 6, 7, 8], [5, 6], [5, 6, 7], [5], [5, 6]], 3)


def test_no_drafts_is_plain_greedy_decode():
    drafts = torch.zeros(2, 0, dtype=torch.int64)
    check(greedy_acceptance(drafts, t([[3], [4]])), [[3], [4]], 0)


def test_logits_argmax_lowest_id_on_ties_and_nan_as_minus_inf():
    logits = torch.full((1, 3, 4), -1.0)
    logits[0, 0, [1, 3]] = 2.0           # tie: id 1
    logits[0, 1, 0] = float("nan")       # NaN never wins: id 2
    logits[0, 1, 2] = 0.5
    logits[0, 2, 3] = 1.0
    check(greedy_acceptance(t([[1, 2]]), logits), [[1, 2, 3]], 2)
    check(greedy_acceptance(t([[1, 0]]), logits), [[1, 2]], 2)


@pytest.mark.parametrize("seed", range(4))
def test_random_against_the_python_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, k, vocab = 64, 5, 3  # a small vocabulary makes long accepted prefixes common
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    argmax = logits.argmax(dim=-1)
    # Drafts agree with the target most of the time, so every prefix length occurs.
    noise = torch.randint(0, vocab, (rows, k), generator=gen)
    agree = torch.rand(rows, k, generator=gen) < 0.7
    drafts = torch.where(agree, argmax[:, :k], noise)
    num = torch.randint(0, k + 1, (rows,), generator=gen)
    expected = reference(drafts.tolist(), argmax.tolist(), num.tolist())
    assert len({len(row) for row in expected}) == k + 1  # the inputs cover every produced length
    check(greedy_acceptance(drafts, logits, num), expected, k)
    check(greedy_acceptance(drafts, argmax, num), expected, k)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="drafts must be int64"):
        greedy_acceptance(torch.zeros(2, 3), t([[0] * 4] * 2))
    with pytest.raises(ValueError, match=r"target tokens must have shape \[2, 4\]"):
        greedy_acceptance(t([[0] * 3] * 2), t([[0] * 3] * 2))
    with pytest.raises(ValueError, match=r"target logits must have shape \[2, 4, V\]"):
        greedy_acceptance(t([[0] * 3] * 2), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="num_drafts must be an integer tensor"):
        greedy_acceptance(t([[0] * 3] * 2), t([[0] * 4] * 2), t([1, 2, 3]))
