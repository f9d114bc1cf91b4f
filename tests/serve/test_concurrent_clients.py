"""16 concurrent clients against ``ninfer serve --max-concurrency 4`` (a real server process).

Every client must get a correct, complete answer: with greedy decoding in fp32, each answer must equal
the answer the same request gets when it is sent alone, before any concurrency. Requests beyond the 4
running at once wait in the queue; none may be refused, cut short or mixed up with another.
"""

from __future__ import annotations

import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_helpers import start_server_process

PROMPTS = [f"What does `{name}` do?" for name in (
    "os.path.join", "len", "json.dumps", "re.compile", "str.split", "sorted", "zip", "enumerate",
    "dict.get", "list.append", "math.sqrt", "open", "print", "range", "isinstance", "hashlib.sha256")]


@pytest.fixture(scope="module")
def server(artifact):
    base, proc = start_server_process(
        artifact, "--device", "cpu", "--dtype", "float32", "--max-concurrency", "4", "--max-context", "512",
        "--queue-capacity", "32", "--model-id", "m", "--log-level", "warning", "--quiet")
    yield base
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(60) == 0
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _ask(base: str, prompt: str, stream: bool) -> tuple[str, str]:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=300, max_retries=0)
    kwargs = dict(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_sixteen_concurrent_clients_get_the_answers_they_get_alone(server):
    alone = [_ask(server, p, stream=False) for p in PROMPTS]
    assert all(finish in ("stop", "length") for _, finish in alone)
    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(lambda i: _ask(server, PROMPTS[i], stream=i % 2 == 0), range(16)))
    assert together == alone
    stats = httpx.get(f"{server}/metrics", timeout=10).text
    assert "ninfer_requests_total" in stats
