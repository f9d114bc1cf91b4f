"""The MoE architecture through the whole Engine (issue 38 item 4): a tiny random Qwen3_5MoeForCausalLM
(8 experts, top-2, a shared expert), converted by our converter, served on the CPU in fp32.

- Oracle: a request's greedy tokens are transformers' argmax at every position (one teacher-forced forward).
- Packing never changes a token: a burst of 8 mixed greedy and sampled requests, with several prefills per step
  and prompts chunked across steps, gives each request the tokens it gets alone (one request, whole prompt, no
  context cache); so does a burst under forced preemption (Replay), and one whose prompts extend earlier
  prompts (context-cache hits). Routing is per token, so an expert's rows mixing several requests, chunk
  boundaries or a rebuilt prefix must not move a single token.
"""

from __future__ import annotations

import pytest
import torch

from .test_multi_prefill import alone, burst, qwen_work, start

MOE_TEXT = dict(vocab_size=272, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                tie_word_embeddings=False)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(artifact, the transformers model) of the tiny MoE."""
    pytest.importorskip("transformers")
    from support.models import tiny_served_model

    return tiny_served_model(tmp_path_factory.mktemp("tiny_moe"), "moe", MOE_TEXT, seed=77)


BURST = [70, 3, 33, 9, 90, 2, 21, 48]


@pytest.fixture(scope="module")
def moe_reference(moe):
    artifact, _ = moe
    work = qwen_work(BURST, seed=17)
    return work, alone(artifact, work)


def test_greedy_tokens_are_transformers_argmax(moe, moe_reference):
    _, hf = moe
    work, expected = moe_reference
    checked = 0
    for (prompt, sp), tokens in zip(work, expected, strict=True):
        if sp.temperature != 0.0:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([list(prompt) + list(tokens[:-1])])).logits[0, len(prompt) - 1:]
        assert list(tokens) == logits.argmax(-1).tolist()
        checked += 1
    assert checked == 4


@pytest.mark.parametrize("options", [dict(prefill_chunk_size=32, max_step_tokens=12),
                                     dict(prefill_chunk_size=16, max_step_tokens=40)])
def test_moe_burst_equals_alone(moe, moe_reference, options):
    artifact, _ = moe
    work, expected = moe_reference
    with start(artifact, max_concurrency=8, context_cache=False, **options) as engine:
        assert burst(engine, engine._program, work) == expected  # noqa: SLF001
        stats = engine.stats()
    assert stats.max_unit_chunks >= 2 and stats.preemptions == 0


def test_moe_preempted_burst_equals_alone(moe, moe_reference):
    artifact, _ = moe
    work, expected = moe_reference
    with start(artifact, max_concurrency=8, prefill_chunk_size=16, max_step_tokens=12, num_pages=40,
               context_cache=False) as engine:
        assert burst(engine, engine._program, work) == expected  # noqa: SLF001
        engine.close()
        stats = engine.stats()
    assert stats.preemptions > 0 and stats.replay_tokens > 0
    assert stats.pages_used == 0 and stats.state_slots_used == 0


def test_moe_cache_hits_equal_alone(moe):
    artifact, _ = moe
    first = qwen_work([30, 41, 12, 25], seed=18)
    second = qwen_work([5, 9, 3, 14, 40, 7, 22, 2], seed=19, prefixes={i: first[i][0] for i in range(4)})
    expected = alone(artifact, first + second)
    with start(artifact, max_concurrency=8, prefill_chunk_size=16, max_step_tokens=12, context_cache=True) as engine:
        got = [engine.generate(p, sampling=sp).token_ids for p, sp in first]
        got += burst(engine, engine._program, second)  # noqa: SLF001
        stats = engine.stats()
    assert got == expected
    assert stats.cache_hits >= 4 and stats.cache_hit_tokens > 0
