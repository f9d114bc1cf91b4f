"""Rejection-sampling acceptance (ninfer.program.speculation.rejection_acceptance) is distribution-exact.

A toy "model" over V = 5 tokens: the target's next-token distribution is P0 at the first position and
P[x] after token x; the drafter's is Q0 and Q[x] (or a deterministic drafter: D0 first, then D[x]). One
speculative step per row drafts k tokens from the drafter, gives the rule the target's p at positions 0..k
(P0, then P[d_i]: the target conditions on the drafts) and the drafter's q, and seeded uniforms. Many
independent rows (one tensor call) give samples of the committed tokens.

Statistic and bound: the total-variation distance between the empirical distribution of N samples over C
categories and the true one. By the Bretagnolle-Huber-Carol inequality,
P(sum_j |N_j - N p_j| >= 2 sqrt(N) lam) <= 2^C exp(-2 lam^2); with TV = sum_j |N_j / N - p_j| / 2 and
t = lam / sqrt(N): P(TV >= t) <= 2^C exp(-2 N t^2). The test fails when TV >= t with
t = sqrt((C ln 2 + ln(1 / delta)) / (2 N)), so a correct rule fails with probability at most delta = 1e-6
(the draws are seeded, so a run is deterministic anyway). Checked: the first committed token against P0
(C = 5), and the first two committed tokens against P0(x) P[x](y) (C = 25; a row that committed one token
takes its second from a second speculative step whose first target position is P[x]). Negative checks: a
rule that accepts every draft, and the one-hot rule applied to a stochastic drafter, are caught by the same
statistic.
"""

import math

import pytest
import torch
from ninfer.ops.reference.sampling import hash_uniform, sample
from ninfer.program.speculation import Acceptance, _gumbel_argmax, rejection_acceptance

V = 5
N = 200_000
DELTA = 1e-6


def tv_bound(n: int, categories: int) -> float:
    return math.sqrt((categories * math.log(2) + math.log(1 / DELTA)) / (2 * n))


def tv(samples: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    return float((counts / samples.numel() - expected.flatten().double()).abs().sum() / 2)


def dist(gen: torch.Generator, *shape: int) -> torch.Tensor:
    w = torch.rand(*shape, V, generator=gen, dtype=torch.float64) + 0.05
    return w / w.sum(dim=-1, keepdim=True)


class Toy:
    """Target (P0, P) and drafter (Q0, Q) or deterministic drafter (D0, D); see the module docstring."""

    def __init__(self, p0, p, q0=None, q=None, d0=None, d=None):
        self.p0, self.p, self.q0, self.q, self.d0, self.d = p0, p, q0, q, d0, d

    def step(self, gen, first_p, first_q, first_d, k, *, num_drafts=None, q_mode="given", rule=None):
        """One speculative step of len(first_p) rows; ``first_*``: the rows' first-position distributions."""
        rows = first_p.shape[0]
        drafts = torch.empty(rows, k, dtype=torch.int64)
        qs = torch.empty(rows, k, V, dtype=torch.float64)
        for i in range(k):
            if self.q is not None:
                qs[:, i] = first_q if i == 0 else self.q[drafts[:, i - 1]]
                drafts[:, i] = torch.multinomial(qs[:, i], 1, generator=gen)[:, 0]
            else:
                drafts[:, i] = first_d if i == 0 else self.d[drafts[:, i - 1]]
                qs[:, i] = torch.nn.functional.one_hot(drafts[:, i], V).double()
        ps = torch.cat([first_p[:, None], self.p[drafts]], dim=1)
        noise = torch.rand(rows, k + 1, V, generator=gen, dtype=torch.float64)
        accept_u = torch.rand(rows, k, generator=gen, dtype=torch.float64)
        if rule is not None:
            return rule(ps, drafts, noise, qs, accept_u)
        q = None if q_mode == "none" else qs
        return rejection_acceptance(ps, drafts, noise, q=q, accept_u=accept_u, num_drafts=num_drafts)

    def first_step(self, gen, rows, k, **kw):
        first_q = None if self.q0 is None else self.q0.expand(rows, V)
        first_d = None if self.d0 is None else torch.full((rows,), self.d0, dtype=torch.int64)
        return self.step(gen, self.p0.expand(rows, V), first_q, first_d, k, **kw)

    def first_two(self, gen, rows, k, **kw) -> torch.Tensor:
        """Samples of (first, second) committed token as x * V + y."""
        out = self.first_step(gen, rows, k, **kw)
        first, second = out.tokens[:, 0], out.tokens[:, 1].clone()
        short = out.accepted == 0
        x = first[short]
        first_q = None if self.q is None else self.q[x]
        first_d = None if self.d is None else self.d[x]
        if kw.get("num_drafts") is not None:
            kw = {**kw, "num_drafts": kw["num_drafts"][short]}
        again = self.step(gen, self.p[x], first_q, first_d, k, **kw)
        second[short] = again.tokens[:, 0]
        return first * V + second

    def joint(self) -> torch.Tensor:
        return self.p0[:, None] * self.p


def toys() -> dict[str, Toy]:
    gen = torch.Generator().manual_seed(7)
    p0, p, q0, q = dist(gen), dist(gen, V), dist(gen), dist(gen, V)
    # Zero target mass where the drafter has plenty: the residual must never draw those tokens.
    holes = p0.clone()
    holes[[1, 3]] = 0.0
    holes /= holes.sum()
    p_holes = p.clone()
    p_holes[:, 0] = 0.0
    p_holes /= p_holes.sum(dim=-1, keepdim=True)
    q_heavy = q0.clone()
    q_heavy[[1, 3]] += 1.0
    q_heavy /= q_heavy.sum()
    # A deterministic drafter that proposes a token the target never emits (0 after P_holes) at times.
    d0, d = 2, torch.tensor([1, 0, 4, 2, 0])
    return {
        "random": Toy(p0, p, q0, q),
        "q_mass_where_p_has_none": Toy(holes, p_holes, q_heavy, q),
        "p_equals_q": Toy(p0, p, p0, p),
        "one_hot": Toy(holes, p_holes, d0=d0, d=d),
    }


# (toy, how q is passed): "given" passes the drafter's q tensor (one-hot for the deterministic drafter),
# "none" passes q=None, the deterministic drafter's form.
CASES = [("random", "given"), ("q_mass_where_p_has_none", "given"), ("p_equals_q", "given"),
         ("one_hot", "given"), ("one_hot", "none")]


@pytest.mark.parametrize("name,q_mode", CASES)
def test_first_token_follows_p(name, q_mode):
    toy = toys()[name]
    gen = torch.Generator().manual_seed(11)
    out = toy.first_step(gen, N, 2, q_mode=q_mode)
    assert tv(out.tokens[:, 0], toy.p0) < tv_bound(N, V)


@pytest.mark.parametrize("name,q_mode", CASES)
def test_first_two_tokens_follow_p_and_its_conditional(name, q_mode):
    toy = toys()[name]
    gen = torch.Generator().manual_seed(12)
    pairs = toy.first_two(gen, N, 2, q_mode=q_mode)
    assert tv(pairs, toy.joint()) < tv_bound(N, V * V)


def test_per_row_draft_counts_keep_the_distribution():
    toy = toys()["random"]
    gen = torch.Generator().manual_seed(13)
    num = torch.randint(0, 4, (N,), generator=gen)
    out = toy.first_step(gen, N, 3, num_drafts=num)
    assert bool((out.accepted <= num).all())
    assert tv(out.tokens[:, 0], toy.p0) < tv_bound(N, V)
    pairs = toy.first_two(gen, N, 3, num_drafts=num)
    assert tv(pairs, toy.joint()) < tv_bound(N, V * V)


def accept_always(ps, drafts, noise, qs, accept_u):
    """A wrong rule: every draft is committed, then a bonus from p_k."""
    k = drafts.shape[1]
    bonus = _gumbel_argmax(ps[:, k], noise[:, k])
    return Acceptance(accepted=torch.full((drafts.shape[0],), k), tokens=torch.cat([drafts, bonus[:, None]], 1))


def resample_from_p(ps, drafts, noise, qs, accept_u):
    """A wrong rule: the right acceptance test, but a rejection draws from p_n instead of the residual."""
    right = rejection_acceptance(ps, drafts, noise, q=qs, accept_u=accept_u)
    n = right.accepted
    rows = torch.arange(drafts.shape[0])
    added = _gumbel_argmax(ps[rows, n], noise[rows, n])
    return Acceptance(accepted=n, tokens=right.tokens.scatter(1, n[:, None], added[:, None]))


@pytest.mark.parametrize("rule", [accept_always, resample_from_p])
def test_the_statistic_catches_wrong_rules(rule):
    toy = toys()["random"]
    gen = torch.Generator().manual_seed(14)
    first = toy.first_step(gen, N, 2, rule=rule).tokens[:, 0]
    assert tv(first, toy.p0) > 3 * tv_bound(N, V)
    pairs = toy.first_two(gen, N, 2, rule=rule)
    assert tv(pairs, toy.joint()) > 3 * tv_bound(N, V * V)


def test_one_hot_rule_is_exact_for_a_sampling_drafter_too():
    """q=None commits plain draws from p whatever proposed the drafts (a draft only decides how many of
    them one step commits), so it is exact for a drafter that samples from q as well, accepting less."""
    toy = toys()["random"]
    gen = torch.Generator().manual_seed(17)
    out = toy.first_step(gen, N, 2, q_mode="none")
    assert tv(out.tokens[:, 0], toy.p0) < tv_bound(N, V)
    pairs = toy.first_two(gen, N, 2, q_mode="none")
    assert tv(pairs, toy.joint()) < tv_bound(N, V * V)
    with_q = toy.first_step(torch.Generator().manual_seed(17), N, 2)
    assert out.accepted.double().mean() < with_q.accepted.double().mean()


def test_one_hot_rule_commits_what_plain_sampling_draws():
    """With q None and the ``sample`` op's seeded noise, every committed token is the token the op draws at
    that step from the same distribution (temperature 1): speculation does not change a seeded request."""
    gen = torch.Generator().manual_seed(15)
    rows, k, vocab = 64, 4, 50
    logits = torch.randn(rows, k + 1, vocab, generator=gen) * 2
    plain = torch.stack([sample(logits[:, i], torch.ones(rows), torch.zeros(rows, dtype=torch.int32),
                                torch.ones(rows), torch.zeros(rows), torch.arange(rows), torch.full((rows,), 9 + i))
                         for i in range(k + 1)], dim=1)
    # Drafts agree with the plain draws most of the time, so long prefixes occur.
    agree = torch.rand(rows, k, generator=gen) < 0.8
    drafts = torch.where(agree, plain[:, :k], torch.randint(0, vocab, (rows, k), generator=gen))
    noise = torch.stack([hash_uniform(torch.arange(rows), torch.full((rows,), 9 + i), vocab) for i in range(k + 1)], 1)
    out = rejection_acceptance(torch.softmax(logits.double(), -1), drafts, noise)
    assert len(set(out.accepted.tolist())) == k + 1
    for r, committed in enumerate(out.to_host()):
        assert committed == plain[r, :len(committed)].tolist()


@pytest.mark.parametrize("q_mode", ["given", "none"])
def test_draws_read_are_the_documented_ones(q_mode):
    """Changing draws the docstring says are unread changes nothing; changing the added token's noise does."""
    gen = torch.Generator().manual_seed(16)
    rows, k = 4000, 3
    toy = toys()["random"]
    p = torch.cat([toy.p0.expand(rows, 1, V), dist(gen, rows, k)], dim=1)
    q = dist(gen, rows, k) if q_mode == "given" else None
    drafts = torch.randint(0, V, (rows, k), generator=gen)
    num = torch.randint(0, k + 1, (rows,), generator=gen)
    noise = torch.rand(rows, k + 1, V, generator=gen, dtype=torch.float64)
    accept_u = torch.rand(rows, k, generator=gen, dtype=torch.float64)
    base = rejection_acceptance(p, drafts, noise, q=q, accept_u=accept_u, num_drafts=num)
    n = base.accepted
    pos = torch.arange(k + 1)
    fresh = torch.rand(rows, k + 1, V, generator=gen, dtype=torch.float64)
    fresh_u = torch.rand(rows, k, generator=gen, dtype=torch.float64)
    unread_noise = torch.where((pos[None, :] > n[:, None])[:, :, None], fresh, noise)
    read_u = pos[None, :k] <= torch.minimum(n, num - 1)[:, None]
    unread_u = torch.where(read_u, accept_u, fresh_u)
    same = rejection_acceptance(p, drafts, unread_noise, q=q, accept_u=unread_u, num_drafts=num)
    assert torch.equal(same.tokens, base.tokens)
    at_n = torch.where((pos[None, :] == n[:, None])[:, :, None], fresh, noise)
    changed = rejection_acceptance(p, drafts, at_n, q=q, accept_u=accept_u, num_drafts=num)
    assert not torch.equal(changed.tokens, base.tokens)


def test_bad_inputs_are_named():
    drafts = torch.zeros(2, 3, dtype=torch.int64)
    p = torch.full((2, 4, V), 1 / V)
    with pytest.raises(ValueError, match=r"noise must have shape \[2, 4, 5\]"):
        rejection_acceptance(p, drafts, torch.rand(2, 3, V))
    with pytest.raises(ValueError, match="accept_u"):
        rejection_acceptance(p, drafts, torch.rand(2, 4, V), q=torch.full((2, 3, V), 1 / V))
    with pytest.raises(ValueError, match=r"q must have shape \[2, 3, 5\]"):
        rejection_acceptance(p, drafts, torch.rand(2, 4, V), q=p, accept_u=torch.rand(2, 3))
