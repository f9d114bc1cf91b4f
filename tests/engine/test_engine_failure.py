"""Engine-level failures are loud: every in-flight request receives EngineFailure, the engine stops
accepting and its worker exits. Request-level problems never take this path."""

from __future__ import annotations

import pytest
from ninfer.contracts.errors import EngineFailure
from ninfer.contracts.events import GenerationError
from ninfer.contracts.frontend import OutputPreview
from ninfer.contracts.sampling import SamplingParams

from .conftest import worker_threads
from .doubles import ToyFrontend, ToySession
from .streams import check_stream

LONG = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, seed=0)


def assert_failed(engine, handles, match):
    for h in handles:
        terminal = check_stream(list(h))
        assert isinstance(terminal, GenerationError) and isinstance(terminal.error, EngineFailure)
        assert match in str(terminal.error)
    with pytest.raises(EngineFailure):
        engine.submit([2])
    engine.close(timeout=30)
    assert not worker_threads()
    assert engine.stats().status == "failed"
    assert engine.failure is not None


@pytest.mark.parametrize("where", ["forward", "commit"])
def test_program_failure_fails_every_request(make_toy_engine, where):
    engine, program, _ = make_toy_engine(max_concurrency=2, queue_capacity=4)
    program.gate.clear()
    handles = [engine.submit([2 + i], sampling=LONG) for i in range(4)]  # 2 running, 2 waiting
    program.entered.wait(10)
    program.fail_on = where
    program.gate.set()
    assert_failed(engine, handles, "injected" if where == "forward" else "Program.commit")


def test_logits_that_are_not_fp32_are_an_engine_failure_naming_the_dtype(make_toy_engine):
    """The forward contract is fp32 logits (sampling, logprobs and greedy ties are defined on them): a Program that
    returns another dtype fails loudly instead of sampling from rounded logits."""
    import torch

    engine, program, _ = make_toy_engine(max_concurrency=2)
    forward = program.forward
    program.forward = lambda batch: forward(batch).to(torch.bfloat16)
    handles = [engine.submit([2], sampling=LONG)]
    assert_failed(engine, handles, "forward returned torch.bfloat16 logits; the contract is torch.float32")


class AcceptTooMany(ToySession):
    def preview(self, tokens):
        p = super().preview(tokens)
        return OutputPreview(len(tokens) + 1, p.finish_reason, p.deltas, p.stop_reason)


class AcceptNone(ToySession):
    def preview(self, tokens):
        p = super().preview(tokens)
        return OutputPreview(0, None, p.deltas, p.stop_reason)


class BrokenFrontend(ToyFrontend):
    def __init__(self, session_type):
        super().__init__()
        self.session_type = session_type

    def open_session(self, options):
        return self.session_type(options)


@pytest.mark.parametrize("session_type", [AcceptTooMany, AcceptNone])
def test_accepted_token_rule_violation_is_an_engine_failure(make_toy_engine, session_type):
    engine, program, _ = make_toy_engine(frontend=BrokenFrontend(session_type), max_concurrency=2)
    program.gate.clear()  # both requests are in before the first unit fails the engine
    handles = [engine.submit([2, 3], sampling=LONG), engine.submit([4], sampling=LONG)]
    program.gate.set()
    assert_failed(engine, handles, "accepted")
    # The failed batch was aborted, never committed: no ledger holds an unaccepted token.
    assert all(s.pending is None for s in program._seqs.values())
