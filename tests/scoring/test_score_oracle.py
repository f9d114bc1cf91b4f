"""Causal scoring against transformers on the same weights (fp32, CPU).

The oracle does not use the engine's window plan: for target ``x[i]`` it derives the history start
from the documented semantics in closed form (targets ``1..C`` see ``x[0..i-1]``; a later target
belongs to window ``k = ceil((i - C) / S)``, whose inputs start at ``min(C + 1 + kS, N) - 1 - C``) and
asks transformers for ``log_softmax`` of the full-sequence logits over ``x[begin..i-1]``.

Tolerance: fp32 on both sides, different kernels (paged attention, chunked GDN recurrence), so per
token ``|delta logprob| <= 5e-5`` and ``|delta perplexity| / perplexity <= 1e-5`` (measured maxima:
1.8e-5 and 1.7e-6 at perplexities of 340..530; see docs/scoring.md).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from .conftest import start_scorer

LOGPROB_ATOL = 5e-5
PPL_RTOL = 1e-5


def history_begin(i: int, n: int, context: int, stride: int) -> int:
    if i <= context:
        return 0
    k = -(-(i - context) // stride)
    return min(context + 1 + k * stride, n) - 1 - context


def hf_logprobs(hf, tokens: list[int], context: int, stride: int, top_k: int = 0):
    """``{i: (logprob of x[i], [(id, logprob)] top_k)}`` for every target, one HF forward per distinct
    history start (a causal forward over ``x[begin:last]`` serves every target that starts there)."""
    n = len(tokens)
    groups: dict[int, list[int]] = {}
    for i in range(1, n):
        groups.setdefault(history_begin(i, n, context, stride), []).append(i)
    out = {}
    with torch.no_grad():
        for begin, targets in groups.items():
            assert all(i - begin <= context for i in targets), "the oracle's history exceeds the context"
            ids = torch.tensor([tokens[begin:max(targets)]])
            lp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
            for i in targets:
                row = lp[i - 1 - begin]
                top = []
                if top_k:
                    vals, idx = torch.topk(row, top_k)
                    top = list(zip(idx.tolist(), vals.tolist(), strict=True))
                out[i] = (float(row[tokens[i]]), top)
    return out


def check_against_hf(hf, tokens, result, context, stride, top_k=0) -> float:
    """Assert one text's result equals the oracle; returns the max per-token |delta logprob|."""
    n = len(tokens)
    ref = hf_logprobs(hf, tokens, context, stride, top_k)
    assert result.input_tokens == n and result.scored_tokens == n - 1
    got = result.token_logprobs
    assert [t.token for t in got] == tokens[1:]
    err = max(abs(t.logprob - ref[i][0]) for i, t in zip(range(1, n), got, strict=True))
    assert err <= LOGPROB_ATOL, err
    ref_nll = -math.fsum(ref[i][0] for i in range(1, n))
    assert result.nll == pytest.approx(ref_nll, rel=PPL_RTOL)
    assert result.perplexity == pytest.approx(math.exp(ref_nll / (n - 1)), rel=PPL_RTOL)
    if top_k:
        for i, t in zip(range(1, n), got, strict=True):
            assert [tok for tok, _ in t.top] == [tok for tok, _ in ref[i][1]]
            assert max(abs(a - b) for (_, a), (_, b) in zip(t.top, ref[i][1], strict=True)) <= LOGPROB_ATOL
    return err


def tokens_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


@pytest.mark.parametrize("n, context, stride, windows", [
    (9, 16, 8, 1),     # shorter than one window
    (17, 16, 8, 1),    # exactly one window: 16 inputs (the whole KV), 16 targets
    (70, 16, 6, 10),   # many windows, stride < context: 10 inputs of context re-read per window
    (70, 16, 16, 5),   # many windows, stride == context: disjoint inputs
    (30, 8, 1, 22),    # stride 1: every later window scores one token
])
def test_dense_matches_transformers(scoring_model, n, context, stride, windows):
    m = scoring_model("dense")
    tokens = tokens_of(n * 100 + stride, n)
    with start_scorer(m.artifact) as engine:
        report = engine.score([tokens], context=context, stride=stride, logprobs=True)
    (text,) = report.texts
    assert text.windows == windows
    check_against_hf(m.hf, tokens, text, context, stride)
    assert report.overall.perplexity == text.perplexity


def test_moe_matches_transformers(scoring_model):
    m = scoring_model("moe")
    tokens = tokens_of(3, 50)
    with start_scorer(m.artifact) as engine:
        report = engine.score([tokens], context=16, stride=6, logprobs=True)
    check_against_hf(m.hf, tokens, report.texts[0], 16, 6)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunk_size_does_not_change_the_scores(scoring_model, chunk):
    """The windows are processed in prefill chunks (context-only chunks skip the LM head); any chunk
    size gives the oracle's numbers."""
    m = scoring_model("dense")
    tokens = tokens_of(5, 40)
    with start_scorer(m.artifact, prefill_chunk_size=chunk) as engine:
        report = engine.score([tokens], context=16, stride=5, logprobs=True)
    check_against_hf(m.hf, tokens, report.texts[0], 16, 5)


def test_top_logprobs_match_transformers(scoring_model):
    m = scoring_model("dense")
    tokens = tokens_of(8, 30)
    with start_scorer(m.artifact) as engine:
        report = engine.score([tokens], context=12, stride=7, logprobs=True, top_logprobs=4)
    check_against_hf(m.hf, tokens, report.texts[0], 12, 7, top_k=4)
    assert all(len(t.top) == 4 for t in report.texts[0].token_logprobs)


def test_several_texts_match_and_aggregate_token_weighted(scoring_model):
    """Texts never share history: each text's scores equal the oracle's on that text alone, and the
    overall figures are the token-weighted totals."""
    m = scoring_model("dense")
    texts = ["def f(x):\n    return x * 2\n", "hello", "The quick brown fox jumps over the lazy dog. " * 2]
    with start_scorer(m.artifact) as engine:
        report = engine.score(texts, context=16, stride=8, logprobs=True)
        encoded = [engine.frontend.encode(t) for t in texts]
    assert [t.input_tokens for t in report.texts] == [len(e) for e in encoded]
    for tokens, result in zip(encoded, report.texts, strict=True):
        check_against_hf(m.hf, tokens, result, 16, 8)
    o = report.overall
    assert o.scored_tokens == sum(len(e) - 1 for e in encoded)
    assert o.nll == pytest.approx(sum(t.nll for t in report.texts), rel=1e-12)
    assert o.perplexity == pytest.approx(math.exp(o.nll / o.scored_tokens), rel=1e-12)
