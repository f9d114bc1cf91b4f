"""SequenceProgram.score_chunk: all-position logits outside the commit protocol, and its preconditions."""

from __future__ import annotations

import pytest
import torch
from ninfer.contracts.options import EngineOptions
from ninfer.contracts.program import ExecutionUnit, PrefillChunk, ProgramError, RowSampling
from ninfer.contracts.sampling import SamplingParams
from ninfer.engine.model_construction import build_model

TOKENS = [5, 80, 17, 200, 33, 33, 9, 120, 64, 7]


@pytest.fixture(scope="module")
def program(scoring_model):
    options = EngineOptions(device="cpu", dtype="float32", max_context=16, page_size=4, max_concurrency=2)
    return build_model(scoring_model("dense").artifact, options).program


def fresh(program, tokens=TOKENS):
    seq = program.open_sequence(tokens)
    assert program.reserve_units({seq: len(tokens)})[seq]
    return seq


def test_rows_are_every_position_and_chunking_does_not_matter(program):
    seq = fresh(program)
    whole = program.score_chunk(seq, len(TOKENS))
    program.release(seq)
    assert whole.dtype == torch.float32 and tuple(whole.shape) == (len(TOKENS), program.vocab_size)
    seq = fresh(program)
    parts = [program.score_chunk(seq, n) for n in (3, 1, 4, 2)]
    program.release(seq)
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)


def test_logits_equal_what_sampling_sees(program):
    """The last row of a score chunk is the distribution a prefill chunk samples from."""
    seq = fresh(program)
    rows = program.score_chunk(seq, len(TOKENS))
    program.release(seq)
    seq = fresh(program)
    sampling = RowSampling(SamplingParams(temperature=0.0, logprobs=True), seed=0, step=0)
    pending = program.run(ExecutionUnit(chunks=(PrefillChunk(seq, len(TOKENS), sampling),)))
    (row,) = pending.rows
    program.abort_pending(pending)
    program.release(seq)
    last = torch.log_softmax(rows[-1], dim=-1)
    assert row.tokens[0] == int(last.argmax())
    assert row.logprobs[0].logprob == pytest.approx(float(last.max()), abs=1e-5)


def test_context_only_chunks_skip_the_head_and_keep_the_state(program):
    seq = fresh(program)
    assert program.score_chunk(seq, 6, logits=False) is None
    tail = program.score_chunk(seq, 4)
    program.release(seq)
    seq = fresh(program)
    whole = program.score_chunk(seq, len(TOKENS))
    program.release(seq)
    torch.testing.assert_close(tail, whole[6:], atol=1e-5, rtol=1e-5)


def test_preconditions(program):
    seq = program.open_sequence(TOKENS)
    with pytest.raises(ProgramError, match="no KV reserved"):
        program.score_chunk(seq, 4)
    assert program.reserve_units({seq: len(TOKENS)})[seq]
    for bad in (0, -1, len(TOKENS) + 1, True, 2.0):
        with pytest.raises(ProgramError, match="exceed its ledger"):
            program.score_chunk(seq, bad)
    assert program.computed(seq) == 0
    program.score_chunk(seq, len(TOKENS))
    assert program.computed(seq) == len(TOKENS)
    with pytest.raises(ProgramError, match="no next input"):  # the state covers the whole ledger
        program.score_chunk(seq, 1)
    program.release(seq)
    assert program.capacity().free_pages == program.capacity().total_pages


def test_refused_while_a_pending_batch_is_unconsumed(program):
    seq = fresh(program)
    sampling = RowSampling(SamplingParams(temperature=0.0), seed=0, step=0)
    pending = program.run(ExecutionUnit(chunks=(PrefillChunk(seq, len(TOKENS), sampling),)))
    with pytest.raises(ProgramError, match="unconsumed pending batch"):
        program.score_chunk(seq, 1)
    program.abort_pending(pending)
    program.release(seq)
