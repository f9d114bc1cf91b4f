"""Server-sent events: framing, keep-alives, and the streaming response that owns a Generation.

Framing: OpenAI streams ``data: JSON`` events ending with ``data: [DONE]``; Anthropic names each
event (``event: NAME`` + ``data: JSON``). A stream idle for ``keepalive_s`` (queueing, long prefill)
gets a keep-alive: an SSE comment for OpenAI clients, Anthropic's ``ping`` event for Anthropic ones.

Admission: the status line is held until the engine admits the request (or ``keepalive_s`` passes), so a
request refused while queued gets its HTTP status; after that an error is an in-stream event.

Disconnects: litestar's streaming response listens for ``http.disconnect`` and cancels the stream;
the generator's ``finally`` then closes the Generation, which cancels the request in the engine. A
generator suspended at ``yield`` (blocked on a slow socket) is not resumed by that cancellation, so
the response also closes the Generation in a background task that runs once the response ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import anyio
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from ninfer_serve.errors import ApiError, openai_body
from ninfer_serve.generation import Generation

T = TypeVar("T")
log = logging.getLogger("ninfer.serve")

DONE = b"data: [DONE]\n\n"
COMMENT_KEEPALIVE = b": keep-alive\n\n"


class KeepAlive:
    """Yielded by :func:`with_keepalive` when the source stayed idle for the interval."""


KEEPALIVE = KeepAlive()


def dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def data_event(payload: Any) -> bytes:
    return f"data: {dumps(payload)}\n\n".encode()


def named_event(name: str, payload: Any) -> bytes:
    return f"event: {name}\ndata: {dumps(payload)}\n\n".encode()


async def with_keepalive(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | KeepAlive]:
    """``source``'s items, with KEEPALIVE whenever none came for ``interval`` seconds. The pending
    ``__anext__`` is kept across timeouts (cancelling it would end the source)."""
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        # Shielded: this runs while the stream is being cancelled, and the source must get to run its
        # own cleanup (releasing the engine handle) before it is closed.
        with anyio.CancelScope(shield=True):
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.wait({pending})
            if pending is not None and not pending.cancelled():
                pending.exception()  # retrieved, so asyncio does not log it as never retrieved
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()


async def openai_events(events: AsyncIterator[bytes], what: str) -> AsyncIterator[bytes]:
    """An OpenAI stream body: ``events``, then ``data: [DONE]``. The status line went out with the first
    event, so an error after it is sent as a ``data: {"error": ...}`` event before ``[DONE]``; a bug is
    logged and sent as an internal error rather than leaving the client on a half-open stream."""
    try:
        async for event in events:
            yield event
    except ApiError as err:
        yield data_event(openai_body(err))
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("%s failed", what)
        yield data_event(openai_body(ApiError("internal", "internal server error")))
    finally:
        await events.aclose()  # type: ignore[attr-defined] - a disconnect must reach the inner generator too
    yield DONE


async def event_stream(body: AsyncIterator[bytes], generation: Generation, *, headers: dict[str, str],
                       admit_wait_s: float) -> Stream:
    """The streaming response for ``generation``. The status line waits up to ``admit_wait_s`` for the engine to
    admit the request, so a refusal in that time (a queue timeout, a deadline) is an HTTP error status that clients
    retry, not a 200 whose stream holds only an error event; past it the stream starts and keeps the client with
    keep-alives."""
    await generation.wait_admitted(admit_wait_s)
    return Stream(body, media_type="text/event-stream", background=BackgroundTask(generation.close),
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
