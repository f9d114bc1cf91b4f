"""/v1/responses with exact model output (the scripted engine, serve_scripted.py), the response store's
bounds, input conversion, an error after the stream started, and cancellation when the client goes away."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from ninfer.contracts.frontend import OutputDelta
from ninfer_serve import Gateway, ServeConfig, create_app
from ninfer_serve.errors import ApiError
from ninfer_serve.generation import Step
from ninfer_serve.responses_input import input_messages
from ninfer_serve.responses_models import ResponseObject, ResponsesRequest
from ninfer_serve.responses_output import OutputAssembler, ResponseFrame
from ninfer_serve.responses_store import ResponseStore
from ninfer_serve.responses_stream import response_events
from serve_helpers import MODEL_ID, AsgiCall, client_for, scripted_engine, wait_idle

CALL = ("<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
WEATHER = {"type": "function", "name": "weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def http(scripted):
    with client_for(scripted, responses_store_size=2) as c:
        yield c
    wait_idle(scripted)


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver.local/v1", api_key="none", http_client=http, max_retries=0)


def script(client, text: str, **fields):
    return client.responses.create(model=MODEL_ID, input=f"SCRIPT:{text}", **fields)


def test_reasoning_text_and_call_items_in_order(client):
    r = script(client, "plan</think>\n\nLet me check.\n\n" + CALL, tools=[WEATHER])
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text.strip() == "plan" and r.output_text == "Let me check."
    call = r.output[2]
    assert call.name == "weather" and json.loads(call.arguments) == {"city": "Paris"} and call.status == "completed"
    assert r.status == "completed" and r.usage.output_tokens_details.reasoning_tokens >= 1


def test_streamed_call_matches_the_json_answer(client):
    fields = dict(input="SCRIPT:Checking.\n\n" + CALL, tools=[WEATHER], reasoning={"effort": "none"})
    whole = client.responses.create(model=MODEL_ID, **fields)
    with client.responses.stream(model=MODEL_ID, **fields) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output_text == whole.output_text == "Checking."
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == json.loads(whole.output[1].arguments)


def test_tool_choice_none_keeps_the_markup_as_text(client):
    r = script(client, CALL, tools=[WEATHER], tool_choice="none", reasoning={"effort": "none"})
    assert [o.type for o in r.output] == ["message"] and r.output_text == CALL


def test_the_store_keeps_the_most_recent_responses(client):
    a = script(client, "one", reasoning={"effort": "none"})
    b = script(client, "two", previous_response_id=a.id, reasoning={"effort": "none"})
    c = script(client, "three", reasoning={"effort": "none"})   # the store holds 2: a goes
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(a.id)
    # b still carries a's turn: a chain outlives its evicted links.
    d = client.responses.create(model=MODEL_ID, previous_response_id=b.id, reasoning={"effort": "none"},
                                input="SCRIPT:four")
    assert d.output_text == "four" and d.usage.input_tokens > c.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(c.id)     # evicted by d (b was used more recently)


def test_input_items_become_chat_messages():
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "r2"}]}]})
    assert input_messages(req.input) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"}]


def test_store_bounds():
    store = ResponseStore(2)
    objs = [ResponseObject(id=f"resp_{i}", created_at=0, status="completed", model="m") for i in range(3)]
    store.put(objs[0], [])
    store.put(objs[1], [])
    assert store.get("resp_0") is not None     # now the most recent
    store.put(objs[2], [])
    assert store.get("resp_1") is None and len(store) == 2
    assert store.delete("resp_0") and not store.delete("resp_0")
    none = ResponseStore(0)
    none.put(objs[0], [])
    assert none.get("resp_0") is None
    with pytest.raises(ValueError):
        ResponseStore(-1)


class _FailingGeneration:
    request_id = "resp_x"

    def __init__(self) -> None:
        self.closed = False

    async def events(self):
        yield Step((OutputDelta("content", "Hel"),), (1,))
        raise ApiError("unavailable", "the engine failed")

    def close(self) -> None:
        self.closed = True


class _Gateway:
    class config:  # noqa: N801 - stands in for ServeConfig
        keepalive_s = 5.0


def test_an_error_after_the_start_is_an_error_event_then_response_failed():
    gen = _FailingGeneration()
    frame = ResponseFrame.of(ResponsesRequest(input="x"), response_id="resp_x", model="m")
    stored = []

    async def run():
        return [e async for e in response_events(_Gateway(), gen, frame, OutputAssembler(thinking_open=False),
                                                 answer_expected=True, on_done=stored.append)]

    events = []
    for chunk in asyncio.run(run()):
        for block in chunk.decode().split("\n\n"):
            if block.startswith("event: "):
                name, data = block.split("\n", 1)
                events.append((name[len("event: "):], json.loads(data[len("data: "):])))
    assert [n for n, _ in events][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    err, failed = events[-2][1], events[-1][1]["response"]
    assert err["code"] == "server_error" and err["message"] == "the engine failed"
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": "the engine failed"}
    assert gen.closed and stored == []


def test_a_stream_the_client_leaves_is_cancelled(engine):
    eng = scripted_engine(engine.frontend, max_concurrency=1, queue_capacity=0, delay=0.01)
    app = create_app(Gateway(eng, ServeConfig(model_id=MODEL_ID)))

    async def run():
        # No SCRIPT: the scripted model says " a" until the budget ends.
        call = AsgiCall(app, "/v1/responses", {"model": MODEL_ID, "input": "go", "stream": True,
                                               "reasoning": {"effort": "none"}}).start()
        assert await call.status() == 200
        assert b"response.created" in await call.chunk()
        await call.chunk()
        await call.disconnect()

    try:
        asyncio.run(run())
        stats = wait_idle(eng)
        assert stats.cancelled == 1 and app.state.responses.get("resp_x") is None
        assert len(app.state.responses) == 0
    finally:
        eng.close()


def test_a_negative_store_size_is_a_clear_error(capsys):
    from ninfer.cli.main import main

    assert main(["serve", "--responses-store-size", "-1"]) == 2
    assert "--responses-store-size must be >= 0" in capsys.readouterr().err
