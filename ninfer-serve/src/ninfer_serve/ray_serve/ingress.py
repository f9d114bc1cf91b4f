"""The HTTP ingress: a thin ASGI proxy in front of the engine replicas.

Every request is read whole (bounded by the body limit), given its affinity
(:mod:`ninfer_serve.ray_serve.affinity`), and sent through a Ray Serve handle to one engine replica
(:class:`~ninfer_serve.ray_serve.router.AffinityRouter` picks it); the replica's ASGI messages are relayed
to the client as they come, so streams stream. The API itself (routes, validation, errors, auth) is the
replica's: the ordinary ``ninfer serve`` app.

Stored responses: the ingress remembers which replica answered each ``POST /v1/responses`` (from the
``x-request-id`` and replica headers of the answer), in a bounded LRU, and pins requests naming that id
(``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``) to that replica.

Replica failure: a replica that dies while it holds a request fails that request with a 503 in the
protocol's error shape, naming the replica failure; if the answer had already started streaming, the
stream ends with an error event instead (the status line is gone). Nothing is retried (the request may
have started generating). Ray marks the replica dead and starts a replacement; the router sends new
requests to the replicas still running.

Client disconnects: the ingress watches its ``receive`` channel and cancels the replica call, which
reaches the replica's app as ``http.disconnect`` (the engine request is cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from ninfer_serve.errors import ApiError, anthropic_body, error_body, openai_body, protocol_of
from ninfer_serve.ray_serve.affinity import affinity_of
from ninfer_serve.ray_serve.envelope import REPLICA_HEADER, ForwardedRequest
from ninfer_serve.sse import DONE, data_event, dumps, named_event

log = logging.getLogger("ninfer.serve")

Message = dict[str, Any]
_REPLICA_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)


class BodyTooLarge(Exception):
    """The request body passed the limit while it was being read."""


class ClientGone(Exception):
    """The client disconnected before its request was read whole."""


class ResponseOwners:
    """Response id -> unique id of the replica that stores it, the ``size`` most recent."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._owners: OrderedDict[str, str] = OrderedDict()

    def record(self, response_id: str, replica: str) -> None:
        if self._size <= 0:
            return
        self._owners[response_id] = replica
        self._owners.move_to_end(response_id)
        while len(self._owners) > self._size:
            self._owners.popitem(last=False)

    def owner(self, response_id: str | None) -> str | None:
        return None if response_id is None else self._owners.get(response_id)


def replica_failure(exc: BaseException) -> ApiError:
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return ApiError("unavailable", f"the engine replica serving this request failed before it finished "
                                   f"({type(exc).__name__}: {first_line}); new requests go to the remaining "
                                   f"replicas, retry it")


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _read_body(receive: Any, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _stream_error(err: ApiError, path: str) -> bytes:
    """The end of an already started SSE answer, written as the app writes a mid-stream error."""
    if protocol_of(path) == "anthropic":
        return named_event("error", anthropic_body(err))
    return data_event(openai_body(err)) + DONE


class IngressApp:
    """The ASGI app of the ingress deployment. ``replicas``: a handle to the engine replica deployment;
    ``max_body_bytes``: the body limit (413 past it, as the replicas' own); ``response_owners``: how many
    stored responses' owners to remember."""

    def __init__(self, replicas: Any, *, max_body_bytes: int, response_owners: int) -> None:
        self._call = replicas.options(stream=True, method_name="handle_request")
        self._max_body = max_body_bytes
        self._owners = ResponseOwners(response_owners)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        # websocket: no route takes one; returning without accepting refuses the handshake.

    @staticmethod
    async def _lifespan(receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path, method = scope["path"], scope["method"]
        try:
            body = await _read_body(receive, self._max_body)
        except BodyTooLarge:
            await _send_error(send, ApiError("too_large", f"the request body is larger than this server's limit "
                                                          f"of {self._max_body / 2**20:g} MiB (--max-body-mib)"),
                              path)
            return
        except ClientGone:
            return
        affinity = affinity_of(method, path, body)
        client = scope.get("client")
        request = ForwardedRequest(method=method, path=path, query_string=scope.get("query_string", b""),
                                   headers=tuple((k, v) for k, v in scope.get("headers", ())), body=body,
                                   client=tuple(client) if client else None, affinity_key=affinity.key,
                                   pinned_replica=self._owners.owner(affinity.response_id))
        answer = self._call.remote(request)
        watch = asyncio.ensure_future(_until_disconnect(receive))
        watch.add_done_callback(lambda t: answer.cancel() if not t.cancelled() else None)
        started: Message | None = None
        finished = False
        try:
            async for message in answer:
                if message["type"] == "http.response.start":
                    started = message
                    if method == "POST" and path == "/v1/responses":
                        self._remember_owner(message)
                await send(message)
            finished = True
        except Exception as exc:  # noqa: BLE001 - a Ray or proxy error must not leave the client without an answer
            if watch.done() and not watch.cancelled():
                return  # the client went away and the replica call was cancelled with it: nobody to answer
            if isinstance(exc, _REPLICA_LOST):
                log.warning("replica failure on %s %s: %s", method, path, exc)
                err = replica_failure(exc)
            else:
                log.exception("forwarding %s %s failed", method, path)
                err = ApiError("internal", "internal server error")
            with contextlib.suppress(Exception):  # the client may be gone too
                await _fail(send, err, path, started)
        finally:
            if not finished:
                # Also when Ray's proxy cancels this call (its client disconnected): the replica must stop too.
                with contextlib.suppress(Exception):
                    answer.cancel()
            watch.cancel()
            with contextlib.suppress(BaseException):
                await watch

    def _remember_owner(self, start: Message) -> None:
        headers = start.get("headers", [])
        response_id = _header(headers, b"x-request-id")
        replica = _header(headers, REPLICA_HEADER.encode())
        if response_id and replica:
            self._owners.record(response_id, replica)


async def _until_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_error(send: Any, err: ApiError, path: str) -> None:
    payload = dumps(error_body(err, protocol_of(path))).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


async def _fail(send: Any, err: ApiError, path: str, started: Message | None) -> None:
    """Answer ``err``: a whole error response if nothing was sent yet; else end the started body, with an
    error event when it is an SSE stream (a JSON body cut short is all a client can be given then)."""
    if started is None:
        await _send_error(send, err, path)
    elif (_header(started.get("headers", []), b"content-type") or "").startswith("text/event-stream"):
        await send({"type": "http.response.body", "body": _stream_error(err, path), "more_body": False})
    else:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
