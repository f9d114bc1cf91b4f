"""The Program's all-greedy fast path and ``precomputed_greedy`` (the hook a decode graph answers with the
tokens it computed in the same replay): consulted with the forward's very logits tensor, its tokens are the
step's; rows whose logits were processed (penalties) or that sample at a temperature never use it. On the CPU
(no graphs) the hook is replaced by one that answers with recognisably different tokens, so the test sees which
path drew each token."""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.program import DecodeRow, ExecutionUnit, RowSampling
from ninfer.contracts.sampling import SamplingParams

from .harness import GREEDY, Runner, make_program, prompt


@pytest.fixture(scope="module")
def dense(qwen_case):
    return qwen_case("dense")


def ready_for_a_decode_step(dense):
    """A Program holding one prefilled sequence with one decode unit reserved: (program, sequence)."""
    prog = make_program(dense)
    run = Runner(prog)
    seq = run.open(prompt(7, 6))
    run.prefill(seq)
    prog.reserve_units({seq: 1})
    return prog, seq


def step_with_hook(dense, sampling: RowSampling) -> tuple[int, int, list[bool], int]:
    """One decode step of one sequence: (the token drawn, the plain argmax of its logits, the hook's answers
    (True: it answered, for the forward's own tensor), the vocabulary size)."""
    prog, seq = ready_for_a_decode_step(dense)
    last: dict[str, torch.Tensor] = {}
    answered: list[bool] = []
    forward = prog.forward

    def recording_forward(batch):
        last["logits"] = forward(batch)
        return last["logits"]

    def hook(logits):
        mine = logits is last.get("logits")
        answered.append(mine)
        # A recognisably different token: the argmax shifted by one (a real graph's would be the argmax).
        return (torch.argmax(logits, dim=-1) + 1) % prog.vocab_size if mine else None

    prog.forward = recording_forward
    prog.precomputed_greedy = hook
    pending = prog.run(ExecutionUnit(decode=(DecodeRow(seq, sampling),)))
    token = pending.row(seq).tokens[0]
    return token, int(torch.argmax(last["logits"][0])), answered, prog.vocab_size


def test_greedy_rows_take_the_precomputed_tokens(dense):
    token, argmax, answered, vocab = step_with_hook(dense, GREEDY)
    assert answered == [True]
    assert token == (argmax + 1) % vocab


def test_processed_or_sampled_rows_never_use_it(dense):
    penalised = RowSampling(SamplingParams(temperature=0.0, repetition_penalty=1.3), seed=0, step=0)
    _, _, answered, _ = step_with_hook(dense, penalised)
    assert answered == [False]          # consulted with the penalised copy: no answer, the argmax of that copy
    sampled = RowSampling(SamplingParams(temperature=0.8, seed=3), seed=3, step=0)
    token, _, answered, vocab = step_with_hook(dense, sampled)
    assert answered == []               # not consulted at all
    assert 0 <= token < vocab


def test_the_host_copy_of_precomputed_tokens_is_used_when_the_forward_made_one(dense):
    """A decode graph also stores its greedy tokens into pinned memory (``precomputed_host_tokens``): the step's
    token is then read from there (no copy of the device tokens), and only for the precomputed tensor itself."""
    prog, seq = ready_for_a_decode_step(dense)
    made: dict[str, torch.Tensor] = {}
    asked: list[bool] = []

    class Host:
        def values(self) -> list[int]:
            return [5]

    def hook(logits):
        made["tokens"] = torch.tensor([3])
        return made["tokens"]

    def host_hook(tokens):
        asked.append(tokens is made.get("tokens"))
        return Host() if asked[-1] else None

    prog.precomputed_greedy = hook
    prog.precomputed_host_tokens = host_hook
    pending = prog.run(ExecutionUnit(decode=(DecodeRow(seq, GREEDY),)))
    assert asked == [True]
    assert pending.row(seq).tokens == (5,)            # the host copy's answer, not the device tensor's 3
