"""Multi-turn reuse (issue 11 C): an 8k-token turn 1, then turn 2 = turn 1's history re-rendered plus
a new user message. Turn 2's prefill must drop by at least 90% and its tokens must equal a cold run
(fp32, CPU), whether the history keeps the generated tokens exactly or the template re-renders them
(reasoning stripped, empty think block dropped). Prompts are built at the token level the way a
ChatML template lays them out, with the tiny model's byte tokenizer ids."""

from __future__ import annotations

import random

import pytest
from ninfer.contracts.sampling import SamplingParams

from .conftest import END_THINK, IM_END, IM_START, THINK, settled

NL = 10


def text(s: str) -> list[int]:
    return list(s.encode())


def turn(role: str, body: list[int]) -> list[int]:
    return [IM_START] + text(role + "\n") + body + [IM_END, NL]


def generation_prompt(mode: str) -> list[int]:
    head = [IM_START] + text("assistant\n")
    return head + ([THINK, NL, NL, END_THINK, NL, NL] if mode == "no_think" else [THINK, NL])


def history_answer(mode: str, output: list[int]) -> list[int]:
    """How turn 2 renders turn 1's answer: ``exact`` keeps the generation prompt and the generated
    tokens as they were; the other modes drop the think part (the first difference right after
    ``assistant\\n``)."""
    if mode == "exact":
        return output + [IM_END, NL] if output[-1:] != [IM_END] else output + [NL]
    return [IM_START] + text("assistant\n") + output + [IM_END, NL]


def body(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, seed=0)


@pytest.mark.parametrize("mode", ["exact", "stripped", "no_think"])
def test_8k_second_turn_reuses_turn_one(make_engine, mode):
    rng = random.Random(11)
    system = turn("system", body(rng, 300))
    turn1 = system + turn("user", body(rng, 7900)) + generation_prompt(mode)
    assert len(turn1) > 8192
    # Two requests' worth of pages, so the cold run below fits beside the cached turn 1.
    engine = make_engine(max_context=9000, max_concurrency=2, prefill_chunk_size=512, context_cache=True,
                         cache_checkpoint_slots=8)
    r1 = engine.generate(turn1, sampling=GREEDY)
    output = list(r1.token_ids)
    if mode == "exact":
        turn2 = turn1 + history_answer(mode, output) + turn("user", body(rng, 40)) + generation_prompt(mode)
    else:
        turn2 = system + turn1[len(system):len(turn1) - len(generation_prompt(mode))] + \
            history_answer(mode, output) + turn("user", body(rng, 40)) + generation_prompt(mode)
    before = settled(engine)
    r2 = engine.generate(turn2, sampling=GREEDY)
    after = settled(engine)
    cached_prefill = after.prefill_tokens - before.prefill_tokens
    # The cold run: the same engine, the request kept out of the cache (it binds and publishes nothing).
    cold = engine.generate(turn2, sampling=GREEDY, cache=False)
    final = settled(engine)
    assert final.prefill_tokens - after.prefill_tokens == len(turn2)
    assert final.cache_hits == after.cache_hits and final.cache_checkpoints == after.cache_checkpoints
    assert r2.token_ids == cold.token_ids
    assert after.cache_hits == before.cache_hits + 1
    assert cached_prefill <= 0.1 * len(turn2), (mode, cached_prefill, len(turn2))
    assert after.cache_saved_prefill_tokens - before.cache_saved_prefill_tokens == len(turn2) - cached_prefill
    print(f"{mode}: turn 2 has {len(turn2)} tokens, prefilled {cached_prefill} with the cache")


def test_shared_system_prompt_is_reused(make_engine):
    rng = random.Random(12)
    system = turn("system", body(rng, 700))
    a = system + turn("user", body(rng, 300)) + generation_prompt("thinking")
    b = system + turn("user", body(rng, 200)) + generation_prompt("thinking")
    engine = make_engine(max_context=2048, max_concurrency=2, prefill_chunk_size=256, context_cache=True,
                         cache_checkpoint_interval=128)
    ra = engine.generate(a, sampling=GREEDY)
    before = settled(engine)
    rb = engine.generate(b, sampling=GREEDY)
    after = settled(engine)
    hit = after.cache_hit_tokens - before.cache_hit_tokens
    assert len(system) - 128 < hit <= len(system)
    assert after.prefill_tokens - before.prefill_tokens == len(b) - hit
    cold = make_engine(max_context=2048, max_concurrency=2, prefill_chunk_size=256)
    assert ra.token_ids == cold.generate(a, sampling=GREEDY).token_ids
    assert rb.token_ids == cold.generate(b, sampling=GREEDY).token_ids
