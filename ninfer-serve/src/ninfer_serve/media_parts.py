"""Images and videos in API messages: OpenAI ``image_url`` / ``video_url`` content parts and Anthropic ``image``
blocks become the frontend's media parts (``{"type": "image", "image": ...}``, as the Python API takes them).

Converting a message only records where each item comes from (:class:`MediaRef`, checked for shape at once, so a
malformed part is a 400 before anything is fetched); :func:`resolve_media` then loads every item under the
server's :class:`~ninfer_serve.media_policy.MediaPolicy`. It reads files and the network, so it runs off the event
loop, with the prompt's rendering. Every refusal is a 400 naming the part.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ninfer_serve.errors import bad_request
from ninfer_serve.media_fetch import fetch
from ninfer_serve.media_policy import MediaPolicy

Kind = Literal["image", "video"]
# OpenAI part type -> (media kind, the field holding {"url": ...} or the URL itself). ``video_url`` as vLLM takes it;
# ``input_image`` as the Responses API names an image part; ``input_video`` by analogy with it.
OPENAI_PARTS: dict[str, tuple[Kind, str]] = {"image_url": ("image", "image_url"), "video_url": ("video", "video_url"),
                                              "input_image": ("image", "image_url"),
                                              "input_video": ("video", "video_url")}


@dataclass(frozen=True)
class MediaRef:
    """An image or video a request names by URL (``data:``, ``file://`` or a path, ``http(s)://``); ``param`` is
    where the request named it."""

    kind: Kind
    url: str
    param: str


def openai_part(part: Any, where: str) -> dict[str, Any] | None:
    """The frontend part of an OpenAI media content part (None when ``part`` is not a media part)."""
    spec = OPENAI_PARTS.get(part.type)
    if spec is None:
        return None
    kind, key = spec
    value = getattr(part, key, None)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise bad_request(f"a {part.type} part needs '{key}.url' (a data:, file:// or http(s):// URL)",
                          param=f"{where}.{key}")
    return {"type": kind, kind: MediaRef(kind, url, f"{where}.{key}.url")}


def anthropic_image(source: Any, where: str) -> dict[str, Any]:
    """The frontend part of an Anthropic ``image`` block's ``source`` (base64 or url)."""
    if not isinstance(source, dict) or source.get("type") not in ("base64", "url"):
        raise bad_request("an image block's source must be {type: base64, media_type, data} or {type: url, url}",
                          param=f"{where}.source")
    if source["type"] == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise bad_request("an image url source needs 'url'", param=f"{where}.source.url")
        return {"type": "image", "image": MediaRef("image", url, f"{where}.source.url")}
    media_type, data = source.get("media_type"), source.get("data")
    if not isinstance(media_type, str) or not media_type.startswith("image/"):
        raise bad_request("an image base64 source needs an image/* 'media_type'", param=f"{where}.source.media_type")
    if not isinstance(data, str) or not data:
        raise bad_request("an image base64 source needs 'data'", param=f"{where}.source.data")
    return {"type": "image", "image": MediaRef("image", f"data:{media_type};base64,{data}", f"{where}.source.data")}


def resolve_media(messages: list[dict[str, Any]], policy: MediaPolicy) -> list[dict[str, Any]]:
    """``messages`` with every :class:`MediaRef` replaced by the item's bytes or file path (blocking I/O)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [{**p, p["type"]: load(p[p["type"]], policy)}
                       if isinstance(p.get(p.get("type", "")), MediaRef) else p for p in content]
            m = {**m, "content": content}
        out.append(m)
    return out


def load(ref: MediaRef, policy: MediaPolicy) -> bytes | Path:
    url = ref.url
    if url.startswith("data:"):
        return decode_data_url(url, ref, policy.max_bytes)
    if url.startswith(("http://", "https://")):
        return fetch(url, policy, ref.param)
    if url.startswith("file://") or url.startswith("/"):
        return policy.local_path(url, ref.param)
    scheme = url.split(":", 1)[0] if ":" in url else url[:16]
    raise bad_request(f"{ref.kind} URL scheme {scheme!r} is not supported: use data:, file:// or http(s)://",
                      param=ref.param)


def decode_data_url(url: str, ref: MediaRef, max_bytes: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise bad_request(f"a data: URL of an {ref.kind} must be base64 (data:<type>;base64,<data>)",
                          param=ref.param)
    mime = head[len("data:"):-len(";base64")]
    if mime and not mime.startswith(f"{ref.kind}/"):
        raise bad_request(f"a data: URL of type {mime!r} is not an {ref.kind}", param=ref.param)
    if len(payload) // 4 * 3 > max_bytes:
        raise bad_request(f"the {ref.kind} exceeds {max_bytes} bytes (the server's media size limit)",
                          param=ref.param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"the {ref.kind}'s base64 data is malformed: {exc}", param=ref.param) from None
