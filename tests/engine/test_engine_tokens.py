"""A request's tokens do not depend on what it is batched with, on the chunk size, or on preemption
and Replay (docs/design.md section 8), checked against the toy LM's independent sequential oracle."""

from __future__ import annotations

import asyncio
import random

import pytest
from ninfer.contracts.events import GenerationDelta
from ninfer.contracts.frontend import OutputOptions
from ninfer.contracts.sampling import SamplingParams

from .doubles import EOS, reference_tokens, token_text
from .streams import check_stream, delta_text

VOCAB = 48


def workload(n: int, seed: int = 0, max_context: int = 64):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 30))]
        kind = i % 4
        if kind == 0:
            sp = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 25), seed=i)
        elif kind == 1:
            sp = SamplingParams(temperature=0.9, top_k=8, max_tokens=rng.randrange(1, 25), seed=1000 + i)
        elif kind == 2:
            sp = SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05, max_tokens=rng.randrange(1, 25), seed=7 * i)
        else:  # output-counting penalties must survive Replay (the prompt boundary is kept)
            sp = SamplingParams(temperature=0.7, presence_penalty=1.5, frequency_penalty=0.5,
                                repetition_penalty=1.3, max_tokens=rng.randrange(1, 25), seed=i)
        out.append((prompt, sp, reference_tokens(prompt, sp, vocab_size=VOCAB, max_context=max_context)))
    return out


CONFIGS = {
    "alone": dict(max_concurrency=1, prefill_chunk_size=64),
    "batched-chunk1": dict(max_concurrency=8, prefill_chunk_size=1),
    "batched-chunk5": dict(max_concurrency=8, prefill_chunk_size=5),
    "batched-chunk64": dict(max_concurrency=8, prefill_chunk_size=64),
    "preempted": dict(max_concurrency=8, prefill_chunk_size=5, program_kwargs=dict(num_pages=16, page_size=4)),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_tokens_match_the_oracle(make_toy_engine, config):
    opts = dict(CONFIGS[config])
    engine, program, _ = make_toy_engine(**opts)
    work = workload(24, seed=1)
    handles = [engine.submit(prompt, sampling=sp) for prompt, sp, _ in work]
    for (prompt, sp, expected), handle in zip(work, handles, strict=True):
        events = list(handle)
        result = check_stream(events, started=True)
        assert list(result.token_ids) == expected, f"{config}: prompt {prompt} {sp}"
        assert result.finish_reason == ("stop" if expected[-1] == EOS else "length")
        assert result.usage.prompt_tokens == len(prompt)
        # The session's text: every non-stop token, published once, in order (incl. the final flush).
        assert delta_text(events) == "".join(token_text(t) for t in expected if t != EOS)
    engine.close()
    stats = engine.stats()
    if config == "preempted":
        assert stats.preemptions > 0 and stats.resumes == stats.preemptions and stats.replay_tokens > 0
    else:
        assert stats.preemptions == 0
    if config == "batched-chunk1":
        assert max(b for b, _ in program.units) > 1, "decode rows were never batched"
        assert all(sum(c) <= 1 for _, c in program.units)
    cap = program.capacity()
    assert cap.free_pages == cap.total_pages and cap.free_state_slots == cap.total_state_slots
    assert stats.finished == len(work) and stats.outstanding == 0


def test_decode_batch_is_compact_and_chunks_fit_the_prefill_chunk(make_toy_engine):
    engine, program, _ = make_toy_engine(max_concurrency=4, prefill_chunk_size=3)
    work = workload(8, seed=2)
    handles = [engine.submit(p, sampling=sp) for p, sp, _ in work]
    for h in handles:
        h.result(timeout=60)
    engine.close()
    # Each unit: B decode rows (B <= max_concurrency, never padded) and chunks of <= 3 tokens together,
    # each of a request that is not a decode row.
    assert all(0 <= b <= 4 and b + len(c) <= 4 and sum(c) <= 3 and all(t >= 1 for t in c) and (b or c)
               for b, c in program.units)


def test_finish_reasons_and_stop_tokens(make_toy_engine):
    engine, _, _ = make_toy_engine(max_concurrency=2, max_context=40)
    prompt = [5, 6, 7]
    greedy = reference_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=30, seed=0),
                              vocab_size=VOCAB, max_context=40, stop_ids=())
    # length by max_tokens
    r = engine.generate(prompt, sampling=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, seed=0))
    assert r.finish_reason == "length" and list(r.token_ids) == greedy[:3]
    # a request stop token (from SamplingParams) ends with "stop" and names it; the token is accepted
    stop_at = greedy[2]
    r = engine.generate(prompt, sampling=SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                        stop_token_ids=(stop_at,), seed=0))
    first = greedy.index(stop_at)
    assert r.finish_reason == "stop" and r.stop_reason == stop_at and list(r.token_ids) == greedy[:first + 1]
    # the same through OutputOptions
    r = engine.generate(prompt, sampling=SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, seed=0),
                        output=OutputOptions(stop_token_ids=(stop_at,), ignore_eos=True))
    assert list(r.token_ids) == greedy[:first + 1]
    # length by max_context: the ledger never exceeds it
    long_prompt = [3] * 37
    r = engine.generate(long_prompt, sampling=SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                             seed=0))
    assert r.finish_reason == "length" and len(r.token_ids) == 40 - 37


def test_logprobs_are_published_with_their_tokens(make_toy_engine):
    engine, _, _ = make_toy_engine(max_concurrency=2)
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=3, seed=0)
    with engine.submit([4, 5, 6], sampling=sp) as h:
        events = list(h)
    deltas = [e for e in events if isinstance(e, GenerationDelta) and e.token_ids]
    assert deltas
    for d in deltas:
        assert d.logprobs is not None and len(d.logprobs) == len(d.token_ids)
        for tok, lp in zip(d.token_ids, d.logprobs, strict=True):
            assert lp.token == tok and lp.logprob <= 0.0 and len(lp.top) == 3
            assert lp.top[0][0] == tok  # greedy: the chosen token is the most likely one
    plain = engine.generate([4, 5, 6], sampling=SamplingParams(temperature=0.0, max_tokens=2, seed=0))
    assert plain.token_ids  # and without logprobs the deltas carry none:
    with engine.submit([4, 5, 6], sampling=SamplingParams(temperature=0.0, max_tokens=2, seed=0)) as h:
        assert all(e.logprobs is None for e in h if isinstance(e, GenerationDelta))


def test_model_sampling_defaults_apply_when_the_request_has_none(make_toy_engine):
    from .doubles import ToyFrontend

    engine, _, _ = make_toy_engine(frontend=ToyFrontend(VOCAB, defaults={"temperature": 0.0, "unknown": 1}))
    assert engine.sampling_params(max_tokens=4).temperature == 0.0
    prompt = [9, 8, 7]
    expected = reference_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=256, seed=0), vocab_size=VOCAB,
                                max_context=64)
    assert list(engine.generate(prompt).token_ids) == expected


def test_text_prompts_go_through_the_frontend(make_toy_engine):
    engine, _, frontend = make_toy_engine()
    sp = SamplingParams(temperature=0.0, max_tokens=4, seed=0)
    assert engine.generate("hi there", sampling=sp).token_ids == engine.generate(
        frontend.encode("hi there"), sampling=sp).token_ids


def test_async_consumers_of_concurrent_requests(make_toy_engine):
    engine, _, _ = make_toy_engine(max_concurrency=4)
    work = workload(6, seed=3)

    async def consume(prompt, sp):
        events = []
        async for e in engine.submit(prompt, sampling=sp):
            events.append(e)
        return events

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(consume(p, sp) for p, sp, _ in work)), timeout=60)

    for (_, _, expected), events in zip(work, asyncio.run(main()), strict=True):
        assert list(check_stream(events, started=True).token_ids) == expected


def test_output_penalties_survive_replay(make_toy_engine):
    """Presence/frequency penalties count output tokens only: a Replay resume must keep the prompt
    boundary (open_sequence's prompt_length), or the resumed request samples different tokens."""
    engine, _, _ = make_toy_engine(max_concurrency=8, prefill_chunk_size=5,
                                   program_kwargs=dict(num_pages=16, page_size=4))
    rng = random.Random(4)
    work = []
    for i in range(16):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 12))]
        sp = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0, max_tokens=30,
                            ignore_eos=True, seed=i)
        work.append((prompt, sp, reference_tokens(prompt, sp, vocab_size=VOCAB, max_context=64, stop_ids=())))
    handles = [engine.submit(p, sampling=sp) for p, sp, _ in work]
    for (_, _, expected), h in zip(work, handles, strict=True):
        assert list(h.result(60).token_ids) == expected
    engine.close()
    assert engine.stats().preemptions > 0 and engine.stats().replay_tokens > 0


def test_session_options_merge_request_and_prompt(make_toy_engine):
    from ninfer.contracts.frontend import PreparedPrompt

    engine, _, frontend = make_toy_engine()
    sp = SamplingParams(temperature=0.0, max_tokens=1, stop_token_ids=(7, 9), ignore_eos=True, seed=0)
    engine.generate(PreparedPrompt((4, 5), thinking_open=True), sampling=sp,
                    output=OutputOptions(stop_token_ids=(9, 11)))
    options = frontend.sessions[-1].options
    assert options.thinking_open and options.ignore_eos
    assert options.stop_token_ids == (9, 11, 7)
