"""Several prefills per step (issue 30): a unit carries the decode rows and the chunks of as many
prefilling requests as fit the step's token budget (``EngineOptions.max_step_tokens``).

- The budget holds: with decode rows in a unit, its tokens stay within ``max_step_tokens`` (decode rows
  count one each); without, within ``prefill_chunk``.
- No request starves: the rotation serves every prefilling request; a long prompt is chunked.
- Exact: a request's tokens are those of it alone whatever the packing, under preemption and Replay and
  with context-cache hits, on the toy LM (its sequential oracle) and on the tiny Qwen3.5 (fp32 reference
  ops, each request alone on a one-request engine).

A burst is made deterministic by holding the worker inside the first request's forward while the rest
are submitted: the next step then sees every request at once.
"""

from __future__ import annotations

import random
import threading

import pytest
from ninfer import Engine, EngineOptions
from ninfer.contracts.sampling import SamplingParams

from .doubles import reference_tokens
from .streams import check_stream

VOCAB = 48


def hold_forward(program, method: str = "forward") -> tuple[threading.Event, threading.Event]:
    """Gate ``program.<method>`` (``forward``, or ``run`` for a Program whose speculative decoding calls its
    model directly): returns (gate, entered); while ``gate`` is clear the worker waits inside its next call,
    after setting ``entered``."""
    gate, entered = threading.Event(), threading.Event()
    gate.set()
    call = getattr(program, method)

    def held(arg):
        entered.set()
        gate.wait(60)
        return call(arg)

    setattr(program, method, held)
    return gate, entered


def burst(engine: Engine, program, work, method: str = "forward") -> list[tuple[int, ...]]:
    """Submit ``work[0]``, hold the worker in its first ``program.<method>`` call, submit the rest, release;
    the tokens of each."""
    gate, entered = hold_forward(program, method)
    gate.clear()
    handles = [engine.submit(work[0][0], sampling=work[0][1])]
    assert entered.wait(60)
    handles += [engine.submit(p, sampling=sp) for p, sp in work[1:]]
    gate.set()
    return [check_stream(list(h), started=True).token_ids for h in handles]


def chunk_log(program) -> list[tuple[int, tuple[int, ...]]]:
    """Record (decode rows, the sequences of its chunks) for every unit ``program.run`` is given."""
    log: list[tuple[int, tuple[int, ...]]] = []
    run = program.run

    def logged(unit):
        log.append((len(unit.decode), tuple(c.seq for c in unit.chunks)))
        return run(unit)

    program.run = logged
    return log


# -- the toy LM: budget, fairness, exactness against the sequential oracle -------------------------------

def toy_work(lengths, seed: int, max_tokens: int = 12):
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        prompt = [rng.randrange(2, VOCAB) for _ in range(n)]
        if i % 2:
            sp = SamplingParams(temperature=0.9, top_k=8, max_tokens=max_tokens, seed=100 + i)
        else:
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=i)
        out.append((prompt, sp))
    return out


def oracle(work, max_context: int = 64) -> list[tuple[int, ...]]:
    return [tuple(reference_tokens(p, sp, vocab_size=VOCAB, max_context=max_context)) for p, sp in work]


def test_the_step_budget_holds_and_units_pack_several_chunks(make_toy_engine):
    engine, program, _ = make_toy_engine(max_concurrency=4, prefill_chunk_size=10, max_step_tokens=6,
                                         context_cache=False)
    work = toy_work([25, 3, 17, 2, 9, 30, 4, 12], seed=1)
    assert burst(engine, program, work) == oracle(work)
    engine.close()
    units = program.units
    assert units[0] == (0, (10,))  # the first request alone, no decode row: a whole prefill chunk
    for b, chunks in units:
        assert all(t >= 1 for t in chunks) and b + len(chunks) <= 4
        assert (b + sum(chunks) <= 6) if b else sum(chunks) <= 10, (b, chunks)
    assert any(b and len(chunks) >= 2 for b, chunks in units), "decode rows never shared a unit with two chunks"
    assert engine.stats().max_unit_chunks >= 2


def test_a_burst_is_admitted_and_prefilled_whole_in_one_step(make_toy_engine):
    # Eight requests arrive together: the step after the first request's prefill admits all seven others
    # and prefills them together (admission once took the head and the bypass allowance only, 3 a step).
    engine, program, _ = make_toy_engine(max_concurrency=8, prefill_chunk_size=64, max_step_tokens=64,
                                         context_cache=False)
    work = toy_work([5, 6, 4, 7, 5, 3, 6, 4], seed=5)
    assert burst(engine, program, work) == oracle(work)
    engine.close()
    assert program.units[0] == (0, (5,))
    assert program.units[1] == (1, (6, 4, 7, 5, 3, 6, 4)), program.units[:3]
    assert engine.stats().admitted == 8 and engine.stats().max_unit_chunks == 7


def test_decode_rows_filling_the_budget_leave_one_prefill_token(make_toy_engine):
    # max_step_tokens 1 is below the decode rows: every unit with decode rows still prefills one token.
    engine, program, _ = make_toy_engine(max_concurrency=4, prefill_chunk_size=8, max_step_tokens=1,
                                         context_cache=False)
    work = toy_work([6, 5, 7, 3, 9], seed=2)
    assert burst(engine, program, work) == oracle(work)
    assert all(sum(chunks) <= 1 for b, chunks in program.units if b)


def test_no_request_starves_and_a_long_prompt_is_chunked(make_toy_engine):
    # Two running places: the long prompt and a stream of short requests that each fill the step budget and
    # finish on their first token, so a newer short one is always waiting for a chunk. The rotation must
    # still serve the long prompt every other step.
    engine, program, _ = make_toy_engine(max_concurrency=2, prefill_chunk_size=4, max_step_tokens=4,
                                         context_cache=False)
    log = chunk_log(program)
    long = toy_work([24], seed=3, max_tokens=3)
    short = [(p, SamplingParams(temperature=0.0, max_tokens=1, seed=i)) for i, (p, _) in
             enumerate(toy_work([4] * 12, seed=5))]
    work = long + short
    assert burst(engine, program, work) == oracle(work)
    engine.close()
    stats = engine.stats()
    assert stats.finished == len(work) and stats.prefill_tokens == sum(len(p) for p, _ in work)
    long_seq = log[0][1][0]
    served = [i for i, (_, seqs) in enumerate(log) if long_seq in seqs]
    assert len(served) == 24 // 4  # chunked across steps
    # While it prefills, the long prompt waits at most max_concurrency - 1 units between its chunks.
    assert max(b - a for a, b in zip(served, served[1:], strict=False)) <= 2, served


def test_preempted_bursts_equal_the_oracle(make_toy_engine):
    engine, program, _ = make_toy_engine(program_kwargs=dict(num_pages=16, page_size=4), max_concurrency=8,
                                         prefill_chunk_size=8, max_step_tokens=6, context_cache=False)
    work = toy_work([20, 9, 14, 3, 11, 6, 17, 2], seed=4)
    assert burst(engine, program, work) == oracle(work)
    engine.close()
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.replay_tokens > 0 and stats.max_unit_chunks >= 2
    cap = program.capacity()
    assert cap.free_pages == cap.total_pages and cap.free_state_slots == cap.total_state_slots


# -- the tiny Qwen3.5: packing never changes a token ------------------------------------------------

def start(artifact, **options) -> Engine:
    options.setdefault("device", "cpu")
    options.setdefault("dtype", "float32")
    options.setdefault("max_context", 128)
    options.setdefault("page_size", 4)
    return Engine.start(artifact, EngineOptions(**options))


def qwen_work(lengths, seed: int, prefixes: dict[int, list[int]] | None = None):
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        prompt = (prefixes or {}).get(i, []) + [rng.randrange(0, 256) for _ in range(n)]
        if i % 2 == 0:
            sp = SamplingParams(temperature=0.0, max_tokens=10, seed=i)
        else:
            sp = SamplingParams(temperature=0.9, top_p=0.9, presence_penalty=0.5, max_tokens=10, seed=100 + i)
        out.append((prompt, sp))
    return out


BURST = [70, 3, 33, 9, 90, 2, 21, 48]  # some longer than the step budget and the prefill chunk


def alone(artifact, work) -> list[tuple[int, ...]]:
    with start(artifact, max_concurrency=1, prefill_chunk_size=128, context_cache=False) as engine:
        return [engine.generate(p, sampling=sp).token_ids for p, sp in work]


@pytest.fixture(scope="module")
def burst_reference(tiny_qwen_artifact):
    work = qwen_work(BURST, seed=7)
    return work, alone(tiny_qwen_artifact, work)


@pytest.mark.parametrize("options", [dict(prefill_chunk_size=32, max_step_tokens=12),
                                     dict(prefill_chunk_size=16, max_step_tokens=40)])
def test_qwen_burst_tokens_equal_alone(tiny_qwen_artifact, burst_reference, options):
    work, expected = burst_reference
    with start(tiny_qwen_artifact, max_concurrency=8, **options) as engine:
        assert burst(engine, engine._program, work) == expected  # noqa: SLF001
        stats = engine.stats()
        assert stats.max_unit_chunks >= 2 and stats.preemptions == 0


def test_qwen_preempted_burst_equals_alone(tiny_qwen_artifact, burst_reference):
    work, expected = burst_reference
    # 40 pages x 4 tokens: one full request fits, eight do not.
    with start(tiny_qwen_artifact, max_concurrency=8, prefill_chunk_size=16, max_step_tokens=12, num_pages=40,
               context_cache=False) as engine:
        assert burst(engine, engine._program, work) == expected  # noqa: SLF001
        engine.close()
        stats = engine.stats()
        assert stats.preemptions > 0 and stats.replay_tokens > 0 and stats.max_unit_chunks >= 2
        assert stats.pages_used == 0 and stats.state_slots_used == 0


def test_qwen_cache_hits_in_a_burst_equal_alone(tiny_qwen_artifact):
    first = qwen_work([30, 41, 12, 25], seed=8)
    # The burst: each of the first requests' prompts extended, and four new prompts.
    second = qwen_work([5, 9, 3, 14, 40, 7, 22, 2], seed=9, prefixes={i: first[i][0] for i in range(4)})
    expected = alone(tiny_qwen_artifact, first + second)
    with start(tiny_qwen_artifact, max_concurrency=8, prefill_chunk_size=16, max_step_tokens=12,
               context_cache=True) as engine:
        got = [engine.generate(p, sampling=sp).token_ids for p, sp in first]
        got += burst(engine, engine._program, second)  # noqa: SLF001
        stats = engine.stats()
    assert got == expected
    assert stats.cache_hits >= 4 and stats.max_unit_chunks >= 2
