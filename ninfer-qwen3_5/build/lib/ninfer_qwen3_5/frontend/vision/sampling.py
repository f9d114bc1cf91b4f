"""Which frames of a video are sampled, and the time the prompt shows for each temporal group.

Sampling takes ``fps`` frames per second of video (``int(total / video_fps * fps)``), at least
``min_frames`` and at most ``max_frames``, never more than the video has, spread evenly from the first
to the last frame (``linspace(0, total - 1, n)``, rounded half to even): transformers' Qwen3-VL video
processor's rule, which Qwen3.5 uses.
"""

from __future__ import annotations

import numpy as np

from ninfer_qwen3_5.frontend.vision.config import VideoPreprocessConfig


def sample_frame_indices(total_frames: int, video_fps: float, cfg: VideoPreprocessConfig) -> tuple[int, ...]:
    """Strictly increasing indices into a video of ``total_frames`` (> 0) frames playing at ``video_fps``."""
    if total_frames <= 0 or not video_fps > 0:
        raise ValueError(f"sample_frame_indices: needs frames and a frame rate, got {total_frames}, {video_fps}")
    wanted = int(total_frames / video_fps * cfg.fps)
    count = min(max(wanted, cfg.min_frames), cfg.max_frames, total_frames)
    return tuple(int(i) for i in np.linspace(0, total_frames - 1, count).round().astype(np.int64))


def group_timestamps(frame_indices: tuple[int, ...], video_fps: float, temporal_patch_size: int) -> tuple[float, ...]:
    """Seconds shown before each temporal group: the mean of the times of its first and last frame, the
    last index repeated to fill an incomplete final group (as the frames themselves are)."""
    padded = list(frame_indices) + [frame_indices[-1]] * (-len(frame_indices) % temporal_patch_size)
    times = [i / video_fps for i in padded]
    return tuple((times[g] + times[g + temporal_patch_size - 1]) / 2 for g in range(0, len(times), temporal_patch_size))
