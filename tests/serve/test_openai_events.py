"""ninfer_serve.sse.openai_events: the tail every OpenAI stream shares (errors after the first event become
an error event, then ``[DONE]``; closing the stream closes the route's generator)."""

from __future__ import annotations

import asyncio
import json

from ninfer_serve.errors import ApiError
from ninfer_serve.sse import DONE, data_event, openai_events


def _drain(events) -> list[bytes]:
    async def run():
        return [e async for e in events]

    return asyncio.run(run())


def _body(fail: BaseException | None):
    async def gen():
        yield data_event({"n": 1})
        if fail is not None:
            raise fail
        yield data_event({"n": 2})

    return gen()


def _error(event: bytes) -> dict:
    assert event.startswith(b"data: ")
    return json.loads(event[len(b"data: "):])["error"]


def test_events_then_done():
    assert _drain(openai_events(_body(None), "t")) == [data_event({"n": 1}), data_event({"n": 2}), DONE]


def test_an_api_error_after_the_start_is_an_error_event_before_done():
    out = _drain(openai_events(_body(ApiError("invalid_request", "bad thing", param="x")), "t"))
    assert out[0] == data_event({"n": 1}) and out[-1] == DONE and len(out) == 3
    assert _error(out[1])["message"] == "bad thing"


def test_a_bug_is_an_internal_error_event(caplog):
    out = _drain(openai_events(_body(RuntimeError("boom")), "stream s1"))
    assert _error(out[1])["message"] == "internal server error" and out[-1] == DONE
    assert "stream s1 failed" in caplog.text


def test_closing_the_stream_closes_the_route_generator():
    closed = []

    async def gen():
        try:
            yield b"a"
            yield b"b"
        finally:
            closed.append(True)

    async def run():
        events = openai_events(gen(), "t")
        assert await events.__anext__() == b"a"
        await events.aclose()  # a client disconnect
        assert closed == [True]  # at once, not when the event loop finalises stray generators

    asyncio.run(run())
