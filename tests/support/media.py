"""Media made on the fly for the vision preprocessing tests (deterministic, no files in the repository),
and transformers' Qwen3.5 processors as oracles (test-only).

Pillow and PyAV are test requirements (requirements-dev.txt); import this module only from tests that
need them.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

# What Qwen3.5 checkpoints ship (preprocessor_config.json, video_preprocessor_config.json), less the
# class names.
QWEN3_5_IMAGE = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5]}
QWEN3_5_VIDEO = {"size": {"longest_edge": 25165824, "shortest_edge": 4096}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "fps": 2, "min_frames": 4, "max_frames": 768}


def picture(width: int, height: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    """uint8 [H, W, channels]: smooth gradients plus noise, so resizing has edges and texture to work on."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1),
                     (x + y) * 127 / max(width + height - 2, 1), 255 - x * 200 / max(width - 1, 1)], -1)
    noisy = base[..., :channels] + rng.normal(0, 30, (height, width, channels))
    return np.clip(noisy, 0, 255).astype(np.uint8)


def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature, an IHDR chunk (RGB, 8 bits) claiming ``width x height`` with a valid CRC, one tiny
    IDAT and IEND: what a decompression bomb's header looks like."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def make_video(width: int, height: int, frames: int, fps: int, *, codec: str = "libx264", pix_fmt: str = "yuv444p",
               container: str = "mp4") -> bytes:
    """A video with moving gradients, encoded with PyAV. libx264 in 4:4:4 accepts odd frame sizes."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        y, x = np.mgrid[0:height, 0:width]
        for i in range(frames):
            rgb = np.stack([(x * 3 + i * 10) % 256, (y * 5 + i * 7) % 256, ((x + y) * 2 + i * 13) % 256], -1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def hf_image_processor(backend: str, **overrides):
    """transformers' Qwen3.5 image processor (Qwen2-VL's) of ``backend`` ("pil" or "torchvision") with
    Qwen3.5's settings; the torchvision one skips the test where torchvision is not installed."""
    cfg = dict(QWEN3_5_IMAGE, **overrides)
    if backend == "pil":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(**cfg)
    pytest.importorskip("torchvision")
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(**cfg)


def hf_composites_alpha() -> bool:
    """Whether this transformers composites transparent images onto white when converting to RGB (newer
    releases, as qwen-vl-utils does) rather than dropping the alpha band (older ones, e.g. 5.17)."""
    from transformers.image_transforms import convert_to_rgb

    clear = Image.new("RGBA", (2, 2), (10, 20, 30, 0))
    return np.asarray(convert_to_rgb(clear))[0, 0].tolist() == [255, 255, 255]


def white_composite(img: Image.Image) -> Image.Image:
    """``img`` over an opaque white background, as RGB (Pillow's alpha_composite)."""
    rgba = img.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def hf_video_processor():
    """transformers' Qwen3.5 video processor (Qwen3-VL's, torchvision only) with Qwen3.5's settings."""
    pytest.importorskip("torchvision")
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(**QWEN3_5_VIDEO)
