"""The resize rule ("smart resize"): the size an image or video is resized to before patching.

Both sides become multiples of ``factor = patch_size * merge_size`` (32 for Qwen3.5), each rounded to
the nearest multiple (half to even, as Python's ``round``), keeping the aspect ratio as closely as that
allows. If the rounded area is above ``max_pixels`` both sides are scaled down by the same factor and
rounded *down* (never below one factor); if it is below ``min_pixels`` they are scaled up and rounded
*up*. For a video the area counts all sampled frames (the frame count rounded to the temporal patch),
and a side shorter than one factor is first stretched to one factor keeping the aspect ratio.

The float operations are written in the order transformers' processors use, so the result is the same
integer size in every case. Inputs whose long side exceeds 200 times the short side are rejected, as
there.
"""

from __future__ import annotations

import math

from ninfer_qwen3_5.frontend.vision.config import ImagePreprocessConfig, VideoPreprocessConfig
from ninfer_qwen3_5.frontend.vision.errors import MediaDecodeError

MAX_ASPECT_RATIO = 200


def image_target_size(height: int, width: int, cfg: ImagePreprocessConfig) -> tuple[int, int]:
    """(height, width) an image of ``height x width`` pixels is resized to."""
    _check_geometry(height, width, "image")
    return _fit(height, width, 1, 1, cfg.factor, cfg.min_pixels, cfg.max_pixels)


def video_target_size(frames: int, height: int, width: int, cfg: VideoPreprocessConfig) -> tuple[int, int]:
    """(height, width) every frame of a video of ``frames`` sampled frames is resized to."""
    if frames < cfg.temporal_patch_size:
        raise MediaDecodeError("too_few_frames", f"video: {frames} frame(s) sampled; at least "
                               f"{cfg.temporal_patch_size} are needed (the video is too short)")
    _check_not_empty(height, width, "video")
    factor = cfg.factor
    if height < factor or width < factor:
        stretch = max(factor / height, factor / width)
        height, width = int(height * stretch), int(width * stretch)
    _check_geometry(height, width, "video")
    rounded_frames = round(frames / cfg.temporal_patch_size) * cfg.temporal_patch_size
    return _fit(height, width, frames, rounded_frames, factor, cfg.min_pixels, cfg.max_pixels)


def _fit(height: int, width: int, frames: int, rounded_frames: int, factor: int, min_pixels: int,
         max_pixels: int) -> tuple[int, int]:
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if rounded_frames * h * w > max_pixels:
        shrink = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif rounded_frames * h * w < min_pixels:
        grow = math.sqrt(min_pixels / (frames * height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def _check_not_empty(height: int, width: int, what: str) -> None:
    if height <= 0 or width <= 0:
        raise MediaDecodeError("empty", f"{what}: {width}x{height} has no pixels")


def _check_geometry(height: int, width: int, what: str) -> None:
    _check_not_empty(height, width, what)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise MediaDecodeError("aspect_ratio", f"{what}: {width}x{height} has an aspect ratio of {ratio:.1f}, "
                               f"above the limit of {MAX_ASPECT_RATIO}")
