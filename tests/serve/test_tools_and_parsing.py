"""Tool calls, tool_choice, reasoning and stop strings, end to end with exact model output.

The scripted engine (serve_scripted.py) emits the text after ``SCRIPT:`` in the prompt through the
real Qwen frontend, so every assertion here is about what the gateway makes of known output.
"""

from __future__ import annotations

import json

import pytest
from serve_helpers import MODEL_ID, client_for, sse_json, wait_idle

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
NO_THINK = {"enable_thinking": False}


@pytest.fixture(scope="module")
def client(scripted):
    with client_for(scripted) as c:
        yield c
    wait_idle(scripted)


def chat(script: str, **fields) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": f"SCRIPT:{script}"}], **fields}


def test_auto_tool_call_json(client):
    body = client.post("/v1/chat/completions", json=chat("Let me check.\n\n" + CALL, tools=[WEATHER],
                                                          chat_template_kwargs=NO_THINK)).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me check."
    [call] = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}  # typed by the schema


def test_auto_tool_call_stream(client):
    r = client.post("/v1/chat/completions", json=chat(CALL + "\n" + CALL.replace("Paris", "Oslo"), tools=[WEATHER],
                                                       chat_template_kwargs=NO_THINK, stream=True))
    chunks = sse_json(r.text)
    calls = [tc for c in chunks for tc in (c["choices"][0]["delta"].get("tool_calls") or [])]
    assert [tc["index"] for tc in calls] == [0, 1]
    assert [json.loads(tc["function"]["arguments"])["city"] for tc in calls] == ["Paris", "Oslo"]
    assert all(tc["id"] and tc["type"] == "function" and tc["function"]["name"] == "get_weather" for tc in calls)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks[1:])


def test_tool_choice_none_leaves_calls_as_content(client):
    body = client.post("/v1/chat/completions", json=chat(CALL, tools=[WEATHER], tool_choice="none",
                                                          chat_template_kwargs=NO_THINK)).json()
    msg = body["choices"][0]["message"]
    assert "tool_calls" not in msg and msg["content"] == CALL  # omitted when none, as OpenAI does
    assert body["choices"][0]["finish_reason"] == "stop"


def test_parallel_tool_calls_false_keeps_the_first(client):
    two = CALL + "\n" + CALL.replace("Paris", "Oslo")
    body = client.post("/v1/chat/completions", json=chat(two, tools=[WEATHER], parallel_tool_calls=False,
                                                          chat_template_kwargs=NO_THINK)).json()
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] == "Paris"


def test_named_tool_choice_forces_the_call(client):
    # tool_choice required/named is a tool-call grammar (constrained decoding): the script is the call.
    call = CALL.replace("Paris", "Rome").replace("<parameter=days>\n3\n</parameter>\n", "")
    req = chat(call, tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}},
               chat_template_kwargs=NO_THINK)
    body = client.post("/v1/chat/completions", json=req).json()
    choice = body["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    assert choice["finish_reason"] == "stop"  # OpenAI's finish for a call forced by name
    assert choice["message"]["content"] is None and choice["message"]["reasoning_content"] is None
    stream = sse_json(client.post("/v1/chat/completions", json={**req, "stream": True}).text)
    calls = [tc for c in stream for tc in (c["choices"][0]["delta"].get("tool_calls") or [])]
    assert [tc["function"]["name"] for tc in calls] == ["get_weather"]


def test_required_tool_choice_lets_the_model_name_the_function(client):
    script = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    body = client.post("/v1/chat/completions", json=chat(script, tools=[WEATHER, CLOCK], tool_choice="required",
                                                          chat_template_kwargs=NO_THINK)).json()
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"]) == {}
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_required_tool_choice_after_thinking(client):
    script = "The time tool fits.\n</think>\n\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    body = client.post("/v1/chat/completions", json=chat(script, tools=[WEATHER, CLOCK],
                                                          tool_choice="required")).json()
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == "The time tool fits."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time"]


def test_a_model_straying_from_a_forced_call_is_held_to_it(client):
    # The script wants free text; the grammar only allows the (parameterless) get_time call, then the end.
    body = client.post("/v1/chat/completions", json=chat("oops no parameters here", tools=[WEATHER, CLOCK],
                                                          tool_choice={"type": "function",
                                                                       "function": {"name": "get_time"}},
                                                          parallel_tool_calls=False,  # exactly one call
                                                          chat_template_kwargs=NO_THINK)).json()
    msg = body["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time"]
    assert msg["content"] is None and body["choices"][0]["finish_reason"] == "stop"


def test_tool_history_renders_into_the_prompt(client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "user", "content": [{"type": "text", "text": "SCRIPT:"}, {"type": "text", "text": "It is sunny."}]},
    ]
    r = client.post("/v1/chat/completions", json={"model": MODEL_ID, "messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    # Thinking is on (the default): the scripted text is all reasoning, since it never closes </think>.
    assert r.json()["choices"][0]["message"]["reasoning_content"] == "It is sunny."
    tokens = client.post("/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()
    assert tokens["count"] == r.json()["usage"]["prompt_tokens"]
    text = client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and "Be brief." in text


def test_reasoning_split_json_and_stream(client):
    script = "Thinking it over.\n</think>\n\nThe answer."
    body = client.post("/v1/chat/completions", json=chat(script)).json()
    msg = body["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Thinking it over.", "The answer.")
    chunks = sse_json(client.post("/v1/chat/completions", json=chat(script, stream=True)).text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Thinking it over."
    assert "".join(d.get("content", "") for d in deltas) == "The answer."


def test_stop_strings_and_stop_token_ids(client, scripted):
    body = client.post("/v1/chat/completions", json=chat("alpha STOP beta", stop=["STOP", "never"],
                                                          chat_template_kwargs=NO_THINK)).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "alpha " and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "STOP"
    comma = scripted.frontend.encode(",")[0]
    body = client.post("/v1/chat/completions", json=chat("one, two", stop_token_ids=[comma],
                                                          chat_template_kwargs=NO_THINK)).json()
    assert body["choices"][0]["message"]["content"] == "one"
    assert body["choices"][0]["stop_reason"] == comma
    body = client.post("/v1/chat/completions", json=chat("done", chat_template_kwargs=NO_THINK)).json()
    assert body["choices"][0]["stop_reason"] is None  # the model's own end of turn


def test_completions_stop(client):
    body = client.post("/v1/completions", json={"prompt": "SCRIPT:x = 1\ny = 2", "stop": "\n",
                                                "max_tokens": 20}).json()
    assert body["choices"][0]["text"] == "x = 1" and body["choices"][0]["stop_reason"] == "\n"


def test_anthropic_tool_use_thinking_and_stop_sequence(client):
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    base = {"model": MODEL_ID, "max_tokens": 100, "tools": tools}
    body = client.post("/v1/messages", json={**base, "messages": [
        {"role": "user", "content": "SCRIPT:Need data.\n</think>\n\n" + CALL}]}).json()
    assert body["stop_reason"] == "tool_use"
    assert [b["type"] for b in body["content"]] == ["thinking", "tool_use"]
    assert body["content"][0]["thinking"] == "Need data."
    assert body["content"][1]["name"] == "get_weather" and body["content"][1]["input"] == {"city": "Paris", "days": 3}
    # tool_choice tool/any is a tool-call grammar, as in Chat Completions: the script is the whole call.
    lima = CALL.replace("Paris", "Lima").replace("<parameter=days>\n3\n</parameter>\n", "")
    forced = client.post("/v1/messages", json={**base, "tool_choice": {"type": "tool", "name": "get_weather"},
                                               "thinking": {"type": "disabled"},
                                               "messages": [{"role": "user", "content": "SCRIPT:" + lima}]}).json()
    assert forced["content"] == [{"type": "tool_use", "id": forced["content"][0]["id"], "name": "get_weather",
                                  "input": {"city": "Lima"}}]
    stop = client.post("/v1/messages", json={**base, "stop_sequences": ["END"], "thinking": {"type": "disabled"},
                                             "messages": [{"role": "user", "content": "SCRIPT:text END more"}]}).json()
    assert stop["stop_reason"] == "stop_sequence" and stop["stop_sequence"] == "END"
    assert stop["content"] == [{"type": "text", "text": "text "}]


def test_anthropic_forced_tool_holds_the_model_to_the_call(client):
    # The script wants free text; the grammar allows only the parameterless get_time call (after the
    # thinking, which stays on), then the end.
    tools = [{"name": n["function"]["name"], "input_schema": n["function"]["parameters"]} for n in (WEATHER, CLOCK)]
    body = client.post("/v1/messages", json={
        "model": MODEL_ID, "max_tokens": 100, "tools": tools,
        "tool_choice": {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "SCRIPT:Clock.\n</think>\n\noops no parameters here"}]}).json()
    assert [b["type"] for b in body["content"]] == ["thinking", "tool_use"], body
    assert body["content"][0]["thinking"] == "Clock."
    assert body["content"][1]["name"] == "get_time" and body["content"][1]["input"] == {}
    assert body["stop_reason"] == "tool_use"


def test_anthropic_stream_blocks(client):
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    r = client.post("/v1/messages", json={"model": MODEL_ID, "max_tokens": 100, "tools": tools, "stream": True,
                                          "messages": [{"role": "user",
                                                        "content": "SCRIPT:Hmm.\n</think>\n\nOK.\n\n" + CALL}]})
    events = sse_json(r.text)
    kinds = [(e["type"], e.get("content_block", {}).get("type") or e.get("delta", {}).get("type")) for e in events]
    kinds = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # one entry per run of deltas
    assert kinds == [
        ("message_start", None), ("ping", None),
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"), ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_delta", "text_delta"), ("content_block_stop", None),
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
        ("content_block_stop", None), ("message_delta", None), ("message_stop", None)]
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == [0, 1, 2]
    tool_json = next(e for e in events if e.get("delta", {}).get("type") == "input_json_delta")
    assert json.loads(tool_json["delta"]["partial_json"]) == {"city": "Paris", "days": 3}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_anthropic_tool_history_matches_openai_rendering(client):
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    anthropic = {"model": MODEL_ID, "tools": tools, "system": "Be brief.", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": ""},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                     {"type": "text", "text": "And tomorrow?"}]}]}
    openai = {"tools": [{"type": "function", "function": {"name": "get_weather", "description": "",
                                                          "parameters": WEATHER["function"]["parameters"]}}],
              "messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Weather in Paris?"},
                           {"role": "assistant", "content": "", "reasoning_content": "Call it.",
                            "tool_calls": [{"id": "t1", "type": "function",
                                            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                           {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
                           {"role": "user", "content": "And tomorrow?"}]}
    n = client.post("/v1/messages/count_tokens", json=anthropic).json()["input_tokens"]
    assert n == client.post("/tokenize", json=openai).json()["count"]
