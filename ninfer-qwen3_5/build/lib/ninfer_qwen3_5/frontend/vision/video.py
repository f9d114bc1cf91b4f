"""Videos: decode the sampled frames (:func:`load_video`) and turn them into patch rows
(:func:`process_video`).

Decoding is defensive, in this order: the encoded size is checked before parsing; the container is
recognised from its first bytes and only MP4/QuickTime, Matroska/WebM and AVI are opened, with that
demuxer named explicitly (FFmpeg never probes, so playlist or concat formats that would open other
files or URLs are never reached); the stream's codec must be one of :data:`VIDEO_CODECS`; the frame
size, frame count and duration are checked from the headers before any frame is decoded (a stream
that does not state its frame count is counted by decoding it once, stopping at the limit). Frames are
then decoded with FFmpeg's strictest error detection, and the file is rejected on any decoder error, a
frame the decoder marks corrupt, a frame whose size differs from the stream's, or a stream that ends
before the last sampled frame: a video is either decoded at every sampled frame or rejected.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Any

import numpy as np

from ninfer_qwen3_5.frontend.vision._deps import pyav
from ninfer_qwen3_5.frontend.vision.config import VideoPreprocessConfig
from ninfer_qwen3_5.frontend.vision.errors import MediaDecodeError, MediaError
from ninfer_qwen3_5.frontend.vision.limits import MediaLimits, check
from ninfer_qwen3_5.frontend.vision.pixels import (
    normalize,
    patch_rows,
    pixel_digest,
    resize_frames,
    to_frames,
)
from ninfer_qwen3_5.frontend.vision.processed import DecodedVideo, ProcessedVideo
from ninfer_qwen3_5.frontend.vision.sampling import group_timestamps, sample_frame_indices
from ninfer_qwen3_5.frontend.vision.sizing import video_target_size
from ninfer_qwen3_5.frontend.vision.source import read_bounded

VideoSource = bytes | bytearray | memoryview | str | os.PathLike[str]

VIDEO_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg1video", "mpeg2video", "mjpeg"})
_DEFAULT_LIMITS = MediaLimits()
_DEFAULT_CONFIG = VideoPreprocessConfig()
_RESIZE_BACKEND = "torchvision"  # the Qwen3-VL video processor exists in transformers' torchvision flavour only


def load_video(source: VideoSource, config: VideoPreprocessConfig = _DEFAULT_CONFIG,
               limits: MediaLimits = _DEFAULT_LIMITS) -> DecodedVideo:
    """The frames of a video that ``config`` samples, decoded to RGB, from encoded bytes or a file path
    (paths are for local callers; a server passes the bytes it received). Raises
    :class:`~.errors.MediaError` (limit, format, codec, corrupt or truncated file)."""
    av = pyav()
    data = read_bounded(source, limits.max_video_bytes, "video")
    demuxer = _demuxer(data)
    with _container(av, data, demuxer) as container:
        stream = _video_stream(container)
        width, height = stream.codec_context.width, stream.codec_context.height
        if width <= 0 or height <= 0:
            raise MediaDecodeError("corrupt", f"video: the stream states no frame size ({width}x{height})")
        check("video_frame_pixels", f"video: frame pixels ({width}x{height})", width * height,
              limits.max_video_frame_pixels)
        fps = _frame_rate(stream)
        declared = _declared_seconds(container, stream)
        if declared is not None:
            check("video_seconds", "video: duration in seconds", declared, limits.max_video_seconds)
        total = stream.frames
        if total > 0:
            _check_frames(total, width * height, limits, "")
    if total <= 0:
        total = _count_frames(av, data, demuxer, (width, height), limits)
    check("video_seconds", "video: duration in seconds (frames / frame rate)", total / fps, limits.max_video_seconds)
    indices = sample_frame_indices(total, fps, config)
    frames = _decode(av, data, demuxer, indices, (width, height))
    return DecodedVideo(frames, indices, fps, total)


def process_video(video: DecodedVideo, config: VideoPreprocessConfig = _DEFAULT_CONFIG) -> ProcessedVideo:
    """Patch rows of decoded frames: all frames resized to one smart-resize size (the budget counts every
    sampled frame), normalised, grouped in temporal pairs (an odd last frame repeated). Bit for bit what
    transformers' Qwen3-VL video processor gives for the same frames and frame indices."""
    frames = to_frames(video.frames)
    count, _, height, width = frames.shape
    resized = resize_frames(frames, video_target_size(count, height, width, config), _RESIZE_BACKEND)
    temporal, merge = config.temporal_patch_size, config.merge_size
    rows, grid = patch_rows(normalize(resized, config.image_mean, config.image_std, _RESIZE_BACKEND),
                            config.patch_size, temporal, merge)
    digest = pixel_digest(resized, grid, config.image_mean, config.image_std, _RESIZE_BACKEND)
    return ProcessedVideo(rows, grid, merge, digest, group_timestamps(video.frame_indices, video.fps, temporal),
                          video.frame_indices, video.fps, (height, width))


def preprocess_video(source: VideoSource, config: VideoPreprocessConfig = _DEFAULT_CONFIG,
                     limits: MediaLimits = _DEFAULT_LIMITS) -> ProcessedVideo:
    """:func:`load_video` then :func:`process_video`: the one call a frontend makes per video."""
    return process_video(load_video(source, config, limits), config)


def _demuxer(data: bytes) -> str:
    """FFmpeg's demuxer for the container the first bytes announce; only the accepted ones."""
    if data[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide"):
        return "mov"      # MP4, QuickTime, 3GP (one demuxer); external data references stay off by default
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"  # Matroska and WebM
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    raise MediaDecodeError("format", "video: not an MP4/QuickTime, Matroska/WebM or AVI file")


@contextmanager
def _container(av: Any, data: bytes, demuxer: str) -> Iterator[Any]:
    try:
        container = av.open(io.BytesIO(data), mode="r", format=demuxer)
    except Exception as e:  # noqa: BLE001  (FFmpeg errors and PyAV's own on malformed input)
        raise MediaDecodeError("corrupt", f"video: the {demuxer} container cannot be opened: {e}") from e
    try:
        yield container
    except MediaError:
        raise
    except Exception as e:  # noqa: BLE001
        raise MediaDecodeError("corrupt", f"video: malformed {demuxer} container: {e}") from e
    finally:
        container.close()


def _video_stream(container: Any) -> Any:
    if not container.streams.video:
        raise MediaDecodeError("no_video_stream", "video: the file has no video stream (or its header is cut off)")
    stream = container.streams.video[0]
    codec = stream.codec_context.name
    if codec not in VIDEO_CODECS:
        raise MediaDecodeError("codec", f"video: codec {codec!r} is not accepted ({', '.join(sorted(VIDEO_CODECS))})")
    return stream


def _frame_rate(stream: Any) -> float:
    rate = stream.average_rate or stream.guessed_rate
    if not rate or not 0 < float(rate) <= 1000:
        raise MediaDecodeError("frame_rate", f"video: the stream has no usable frame rate ({rate})")
    return float(rate)


def _declared_seconds(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * Fraction(stream.time_base))
    if container.duration is not None:
        return container.duration / 1_000_000  # AV_TIME_BASE units
    return None


def _strict(stream: Any) -> None:
    # Fail on any bitstream damage instead of concealing it.
    stream.codec_context.options = {"err_detect": "explode"}


def _count_frames(av: Any, data: bytes, demuxer: str, size: tuple[int, int], limits: MediaLimits) -> int:
    """Frames of a stream whose header does not state them: decode once, stop past the limit."""
    count = 0
    with _container(av, data, demuxer) as container:
        stream = _video_stream(container)
        _strict(stream)
        for frame in container.decode(stream):
            _check_frame(frame, count, size)
            count += 1
            _check_frames(count, size[0] * size[1], limits, " (counted)")
    if count == 0:
        raise MediaDecodeError("corrupt", "video: the stream holds no decodable frame")
    return count


def _decode(av: Any, data: bytes, demuxer: str, indices: tuple[int, ...], size: tuple[int, int]) -> np.ndarray:
    wanted = set(indices)
    last = indices[-1]
    frames: list[np.ndarray] = []
    with _container(av, data, demuxer) as container:
        stream = _video_stream(container)
        _strict(stream)
        for i, frame in enumerate(container.decode(stream)):
            _check_frame(frame, i, size)
            if i in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
            if i >= last:
                break
    if len(frames) < len(indices):
        raise MediaDecodeError("truncated", f"video: the stream ends after {len(frames)} of the {len(indices)} "
                               "sampled frames (truncated or damaged)")
    return np.stack(frames)


def _check_frames(frames: int, frame_pixels: int, limits: MediaLimits, how: str) -> None:
    check("video_frames", f"video: frames{how}", frames, limits.max_video_frames)
    check("video_decoded_pixels", f"video: decoded pixels{how} ({frames} frames x {frame_pixels})",
          frames * frame_pixels, limits.max_video_decoded_pixels)


def _check_frame(frame: Any, index: int, size: tuple[int, int]) -> None:
    if frame.is_corrupt:
        raise MediaDecodeError("corrupt", f"video: frame {index} is damaged")
    if (frame.width, frame.height) != size:
        raise MediaDecodeError("corrupt", f"video: frame {index} is {frame.width}x{frame.height}, the stream "
                               f"states {size[0]}x{size[1]}")
