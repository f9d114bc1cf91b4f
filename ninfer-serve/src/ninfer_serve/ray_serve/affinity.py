"""Which requests belong together: the affinity key of a request, so context-cache hits survive routing.

The context cache lives inside one engine, so a conversation's later turns pay off only on the replica
that served its earlier ones. The key, from the request alone (no state):

- ``prompt_cache_key`` when the client sends one (Chat Completions, Completions, Responses): OpenAI's own
  cache-routing key, which ``ninfer serve`` already uses as the context-cache session key.
- Otherwise the conversation's opening: for chat-shaped requests the messages up to and including the
  first user message (with the system prompt and, for Responses, ``instructions``); for Completions the
  prompt's first :data:`PREFIX_CHARS` characters (or :data:`PREFIX_TOKENS` token ids). Every later turn of
  a conversation repeats its opening verbatim, so it hashes to the same key; two conversations that share
  their opening also share a cached prefix, so sending them to one replica is what the cache wants.
- A request naming a stored response (``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``)
  carries that id in :attr:`Affinity.response_id` instead: only the replica that stored it can answer.
- Anything else (tokenize, models, health, a batch of prompts, an unparsable body): no key, least loaded.

Keys are hashes (no request text is kept by the router).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

PREFIX_CHARS = 512
PREFIX_TOKENS = 128
_RESPONSES_ITEM = "/v1/responses/"


@dataclass(frozen=True)
class Affinity:
    """``key``: the affinity key (``None``: route by load). ``response_id``: the stored response this request
    needs (``None``: none)."""

    key: str | None = None
    response_id: str | None = None


NO_AFFINITY = Affinity()


def _digest(kind: str, value: Any) -> str:
    blob = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return f"{kind}:{hashlib.sha256(blob.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}"


def _opening(messages: Any, user_role: str = "user") -> list[Any] | None:
    """The messages up to and including the first one from the user (all of them when there is none)."""
    if not isinstance(messages, list) or not messages:
        return None
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == user_role:
            return messages[: i + 1]
    return messages


def _chat_key(body: dict) -> str | None:
    opening = _opening(body.get("messages"))
    return None if opening is None else _digest("chat", opening)


def _anthropic_key(body: dict) -> str | None:
    opening = _opening(body.get("messages"))
    return None if opening is None else _digest("messages", [body.get("system"), opening])


def _completion_key(body: dict) -> str | None:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return _digest("completion", prompt[:PREFIX_CHARS])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return _digest("completion-ids", prompt[:PREFIX_TOKENS])
    return None  # a batch of prompts, or nothing usable: route by load


def _responses_key(body: dict) -> str | None:
    inp = body.get("input")
    if isinstance(inp, str) and inp:
        return _digest("responses", [body.get("instructions"), inp[:PREFIX_CHARS]])
    opening = _opening(inp)
    return None if opening is None else _digest("responses", [body.get("instructions"), opening])


_BY_PATH = {"/v1/chat/completions": _chat_key, "/v1/messages": _anthropic_key,
            "/v1/completions": _completion_key, "/v1/responses": _responses_key}


def affinity_of(method: str, path: str, body: bytes) -> Affinity:
    """The affinity of one request (``path`` without the query string). Never raises: a body that is not a
    JSON object has no affinity, and the replica answers it with the usual 400."""
    if path.startswith(_RESPONSES_ITEM) and method in ("GET", "HEAD", "DELETE"):
        return Affinity(response_id=path[len(_RESPONSES_ITEM):] or None)
    keyer = _BY_PATH.get(path)
    if keyer is None or method != "POST":
        return NO_AFFINITY
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return NO_AFFINITY
    if not isinstance(parsed, dict):
        return NO_AFFINITY
    previous = parsed.get("previous_response_id") if path == "/v1/responses" else None
    if isinstance(previous, str) and previous:
        return Affinity(response_id=previous)
    cache_key = parsed.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key:
        return Affinity(key=_digest("cache-key", cache_key))
    try:
        return Affinity(key=keyer(parsed))
    except RecursionError:
        return NO_AFFINITY
