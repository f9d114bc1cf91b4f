"""Preprocessing settings (Qwen3.5 defaults, reading the artifact's processor configs) and the resize
rule against transformers' smart_resize functions over many sizes."""

from __future__ import annotations

import itertools
import json

import pytest
from ninfer_qwen3_5.frontend.errors import FrontendError
from ninfer_qwen3_5.frontend.vision import (
    ImagePreprocessConfig,
    MediaDecodeError,
    VideoPreprocessConfig,
    vision_configs,
)
from ninfer_qwen3_5.frontend.vision.sizing import image_target_size, video_target_size
from support.media import QWEN3_5_IMAGE, QWEN3_5_VIDEO

SIDES = [1, 2, 7, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 100, 199, 200, 333, 517, 1000, 1023, 1024, 1025,
         2049, 4000, 4096, 4097, 6000]


def _files(image=None, video=None, combined=None):
    out = {}
    for role, value in (("preprocessor_config.json", image), ("video_preprocessor_config.json", video),
                        ("processor_config.json", combined)):
        if value is not None:
            out[role] = json.dumps(value).encode()
    return out


def test_defaults_are_qwen3_5s_shipped_settings():
    image, video = vision_configs(_files(dict(QWEN3_5_IMAGE, processor_class="Qwen3VLProcessor",
                                              image_processor_type="Qwen2VLImageProcessorFast"),
                                         dict(QWEN3_5_VIDEO, video_processor_type="Qwen3VLVideoProcessor")))
    assert (image, video) == (ImagePreprocessConfig(), VideoPreprocessConfig())
    assert vision_configs({}) == (ImagePreprocessConfig(), VideoPreprocessConfig())
    assert (image.min_pixels, image.max_pixels, image.factor) == (65536, 16777216, 32)
    assert (video.min_pixels, video.max_pixels, video.fps, video.min_frames, video.max_frames) == (
        4096, 25165824, 2.0, 4, 768)


def test_configs_are_read_from_both_file_layouts():
    image = dict(QWEN3_5_IMAGE, size={"shortest_edge": 1024, "longest_edge": 200_000}, image_mean=[0.1, 0.2, 0.3])
    video = dict(QWEN3_5_VIDEO, fps=4, max_frames=64)
    for files in (_files(image, video), _files(combined={"image_processor": image, "video_processor": video})):
        got_image, got_video = vision_configs(files)
        assert (got_image.min_pixels, got_image.max_pixels, got_image.image_mean) == (1024, 200_000, (0.1, 0.2, 0.3))
        assert (got_video.fps, got_video.max_frames) == (4, 64)


@pytest.mark.parametrize("change, message", [
    ({"resample": 2}, "resample=2 is not supported"),
    ({"rescale_factor": 1 / 127.5}, "rescale_factor"),
    ({"do_normalize": False}, "do_normalize=False is not supported"),
    ({"image_std": [0.5, 0.5]}, "image_std must list 3 numbers"),
    ({"patch_size": 0}, "patch_size must be a positive integer"),
    ({"size": {"shortest_edge": 10, "longest_edge": 5}}, "min_pixels 10 > max_pixels 5"),
])
def test_settings_the_processors_cannot_follow_are_rejected(change, message):
    with pytest.raises(FrontendError, match="^preprocessor_config.json: .*" + message):
        vision_configs(_files(dict(QWEN3_5_IMAGE, **change)))


def test_video_settings_the_sampler_cannot_follow_are_rejected():
    for change, message in (({"num_frames": 8}, "num_frames"), ({"do_sample_frames": False}, "do_sample_frames"),
                            ({"fps": -1}, "fps must be a positive number"), ({"min_frames": 9, "max_frames": 8},
                                                                               "min_frames 9 > max_frames 8")):
        with pytest.raises(FrontendError, match="video_preprocessor_config.json: .*" + message):
            vision_configs(_files(video=dict(QWEN3_5_VIDEO, **change)))
    with pytest.raises(FrontendError, match="not valid JSON"):
        vision_configs({"video_preprocessor_config.json": b"{"})


def test_image_resize_rule_equals_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for budget in ((65536, 16777216), (4096, 200_000), (150_000, 1_000_000)):
        cfg = ImagePreprocessConfig(min_pixels=budget[0], max_pixels=budget[1])
        for h, w in itertools.product(SIDES, SIDES):
            try:
                expected = smart_resize(h, w, factor=32, min_pixels=budget[0], max_pixels=budget[1])
            except ValueError:
                with pytest.raises(MediaDecodeError, match="aspect ratio"):
                    image_target_size(h, w, cfg)
                continue
            assert image_target_size(h, w, cfg) == expected, (h, w, budget)


def test_video_resize_rule_equals_transformers():
    pytest.importorskip("torchvision")
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    cfg = VideoPreprocessConfig()
    for frames, h, w in itertools.product((2, 3, 4, 5, 64, 767, 768), SIDES[::2], SIDES[::2]):
        try:
            expected = smart_resize(frames, h, w, temporal_factor=2, factor=32, min_pixels=cfg.min_pixels,
                                    max_pixels=cfg.max_pixels)
        except ValueError:
            with pytest.raises(MediaDecodeError, match="aspect ratio"):
                video_target_size(frames, h, w, cfg)
            continue
        assert video_target_size(frames, h, w, cfg) == expected, (frames, h, w)


def test_video_resize_rule_by_hand():
    """Cases worked by hand from the rule (documented in sizing.py), for machines without torchvision."""
    cfg = VideoPreprocessConfig()
    assert video_target_size(4, 65, 99, cfg) == (64, 96)            # round each side to 32
    assert video_target_size(4, 9, 17, cfg) == (32, 64)             # stretch 9x17 to 32x60, then round
    # 768 frames share 25,165,824 pixels: shrink by sqrt(768 * 1080 * 1920 / 25165824) ~ 7.95, round down
    assert video_target_size(768, 1080, 1920, cfg) == (128, 224)
    assert video_target_size(2, 16, 16, cfg) == (64, 64)            # 2 x 32 x 32 < 4096: grow to 2 x 64 x 64
    with pytest.raises(MediaDecodeError, match="at least 2"):
        video_target_size(1, 64, 64, cfg)
