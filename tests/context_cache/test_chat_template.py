"""Multi-turn reuse with the embedded default model and its real chat template (fp32, CPU): turn 2
re-renders turn 1's answer (reasoning stripped from history), yet its prefill drops by >= 90% and
its greedy tokens equal a cold run, with thinking on and off: with a 64-token checkpoint interval,
or with the default interval (the prefill chunk size) plus the Frontend's cache points at the end of turn 1's
system message and of its last complete message."""

from __future__ import annotations

import random

import pytest
from ninfer.contracts.sampling import SamplingParams

from .conftest import settled

WORDS = ("the module reads a file and returns its lines while the parser keeps every token of the "
         "input in order so that errors point at a line and a column of the source text").split()


def prose(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def message_boundaries(fe, prompt):
    """The second and last ``<|im_start|>`` of a chat prompt: the end of the system message, and the end of
    the last complete message, where the generation prompt (re-rendered differently in the next turn's
    history) starts."""
    (im_start,) = fe.encode("<|im_start|>")
    starts = [i for i, t in enumerate(prompt.token_ids) if t == im_start]
    return (starts[1], starts[-1])


@pytest.mark.parametrize("boundary", ["interval_64", "message_boundary"])
@pytest.mark.parametrize("thinking", [True, False])
def test_second_turn_with_the_real_template(default_artifact, thinking, boundary):
    from ninfer import Engine, EngineOptions

    rng = random.Random(7)
    # A 2.3k history: boundaries every 64 tokens, or the default 256 plus the message boundary.
    interval = 64 if boundary == "interval_64" else None
    engine = Engine.start(default_artifact, EngineOptions(
        device="cpu", dtype="float32", max_context=4096, max_concurrency=2, prefill_chunk_size=512,
        context_cache=True, cache_checkpoint_interval=interval))
    try:
        fe = engine.frontend
        greedy = SamplingParams(temperature=0.0, max_tokens=24, seed=0)
        msgs = [{"role": "system", "content": prose(rng, 150)}, {"role": "user", "content": prose(rng, 2000)}]
        p1 = fe.prepare_chat(msgs, enable_thinking=thinking)
        if boundary == "message_boundary":
            # The default interval is the chunk size; the Frontend marks the message boundaries itself.
            assert engine.options.checkpoint_interval == 512
            assert p1.cache_points == message_boundaries(fe, p1)
        r1 = engine.generate(p1, sampling=greedy)
        msgs2 = msgs + [{"role": "assistant", "content": r1.output.content, "reasoning_content": r1.output.reasoning},
                        {"role": "user", "content": prose(rng, 20)}]
        p2 = fe.prepare_chat(msgs2, enable_thinking=thinking)
        n2 = len(p2.token_ids)
        assert len(p1.token_ids) > 2000
        before = settled(engine)
        r2 = engine.generate(p2, sampling=greedy)
        after = settled(engine)
        cold = engine.generate(p2, sampling=greedy, cache=False)
        assert r2.token_ids == cold.token_ids
        prefilled = after.prefill_tokens - before.prefill_tokens
        assert after.cache_hits == before.cache_hits + 1
        assert prefilled <= 0.1 * n2, (prefilled, n2)
        print(f"{boundary} thinking={thinking}: turn 1 {len(p1.token_ids)} tokens, turn 2 {n2}, prefilled {prefilled}")
    finally:
        engine.close(timeout=60)
