"""Images and videos end to end through the public Engine on a tiny random Qwen3.5 vision artifact (CPU, fp32,
reference ops; tests/support/vision_models.py).

Oracle: transformers' ``Qwen3_5ForConditionalGeneration`` greedy tokens for the same prepared prompt (its token
ids and pixel rows); the frontend's expansion of that prompt is checked against transformers' processor in
tests/frontend/test_media_prompt.py. Then each scheduling path must give a request's tokens unchanged: batched
with text-only and other multimodal requests, chunked prefill with chunk boundaries inside image spans, the encoder
budget spreading a video's frames over steps, forced preemption with Replay and with Snapshot resumes, and the
context cache (a second turn about the same image binds past the image; another image of the same size never
binds past the image's start). Refusals name their cause.
"""

from __future__ import annotations

import io

import pytest
import torch
from ninfer import Engine, EngineOptions
from ninfer.contracts.errors import InvalidRequestError
from ninfer.contracts.events import GenerationDelta
from ninfer.contracts.frontend import PreparedPrompt
from ninfer.contracts.media import MediaInput
from ninfer.contracts.options import InvalidEngineOptions
from ninfer.testing import settled
from PIL import Image
from support.media import make_video, picture
from support.vision_models import IMAGE_PAD, hf_greedy, tiny_vision_artifact

STEPS = 12


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """``(artifact, transformers model)``."""
    return tiny_vision_artifact(tmp_path_factory.mktemp("tiny_vision"))


def start(artifact, **options) -> Engine:
    options.setdefault("device", "cpu")
    options.setdefault("dtype", "float32")
    options.setdefault("max_context", 256)
    options.setdefault("page_size", 4)
    return Engine.start(artifact, EngineOptions(**options))


def image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(picture(width, height, seed=seed))


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def user(*parts) -> list[dict]:
    content = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def img_part(x) -> dict:
    return {"type": "image", "image": x}


def conversations() -> list[list[dict]]:
    """Multimodal conversations of several shapes (an image, two images, a video and an image)."""
    video = make_video(32, 24, 20, 10)
    return [
        user(img_part(image(40, 28, 1)), "What is this?"),
        user("Compare", img_part(image(24, 40, 2)), "with", img_part(image(48, 16, 3)), "."),
        user({"type": "video", "video": video}, img_part(image(32, 32, 4)), "Which came first?"),
    ]


def greedy(engine: Engine, prompts) -> list[tuple[int, ...]]:
    """Every prompt's greedy tokens, all submitted before any is awaited (they share steps)."""
    params = engine.sampling_params(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    handles = [engine.submit(p, sampling=params) for p in prompts]
    out = [tuple(h.result().token_ids) for h in handles]
    for h in handles:
        h.release()
    return out


def scored(engine: Engine, prompt, steps: int = STEPS) -> tuple[tuple[int, ...], torch.Tensor]:
    """A prompt's greedy tokens and their log-probabilities (a shifted position or a wrong embedding moves these
    even where a tiny model's greedy tokens do not notice)."""
    params = engine.sampling_params(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=True)
    tokens, logprobs = [], []
    with engine.submit(prompt, sampling=params) as handle:
        for event in handle:
            if isinstance(event, GenerationDelta):
                tokens += event.token_ids
                logprobs += [lp.logprob for lp in event.logprobs]
    return tuple(tokens), torch.tensor(logprobs)


def same_run(a, b) -> None:
    assert a[0] == b[0]
    assert torch.allclose(a[1], b[1], atol=1e-5, rtol=0), f"logprobs differ by {(a[1] - b[1]).abs().max():.2e}"


@pytest.fixture(scope="module")
def reference(vision):
    """Each multimodal conversation's prompt and its tokens alone (one request, the whole prompt in one chunk)."""
    artifact, hf = vision
    with start(artifact, max_concurrency=1, prefill_chunk_size=256, context_cache=False) as engine:
        prompts = [engine.frontend.prepare_chat(c, enable_thinking=False) for c in conversations()]
        return prompts, [greedy(engine, [p])[0] for p in prompts]


def test_chat_with_media_matches_transformers(vision, reference):
    """engine.chat with a Pillow image, PNG bytes or a path: the same prompt, transformers' greedy tokens."""
    artifact, hf = vision
    prompts, tokens = reference
    for p, t in zip(prompts, tokens, strict=True):
        assert list(t) == hf_greedy(hf, p, STEPS)
    with start(artifact, max_concurrency=1) as engine:
        assert engine.options.vision is True and engine.info["vision"] is True
        pic = image(40, 28, 1)
        for source in (pic, png(pic)):
            r = engine.chat(user(img_part(source), "What is this?"), enable_thinking=False, temperature=0.0,
                            max_tokens=STEPS, ignore_eos=True)
            assert r.token_ids == tokens[0]


def test_image_path_and_text_requests_batched(vision, reference, tmp_path):
    """Multimodal requests beside text-only ones, prefill chunks of 5 (boundaries inside image spans)."""
    artifact, _ = vision
    prompts, tokens = reference
    path = tmp_path / "a.png"
    image(40, 28, 1).save(path)
    texts = [[int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))]
             for n in (9, 23)]
    with start(artifact, max_concurrency=1, context_cache=False) as engine:
        text_alone = greedy(engine, texts)
    with start(artifact, max_concurrency=6, prefill_chunk_size=5, context_cache=False) as engine:
        from_path = engine.frontend.prepare_chat(user(img_part(str(path)), "What is this?"), enable_thinking=False)
        assert from_path.token_ids == prompts[0].token_ids
        assert [m.digest for m in from_path.media] == [m.digest for m in prompts[0].media]
        got = greedy(engine, [texts[0], *prompts, texts[1], from_path])
        stats = settled(engine)
    assert got == [text_alone[0], *tokens, text_alone[1], tokens[0]]
    assert stats.max_unit_chunks > 1 and stats.preemptions == 0
    assert stats.encode_units == sum(len(m.spans) for p in (*prompts, from_path) for m in p.media)


def test_encoder_budget_spreads_media_over_steps(vision, reference):
    """The requests' media are 348 patch rows (video patches of 48, images of 80, 60, 48, 64); without a budget
    the third request's 160 rows go in one step (with whatever else is prefilling then); with a budget of 96 rows
    no step encodes more, a request's media are spread over several steps (a chunk stops before the medium that
    would not fit), and the tokens do not change."""
    artifact, _ = vision
    prompts, tokens = reference
    total = sum(4 * (b - a) for p in prompts for m in p.media for a, b in m.spans)
    assert total == 348
    for budget in (None, 96):
        with start(artifact, max_concurrency=4, max_encode_rows=budget, context_cache=False) as engine:
            assert greedy(engine, prompts) == tokens
            stats = settled(engine)
        assert stats.encode_rows == total and stats.encode_units == 6
        if budget is None:
            assert stats.max_step_encode_rows >= 160
        else:
            assert 80 <= stats.max_step_encode_rows <= budget


@pytest.mark.parametrize("cache", ["replay", "snapshot"])
def test_preempted_multimodal_requests_resume_with_their_media(vision, reference, cache):
    """A KV pool too small for all of them: requests are preempted and resume (Replay from the root or from a
    checkpoint, or from their Snapshot); every open passes the same media, so the tokens do not change."""
    artifact, _ = vision
    prompts, tokens = reference
    options = dict(context_cache=False) if cache == "replay" else dict(cache_host_mib=64)
    work = prompts * 2
    with start(artifact, max_concurrency=6, prefill_chunk_size=7, num_pages=64, **options) as engine:
        assert greedy(engine, work) == tokens * 2
        engine.close()
        stats = engine.stats()
    assert stats.preemptions > 0
    if cache == "replay":
        assert stats.replays > 0
    else:
        assert stats.snapshot_resumes > 0
    assert stats.pages_used == 0 and stats.state_slots_used == 0


def test_second_turn_about_the_same_image_hits_the_cache(vision):
    artifact, _ = vision
    pic = image(40, 28, 1)
    turn1 = user(img_part(pic), "Describe it.")
    with start(artifact, max_concurrency=1, prefill_chunk_size=16, cache_checkpoint_interval=8) as engine:
        first = engine.chat(turn1, enable_thinking=False, temperature=0.0, max_tokens=6, ignore_eos=True)
        turn2 = [*turn1, {"role": "assistant", "content": first.output.content},
                 *user(img_part(png(pic)), "And the colours?")]
        prompt = engine.frontend.prepare_chat(turn2, enable_thinking=False)
        end_of_first_image = prompt.media[0].spans[-1][1]
        before = settled(engine)
        second = scored(engine, engine.frontend.prepare_chat(turn2, enable_thinking=False))
        after = settled(engine)
    assert after.cache_hits == before.cache_hits + 1
    assert after.cache_hit_tokens - before.cache_hit_tokens > end_of_first_image
    with start(artifact, max_concurrency=1, context_cache=False) as cold:
        same_run(scored(cold, prompt), second)


def test_another_image_of_the_same_size_never_hits_past_its_start(vision):
    """Equal token runs, other pixels: no checkpoint inside or after the first image can bind, although the
    prompts' tokens are identical."""
    artifact, _ = vision
    a, b = (user(img_part(image(40, 28, seed)), "Describe it.") for seed in (1, 7))
    with start(artifact, max_concurrency=1, prefill_chunk_size=16, cache_checkpoint_interval=8) as engine:
        pa, pb = (engine.frontend.prepare_chat(m, enable_thinking=False) for m in (a, b))
        assert pa.token_ids == pb.token_ids and pa.media[0].digest != pb.media[0].digest
        engine.generate(pa, temperature=0.0, max_tokens=4, ignore_eos=True)
        assert settled(engine).cache_captures >= 3
        before = settled(engine)
        got = scored(engine, pb)
        after = settled(engine)
    start_of_image = pb.media[0].spans[0][0]
    assert after.cache_hit_tokens - before.cache_hit_tokens <= start_of_image
    with start(artifact, max_concurrency=1, context_cache=False) as cold:
        same_run(scored(cold, pb), got)


def test_refusals_name_their_cause(vision, tiny_qwen_artifact):
    from ninfer_qwen3_5.frontend.errors import FrontendError
    from ninfer_qwen3_5.frontend.vision import MediaLimitError

    artifact, _ = vision
    pic = image(40, 28, 1)
    with start(artifact, vision=False, max_concurrency=1) as engine:
        assert engine.info["vision"] is False
        with pytest.raises(InvalidRequestError, match="vision off.*--no-vision"):
            engine.chat(user(img_part(pic), "Hi"), max_tokens=2)
    with start(artifact, max_concurrency=1, max_encode_rows=32) as engine:
        with pytest.raises(InvalidRequestError, match="80 patches.*budget of 32.*max_encode_rows"):
            engine.chat(user(img_part(pic), "Hi"), max_tokens=2)
        with pytest.raises(MediaLimitError, match="images in the request: 33 exceeds the limit of 32") as err:
            engine.chat(user(*[img_part(b"not even an image")] * 33, "Hi"), max_tokens=2)
        assert err.value.problem == "images_per_request" and err.value.limit == 32
    with pytest.raises(InvalidEngineOptions, match="vision with speculative decoding"):
        start(artifact, vision=True, speculative="mtp")

    # A text-only artifact: no tower to bind, no vision tokens in its tokenizer, no media in its Program.
    with pytest.raises(InvalidEngineOptions, match="no vision tower"):
        start(tiny_qwen_artifact, vision=True, max_context=64)
    with start(tiny_qwen_artifact, max_context=64, max_concurrency=1) as engine:
        assert engine.options.vision is False
        with pytest.raises(FrontendError, match="no vision tokens"):
            engine.chat(user(img_part(pic), "Hi"), max_tokens=2)
        medium = MediaInput("image", torch.zeros(16, 96), (1, 4, 4), "d", 7, ((2, 6),))
        with pytest.raises(InvalidRequestError, match="started without a vision tower"):
            engine.generate(PreparedPrompt(token_ids=(1, 2, *[7] * 4, 3), media=(medium,)), max_tokens=2)
        assert engine.generate([1, 2, 3], max_tokens=2, ignore_eos=True).finish_reason == "length"   # serving


def test_media_prompt_must_place_its_media_in_the_prompt(vision, reference):
    artifact, _ = vision
    prompts, _ = reference
    p = prompts[0]
    (a, b), = p.media[0].spans
    with start(artifact, max_concurrency=1) as engine:
        short = PreparedPrompt(token_ids=p.token_ids[:b - 1], media=p.media)
        with pytest.raises(InvalidRequestError, match="inside the .*-token prompt"):
            engine.generate(short, max_tokens=2)
        shifted = MediaInput("image", p.media[0].pixels, p.media[0].grid, p.media[0].digest, IMAGE_PAD,
                             ((a - 1, b - 1),))
        with pytest.raises(InvalidRequestError, match="holds tokens other than its placeholder"):
            engine.generate(PreparedPrompt(token_ids=p.token_ids, media=(shifted,)), max_tokens=2)
