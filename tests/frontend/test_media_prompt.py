"""Chat messages with images and videos -> PreparedPrompt (the Qwen frontend over the real Qwen3.5 vocabulary and
its bundled template; Qwen3.5's preprocessing defaults).

Oracle for the placeholder expansion: transformers' Qwen3-VL processor's own replacement methods
(``replace_image_token`` / ``replace_video_token`` / ``get_text_with_replacements``, the text side of what
``Qwen3VLProcessor.__call__`` does), applied to the rendered text with the grids, frame indices and frame rate of
our preprocessing; our token ids must equal the tokenization of that text. The processor object is assembled
without its image and video processors (the video one needs torchvision, which CI does not have); the pixel rows
themselves are the preprocessing tests' subject (test_vision_preprocess.py).
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch
from ninfer_qwen3_5.frontend.errors import FrontendError
from ninfer_qwen3_5.frontend.vision import MediaLimitError, MediaLimits, preprocess_image, preprocess_video
from PIL import Image
from support.media import make_video, picture

IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 248056, 248057, 248053, 248054


def _png(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(picture(width, height, seed=seed)).save(buf, "PNG")
    return buf.getvalue()


def _hf_expand(text: str, images, videos) -> str:
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    proc = object.__new__(Qwen3VLProcessor)
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.vision_start_token, proc.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    proc.image_processor = SimpleNamespace(merge_size=2)
    proc.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
    image_inputs = {"image_grid_thw": torch.tensor([list(i.grid_thw) for i in images] or [[1, 1, 1]])}
    video_inputs = {"video_grid_thw": torch.tensor([list(v.grid_thw) for v in videos] or [[1, 1, 1]]),
                    "video_metadata": [SimpleNamespace(fps=v.fps, frames_indices=list(v.frame_indices))
                                       for v in videos]}
    image_text = [proc.replace_image_token(image_inputs, i) for i in range(len(images))]
    video_text = [proc.replace_video_token(video_inputs, i) for i in range(len(videos))]
    return proc.get_text_with_replacements([text], image_text, video_text)[0][0]


def test_expansion_matches_transformers_processor(frontend):
    a, b = _png(50, 30, 1), _png(20, 70, 2)
    clip = make_video(48, 32, 30, 10)
    messages = [
        {"role": "system", "content": "You look at pictures."},
        {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "and"},
                                     {"type": "video", "video": clip}]},
        {"role": "assistant", "content": "Seen."},
        {"role": "user", "content": [{"type": "text", "text": "Now this:"}, {"type": "image", "image": b}]},
    ]
    prompt = frontend.prepare_chat(messages)
    images = [preprocess_image(a), preprocess_image(b)]
    video = preprocess_video(clip)
    text = frontend.render_chat(messages)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert list(prompt.token_ids) == frontend.encode(_hf_expand(text, images, [video]))

    # The media, in token order, fill exactly the placeholder runs.
    assert [m.kind for m in prompt.media] == ["image", "video", "image"]
    for m, item in zip(prompt.media, [images[0], video, images[1]], strict=True):
        assert m.grid == item.grid_thw and m.digest == item.digest and torch.equal(m.pixels, item.pixel_values)
        assert sum(b - a for a, b in m.spans) == item.num_tokens
        assert all(t == m.token_id for a, b in m.spans for t in prompt.token_ids[a:b])
    v = prompt.media[1]
    assert v.token_id == VIDEO_PAD and len(v.spans) == video.grid_thw[0]
    for (s, e), stamp in zip(v.spans, video.timestamps, strict=True):
        assert prompt.token_ids[s - 1] == VISION_START and prompt.token_ids[e] == VISION_END
        label = frontend.encode(f"<{stamp:.1f} seconds>")
        assert list(prompt.token_ids[s - 1 - len(label):s - 1]) == label
    pads = {IMAGE_PAD: 0, VIDEO_PAD: 0}
    for t in prompt.token_ids:
        if t in pads:
            pads[t] += 1
    assert pads == {IMAGE_PAD: images[0].num_tokens + images[1].num_tokens, VIDEO_PAD: video.num_tokens}
    assert prompt.positions is None and prompt.thinking_open   # the generation prompt opens <think>
    # Cache points at the turn starts of the expanded ids (after the first image, before the generation prompt).
    assert prompt.cache_points and all(prompt.token_ids[p] == 248045 for p in prompt.cache_points)


def test_sources_a_frontend_takes(frontend, tmp_path):
    data = _png(40, 40, 3)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    pil = Image.open(io.BytesIO(data))
    processed = preprocess_image(data)
    prompts = [frontend.prepare_chat([{"role": "user", "content": [part, {"type": "text", "text": "?"}]}])
               for part in ({"type": "image", "image": data}, {"type": "image", "image": str(path)},
                            {"type": "image", "image": path}, {"type": "image", "path": str(path)},
                            {"type": "image", "image": pil}, {"type": "image", "image": processed}, {"image": data})]
    assert len({p.token_ids for p in prompts}) == 1
    assert len({p.media[0].digest for p in prompts}) == 1
    text_only = frontend.prepare_chat([{"role": "user", "content": [{"type": "text", "text": "?"}]}])
    assert text_only.media == () and text_only.positions is not None


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "does not fetch"),
    ({"type": "image", "image": "https://example.com/a.png"}, "is a URL"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "does not fetch"),
    ({"type": "image"}, "needs the image itself"),
])
def test_parts_the_frontend_refuses(frontend, part, message):
    with pytest.raises(FrontendError, match=message):
        frontend.prepare_chat([{"role": "user", "content": [part]}])


def test_placeholder_counts_and_limits(frontend, tmp_path):
    img = {"type": "image", "image": _png(40, 40, 4)}
    # A placeholder typed in the text does not stand for an image.
    with pytest.raises(FrontendError, match="2 image placeholder.*for 1 image"):
        frontend.prepare_chat([{"role": "user", "content": [img, {"type": "text", "text": "<|image_pad|>"}]}])
    # Counts are checked before anything is decoded (the third item is no image at all).
    junk = {"type": "image", "image": b"junk"}
    with pytest.raises(MediaLimitError, match="images in the request: 3 exceeds the limit of 2") as err:
        frontend.prepare_chat([{"role": "user", "content": [img, img, junk]}],
                              media_limits=MediaLimits(max_images_per_request=2))
    assert err.value.problem == "images_per_request"
    with pytest.raises(MediaLimitError, match="videos in the request"):
        frontend.prepare_chat([{"role": "user", "content": [{"type": "video", "video": b"x"}] * 5}])
    # A missing file is the item's error.
    with pytest.raises(FrontendError, match="cannot read"):
        frontend.prepare_chat([{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "no.png")}]}])


def test_a_tokenizer_without_vision_tokens_takes_no_media(tmp_path):
    from ninfer.testing import write_byte_tokenizer
    from ninfer_qwen3_5.frontend import QwenFrontend

    write_byte_tokenizer(tmp_path)
    fe = QwenFrontend({role: (tmp_path / role).read_bytes() for role in ("tokenizer.json", "tokenizer_config.json")})
    assert fe.vision_tokens is None
    with pytest.raises(FrontendError, match="no vision tokens"):
        fe.prepare_chat([{"role": "user", "content": [{"type": "image", "image": _png(40, 40, 5)}]}])


def test_preprocessing_settings_come_from_the_resources(resources):
    """A preprocessor_config.json among the resources sets the patch size (here 28: the grid changes)."""
    import json

    from ninfer_qwen3_5.frontend import QwenFrontend

    cfg = {"size": {"longest_edge": 112 * 112, "shortest_edge": 56 * 56}, "patch_size": 14, "merge_size": 2,
           "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    fe = QwenFrontend({**resources, "preprocessor_config.json": json.dumps(cfg).encode()})
    prompt = fe.prepare_chat([{"role": "user", "content": [{"type": "image", "image": _png(56, 84, 6)}]}])
    assert prompt.media[0].grid == (1, 6, 4) and prompt.media[0].pixels.shape == (24, 3 * 2 * 14 * 14)
