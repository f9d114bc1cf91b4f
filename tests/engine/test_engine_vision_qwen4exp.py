"""Images and videos end to end through the public Engine on a tiny random Qwen4-Exp vision artifact
(``Qwen4ExpForConditionalGeneration``: Qwen3.5-MoE's tower in front of the Qwen4-Exp text model; CPU, fp32, reference
ops; tests/support/vision_models.py), with the conversations and helpers of test_engine_vision.py.

Oracle: transformers' greedy tokens for the same prepared prompt (its token ids and pixel rows). Then the scheduling
paths must leave a request's tokens unchanged: batched with text-only and other multimodal requests, with chunk
boundaries inside image spans, under an encoder budget, preempted and resumed by Replay and from Snapshots, and a
second turn about the same image must hit the context cache past the image and score as a cold run; and bad media
requests (vision off, over the encoder budget or the media limits, misplaced placeholders) are refused with errors
that name the cause. Those are test_engine_vision.py's own tests, collected here again with this module's
``vision`` and ``reference`` fixtures. The Program-level oracle (logits at every position, decode logits) is
tests/models/qwen4exp/test_qwen4exp_vision.py.
"""

from __future__ import annotations

import pytest
from support.vision_models import hf_greedy, tiny_vision_artifact

from .test_engine_vision import STEPS, conversations, greedy, start, user
from .test_engine_vision import test_encoder_budget_spreads_media_over_steps as test_encoder_budget  # noqa: F401
from .test_engine_vision import test_media_prompt_must_place_its_media_in_the_prompt as test_misplaced  # noqa: F401
from .test_engine_vision import test_preempted_multimodal_requests_resume_with_their_media as test_preempted  # noqa: F401
from .test_engine_vision import test_refusals_name_their_cause as test_refusals  # noqa: F401
from .test_engine_vision import test_second_turn_about_the_same_image_hits_the_cache as test_cache_hit  # noqa: F401

pytest.importorskip("transformers.models.qwen4_exp")


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """``(artifact, transformers model)``."""
    return tiny_vision_artifact(tmp_path_factory.mktemp("tiny_vision_qwen4exp"), seed=43, arch="qwen4exp")


@pytest.fixture(scope="module")
def reference(vision):
    """Each conversation's prompt and its tokens alone (one request, the whole prompt in one chunk)."""
    artifact, _ = vision
    with start(artifact, max_concurrency=1, prefill_chunk_size=256, context_cache=False) as engine:
        assert engine.options.vision is True and engine.info["vision"] is True
        assert engine.info["architecture"] == "Qwen4ExpForCausalLM"
        prompts = [engine.frontend.prepare_chat(c, enable_thinking=False) for c in conversations()]
        return prompts, [greedy(engine, [p])[0] for p in prompts]


def test_chat_with_media_matches_transformers(vision, reference):
    _, hf = vision
    prompts, tokens = reference
    assert all(p.media for p in prompts)
    for p, t in zip(prompts, tokens, strict=True):
        assert list(t) == hf_greedy(hf, p, STEPS)


def test_batched_and_chunked_requests_keep_their_tokens(vision, reference):
    artifact, _ = vision
    prompts, tokens = reference
    with start(artifact, max_concurrency=4, prefill_chunk_size=16, context_cache=False) as engine:
        text = engine.frontend.prepare_chat(user("Say something."), enable_thinking=False)
        out = greedy(engine, [*prompts, text])
    assert out[:len(prompts)] == tokens
