"""MediaLimits: the bounds a request's images and videos must stay within, checked before the
expensive step each one protects (bytes before parsing, header geometry before decoding, the
container's frame count and duration before decoding frames).

Invariants:
- Every bound is a positive number; a violation raises :class:`~.errors.MediaLimitError` whose
  ``problem`` code and message name the bound, the item's value and the limit.
- Defaults admit any ordinary photo, screenshot or clip: decoded images up to 8192 x 8192, video
  frames up to 4096 x 4096, videos up to 10 minutes and 36,000 frames, and at most as many decoded
  pixels as 10 minutes of 1080p at 30 fps (sampling needs every frame up to the last sampled one
  decoded, so this bounds the decoding work of one video).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ninfer_qwen3_5.frontend.vision.errors import MediaLimitError

MiB = 1 << 20


@dataclass(frozen=True)
class MediaLimits:
    max_image_bytes: int = 32 * MiB           # encoded size of one image
    max_image_pixels: int = 8192 * 8192       # decoded width x height of one image (from its header)
    max_video_bytes: int = 256 * MiB          # encoded size of one video
    max_video_frame_pixels: int = 4096 * 4096  # width x height of one video frame (from the stream header)
    max_video_frames: int = 36_000            # frames in the video stream (declared or counted)
    max_video_seconds: float = 600.0          # duration of the video stream
    max_video_decoded_pixels: int = 18_000 * 1920 * 1080  # frames x frame pixels, before decoding
    max_images_per_request: int = 32
    max_videos_per_request: int = 4

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"MediaLimits.{f.name} must be a positive number, got {value!r}")

    def check_counts(self, images: int, videos: int) -> None:
        """Raise if a request carries more images or videos than allowed (checked before any decoding)."""
        check("images_per_request", "images in the request", images, self.max_images_per_request)
        check("videos_per_request", "videos in the request", videos, self.max_videos_per_request)


def check(problem: str, what: str, actual: float, limit: float) -> None:
    """Raise :class:`MediaLimitError` ``problem`` when ``actual`` exceeds ``limit``."""
    if actual > limit:
        shown = f"{actual:.3f}".rstrip("0").rstrip(".") if isinstance(actual, float) else str(actual)
        raise MediaLimitError(problem, f"{what}: {shown} exceeds the limit of {limit}", actual=actual, limit=limit)
