"""The contracts between preprocessing and the model: what one image or video becomes.

Invariants of both:
- ``pixel_values`` is float32 ``[grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size**2]``
  (``[N, 1536]`` for Qwen3.5), contiguous, in the vision tower's row order (pixels.py describes it);
- ``grid_thw`` = (t, h, w) counts patches: t temporal groups, h x w patches per group; h and w are
  multiples of ``merge_size``;
- the item occupies ``num_tokens = t * h * w / merge_size**2`` placeholder tokens in the prompt;
- ``digest`` (sha256 hex) identifies the rows: equal digests mean equal ``pixel_values`` (it hashes the
  resized uint8 pixels with the grid and normalisation, see :func:`.pixels.pixel_digest`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    merge_size: int
    digest: str
    source_size: tuple[int, int]  # (height, width) of the decoded image, before resizing

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def num_tokens(self) -> int:
        """Placeholder (``<|image_pad|>``) tokens this image takes in the prompt."""
        return self.num_patches // self.merge_size**2


@dataclass(frozen=True, eq=False)
class DecodedVideo:
    """The sampled frames of a video, decoded: uint8 RGB ``[T, H, W, 3]`` at ``frame_indices`` (strictly
    increasing indices into the video's ``total_frames`` frames, which play at ``fps``)."""

    frames: np.ndarray
    frame_indices: tuple[int, ...]
    fps: float
    total_frames: int


@dataclass(frozen=True, eq=False)
class ProcessedVideo:
    """A video's patch rows. The prompt shows it one temporal group at a time, each group preceded by
    its time: ``timestamps[i]`` (seconds) is the mean time of the first and last source frame of group
    ``i`` (the last sampled frame repeated when the count is odd), rendered by the Qwen3.5 template as
    ``<{t:.1f} seconds>``. Each group takes ``tokens_per_frame`` placeholder tokens."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    merge_size: int
    digest: str
    timestamps: tuple[float, ...]
    frame_indices: tuple[int, ...]  # the sampled source frames, before temporal padding
    fps: float                      # the source video's frame rate
    source_size: tuple[int, int]    # (height, width) of the decoded frames, before resizing

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def tokens_per_frame(self) -> int:
        """Placeholder (``<|video_pad|>``) tokens of one temporal group."""
        _, h, w = self.grid_thw
        return h * w // self.merge_size**2

    @property
    def num_tokens(self) -> int:
        return self.grid_thw[0] * self.tokens_per_frame
