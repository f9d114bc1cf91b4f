"""Non-streaming requests also end when their client goes away.

A handler awaiting a whole answer does not notice a closed connection by itself (litestar only
watches for ``http.disconnect`` while streaming). :func:`unless_disconnected` races the work against
the ASGI ``receive`` channel, which, once the body has been read, yields nothing but
``http.disconnect``; a disconnect cancels the work (whose ``finally`` releases the engine handle).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from litestar import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is cancelling this handler: cancel both
        task.cancel()
        watch.cancel()
        raise
    if task.done():
        watch.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # let the work run its cleanup (releasing the engine handle) first
    raise ClientDisconnected("the client disconnected before the answer was ready")
