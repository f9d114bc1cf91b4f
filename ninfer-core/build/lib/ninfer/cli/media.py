"""Images and videos on the command line: ``--image PATH`` / ``--video PATH`` (generate) and ``/image PATH`` /
``/video PATH`` (chat) become content parts of a user message, ``{"type": "image", "image": PATH}`` (``video``
likewise), the chat-message form every frontend with vision reads (the model's frontend loads the file). The
paths are checked here, before the model loads; the file's contents are the frontend's to judge.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ninfer.errors import NInferError

KINDS = ("image", "video")


def add_media_args(p: argparse.ArgumentParser) -> None:
    """``--image PATH`` and ``--video PATH``, repeatable, kept in command-line order in ``args.media``."""
    g = p.add_argument_group("images and videos (a model with a vision tower; implies the chat template)")
    for kind in KINDS:
        g.add_argument(f"--{kind}", dest="media", action="append", default=[], metavar="PATH",
                       type=lambda path, kind=kind: (kind, path),
                       help=f"attach an {kind} file to the user message (repeatable; PNG, JPEG, GIF, WebP or BMP)"
                            if kind == "image" else
                            "attach a video file to the user message (repeatable; MP4, MKV/WebM or AVI)")


def checked_path(kind: str, path: str) -> str:
    """``path`` expanded (``~``) when it names a readable file; an NInferError naming the flag otherwise."""
    full = Path(path).expanduser()
    if not full.is_file():
        raise NInferError(f"{kind} {path!r}: no such file")
    if not os.access(full, os.R_OK):
        raise NInferError(f"{kind} {path!r}: the file is not readable")
    return str(full)


def media_parts(media: list[tuple[str, str]]) -> list[dict]:
    """The content parts of ``(kind, path)`` items, each path checked."""
    return [{"type": kind, kind: checked_path(kind, path)} for kind, path in media]


def user_content(text: str, parts: list[dict]) -> str | list[dict]:
    """A user message's content: ``text`` alone, or the media parts followed by the text."""
    return [*parts, {"type": "text", "text": text}] if parts else text


def attach_to_last_user(messages: list[dict], parts: list[dict]) -> list[dict]:
    """``messages`` with ``parts`` put before the content of the last user message (an NInferError when there
    is none)."""
    if not parts:
        return messages
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            content = messages[i].get("content")
            if isinstance(content, list):
                new = [*parts, *content]
            else:
                new = user_content("" if content is None else str(content), parts)
            return [*messages[:i], {**messages[i], "content": new}, *messages[i + 1:]]
    raise NInferError("--image/--video attach to the last user message, and the messages have none")
