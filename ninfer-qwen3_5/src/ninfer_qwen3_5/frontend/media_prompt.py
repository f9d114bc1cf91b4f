"""Images and videos in chat messages: taken out before the template renders, preprocessed, and expanded into
their placeholder runs after tokenization, as transformers' Qwen3.5 processor writes them.

A message's ``content`` list may hold media parts (anything else in the list is left to the template):

- ``{"type": "image", "image": X}`` with X a Pillow image, encoded bytes, a local path (str or PathLike) or an
  already processed :class:`~ninfer_qwen3_5.frontend.vision.ProcessedImage`; ``{"type": "image", "path": P}``;
- ``{"type": "video", "video": X}`` likewise (bytes, a path or a
  :class:`~ninfer_qwen3_5.frontend.vision.ProcessedVideo`), or ``"path"``.

URLs (``image_url`` / ``video_url`` parts, an ``"image"`` string with a scheme) are not fetched here: a caller
that serves URLs (the HTTP server) resolves them to bytes first. Each media part reaches the template as
``{"type": "image"}`` / ``{"type": "video"}``, which Qwen3.5 templates render as
``<|vision_start|><|image_pad|><|vision_end|>`` (``<|video_pad|>`` for a video).

Expansion of the tokenized prompt (:func:`expand_media`), the i-th image placeholder standing for the i-th image
part and likewise for videos: an image's ``<|image_pad|>`` becomes ``num_tokens`` of them (one span); a video's
``<|video_pad|>`` becomes, per temporal patch ``g``, the tokens of ``<{t_g:.1f} seconds>``, ``<|vision_start|>``,
``tokens_per_frame`` of ``<|video_pad|>`` (span ``g``) and ``<|vision_end|>``. Every frame group brings its own
start and end tokens, so the template's wrapper around the video pad (``<|vision_start|>`` right before it,
``<|vision_end|>`` right after) is dropped rather than left as a second pair around all frames: the layout
transformers' Qwen3-VL processor and vLLM write. Tokenizing the timestamp text on its own equals tokenizing it in
place: special tokens bound it on both sides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ninfer.contracts.media import MediaInput

from ninfer_qwen3_5.frontend.errors import FrontendError

IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
_URL_PARTS = {"image_url": "image", "video_url": "video"}
_SCHEMES = ("http://", "https://", "data:", "file:", "ftp://")


@dataclass(frozen=True)
class MediaPart:
    """One media part of the messages, in message order: ``kind`` and where its pixels come from."""

    kind: str      # "image" or "video"
    source: Any    # PIL image, bytes, path, or a ProcessedImage / ProcessedVideo


@dataclass(frozen=True)
class VisionTokens:
    """The placeholder and delimiter token ids of a tokenizer that has them."""

    image_pad: int
    video_pad: int
    vision_start: int
    vision_end: int


def vision_tokens(token_to_id: Callable[[str], int | None]) -> VisionTokens | None:
    """The vision tokens of a vocabulary, or None when it lacks any of them (a text-only tokenizer)."""
    ids = [token_to_id(t) for t in (IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END)]
    return None if any(i is None for i in ids) else VisionTokens(*ids)


def _media_kind(part: Mapping[str, Any]) -> str | None:
    kind = part.get("type")
    if kind in ("image", "video") or kind in _URL_PARTS:
        return kind
    for key in ("image", "video", *_URL_PARTS):
        if key in part:
            return key
    return None


def _source(part: Mapping[str, Any], kind: str, where: str) -> Any:
    if kind in _URL_PARTS:
        raise FrontendError(f"{where}: a {kind} part names a URL, which the frontend does not fetch; pass the "
                            f"{_URL_PARTS[kind]}'s bytes, a Pillow image or a local path as "
                            f"{{'type': '{_URL_PARTS[kind]}', '{_URL_PARTS[kind]}': ...}} (the HTTP server resolves "
                            f"URLs before it prepares the prompt)")
    source = part.get(kind, part.get("path"))
    if source is None:
        raise FrontendError(f"{where}: an {kind} part needs the {kind} itself under '{kind}' (bytes, a path"
                            f"{', a Pillow image' if kind == 'image' else ''}) or a local file under 'path'")
    if isinstance(source, str) and source.lower().startswith(_SCHEMES):
        raise FrontendError(f"{where}: {kind} {source[:40]!r} is a URL, which the frontend does not fetch; pass the "
                            f"bytes or a local path")
    return source


def extract_media(messages: Sequence[Mapping[str, Any]], *, sources: bool = True) -> tuple[list[Any], list[MediaPart]]:
    """``(messages with every media part replaced by {"type": kind}, the media parts in order)``. Messages
    without media come back as they are (the same objects). ``sources=False`` only marks the parts (for rendering
    alone): their sources are neither checked nor kept."""
    out: list[Any] = []
    parts: list[MediaPart] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, (list, tuple)):
            out.append(message)
            continue
        new_content = []
        for j, part in enumerate(content):
            kind = _media_kind(part) if isinstance(part, Mapping) else None
            if kind is None:
                new_content.append(part)
                continue
            source = _source(part, kind, f"message {i} part {j}") if sources else None
            kind = _URL_PARTS.get(kind, kind)
            parts.append(MediaPart(kind, source))
            new_content.append({"type": kind})
        out.append({**message, "content": new_content})
    return out, parts


def expand_media(ids: Sequence[int], processed: Sequence[Any], kinds: Sequence[str], tokens: VisionTokens,
                 encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], tuple[MediaInput, ...]]:
    """The prompt ``ids`` with each placeholder expanded (module docstring), and its media in token order.
    ``processed[k]`` (a ProcessedImage or ProcessedVideo) is the medium of kind ``kinds[k]``; the i-th
    placeholder of a kind takes the i-th medium of that kind. A count that does not match (a template that drops
    a media part, a placeholder token typed in the text) is a FrontendError."""
    queues: dict[str, list[Any]] = {"image": [], "video": []}
    for kind, item in zip(kinds, processed, strict=True):
        queues[kind].append(item)
    for kind, pad in (("image", tokens.image_pad), ("video", tokens.video_pad)):
        found = sum(1 for t in ids if t == pad)
        if found != len(queues[kind]):
            raise FrontendError(f"the rendered prompt holds {found} {kind} placeholder(s) "
                                f"({IMAGE_PAD if kind == 'image' else VIDEO_PAD}) for {len(queues[kind])} {kind}(s): "
                                f"the chat template dropped or added one, or the text itself contains the token")
    out: list[int] = []
    media: list[MediaInput] = []
    taken = {"image": 0, "video": 0}
    skip_end = False
    for k, t in enumerate(ids):
        if skip_end:
            skip_end = False
            if t == tokens.vision_end:
                continue
        if t == tokens.image_pad:
            item = queues["image"][taken["image"]]
            taken["image"] += 1
            start = len(out)
            out.extend([t] * item.num_tokens)
            media.append(MediaInput("image", item.pixel_values, tuple(item.grid_thw), item.digest, t,
                                    ((start, len(out)),)))
        elif t == tokens.video_pad:
            item = queues["video"][taken["video"]]
            taken["video"] += 1
            if k > 0 and ids[k - 1] == tokens.vision_start and k + 1 < len(ids) and ids[k + 1] == tokens.vision_end:
                out.pop()  # the template's wrapper: the frame groups below carry their own (module docstring)
                skip_end = True
            spans = []
            for stamp in item.timestamps:
                out.extend(encode(f"<{stamp:.1f} seconds>"))
                out.append(tokens.vision_start)
                start = len(out)
                out.extend([t] * item.tokens_per_frame)
                spans.append((start, len(out)))
                out.append(tokens.vision_end)
            media.append(MediaInput("video", item.pixel_values, tuple(item.grid_thw), item.digest, t, tuple(spans)))
        else:
            out.append(int(t))
    return tuple(out), tuple(media)
