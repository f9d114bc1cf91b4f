"""Images: decode (:func:`load_image`) and turn into patch rows (:func:`process_image`).

Decoding is defensive, in this order: the encoded size is checked before parsing; only the formats in
:data:`IMAGE_FORMATS` are parsed; the header's width x height is checked against the decoded-pixel limit
before any pixel is decoded (Pillow's own decompression-bomb guard, warning included, becomes the same
error); a PNG's chunk checksums are verified up to its end marker; then the first frame is decoded in
full, and any decoder complaint rejects the file. No partially decoded image is ever returned, so a
truncated or corrupted file either fails with :class:`~.errors.MediaDecodeError` or, where the damage
leaves a complete valid picture (bit flips in JPEG entropy data cannot be detected), decodes in full.
EXIF orientation is applied, as transformers' image loaders do. Animated formats give their first frame.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from typing import TYPE_CHECKING

from ninfer_qwen3_5.frontend.vision._deps import pillow
from ninfer_qwen3_5.frontend.vision.config import ImagePreprocessConfig
from ninfer_qwen3_5.frontend.vision.errors import MediaDecodeError, MediaLimitError
from ninfer_qwen3_5.frontend.vision.limits import MediaLimits, check
from ninfer_qwen3_5.frontend.vision.pixels import (
    normalize,
    patch_rows,
    pixel_digest,
    resize_frames,
    rgb_array,
    to_frames,
)
from ninfer_qwen3_5.frontend.vision.processed import ProcessedImage
from ninfer_qwen3_5.frontend.vision.sizing import image_target_size
from ninfer_qwen3_5.frontend.vision.source import read_bounded

if TYPE_CHECKING:
    from PIL.Image import Image

    ImageSource = bytes | bytearray | memoryview | str | os.PathLike[str] | Image

IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the IEND chunk: zero length, type, CRC
_DEFAULT_LIMITS = MediaLimits()
_DEFAULT_CONFIG = ImagePreprocessConfig()


def load_image(source: ImageSource, limits: MediaLimits = _DEFAULT_LIMITS) -> Image:
    """A fully decoded Pillow image from encoded bytes, a file path, or a Pillow image (taken as it is:
    only its size is checked and its pixels loaded). Paths are for local callers; a server passes the
    bytes it received. Raises :class:`~.errors.MediaError` (limit, format, corrupt or truncated file)."""
    image_mod = pillow()
    if isinstance(source, image_mod.Image):
        _check_pixels(source.size, limits)
        _load(source, limits)
        return source
    from PIL import ImageOps

    data = read_bounded(source, limits.max_image_bytes, "image")
    # Pillow only warns between its two bomb thresholds; escalate that warning here. (Filters are process
    # state: were another thread to undo this one, the explicit size check below still holds.)
    with warnings.catch_warnings():
        warnings.simplefilter("error", image_mod.DecompressionBombWarning)
        img = _open(image_mod, data, limits)
        _check_pixels(img.size, limits)
        if img.format == "PNG":
            _verify_png(image_mod, data)
        _load(img, limits)
        try:
            return ImageOps.exif_transpose(img)
        except Exception as e:  # noqa: BLE001  (a malformed EXIF block, in any of its forms)
            raise MediaDecodeError("corrupt", f"image: its EXIF orientation cannot be applied: {e}") from e


def process_image(img: Image, config: ImagePreprocessConfig = _DEFAULT_CONFIG) -> ProcessedImage:
    """Patch rows of a decoded image: RGB (alpha composited onto white), resized by the smart-resize rule,
    normalised, one temporal pair made of the frame twice. Bit for bit what transformers' Qwen2-VL image
    processor of ``config.backend`` gives for the same Pillow image."""
    rgb = rgb_array(img)
    height, width = rgb.shape[:2]
    resized = resize_frames(to_frames(rgb), image_target_size(height, width, config), config.backend)
    patch, temporal, merge = config.patch_size, config.temporal_patch_size, config.merge_size
    rows, grid = patch_rows(normalize(resized, config.image_mean, config.image_std, config.backend),
                            patch, temporal, merge)
    digest = pixel_digest(resized, grid, config.image_mean, config.image_std, config.backend)
    return ProcessedImage(rows, grid, merge, digest, (height, width))


def preprocess_image(source: ImageSource, config: ImagePreprocessConfig = _DEFAULT_CONFIG,
                     limits: MediaLimits = _DEFAULT_LIMITS) -> ProcessedImage:
    """:func:`load_image` then :func:`process_image`: the one call a frontend makes per image."""
    return process_image(load_image(source, limits), config)


def _open(image_mod, data: bytes, limits: MediaLimits) -> Image:
    try:
        return image_mod.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except (image_mod.DecompressionBombError, image_mod.DecompressionBombWarning) as e:
        raise _bomb(image_mod, e, limits) from e
    except image_mod.UnidentifiedImageError as e:
        raise MediaDecodeError("format", f"image: not a complete file of an accepted format "
                               f"({', '.join(IMAGE_FORMATS)})") from e
    except Exception as e:  # noqa: BLE001  (Pillow's parsers raise many types on malformed headers)
        raise MediaDecodeError("corrupt", f"image: malformed header: {e}") from e


def _check_pixels(size: tuple[int, int], limits: MediaLimits) -> None:
    width, height = size
    check("image_pixels", f"image: decoded pixels ({width}x{height})", width * height, limits.max_image_pixels)


def _verify_png(image_mod, data: bytes) -> None:
    """Check every chunk's CRC and that the whole IEND chunk is there (a separate parse: Pillow's verify
    must run right after open and leaves that image unusable)."""
    if _PNG_END not in data:
        raise MediaDecodeError("corrupt", "image: PNG ends before its IEND chunk (truncated)")
    try:
        image_mod.open(io.BytesIO(data), formats=("PNG",)).verify()
    except Exception as e:  # noqa: BLE001
        raise MediaDecodeError("corrupt", f"image: PNG structure is damaged or truncated: {e}") from e


def _load(img: Image, limits: MediaLimits) -> None:
    image_mod = pillow()
    try:
        img.load()
    except (image_mod.DecompressionBombError, image_mod.DecompressionBombWarning) as e:
        raise _bomb(image_mod, e, limits) from e
    except Exception as e:  # noqa: BLE001  (decoders raise OSError, SyntaxError, ValueError, EOFError...)
        raise MediaDecodeError("corrupt", f"image: cannot be decoded in full (corrupt or truncated): {e}") from e


def _bomb(image_mod, e: Exception, limits: MediaLimits) -> MediaLimitError:
    """Pillow's own guard (it runs inside ``Image.open``, before our check can) as our error: stated
    against our limit when the size it reports exceeds that, else against Pillow's."""
    found = re.search(r"\((\d+) pixels\)", str(e))
    actual = int(found.group(1)) if found else None
    if actual is not None and actual > limits.max_image_pixels:
        return MediaLimitError("image_pixels", f"image: decoded pixels: {actual} exceeds the limit of "
                               f"{limits.max_image_pixels}", actual=actual, limit=limits.max_image_pixels)
    return MediaLimitError("image_pixels", f"image: decoded pixels exceed Pillow's decompression-bomb guard: {e}",
                           actual=actual, limit=image_mod.MAX_IMAGE_PIXELS or 0)
