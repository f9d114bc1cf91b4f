"""Pixel steps shared by images and videos: RGB conversion, resize, normalisation, patch rows, digest.

Frames travel as uint8 tensors ``[T, 3, H, W]`` (contiguous) until normalisation, which is where they
become float32. The patch rows follow the vision tower's order:

- rows go temporal group by temporal group; inside one, merge window by merge window in raster order
  (``merge x merge`` patches that the merger later fuses into one token), and inside a window patch by
  patch in raster order;
- one row holds ``C x temporal_patch_size x patch x patch`` values (3 x 2 x 16 x 16 = 1536), channel
  major, then frame, then patch row, then patch column: the layout the tower's Conv3d patch embedding
  reads;
- a frame count that is not a multiple of ``temporal_patch_size`` is padded by repeating the last frame,
  so a still image fills its temporal pair with two copies of itself.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np
import torch

from ninfer_qwen3_5.frontend.vision.errors import MediaDecodeError

if TYPE_CHECKING:
    from PIL.Image import Image

RESCALE = 1 / 255
DIGEST_VERSION = b"ninfer-vision-pixels-v1"


def rgb_array(img: Image) -> np.ndarray:
    """``img`` as uint8 ``[H, W, 3]``. An image with an alpha band or a transparent palette entry is
    composited onto white first, as current transformers processors and Qwen's own preprocessing do
    (transformers 5.17 dropped the alpha band instead); other modes use Pillow's own
    conversion (so 16-bit greyscale saturates above 255 there and here alike)."""
    from ninfer_qwen3_5.frontend.vision._deps import pillow

    image_mod = pillow()
    try:
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            white = image_mod.new("RGBA", rgba.size, (255, 255, 255, 255))
            rgb = image_mod.alpha_composite(white, rgba).convert("RGB")
        else:
            rgb = img.convert("RGB")
        return np.array(rgb, dtype=np.uint8)  # a writable copy: torch refuses to wrap read-only arrays
    except (ValueError, OSError) as e:
        raise MediaDecodeError("mode", f"image: cannot convert mode {img.mode!r} to RGB: {e}") from e


def to_frames(rgb: np.ndarray) -> torch.Tensor:
    """uint8 ``[H, W, 3]`` or ``[T, H, W, 3]`` as a contiguous uint8 ``[T, 3, H, W]`` tensor."""
    array = rgb[None] if rgb.ndim == 3 else rgb
    return torch.from_numpy(np.ascontiguousarray(array)).permute(0, 3, 1, 2).contiguous()


def resize_frames(frames: torch.Tensor, size: tuple[int, int], backend: str) -> torch.Tensor:
    """Bicubic resize of uint8 ``[T, 3, H, W]`` to ``size`` = (height, width), still uint8.
    ``"torchvision"``: torch's antialiased bicubic on uint8 (Pillow's filter, computed by torch), skipped
    when the size is unchanged. ``"pil"``: Pillow's bicubic frame by frame."""
    if backend == "pil":
        from ninfer_qwen3_5.frontend.vision._deps import pillow

        image_mod = pillow()
        height, width = size
        out = [np.asarray(image_mod.fromarray(f.permute(1, 2, 0).numpy(), "RGB").resize(
            (width, height), resample=image_mod.Resampling.BICUBIC)) for f in frames]
        return to_frames(np.stack(out))
    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    return torch.nn.functional.interpolate(frames, size=list(size), mode="bicubic", align_corners=False,
                                           antialias=True).contiguous()


def normalize(frames: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...], backend: str) -> torch.Tensor:
    """float32 ``(x / 255 - mean) / std`` of uint8 frames. The two backends round differently in the last
    bit, and each is reproduced exactly: ``"pil"`` scales in float64, rounds to float32, then normalises;
    ``"torchvision"`` folds the 1/255 into mean and std (``(x - 255 mean) / (255 std)`` in float32)."""
    mean32 = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    std32 = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    if backend == "pil":
        scaled = (frames.to(torch.float64) * RESCALE).to(torch.float32)
        return (scaled - mean32) / std32
    return (frames.to(torch.float32) - mean32 * (1.0 / RESCALE)) / (std32 * (1.0 / RESCALE))


def patch_rows(frames: torch.Tensor, patch: int, temporal: int, merge: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """float32 ``[T, 3, H, W]`` (H and W multiples of ``patch * merge``) as patch rows
    ``[grid_t * grid_h * grid_w, 3 * temporal * patch * patch]`` and the grid (t, h, w) in patches."""
    t, c, height, width = frames.shape
    if pad := -t % temporal:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
        t += pad
    gt, gh, gw = t // temporal, height // patch, width // patch
    blocks = frames.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    # (group, window row, window col, row in window, col in window, channel, frame, pixel row, pixel col)
    rows = blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, c * temporal * patch * patch)
    return rows.contiguous(), (gt, gh, gw)


def pixel_digest(frames: torch.Tensor, grid: tuple[int, int, int], mean: tuple[float, ...], std: tuple[float, ...],
                 backend: str) -> str:
    """sha256 (hex) of the resized uint8 frames ``[T, 3, H, W]`` (before temporal padding) together with
    the grid and the normalisation: the patch rows are a function of exactly these, so equal digests mean
    equal rows. The uint8 frames are 4 to 8 times smaller than the float32 rows they become."""
    h = hashlib.sha256(DIGEST_VERSION)
    h.update(repr((tuple(frames.shape), grid, tuple(mean), tuple(std), backend)).encode())
    h.update(frames.contiguous().numpy())
    return h.hexdigest()
