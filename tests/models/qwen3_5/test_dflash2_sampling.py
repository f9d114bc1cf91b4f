"""DFlash2's sampled drafts are lossless: the selector's path drawn from its q (ninfer_qwen3_5.dflash.propose.
select_path) and accepted against that q (ninfer_qwen3_5.dflash.sampling.sampled_acceptance) commit tokens
distributed exactly as plain sampling draws them.

A toy over V = 6 tokens: the target's logits are L0 at the first position and L[x] after token x; the drafter's
block logits are fixed random logits per position, its selector a random rank-3 bilinear term over the top 4
candidates (so q is zero off the candidates); temperature 0.9 and top-k 5 on the target (its p is the ``sample``
op's filtered distribution). Each of N rows has its own seed: the selector's, the acceptance's and the residual's
draws come from the request's hash streams, as in the Program. The first committed token is checked against
p(L0), and the first two against p(L0)(x) p(L[x])(y) (a row that committed one token takes its second from a
second step at the next step index, starting from L[x]), by the total-variation bound of
tests/speculative/test_rejection_acceptance.py (false failure probability 1e-6). A wrong q (the selector's
squared and renormalised) is caught by the same statistic.
"""

from __future__ import annotations

import torch
from ninfer.contracts.program import RowSampling
from ninfer.contracts.sampling import SamplingParams
from ninfer_qwen3_5.dflash.propose import select_path
from ninfer_qwen3_5.dflash.sampling import sampled_acceptance, target_probabilities
from ninfer_qwen3_5.speculative_decode import Drafts

V, RANK, TOP_K, K = 6, 3, 4, 3
N = 120_000
PARAMS = SamplingParams(temperature=0.9, top_k=5)


def tv_bound(n: int, categories: int, delta: float = 1e-6) -> float:
    import math

    return math.sqrt((categories * math.log(2) + math.log(1 / delta)) / (2 * n))


def tv(samples: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    return float((counts / samples.numel() - expected.flatten().double()).abs().sum() / 2)


class Toy:
    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.l0 = 1.5 * torch.randn(V, generator=g)
        self.l = 1.5 * torch.randn(V, V, generator=g)
        self.draft_logits = 1.5 * torch.randn(K, V, generator=g)
        self.projected = torch.randn(K, RANK, generator=g)
        self.pred = torch.randn(V, RANK, generator=g)
        self.succ = torch.randn(V, RANK, generator=g)

    def p(self, logits: torch.Tensor) -> torch.Tensor:
        return target_probabilities(logits, [PARAMS] * logits.shape[0]).double()

    def step(self, first: torch.Tensor, anchors: torch.Tensor, seeds: list[int], step: int, wrong_q: bool = False):
        """One speculative step of len(seeds) rows whose first target logits are ``first`` [R, V]: their
        committed tokens (host lists)."""
        rows = len(seeds)
        drafts, q = select_path(self.draft_logits.expand(rows, K, V), self.projected.expand(rows, K, RANK), anchors,
                                self.pred, self.succ, TOP_K, [PARAMS.temperature] * rows, seeds, [step] * rows)
        assert q is not None and torch.allclose(q.sum(-1), torch.ones(rows, K))
        assert ((q > 0).sum(-1) <= TOP_K).all()
        if wrong_q:
            q = q ** 2 / (q ** 2).sum(-1, keepdim=True)
        processed = torch.cat([first[:, None], self.l[drafts]], dim=1).reshape(rows * (K + 1), V)
        sampling = [((r, i), RowSampling(PARAMS, seeds[r], step + i)) for r in range(rows) for i in range(K + 1)]
        got = sampled_acceptance(processed, sampling, [K] * rows, [r * (K + 1) for r in range(rows)],
                                 Drafts(drafts.tolist(), dict(enumerate(q))), [K] * rows)
        return [got[r] for r in range(rows)]

    def first_two(self, wrong_q: bool = False) -> torch.Tensor:
        seeds = list(range(N))
        anchors = torch.zeros(N, dtype=torch.int64)
        out = self.step(self.l0.expand(N, V), anchors, seeds, 0, wrong_q)
        short = [r for r, toks in enumerate(out) if len(toks) == 1]
        if short:
            x = torch.tensor([out[r][0] for r in short])
            more = self.step(self.l[x], x, [seeds[r] for r in short], 1, wrong_q)
            for r, toks in zip(short, more, strict=True):
                out[r] = out[r] + toks
        return torch.tensor([toks[0] * V + toks[1] for toks in out])


def test_first_two_committed_tokens_follow_plain_sampling():
    toy = Toy(3)
    p0 = toy.p(toy.l0[None])[0]
    pairs = p0[:, None] * toy.p(toy.l)
    samples = toy.first_two()
    assert tv(samples // V, p0) < tv_bound(N, V)
    assert tv(samples, pairs) < tv_bound(N, V * V)


def test_a_wrong_q_is_caught():
    toy = Toy(3)
    p0 = toy.p(toy.l0[None])[0]
    pairs = p0[:, None] * toy.p(toy.l)
    assert tv(toy.first_two(wrong_q=True), pairs) > 3 * tv_bound(N, V * V)


def test_greedy_rows_take_the_best_path():
    """At temperature 0 the selector takes each position's best score; no q."""
    toy = Toy(4)
    drafts, q = select_path(toy.draft_logits[None], toy.projected[None], torch.tensor([2]), toy.pred, toy.succ,
                            TOP_K, [0.0], [0], [0])
    assert q is None
    prev = 2
    for i in range(K):
        unary, cand = torch.topk(toy.draft_logits[i], TOP_K)
        scores = unary + (toy.pred[prev] * toy.projected[i]) @ toy.succ[cand].T
        prev = int(cand[scores.argmax()])
        assert int(drafts[0, i]) == prev
