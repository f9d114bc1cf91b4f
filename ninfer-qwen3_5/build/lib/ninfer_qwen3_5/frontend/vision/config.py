"""Preprocessing settings of images and videos, with Qwen3.5's values as defaults.

The defaults are the values Qwen3.5 checkpoints ship in ``preprocessor_config.json`` (images: 65,536 to
16,777,216 pixels) and ``video_preprocessor_config.json`` (videos: 4,096 to 25,165,824 pixels over all
sampled frames, 2 frames per second, 4 to 768 frames), with patch 16, temporal patch 2, merge 2 and
mean = std = 0.5 per channel. :func:`vision_configs` reads those files from an artifact's resources when
they are present; settings the processors cannot follow (another resample filter, rescale factor or a
switched-off step) are rejected rather than silently ignored.

Invariants: sizes are positive integers; ``min_pixels <= max_pixels``; ``min_frames <= max_frames``;
``factor = patch_size * merge_size`` is the multiple every resized side is rounded to.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from ninfer_qwen3_5.frontend.errors import FrontendError

Backend = Literal["torchvision", "pil"]
BACKENDS = ("torchvision", "pil")
IMAGE_CONFIG_ROLE = "preprocessor_config.json"
VIDEO_CONFIG_ROLE = "video_preprocessor_config.json"
COMBINED_CONFIG_ROLE = "processor_config.json"
_BICUBIC = 3  # PIL's resample code, as the configs store it


@dataclass(frozen=True)
class ImagePreprocessConfig:
    """How one image becomes patch rows. ``backend`` names which of transformers' two Qwen2-VL image
    processor backends the output reproduces bit for bit: ``"torchvision"`` (what Qwen3.5 checkpoints
    name, ``Qwen2VLImageProcessorFast``: torch's antialiased bicubic on uint8, fused rescale-normalise) or
    ``"pil"`` (Pillow's bicubic, rescale then normalise). They differ by at most a couple of uint8 levels
    in a few pixels. Neither needs torchvision: the torch path calls torch directly."""

    min_pixels: int = 256 * 256
    max_pixels: int = 4096 * 4096
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    backend: Backend = "torchvision"

    def __post_init__(self):
        _validate(self, "ImagePreprocessConfig")
        if self.backend not in BACKENDS:
            raise ValueError(f"ImagePreprocessConfig.backend must be one of {BACKENDS}, got {self.backend!r}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_processor_json(cls, cfg: Mapping[str, Any], *, source: str = IMAGE_CONFIG_ROLE,
                            backend: Backend = "torchvision") -> ImagePreprocessConfig:
        return _build(cls, dict(_common_fields(cfg, source, cls()), backend=backend), source)


@dataclass(frozen=True)
class VideoPreprocessConfig:
    """How one video becomes patch rows: frame sampling (``fps`` frames per second of video, clamped to
    ``[min_frames, max_frames]`` and to the frames the video has) and the resize budget, which counts the
    pixels of all sampled frames together. Resizing is torch's antialiased bicubic, as transformers'
    (torchvision-only) Qwen3-VL video processor does."""

    min_pixels: int = 4096
    max_pixels: int = 25_165_824
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    def __post_init__(self):
        _validate(self, "VideoPreprocessConfig")
        if self.min_frames > self.max_frames:
            raise ValueError(f"VideoPreprocessConfig: min_frames {self.min_frames} > max_frames {self.max_frames}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_processor_json(cls, cfg: Mapping[str, Any], *,
                            source: str = VIDEO_CONFIG_ROLE) -> VideoPreprocessConfig:
        values = _common_fields(cfg, source, cls())
        if cfg.get("do_sample_frames", True) is not True:
            raise FrontendError(f"{source}: do_sample_frames={cfg['do_sample_frames']!r} is not supported")
        if cfg.get("num_frames") is not None:
            raise FrontendError(f"{source}: a fixed num_frames={cfg['num_frames']!r} is not supported (fps only)")
        if cfg.get("cap_pixels_per_frame"):
            raise FrontendError(f"{source}: cap_pixels_per_frame is not supported")
        for key in ("fps", "min_frames", "max_frames"):
            if cfg.get(key) is not None:
                values[key] = cfg[key]
        return _build(cls, values, source)


def vision_configs(resources: Mapping[str, bytes]) -> tuple[ImagePreprocessConfig, VideoPreprocessConfig]:
    """The image and video settings an artifact's frontend resources state, Qwen3.5's defaults where a
    file is absent. Reads ``preprocessor_config.json`` and ``video_preprocessor_config.json``, or the
    combined ``processor_config.json`` (``image_processor`` / ``video_processor`` keys)."""
    combined = _json(resources, COMBINED_CONFIG_ROLE) or {}
    image = _json(resources, IMAGE_CONFIG_ROLE) or combined.get("image_processor")
    video = _json(resources, VIDEO_CONFIG_ROLE) or combined.get("video_processor")
    return (ImagePreprocessConfig() if image is None else ImagePreprocessConfig.from_processor_json(image),
            VideoPreprocessConfig() if video is None else VideoPreprocessConfig.from_processor_json(video))


def _json(resources: Mapping[str, bytes], role: str) -> dict[str, Any] | None:
    raw = resources.get(role)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise FrontendError(f"{role} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise FrontendError(f"{role} must hold a JSON object")
    return value


def _common_fields(cfg: Mapping[str, Any], source: str, default: Any) -> dict[str, Any]:
    """The settings images and videos share, checked against what the processors can follow."""
    for switch in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if cfg.get(switch, True) is not True:
            raise FrontendError(f"{source}: {switch}={cfg[switch]!r} is not supported (only true)")
    if cfg.get("resample", _BICUBIC) != _BICUBIC:
        raise FrontendError(f"{source}: resample={cfg['resample']!r} is not supported (only 3, bicubic)")
    factor = cfg.get("rescale_factor", 1 / 255)
    if not isinstance(factor, (int, float)) or not math.isclose(factor, 1 / 255, rel_tol=1e-9):
        raise FrontendError(f"{source}: rescale_factor={factor!r} is not supported (only 1/255)")
    size = cfg.get("size") or {}
    if not isinstance(size, Mapping):
        raise FrontendError(f"{source}: size must be an object with shortest_edge and longest_edge")
    values = {
        "min_pixels": size.get("shortest_edge", cfg.get("min_pixels", default.min_pixels)),
        "max_pixels": size.get("longest_edge", cfg.get("max_pixels", default.max_pixels)),
    }
    for key in ("patch_size", "temporal_patch_size", "merge_size"):
        values[key] = cfg.get(key, getattr(default, key))
    for key in ("image_mean", "image_std"):
        raw = cfg.get(key, getattr(default, key))
        if not isinstance(raw, (list, tuple)) or len(raw) != 3:
            raise FrontendError(f"{source}: {key} must list 3 numbers (one per RGB channel), got {raw!r}")
        values[key] = tuple(raw)
    return values


def _build(cls: type, values: dict[str, Any], source: str) -> Any:
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise FrontendError(f"{source}: {e}") from e


def _validate(cfg: Any, name: str) -> None:
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("image_mean", "image_std"):
            ok = (isinstance(value, tuple) and len(value) == 3
                  and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
                  and (f.name == "image_mean" or all(v > 0 for v in value)))
            if not ok:
                raise ValueError(f"{name}.{f.name} must be 3 numbers (std positive), got {value!r}")
        elif f.name == "fps":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}.fps must be a positive number, got {value!r}")
        elif f.name != "backend":
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}.{f.name} must be a positive integer, got {value!r}")
    if cfg.min_pixels > cfg.max_pixels:
        raise ValueError(f"{name}: min_pixels {cfg.min_pixels} > max_pixels {cfg.max_pixels}")
