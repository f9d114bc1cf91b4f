"""The context cache through the public Engine: hits give exactly the cold tokens (fp32, CPU)."""

from __future__ import annotations

import random

from ninfer.runtime.contract.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, seed=1)


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


def test_second_turn_hits_and_equals_cold(make_engine):
    rng = random.Random(1)
    turn1 = toks(rng, 100)
    cold = make_engine(max_context=512, max_concurrency=2, prefill_chunk_size=64)
    warm = make_engine(max_context=512, max_concurrency=2, prefill_chunk_size=64, context_cache=True,
                       cache_checkpoint_interval=32)
    r1 = warm.generate(turn1, sampling=GREEDY)
    assert r1.token_ids == cold.generate(turn1, sampling=GREEDY).token_ids
    s = warm.stats()
    assert s.cache_checkpoints == 5  # boundaries 32, 64, 96, the prompt end 100, the response end 107
    turn2 = turn1 + list(r1.token_ids) + toks(rng, 20)
    before = warm.stats().prefill_tokens
    r2 = warm.generate(turn2, sampling=GREEDY)
    assert r2.token_ids == cold.generate(turn2, sampling=GREEDY).token_ids
    s = warm.stats()
    assert s.cache_hits == 1 and s.cache_hit_tokens == 107
    assert s.prefill_tokens - before == len(turn2) - 107
