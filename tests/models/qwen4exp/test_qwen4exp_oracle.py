"""Oracle: our converted artifact + Program against transformers' ``Qwen4ExpForCausalLM``, fp32 on the CPU.

Logits of every position of a prompt must match transformers' within ``ATOL + RTOL * |ref|`` (both compute the same
fp32 maths in other summation orders: the GDN's chunked delta rule, paged attention's softmax, the fused GEMMs), for
the whole prompt in one chunk and in chunks whose boundaries cut n-gram windows and QSA blocks (3, 5, 7 tokens
against windows of 3-4 tokens and blocks of 2 or 4). Greedy decoding through the Program's decode rows must give
transformers' 32 tokens exactly, with per-step logits within the same tolerance. Every case's prompt holds EOS tokens,
where the n-gram windows restart.

The oracle's power is checked too: the models' logits are O(1) and varied, and removing what Qwen4-Exp adds (the PLE
table, the sparse selection, a hyper-connection stream's weights) moves the logits far beyond the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from .harness import CASES, Runner, hf_logits, make_program, prompt

ATOL, RTOL = 5e-4, 1e-4
STEPS = 32


def _program_logits(case, ids, chunks):
    program = make_program(case)
    run = Runner(program)
    seq = program.open_sequence(ids)
    out = []
    for n in chunks:
        assert program.reserve_units({seq: n})[seq]
        out.append(program.score_chunk(seq, n))
    program.release(seq)
    del run
    return torch.cat(out).float()


def _close(ours, ref, what):
    err = (ours - ref).abs()
    assert torch.all(err <= ATOL + RTOL * ref.abs()), f"{what}: max err {err.max().item():.3e}"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("chunks", [None, 3, 5, 7])
def test_logits_of_every_position_match_transformers(q4x_case, name, chunks):
    case = q4x_case(name)
    ids = prompt(seed=5, length=40, eos_every=13)
    sizes = [len(ids)] if chunks is None else [min(chunks, len(ids) - i) for i in range(0, len(ids), chunks)]
    _close(_program_logits(case, ids, sizes), hf_logits(case, ids), f"{name} chunks {chunks}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_decode_matches_transformers(q4x_case, name):
    case = q4x_case(name)
    ids = prompt(seed=9, length=17, eos_every=7)
    program = make_program(case)
    run = Runner(program)
    seq = program.open_sequence(ids)
    run.unit(chunks=[(seq, 6)])                               # a prefill in two chunks, then decode rows
    tokens = [run.unit(chunks=[(seq, len(ids) - 6)])[seq]]
    while len(tokens) < STEPS:
        tokens.append(run.unit(decode=[seq])[seq])
    ref = hf_logits(case, ids + tokens)[len(ids) - 1:-1]
    assert tokens == ref.argmax(dim=-1).tolist(), f"{name}: greedy tokens differ from transformers'"
    ours = torch.stack(run.logits[seq]).float()
    gaps = [float(torch.topk(r, 2).values.diff().abs()) for r in ref]
    print(f"\n{name}: max|err| {(ours - ref).abs().max():.2e}, min top-2 gap {min(gaps):.3f}")
    _close(ours, ref, f"{name} decode")


def test_the_random_models_are_not_degenerate(q4x_case):
    for name in CASES:
        logits = hf_logits(q4x_case(name), prompt(seed=3, length=24))
        assert logits.std() > 0.5, name
        assert len(set(logits.argmax(-1).tolist())) > 4, name


def _mutated(case, ids, mutate_weights=None, config=None):
    weights = dict(case.weights)
    if mutate_weights is not None:
        weights = mutate_weights(weights)
    saved, case.weights = case.weights, weights
    try:
        program = make_program(case, config=config)
    finally:
        case.weights = saved
    seq = program.open_sequence(ids)
    assert program.reserve_units({seq: len(ids)})[seq]
    return program.score_chunk(seq, len(ids)).float()


def test_what_qwen4exp_adds_is_visible_in_the_logits(q4x_case):
    """The oracle has power over PLE, QSA's selection and the hyper-connections: each mutation moves the logits."""
    case = q4x_case("sparse")
    ids = prompt(seed=5, length=40, eos_every=13)
    ref = hf_logits(case, ids)

    def moved(logits):
        return (logits - ref).abs().max().item()

    no_ple = _mutated(case, ids, lambda w: {k: (torch.zeros_like(v) if k.endswith("ple/table") else v)
                                            for k, v in w.items()})
    assert moved(no_ple) > 0.05
    dense = _mutated(case, ids, config=dict(case.config, indexer_budget=1024))
    assert moved(dense) > 0.05
    assert (dense[:5] - ref[:5]).abs().max() < ATOL   # up to 5 positions the selection keeps every key: dense
    one_stream = _mutated(case, ids, lambda w: {k: (v.clone().index_fill_(0, torch.arange(32), 0.0)
                                                    if k.endswith("attn_hc/norm") else v) for k, v in w.items()})
    assert moved(one_stream) > 0.05
