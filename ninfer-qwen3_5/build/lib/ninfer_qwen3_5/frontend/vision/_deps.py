"""Lazy imports of the media libraries, so that text-only use never needs them.

Pillow decodes images and PyAV (FFmpeg) decodes videos; both come with ``pip install
ninfer-qwen3_5[vision]``. They are imported on the first media item, never at module import.
"""

from __future__ import annotations

from types import ModuleType

from ninfer_qwen3_5.frontend.errors import FrontendError
from ninfer_qwen3_5.frontend.vision.errors import VisionDependencyError

_HINT = "install ninfer-qwen3_5[vision]"


def pillow() -> ModuleType:
    """The ``PIL.Image`` module, with ``PIL.ImageFile`` and ``PIL.ImageOps`` loaded. Refuses a process in
    which ``ImageFile.LOAD_TRUNCATED_IMAGES`` was switched on: truncated files would then decode with
    made-up pixels instead of failing."""
    try:
        from PIL import Image, ImageFile, ImageOps  # noqa: F401  (loads the submodules)
    except ImportError as e:
        raise VisionDependencyError(f"image input needs Pillow, which is not installed: {_HINT}") from e
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise FrontendError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True in this process; images "
                            "are refused because truncated files would be half-decoded (set it back to False)")
    return Image


def pyav() -> ModuleType:
    """The ``av`` module (PyAV)."""
    try:
        import av
    except ImportError as e:
        raise VisionDependencyError(f"video input needs PyAV, which is not installed: {_HINT}") from e
    return av
