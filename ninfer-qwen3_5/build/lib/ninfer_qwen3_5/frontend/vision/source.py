"""Reading an item's encoded bytes, bounded: nothing larger than the limit is ever held in memory."""

from __future__ import annotations

import os

from ninfer_qwen3_5.frontend.vision.errors import MediaDecodeError
from ninfer_qwen3_5.frontend.vision.limits import check


def read_bounded(source: bytes | bytearray | memoryview | str | os.PathLike[str], max_bytes: int, what: str) -> bytes:
    """The encoded bytes of ``source`` (bytes, or a path read no further than one byte past the limit),
    rejected when longer than ``max_bytes``."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, os.PathLike)):
        try:
            size = os.stat(source).st_size
            check(f"{what}_bytes", f"{what}: encoded size in bytes", size, max_bytes)
            with open(source, "rb") as f:
                data = f.read(max_bytes + 1)
        except OSError as e:
            raise MediaDecodeError("unreadable", f"{what}: cannot read {os.fspath(source)!r}: {e}") from e
    else:
        raise TypeError(f"{what} source must be bytes, a path or (images) a PIL image, not {type(source).__name__}")
    check(f"{what}_bytes", f"{what}: encoded size in bytes", len(data), max_bytes)
    if not data:
        raise MediaDecodeError("empty", f"{what}: no bytes")
    return data
