"""The real thing: ``ninfer serve`` in a subprocess on a free loopback port (uvicorn, the embedded
default model, bfloat16 on CPU), driven by the official ``openai`` and ``anthropic`` clients and by
httpx for a disconnect mid-stream. SIGTERM at the end must shut it down cleanly (exit status 0).

No assertion depends on how fast the machine is: every timeout is a hang guard (HANG_GUARD_S), the drain
after SIGTERM may take as long as that, and the disconnected request could not finish on its own before
the disconnect is noticed however slowly the server reacts (it asks for more tokens than it could make
before a hang guard fires)."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import pytest
from serve_helpers import start_server_process

MODEL = "test-model"
KEY = "k-123"
HANG_GUARD_S = 300  # stops a hung server from hanging the suite; never a speed requirement
MAX_CONTEXT = 4096  # the model's whole range: room for a disconnected request that would run for a long while


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not exposed")


@pytest.fixture(scope="module")
def server(artifact):
    base, proc = start_server_process(
        artifact, "--device", "cpu", "--dtype", "bfloat16", "--max-concurrency", "2", "--max-context", str(MAX_CONTEXT),
        "--model-id", MODEL, "--api-key", KEY, "--log-level", "warning", "--shutdown-timeout", str(HANG_GUARD_S),
        timeout=HANG_GUARD_S)
    yield base, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def test_openai_client(server):
    import openai

    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=HANG_GUARD_S)
    assert [m.id for m in client.models.list().data] == [MODEL]
    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is os.sep?"}],
                                          max_tokens=16, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.completion_tokens <= 16
    assert done.id.startswith("chatcmpl-")
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is os.sep?"}],
                                                max_tokens=16, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append((choice.delta.content or "", getattr(choice.delta, "reasoning_content", None) or ""))
    assert "".join(p[0] for p in pieces) == (done.choices[0].message.content or "")
    assert usage is not None and usage.completion_tokens == done.usage.completion_tokens
    comp = client.completions.create(model=MODEL, prompt="def main():\n", max_tokens=8, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="def main():\n", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == comp.choices[0].text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0, timeout=HANG_GUARD_S).models.list()


def test_anthropic_client(server):
    import anthropic

    base, _ = server
    client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=HANG_GUARD_S)
    msg = client.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "What is re?"}])
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens <= 12
    with client.messages.stream(model=MODEL, max_tokens=12,
                                messages=[{"role": "user", "content": "What is re?"}]) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens <= 12 and final.content
    count = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "What is re?"}])
    assert count.input_tokens == msg.usage.input_tokens


# tool_choice any / tool is a tool-call grammar; the tiny model needs more than 30 tokens for a whole call (one:
# greedy, it would go on with further parallel calls until max_tokens).
FIND = {"name": "find", "input_schema": {"type": "object", "properties": {"t": {"type": "string", "maxLength": 6}},
                                         "required": ["t"], "additionalProperties": False}}
FORCED = pytest.mark.parametrize("tool_choice", [{"type": "any", "disable_parallel_tool_use": True},
                                                 {"type": "tool", "name": "find", "disable_parallel_tool_use": True}],
                                 ids=["any", "tool"])
NO_THINKING = {"type": "disabled"}


def _forced(server, tool_choice, max_tokens, **fields):
    """A forced call's message, and the events and accumulated message of the same request streamed (greedy:
    this client version has no temperature argument)."""
    import anthropic

    client = anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0, timeout=HANG_GUARD_S)
    request = dict(model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": "find cats"}],
                   tools=[FIND], tool_choice=tool_choice, extra_body={"temperature": 0}, **fields)
    message = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    return message, events, streamed


def _blocks(message) -> list[dict]:
    return [b.model_dump(exclude={"id"}) for b in message.content]


@FORCED
@pytest.mark.parametrize("max_tokens", [1, 5, 30])
def test_anthropic_forced_call_cut_by_max_tokens_has_no_empty_text_block(server, tool_choice, max_tokens):
    """As the API answers: stop_reason max_tokens, the cut call not reported and no empty text block standing
    in for it; the stream opens no content block at all."""
    message, events, streamed = _forced(server, tool_choice, max_tokens, thinking=NO_THINKING)
    assert (message.stop_reason, message.stop_sequence, message.content) == ("max_tokens", None, [])
    assert message.usage.output_tokens == max_tokens
    assert [e.type for e in events if e.type.startswith("content_block")] == []
    assert (streamed.stop_reason, streamed.content, streamed.usage.output_tokens) == ("max_tokens", [], max_tokens)


@FORCED
def test_anthropic_forced_call_cut_in_the_thinking_is_only_thinking(server, tool_choice):
    message, events, streamed = _forced(server, tool_choice, 12)  # thinking on: the budget ends inside it
    assert message.stop_reason == streamed.stop_reason == "max_tokens"
    assert [b.type for b in message.content] == ["thinking"] and message.content[0].thinking
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["thinking"]
    assert _blocks(streamed) == _blocks(message)


@FORCED
def test_anthropic_forced_call_is_one_tool_use_block(server, tool_choice):
    message, events, streamed = _forced(server, tool_choice, 200, thinking=NO_THINKING)
    assert message.stop_reason == streamed.stop_reason == "tool_use"
    assert [(b.type, b.name) for b in message.content] == [("tool_use", "find")]
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["tool_use"]
    assert _blocks(streamed) == _blocks(message)


def test_utility_endpoints(server):
    """The endpoints no official client covers, on the real process: health (GET and HEAD), tokenize round
    trip, model by id."""
    base, _ = server
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{base}/health", timeout=HANG_GUARD_S).status_code == 200
    # One keep-alive connection: a stray HEAD body would show.
    with httpx.Client(base_url=base, timeout=HANG_GUARD_S) as c:
        for path, status, auth in (("/health", 200, {}), ("/v1/models", 401, {}), ("/v1/chat/completions", 401, {}),
                                   ("/v1/chat/completions", 405, headers)):
            head, got = c.head(path, headers=auth), c.get(path, headers=auth)
            assert (head.status_code, got.status_code, head.content) == (status, status, b""), path
            assert head.headers["content-length"] == got.headers["content-length"], path
    tok = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "def main():"}, headers=headers,
                     timeout=HANG_GUARD_S)
    assert tok.status_code == 200, tok.text
    ids = tok.json()["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    detok = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": ids}, headers=headers,
                       timeout=HANG_GUARD_S)
    assert detok.status_code == 200 and detok.json()["prompt"] == "def main():"
    one = httpx.get(f"{base}/v1/models/{MODEL}", headers=headers, timeout=HANG_GUARD_S)
    assert one.status_code == 200 and one.json()["id"] == MODEL


def test_disconnect_mid_stream_frees_capacity(server):
    base, _ = server
    headers = {"Authorization": f"Bearer {KEY}"}

    def metrics() -> str:
        return httpx.get(f"{base}/metrics", headers=headers, timeout=HANG_GUARD_S).text

    before = metrics()
    max_tokens = MAX_CONTEXT - 64  # thousands of steps: still running when the disconnect is noticed, however late
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long essay."}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=HANG_GUARD_S) as c:
        with c.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
        # Leaving the block closed the connection mid-stream.
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        text = metrics()
        if (_metric(text, "ninfer_engine_cancelled_total") == _metric(before, "ninfer_engine_cancelled_total") + 1
                and _metric(text, "ninfer_requests_outstanding") == 0 and _metric(text, "ninfer_state_slots_used") == 0):
            break  # its KV pages may stay as context-cache checkpoints (on by default), which pressure reclaims
        assert time.monotonic() < deadline, "the disconnected request was not cancelled"
        time.sleep(0.05)
    assert _metric(text, "ninfer_generation_tokens_total") - _metric(before, "ninfer_generation_tokens_total") < max_tokens
    assert 'outcome="cancelled"' in text
    ok = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 4},
                    headers=headers, timeout=HANG_GUARD_S)
    assert ok.status_code == 200


def test_sigterm_drains_in_flight_stream_and_exits_cleanly(server):
    base, proc = server
    body = {"model": MODEL, "prompt": "import", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=HANG_GUARD_S) as c:
        with c.stream("POST", f"{base}/v1/completions", json=body, headers={"x-api-key": KEY}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGTERM)  # the in-flight stream is drained, not cut
            rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, out
    assert "serving 'test-model'" in out and "warm-up done" in out
