"""Image and video preprocessing of the Qwen frontend: bytes in, the vision tower's patch rows out.

Public API (Pillow and PyAV are imported on first use; without them a media call raises
:class:`VisionDependencyError` naming the ``vision`` extra):

- :func:`preprocess_image` / :func:`preprocess_video`: one call per item (decode, then process);
- :func:`load_image` / :func:`process_image`, :func:`load_video` / :func:`process_video`: the two halves;
- :class:`ProcessedImage` / :class:`ProcessedVideo`: patch rows, grid, token counts, digest (timestamps
  for videos); :class:`DecodedVideo`: a video's sampled frames;
- :class:`ImagePreprocessConfig` / :class:`VideoPreprocessConfig` (Qwen3.5 defaults) and
  :func:`vision_configs` (from an artifact's frontend resources);
- :class:`MediaLimits` and the errors: :class:`MediaError` (:class:`MediaLimitError`,
  :class:`MediaDecodeError`) for bad input.

docs/vision.md describes the rules and the limits.
"""

from ninfer_qwen3_5.frontend.vision.config import ImagePreprocessConfig, VideoPreprocessConfig, vision_configs
from ninfer_qwen3_5.frontend.vision.errors import (
    MediaDecodeError,
    MediaError,
    MediaLimitError,
    VisionDependencyError,
)
from ninfer_qwen3_5.frontend.vision.image import IMAGE_FORMATS, load_image, preprocess_image, process_image
from ninfer_qwen3_5.frontend.vision.limits import MediaLimits
from ninfer_qwen3_5.frontend.vision.processed import DecodedVideo, ProcessedImage, ProcessedVideo
from ninfer_qwen3_5.frontend.vision.video import VIDEO_CODECS, load_video, preprocess_video, process_video

__all__ = [
    "IMAGE_FORMATS", "VIDEO_CODECS", "DecodedVideo", "ImagePreprocessConfig", "MediaDecodeError", "MediaError",
    "MediaLimitError", "MediaLimits", "ProcessedImage", "ProcessedVideo", "VideoPreprocessConfig",
    "VisionDependencyError", "load_image", "load_video", "preprocess_image", "preprocess_video", "process_image",
    "process_video", "vision_configs",
]
