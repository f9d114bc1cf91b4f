"""/v1/responses on the real embedded default model, driven by the official openai client
(``responses.create`` / ``responses.stream``; the client's HTTP transport is the app's TestClient).

Few tokens, greedy (temperature 0) or seeded, so every answer is deterministic.
"""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from serve_helpers import MODEL_ID, client_for, wait_idle

NO_THINK = {"effort": "none"}
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 10},
                                           "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
          "required": ["title", "year"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "weather", "description": "current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
# A forced WEATHER call is at most 118 tokens (its markup's 86 bytes plus a city of at most 8 characters of 4 bytes,
# one byte-level token per byte at worst): room for the whole call whatever tokens this small model picks.
CALL_TOKENS = 128


@pytest.fixture(scope="module")
def http(engine):
    with client_for(engine) as c:
        yield c
    wait_idle(engine)


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver.local/v1", api_key="none", http_client=http, max_retries=0)


def create(client, **fields):
    return client.responses.create(model=MODEL_ID, temperature=0, **fields)


def prompt_tokens(http, messages, *, generation_prompt: bool = True) -> int:
    r = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False},
                                     "add_generation_prompt": generation_prompt})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def settled(engine):
    """The engine's stats once it holds no request (they are published after each engine step)."""
    deadline = time.monotonic() + 10
    while (s := engine.stats()).outstanding and time.monotonic() < deadline:
        time.sleep(0.01)
    return s


def test_text_in_text_out(client, http):
    r = create(client, input="What does os.path.join do?", max_output_tokens=12, reasoning=NO_THINK)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL_ID
    assert r.status in ("completed", "incomplete") and r.created_at > 0
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and r.output_text == msg.content[0].text and r.output_text
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and 0 < u.output_tokens <= 12
    assert u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens == prompt_tokens(http, [{"role": "user", "content": "What does os.path.join do?"}])


def test_thinking_is_a_reasoning_item(client):
    r = create(client, input="hi", max_output_tokens=40)
    assert r.output[0].type == "reasoning" and r.output[0].id.startswith("rs_")
    assert r.output[0].content[0].type == "reasoning_text" and r.output[0].content[0].text
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens


def test_instructions_are_a_system_message(client, http):
    r = create(client, instructions="Answer in French.", input="Say hello.", max_output_tokens=4, reasoning=NO_THINK)
    assert r.instructions == "Answer in French."
    assert r.usage.input_tokens == prompt_tokens(http, [{"role": "system", "content": "Answer in French."},
                                                        {"role": "user", "content": "Say hello."}])


def test_multi_item_input(client, http):
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a "}, {"type": "input_text",
                                                                                     "text": "module."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "os"}]},
             {"role": "user", "content": "Another?"}]
    r = create(client, input=items, max_output_tokens=4, reasoning=NO_THINK)
    assert r.usage.input_tokens == prompt_tokens(http, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a module."},
        {"role": "assistant", "content": "os"}, {"role": "user", "content": "Another?"}])


def test_previous_response_id_continues_the_conversation_from_the_cache(client, http, engine):
    first = create(client, input="Name a Python module.", max_output_tokens=6, reasoning=NO_THINK)
    before = settled(engine)
    second = create(client, input="Why?", previous_response_id=first.id, max_output_tokens=4, reasoning=NO_THINK)
    after = settled(engine)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_tokens(http, [
        {"role": "user", "content": "Name a Python module."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Why?"}])
    # The repeated prefix is served by the context cache: at least the first turn's user message (the answer
    # after it is re-rendered without its empty think block, so the checkpoint at the turn's end is the one).
    hit = after.cache_hit_tokens - before.cache_hit_tokens
    assert after.cache_hits == before.cache_hits + 1
    assert hit >= prompt_tokens(http, [{"role": "user", "content": "Name a Python module."}], generation_prompt=False)
    # The response reports that hit as its cached input tokens (the first turn had none).
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens == hit
    third = create(client, input="Thanks.", previous_response_id=second.id, max_output_tokens=2, reasoning=NO_THINK)
    assert third.usage.input_tokens > second.usage.input_tokens


def test_json_schema_output_parses_and_validates(client):
    fmt = {"type": "json_schema", "name": "book", "schema": SCHEMA, "strict": True}
    r = create(client, input="Describe a book as JSON.", text={"format": fmt}, max_output_tokens=80,
               reasoning=NO_THINK)
    assert r.status == "completed", r.usage
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_json_object_output(client):
    r = client.responses.create(model=MODEL_ID, input="Describe json.dumps as a JSON object.", temperature=1.0,
                                top_p=1.0, text={"format": {"type": "json_object"}}, max_output_tokens=300,
                                reasoning=NO_THINK, extra_body={"seed": 0, "top_k": 0})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


def test_function_tool_call_round_trip(client, http):
    r = create(client, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
               reasoning=NO_THINK, max_output_tokens=CALL_TOKENS)
    assert r.status == "completed"
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    follow = create(client, previous_response_id=r.id, tools=[WEATHER], reasoning=NO_THINK, max_output_tokens=6,
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 20 C"}])
    assert follow.status in ("completed", "incomplete") and follow.output
    # The same conversation sent whole (the call as an input item) renders the same prompt.
    whole = create(client, tools=[WEATHER], reasoning=NO_THINK, max_output_tokens=6, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": "weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 20 C"}])
    assert whole.usage.input_tokens == follow.usage.input_tokens and whole.output_text == follow.output_text


def test_max_output_tokens_makes_it_incomplete(client):
    r = create(client, input="Tell me a long story.", max_output_tokens=3, reasoning=NO_THINK)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_stream_event_order_and_final_response(client):
    fields = dict(input="What is json.dumps?", max_output_tokens=24, reasoning={"effort": "low"})
    whole = create(client, **fields)
    with client.responses.stream(model=MODEL_ID, temperature=0, **fields) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    final = events[-1].response
    assert [o.type for o in final.output] == [o.type for o in whole.output]
    for index, item in enumerate(final.output):
        mine = [e.type for e in events if getattr(e, "output_index", None) == index]
        text = "reasoning_text" if item.type == "reasoning" else "output_text"
        assert mine[:2] == ["response.output_item.added", "response.content_part.added"]
        assert mine[-3:] == [f"response.{text}.done", "response.content_part.done", "response.output_item.done"]
        assert set(mine[2:-3]) == {f"response.{text}.delta"}
        deltas = "".join(e.delta for e in events if e.type == f"response.{text}.delta" and e.output_index == index)
        assert deltas == item.content[0].text == whole.output[index].content[0].text
    # Equal counts; the repeated prompt's cached share may differ (its second run hits the context cache).
    assert final.usage.model_copy(update={"input_tokens_details": None}) == \
        whole.usage.model_copy(update={"input_tokens_details": None})


def test_stream_function_call_events(client):
    with client.responses.stream(model=MODEL_ID, temperature=0, input="Weather in Oslo?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "weather"}, reasoning=NO_THINK,
                                 max_output_tokens=CALL_TOKENS, parallel_tool_calls=False) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    at = types.index("response.function_call_arguments.delta")
    assert types[at - 1] == "response.output_item.added" and types[at + 1:at + 3] == [
        "response.function_call_arguments.done", "response.output_item.done"]
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == json.loads(events[at + 1].arguments)


def test_retrieve_delete_and_store_false(client):
    r = create(client, input="hi", max_output_tokens=2, reasoning=NO_THINK)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = create(client, input="hi", max_output_tokens=2, reasoning=NO_THINK, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_unknown_previous_response_id_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        create(client, input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    err = info.value.body
    assert err["param"] == "previous_response_id" and err["code"] == "previous_response_not_found"
    assert err["type"] == "invalid_request_error" and "resp_nope" in err["message"]


@pytest.mark.parametrize("fields, param, code", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type", "unsupported_value"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_value"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", None),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice", None),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens", "context_length_exceeded"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}]},
     "input[0].arguments", None),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", None),
    ({"input": "hi", "background": True}, "background", "unsupported_value"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include", "unsupported_value"),
    ({"input": "hi", "include": ["reasoning.encrypted_content", "bogus"]}, "include", None),
    ({}, None, None),
])
def test_malformed_requests_are_400s_naming_the_field(client, fields, param, code):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL_ID, **fields)
    err = info.value.body
    assert info.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code, err


def test_include_of_output_never_produced_changes_nothing(client):
    # Codex-style clients ask for encrypted reasoning with store=false; there is none to include.
    plain = create(client, input="Name a Python module.", max_output_tokens=6, reasoning=NO_THINK, store=False)
    asked = create(client, input="Name a Python module.", max_output_tokens=6, reasoning=NO_THINK, store=False,
                   include=["reasoning.encrypted_content", "web_search_call.results"])
    assert asked.output_text == plain.output_text and asked.usage.input_tokens == plain.usage.input_tokens


def test_output_items_passed_back_render_as_the_chain_does(client):
    """Manual context management (the output items sent back as input) and previous_response_id give the same
    prompt, reasoning item included, and so the same greedy answer."""
    first = create(client, input="Name a Python module.", max_output_tokens=30)
    assert first.output[0].type == "reasoning"
    chained = create(client, input="Why?", previous_response_id=first.id, max_output_tokens=4, reasoning=NO_THINK)
    manual = create(client, max_output_tokens=4, reasoning=NO_THINK, store=False, input=[
        {"role": "user", "content": "Name a Python module."}, *first.output, {"role": "user", "content": "Why?"}])
    assert manual.usage.input_tokens == chained.usage.input_tokens and manual.output_text == chained.output_text


def test_over_real_http(artifact):
    """A real `ninfer serve` process: SSE framing through uvicorn, the store flag, a chain."""
    import signal

    from serve_helpers import start_server_process

    base, proc = start_server_process(artifact, "--device", "cpu", "--max-context", "512", "--model-id", "m",
                                      "--responses-store-size", "1", "--log-level", "warning", "--quiet")
    try:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0)
        with c.responses.stream(model="m", input="hi", max_output_tokens=6, temperature=0,
                                reasoning=NO_THINK) as stream:
            types = [e.type for e in stream]
            final = stream.get_final_response() if types[-1] == "response.completed" else None
        assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
        assert "response.output_text.delta" in types
        first = c.responses.retrieve(final.id) if final else None
        r = c.responses.create(model="m", input="hi", max_output_tokens=4, temperature=0, reasoning=NO_THINK)
        follow = c.responses.create(model="m", input="more", previous_response_id=r.id, max_output_tokens=2,
                                    temperature=0, reasoning=NO_THINK)
        assert follow.usage.input_tokens > r.usage.input_tokens
        with pytest.raises(openai.NotFoundError):   # the store holds one response: r went when follow came
            c.responses.retrieve(r.id)
        assert first is None or first.id == final.id
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
