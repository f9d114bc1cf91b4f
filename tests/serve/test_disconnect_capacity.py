"""Client disconnects cancel their request in the engine and free its capacity; a full engine
answers 429 while the running request is unharmed; idle streams get keep-alives.

Requests are driven through raw ASGI (serve_helpers.AsgiCall) against a one-request-at-a-time, no-queue scripted
engine whose forwards are slowed, so "running", "full" and "free again" are exact engine states.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from ninfer_serve import Gateway, ServeConfig, create_app
from serve_helpers import MODEL_ID, AsgiCall, chat, scripted_engine, wait_idle


@pytest.fixture
def one_at_a_time(engine):
    eng = scripted_engine(engine.frontend, max_concurrency=1, queue_capacity=0, delay=0.01)
    yield eng
    eng.close()


def app_for(eng, **config):
    gw = Gateway(eng, ServeConfig(model_id=MODEL_ID, **config))
    return create_app(gw), gw


async def wait_running(eng, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while eng.stats().running == 0:
        assert time.monotonic() < end, "the request never started running"
        await asyncio.sleep(0.01)


LONG = chat("filler", max_tokens=400, ignore_eos=True)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_and_frees_capacity(one_at_a_time, stream):
    app, gw = app_for(one_at_a_time)

    async def scenario():
        call = AsgiCall(app, "/v1/chat/completions", {**LONG, "stream": stream}).start()
        if stream:
            assert await call.status() == 200
            assert (await call.chunk()).startswith(b"data: ")
        await wait_running(one_at_a_time)
        # The one running place is taken: another request is refused now.
        other = AsgiCall(app, "/v1/chat/completions", chat("SCRIPT:x")).start()
        assert await other.status() == 429
        await other.rest()
        before = one_at_a_time.stats()
        await call.disconnect()
        stats = wait_idle(one_at_a_time)
        assert stats.cancelled == before.cancelled + 1
        assert stats.completion_tokens < before.completion_tokens + 400  # it did not run to the end
        again = AsgiCall(app, "/v1/chat/completions", chat("SCRIPT:served", chat_template_kwargs={
            "enable_thinking": False})).start()
        assert await again.status() == 200
        assert b'"content":"served"' in await again.rest()

    asyncio.run(scenario())
    text = gw.metrics.exposition().decode()
    assert 'ninfer_requests_total{endpoint="/v1/chat/completions",outcome="cancelled"} 1.0' in text
    assert 'ninfer_requests_total{endpoint="/v1/chat/completions",outcome="rejected"} 1.0' in text


def test_anthropic_stream_disconnect(one_at_a_time):
    app, _ = app_for(one_at_a_time)

    async def scenario():
        call = AsgiCall(app, "/v1/messages", {"model": MODEL_ID, "max_tokens": 400, "stream": True,
                                              "messages": [{"role": "user", "content": "filler"}]}).start()
        assert await call.status() == 200
        assert b"message_start" in await call.chunk()
        await wait_running(one_at_a_time)
        await call.disconnect()
        wait_idle(one_at_a_time)

    asyncio.run(scenario())
    assert one_at_a_time.stats().cancelled == 1


def test_running_stream_unharmed_by_refusals_and_errors(one_at_a_time):
    app, _ = app_for(one_at_a_time)

    async def scenario():
        call = AsgiCall(app, "/v1/completions", {"prompt": "filler", "max_tokens": 30, "ignore_eos": True,
                                                 "stream": True}).start()
        assert await call.status() == 200
        await wait_running(one_at_a_time)
        for payload in ({"prompt": "x"}, {"prompt": 5}, {"prompt": "x", "model": "nope"}):
            other = AsgiCall(app, "/v1/completions", payload).start()
            assert await other.status() in (400, 404, 429)
            await other.rest()
        body = (await call.rest()).decode()
        assert body.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in body
        assert body.count('"text":" a"') == 30

    asyncio.run(scenario())
    wait_idle(one_at_a_time)


def test_idle_stream_gets_keepalives(engine):
    eng = scripted_engine(engine.frontend, max_concurrency=1, queue_capacity=0, delay=0.15)
    try:
        app, _ = app_for(eng, keepalive_s=0.02)

        async def scenario():
            call = AsgiCall(app, "/v1/chat/completions", {**chat("SCRIPT:ok"), "max_tokens": 3,
                                                          "stream": True}).start()
            assert await call.status() == 200
            return (await call.rest()).decode()

        body = asyncio.run(scenario())
        assert ": keep-alive\n\n" in body and body.endswith("data: [DONE]\n\n")
        wait_idle(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat("SCRIPT:x", stream=True)),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True}),
    ("/v1/messages", {"model": MODEL_ID, "max_tokens": 3, "stream": True,
                      "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/responses", {"model": MODEL_ID, "input": "x", "max_output_tokens": 3, "stream": True}),
])
def test_stream_refused_in_the_queue_gets_an_http_status(engine, path, body):
    """A streaming request that times out in the queue before its stream starts is answered with the HTTP 429
    (which SDKs retry), not a 200 whose stream holds only an error event; the running stream is unharmed."""
    eng = scripted_engine(engine.frontend, max_concurrency=1, queue_capacity=1, delay=0.01, queue_timeout_s=0.2)
    try:
        app, _ = app_for(eng, keepalive_s=600.0)

        async def scenario():
            running = AsgiCall(app, "/v1/completions", {"prompt": "filler", "max_tokens": 400, "ignore_eos": True,
                                                        "stream": True}).start()
            assert await running.status() == 200
            await wait_running(eng)
            queued = AsgiCall(app, path, body).start()
            assert await queued.status() == 429
            refused = (await queued.rest()).decode()
            assert "waited too long" in refused and "queue_timeout_s=0.2" in refused
            await running.disconnect()

        asyncio.run(scenario())
        wait_idle(eng)
    finally:
        eng.close()


def test_the_status_line_outwaits_the_queue_timeout(engine):
    """With a queue timeout longer than the keep-alive, a stream's status line still waits for the queue's verdict
    (up to the timeout plus the keep-alive): the refused request gets its 429, not a 200 whose stream then carries
    the refusal as an error event (which clients do not retry)."""
    eng = scripted_engine(engine.frontend, max_concurrency=1, queue_capacity=1, delay=0.2, queue_timeout_s=2.0)
    try:
        app, gw = app_for(eng, keepalive_s=1.5)
        assert gw.admit_wait_s == 3.5

        async def scenario():
            running = AsgiCall(app, "/v1/completions", {"prompt": "filler", "max_tokens": 400, "ignore_eos": True,
                                                        "stream": True}).start()
            assert await running.status() == 200
            await wait_running(eng)
            queued = AsgiCall(app, "/v1/chat/completions", chat("SCRIPT:x", stream=True)).start()
            assert await queued.status() == 429
            assert "waited too long" in (await queued.rest()).decode()
            await running.disconnect()

        asyncio.run(scenario())
        wait_idle(eng)
    finally:
        eng.close()
    plain = scripted_engine(engine.frontend, max_concurrency=1)
    try:
        assert app_for(plain, keepalive_s=1.5)[1].admit_wait_s == 1.5   # no queue timeout: the keep-alive alone
    finally:
        plain.close()
