"""Chat Completions, Completions, Messages and tokenize on the real embedded default model."""

from __future__ import annotations

import json

import pytest
from serve_helpers import MODEL_ID, chat, client_for, sse_data, sse_json, wait_idle


def same_usage(a: dict, b: dict) -> bool:
    """Equal token counts; the cached share may differ (the repeat of a prompt hits the context cache), but never
    exceeds the prompt."""
    assert b["prompt_tokens_details"]["cached_tokens"] <= b["prompt_tokens"]
    strip = lambda u: {k: v for k, v in u.items() if k != "prompt_tokens_details"}  # noqa: E731
    return strip(a) == strip(b)


@pytest.fixture(scope="module")
def client(engine):
    with client_for(engine) as c:
        yield c


def test_usage_reports_the_prompt_tokens_served_by_the_context_cache(client, engine):
    first = chat("Which module parses command lines?", max_tokens=6, seed=1)
    r1 = client.post("/v1/chat/completions", json=first).json()
    turn2 = {**first, "messages": [*first["messages"], r1["choices"][0]["message"],
                                   {"role": "user", "content": "And for JSON?"}]}
    r2 = client.post("/v1/chat/completions", json=turn2).json()
    assert r1["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < r2["usage"]["prompt_tokens"]


def test_chat_json_shape_and_usage(client, engine):
    r = client.post("/v1/chat/completions", json=chat("What does os.path.join do?", max_tokens=24, seed=3))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL_ID
    assert body["id"].startswith("chatcmpl-") and r.headers["x-request-id"] == body["id"]
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    msg = choice["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    # Thinking is on by default: the generation prompt opens <think>, so reasoning comes first.
    assert msg["reasoning_content"]
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and 0 < u["completion_tokens"] <= 24
    tok = client.post("/tokenize", json={"messages": [{"role": "user", "content": "What does os.path.join do?"}]})
    assert tok.json()["count"] == u["prompt_tokens"]
    wait_idle(engine)


def test_enable_thinking_off_through_chat_template_kwargs(client):
    req = chat("Explain re.compile.", max_tokens=16, temperature=0,
               chat_template_kwargs={"enable_thinking": False})
    body = client.post("/v1/chat/completions", json=req).json()
    assert body["choices"][0]["message"]["reasoning_content"] is None
    assert body["choices"][0]["message"]["content"]
    tok = client.post("/tokenize", json={"messages": req["messages"],
                                         "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert tok["count"] == body["usage"]["prompt_tokens"]
    text = client.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_stream_equals_json_for_greedy(client):
    req = chat("What is json.dumps?", max_tokens=20, temperature=0, ignore_eos=True)
    whole = client.post("/v1/chat/completions", json=req).json()
    r = client.post("/v1/chat/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["id"] == chunks[0]["id"] == r.headers["x-request-id"] for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and same_usage(chunks[-1]["usage"], whole["usage"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks[:-1])
    msg = whole["choices"][0]["message"]
    assert content == msg["content"] and reasoning == (msg["reasoning_content"] or "")


def test_stream_without_include_usage_has_no_usage_key(client):
    r = client.post("/v1/chat/completions", json=chat("hi", max_tokens=3, stream=True))
    chunks = sse_json(r.text)
    assert chunks and all("usage" not in c for c in chunks)


def test_logprobs_and_top_logprobs(client):
    r = client.post("/v1/chat/completions", json=chat("hi", max_tokens=6, logprobs=True, top_logprobs=3,
                                                       ignore_eos=True))
    body = r.json()
    entries = body["choices"][0]["logprobs"]["content"]
    assert len(entries) == body["usage"]["completion_tokens"] == 6
    for e in entries:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 3
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and e["logprob"] <= tops[0] + 1e-6
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
    # Streaming carries the same per-token entries, spread over the chunks.
    r = client.post("/v1/chat/completions", json=chat("hi", max_tokens=6, logprobs=True, top_logprobs=2,
                                                       ignore_eos=True, stream=True))
    streamed = [e for c in sse_json(r.text) for ch in c["choices"] if ch.get("logprobs")
                for e in ch["logprobs"]["content"]]
    assert len(streamed) == 6 and all(len(e["top_logprobs"]) == 2 for e in streamed)


def test_seed_reproduces_sampled_output(client):
    req = chat("Describe the itertools module.", max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01,
               presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1, ignore_eos=True)
    a = client.post("/v1/chat/completions", json={**req, "seed": 11}).json()["choices"][0]["message"]
    b = client.post("/v1/chat/completions", json={**req, "seed": 11}).json()["choices"][0]["message"]
    assert a == b
    others = [client.post("/v1/chat/completions", json={**req, "seed": s}).json()["choices"][0]["message"]
              for s in (12, -5)]
    assert any(o != a for o in others)


def test_max_completion_tokens_and_length(client):
    body = client.post("/v1/chat/completions", json=chat("hi", max_completion_tokens=5, ignore_eos=True)).json()
    assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/chat/completions", json=chat("hi", max_tokens=100000))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "maximum context length is 512" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=chat("word " * 600))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_min_tokens_holds_the_stop_back(client):
    body = chat("Say hi.", max_tokens=60, temperature=0, chat_template_kwargs={"enable_thinking": False})
    plain = client.post("/v1/chat/completions", json=body).json()
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] < 30, plain
    held = client.post("/v1/chat/completions", json={**body, "min_tokens": 30}).json()
    assert held["usage"]["completion_tokens"] >= 30, held
    assert held["choices"][0]["message"]["content"].startswith(plain["choices"][0]["message"]["content"])


def test_include_stop_str_in_output(client):
    body = {"model": MODEL_ID, "prompt": "def fibonacci(n):", "max_tokens": 40, "temperature": 0, "stop": ["return"]}
    cut = client.post("/v1/completions", json=body).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == "return" and "return" not in cut["text"], cut
    kept = client.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()["choices"][0]
    assert kept["text"] == cut["text"] + "return" and kept["stop_reason"] == "return", kept
    # Streamed: the same text, the stop string once.
    chunks = sse_json(client.post("/v1/completions", json={**body, "include_stop_str_in_output": True,
                                                          "stream": True}).text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == kept["text"]
    # A stop token id: its text ends the output with the flag (vLLM), not without.
    ids = client.post("/v1/completions", json={**body, "stop": None, "logprobs": 0}).json()["choices"][0]
    stop_id = client.post("/tokenize", json={"prompt": ids["logprobs"]["tokens"][3]}).json()["tokens"][0]
    by_id = {**body, "stop": None, "stop_token_ids": [stop_id]}
    plain = client.post("/v1/completions", json=by_id).json()["choices"][0]
    with_text = client.post("/v1/completions", json={**by_id, "include_stop_str_in_output": True}).json()["choices"][0]
    assert plain["stop_reason"] == with_text["stop_reason"] == stop_id, (plain, with_text)
    assert with_text["text"] == plain["text"] + client.post("/detokenize", json={"tokens": [stop_id]}).json()["prompt"]


def test_completions_default_max_tokens_is_named_when_it_does_not_fit(client):
    # 500 prompt tokens leave 12 of the 512: Completions' default max_tokens (16) does not fit, and the error says
    # it is the default the request did not set; an explicit 16 is blamed as sent, and 12 fits.
    body = {"model": MODEL_ID, "prompt": [1] * 500}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["message"].startswith("The default 'max_tokens' of 16 (the request did not set it) is "
                                                   "too large. This model's maximum context length is 512 tokens")
    r = client.post("/v1/completions", json={**body, "max_tokens": 16})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("'max_tokens' is too large: 16.")
    assert client.post("/v1/completions", json={**body, "max_tokens": 12, "ignore_eos": True}).status_code == 200


def test_completions_json_stream_echo_and_logprobs(client):
    req = {"model": MODEL_ID, "prompt": "import os\nimport", "max_tokens": 8, "temperature": 0, "logprobs": 2,
           "ignore_eos": True}
    body = client.post("/v1/completions", json=req).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert "".join(lp["tokens"]) == choice["text"] and all(len(t) <= 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0
    echo = client.post("/v1/completions", json={**{k: v for k, v in req.items() if k != "logprobs"},
                                                "echo": True}).json()["choices"][0]
    assert echo["text"] == "import os\nimport" + choice["text"] and echo["logprobs"] is None
    # OpenAI's echo with logprobs also scores the prompt's tokens (evaluation harnesses read log-likelihoods from
    # it): refused by name rather than answered with the generated tokens' log-probabilities alone.
    refused = client.post("/v1/completions", json={**req, "echo": True})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "echo" and error["code"] == "unsupported_value"
    assert "echo with logprobs" in error["message"] and "ninfer score" in error["message"]
    stream = client.post("/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_json(stream.text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    assert same_usage(chunks[-1]["usage"], body["usage"])
    ids = client.post("/tokenize", json={"prompt": "import os\nimport"}).json()["tokens"]
    by_ids = client.post("/v1/completions", json={**req, "prompt": ids}).json()["choices"][0]
    assert by_ids["text"] == choice["text"]


def test_anthropic_messages_json_and_stream(client):
    req = {"model": MODEL_ID, "max_tokens": 12, "system": "You answer briefly.",
           "messages": [{"role": "user", "content": [{"type": "text", "text": "What is shutil?"}]}],
           "temperature": 0}
    r = client.post("/v1/messages", json=req)
    body = r.json()
    assert r.status_code == 200 and body["type"] == "message" and body["id"].startswith("msg_")
    assert r.headers["request-id"] == body["id"]
    assert body["stop_reason"] in ("end_turn", "max_tokens")
    assert body["content"][0]["type"] in ("thinking", "text")
    n = client.post("/v1/messages/count_tokens", json={k: req[k] for k in ("model", "system", "messages")})
    assert n.json() == {"input_tokens": body["usage"]["input_tokens"]}
    s = client.post("/v1/messages", json={**req, "stream": True})
    events = [line[len("event: "):] for line in s.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    datas = sse_json(s.text)
    thinking = "".join(d["delta"].get("thinking", "") for d in datas if d["type"] == "content_block_delta")
    text = "".join(d["delta"].get("text", "") for d in datas if d["type"] == "content_block_delta")
    want = {b["type"]: b.get("thinking", b.get("text")) for b in body["content"]}
    assert thinking == want.get("thinking", "") and text == want.get("text", "")
    delta = next(d for d in datas if d["type"] == "message_delta")
    assert delta["usage"]["output_tokens"] == body["usage"]["output_tokens"]
    assert delta["delta"]["stop_reason"] == body["stop_reason"]


def test_models_endpoints(client, engine):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL_ID]
    assert body["data"][0]["max_model_len"] == engine.max_context == 512
    assert client.get(f"/v1/models/{MODEL_ID}").json()["id"] == MODEL_ID
    r = client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
