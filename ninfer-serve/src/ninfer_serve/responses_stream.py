"""Streaming ``POST /v1/responses``: the Responses API's server-sent events.

Each event is sent as ``event: TYPE`` + ``data: JSON`` and carries a ``sequence_number`` counting
from 0. The stream opens with ``response.created`` and ``response.in_progress`` (the response
object, status ``in_progress``, no output), then the output items' events
(:class:`~ninfer_serve.responses_output.OutputAssembler`), and ends with ``response.completed``, or
``response.incomplete`` (``max_output_tokens`` reached) carrying the whole response object; there is
no ``[DONE]`` line (OpenAI sends none on this API). An idle stream gets SSE comments as keep-alives.

An error after the stream started is an ``error`` event (``code``, ``message``, ``param``) followed by
``response.failed`` (the response with status ``failed`` and its ``error``). A finished response is
stored (``store: true``) when its last event is written; a stream the client abandoned is cancelled
(:mod:`ninfer_serve.sse`) and not stored.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from ninfer_serve.errors import ApiError
from ninfer_serve.gateway import Gateway
from ninfer_serve.generation import Generation, Outcome, Step
from ninfer_serve.responses_models import ResponseError, ResponseObject
from ninfer_serve.responses_output import OutputAssembler, ResponseFrame, conclude
from ninfer_serve.sse import COMMENT_KEEPALIVE, KEEPALIVE, named_event, with_keepalive

log = logging.getLogger("ninfer.serve")


def error_code(err: ApiError) -> str:
    """The ``code`` of a failed response: OpenAI's code of the condition, else a generic one."""
    if err.code:
        return err.code
    return "server_error" if err.status >= 500 else "invalid_request_error"


async def response_events(gw: Gateway, gen: Generation, frame: ResponseFrame, assembler: OutputAssembler, *,
                          answer_expected: bool, on_done: Callable[[ResponseObject], None]) -> AsyncIterator[bytes]:
    """The stream body. ``on_done`` receives the finished response (to store it) before its last event."""
    sequence = 0

    def event(payload: dict[str, Any]) -> bytes:
        nonlocal sequence
        out = named_event(payload["type"], {**payload, "sequence_number": sequence})
        sequence += 1
        return out

    def lifecycle(kind: str, response: ResponseObject) -> bytes:
        return event({"type": kind, "response": response.model_dump(mode="json")})

    try:
        yield lifecycle("response.created", frame.object("in_progress"))
        yield lifecycle("response.in_progress", frame.object("in_progress"))
        async for item in with_keepalive(gen.events(), gw.config.keepalive_s):
            if item is KEEPALIVE:
                yield COMMENT_KEEPALIVE
            elif isinstance(item, Step):
                for payload in assembler.feed(item):
                    yield event(payload)
            elif isinstance(item, Outcome):
                response, closing = conclude(frame, assembler, item, answer_expected=answer_expected)
                for payload in closing:
                    yield event(payload)
                on_done(response)
                kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
                yield lifecycle(kind, response)
    except ApiError as err:
        yield from_error(event, lifecycle, frame, assembler, err)
    except Exception:  # noqa: BLE001 - a bug must not leave the client waiting on a half-open stream
        log.exception("responses stream %s failed", gen.request_id)
        yield from_error(event, lifecycle, frame, assembler, ApiError("internal", "internal server error"))
    finally:
        gen.close()


def from_error(event: Callable[[dict[str, Any]], bytes], lifecycle: Callable[[str, ResponseObject], bytes],
               frame: ResponseFrame, assembler: OutputAssembler, err: ApiError) -> bytes:
    """The ``error`` and ``response.failed`` events of a stream that failed after it started."""
    code = error_code(err)
    failed = frame.object("failed", assembler.items, error=ResponseError(code=code, message=err.message))
    return (event({"type": "error", "code": code, "message": err.message, "param": err.param})
            + lifecycle("response.failed", failed))
