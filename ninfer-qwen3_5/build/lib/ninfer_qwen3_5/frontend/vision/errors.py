"""Errors of media preprocessing. Every message names the item's problem and, for a limit, the limit.

:class:`MediaError` and its subclasses mean *this request's media is bad* (a gateway answers 400 and
shows the message); :class:`VisionDependencyError` means *this installation cannot read media at all*.
"""

from __future__ import annotations

from ninfer_qwen3_5.frontend.errors import FrontendError


class MediaError(FrontendError):
    """An image or video of a request was rejected. ``problem`` is a short stable code (the docs list
    them) for programs; the message is for people."""

    def __init__(self, problem: str, message: str):
        super().__init__(message)
        self.problem = problem


class MediaLimitError(MediaError):
    """An item (or a request's item count) exceeds one of :class:`~.limits.MediaLimits`. ``actual`` is
    the item's value where known (None when a decoder's own guard refused the item first)."""

    def __init__(self, problem: str, message: str, *, actual: float | None, limit: float):
        super().__init__(problem, message)
        self.actual = actual
        self.limit = limit


class MediaDecodeError(MediaError):
    """The bytes are not a complete, decodable file of an accepted format (corrupt, truncated,
    unsupported format or codec, or a geometry the processors cannot represent)."""


class VisionDependencyError(FrontendError):
    """Pillow or PyAV is not installed: media input needs the ``vision`` extra of ninfer-qwen3_5."""
