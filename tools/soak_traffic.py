"""The soak's traffic: a pool of requests with reference answers, and one coroutine per kind of request or fault.

Every request the soak sends is one of :data:`KINDS`. Greedy and seeded requests come from a fixed pool whose
answers were recorded by sending each one alone (:func:`record_references`); during the soak each answer must equal
its reference exactly (text, reasoning, finish reason, token count), streamed or not, whatever ran beside it. A
multi-turn session replays recorded user turns, so its later turns hit the context cache. Faults are requests too:
a client that disconnects mid-stream or gives up before the first byte, malformed bodies, and bursts beyond the
queue. :class:`Tally` counts outcomes per kind and collects failures (anything a correct server would not do).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

WORDS = ("def", "return", "self", "import", "class", "for", "in", "range", "if", "else", "while", "yield", "x", "y",
         "value", "items", "queue", "append", "len", "print", "None", "True", "data", "key", "open", "path", "(",
         ")", ":", "=", "+", ",", "[", "]", "\n", "    ", "# note", "list", "dict", "str", "int", "json", "os")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# Kind -> weight of the random plan; besides those, every BURST_EVERY-th request (from the 100th on) is an
# "overflow" burst of more requests than the server's running places and queue hold.
KINDS = {"completion": 18, "chat": 14, "session": 8, "sampled": 14, "constrained": 10, "disconnect": 9,
         "abort": 5, "malformed": 10, "stop": 5, "oversize": 3}
BURST_EVERY = 200


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass(frozen=True)
class Item:
    """One pool request: ``route`` ("completions" or "chat/completions") and its JSON body (no ``stream``)."""
    route: str
    body: dict


@dataclass(frozen=True)
class Answer:
    """What a request produced: text, reasoning text, finish reason, completion tokens (compared), and the prompt
    tokens the context cache supplied (not compared: it depends on what ran before)."""
    text: str
    reasoning: str
    finish: str
    tokens: int
    cached: int = field(default=0, compare=False)


Send = Callable[["Item", bool], Awaitable[tuple[int, "Answer | str"]]]


def _cached(usage: dict) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@dataclass
class Tally:
    """Outcomes per kind, faults injected per kind, and failures (each a line naming the request)."""
    outcomes: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    compared: int = 0
    cached_turns: int = 0

    def fail(self, what: str) -> None:
        self.failures.append(what)


def build_pool(seed: int, model: str, size: int) -> list[Item]:
    """``size`` requests: completions and chats (thinking on and off, some constrained to :data:`SCHEMA`), greedy
    or seeded, prompts of 1..200 words, budgets 1..32 tokens."""
    rng = random.Random(seed)
    pool = []
    for i in range(size):
        sampling = {"temperature": 0} if i % 3 else {"temperature": 0.9, "top_p": 0.95, "seed": rng.randrange(10**6)}
        budget = rng.randint(1, 32)
        words = rng.choice((1, 8, 40, 120, rng.randint(1, 200)))
        if i % 2:
            pool.append(Item("completions", {"model": model, "prompt": _text(rng, words), "max_tokens": budget,
                                             **sampling}))
            continue
        body = {"model": model, "messages": [{"role": "user", "content": _text(rng, words)}], "max_tokens": budget,
                **sampling}
        if i % 4 == 0:
            body.update(NO_THINKING)
        if i % 8 == 0:
            body.update(NO_THINKING, max_tokens=48, response_format={
                "type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}})
        pool.append(Item("chat/completions", body))
    return pool


def build_sessions(seed: int, model: str, count: int) -> list[list[str]]:
    """``count`` conversations of 2-3 user turns."""
    rng = random.Random(seed + 1)
    return [[_text(rng, rng.randint(3, 60)) for _ in range(rng.randint(2, 3))] for _ in range(count)]


def _answer(route: str, payload: dict) -> Answer:
    choice = payload["choices"][0]
    if route == "completions":
        text, reasoning = choice["text"], ""
    else:
        text, reasoning = choice["message"].get("content") or "", choice["message"].get("reasoning_content") or ""
    usage = payload["usage"]
    return Answer(text, reasoning, choice["finish_reason"], usage["completion_tokens"], _cached(usage))


async def send(client: httpx.AsyncClient, item: Item, stream: bool) -> tuple[int, Answer | str]:
    """POST ``item``; (status, its Answer) on 200, else (status, the body). A stream is read to ``[DONE]``."""
    if not stream:
        r = await client.post(f"/v1/{item.route}", json=item.body)
        return (200, _answer(item.route, r.json())) if r.status_code == 200 else (r.status_code, r.text)
    body = {**item.body, "stream": True, "stream_options": {"include_usage": True}}
    text, reasoning, finish, tokens, cached, done = [], [], None, None, 0, False
    async with client.stream("POST", f"/v1/{item.route}", json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return 200, f"the stream carried an error event: {json.dumps(chunk)[:300]}"
            if chunk.get("usage"):
                tokens, cached = chunk["usage"]["completion_tokens"], _cached(chunk["usage"])
            for choice in chunk.get("choices", ()):
                if item.route == "completions":
                    text.append(choice.get("text") or "")
                else:
                    text.append(choice["delta"].get("content") or "")
                    reasoning.append(choice["delta"].get("reasoning_content") or "")
                finish = choice.get("finish_reason") or finish
    if not done or finish is None or tokens is None:
        return 200, f"the stream ended without [DONE], a finish reason or usage (done={done}, finish={finish})"
    return 200, Answer("".join(text), "".join(reasoning), finish, tokens, cached)


async def record_references(client: httpx.AsyncClient, pool: list[Item], sessions: list[list[str]],
                            model: str) -> tuple[list[Answer], list[list[Answer]]]:
    """Every pool item and session sent alone, one after another: the answers the soak must reproduce."""
    answers = []
    for item in pool:
        status, got = await send(client, item, stream=False)
        if status != 200:
            raise RuntimeError(f"reference request failed with {status}: {got}")
        answers.append(got)
    turns = []
    for user_turns in sessions:
        got = await run_session(lambda item, stream: send(client, item, stream), user_turns, model, stream=False)
        if isinstance(got, str):
            raise RuntimeError(f"reference session failed: {got}")
        turns.append(got)
    return answers, turns


async def run_session(post: Send, user_turns: list[str], model: str, stream: bool,
                      tally: Tally | None = None) -> list[Answer] | str:
    """The conversation's turns in order through ``post``, each answer appended to the history; the answers, or
    what failed. With a ``tally``, counts the turns the context cache served a prefix of."""
    messages, answers = [], []
    for user in user_turns:
        messages.append({"role": "user", "content": user})
        item = Item("chat/completions", {"model": model, "messages": list(messages), "max_tokens": 12,
                                         "temperature": 0, **NO_THINKING})
        status, got = await post(item, stream)
        if status != 200 or isinstance(got, str):
            return f"turn {len(answers) + 1} got {status}: {str(got)[:200]}"
        if tally is not None and answers:
            tally.cached_turns += got.cached > 0
        answers.append(got)
        messages.append({"role": "assistant", "content": got.text})
    return answers


def check_schema(text: str) -> str | None:
    """None when ``text`` is a JSON object valid against :data:`SCHEMA`, else what is wrong."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc}): {text[:120]!r}"
    if not isinstance(obj, dict) or set(obj) != {"name", "count"}:
        return f"wrong keys: {text[:120]!r}"
    if not isinstance(obj["name"], str) or len(obj["name"]) > 12 or type(obj["count"]) is not int:
        return f"wrong value types: {text[:120]!r}"
    return None


def malformed_requests(model: str, max_context: int) -> list[tuple[str, str, bytes, int]]:
    """(label, route, raw body, expected status) of bad requests, each of which must get that status and an
    OpenAI-shaped error naming the problem."""
    msg = [{"role": "user", "content": "hi"}]

    def js(obj) -> bytes:
        return json.dumps(obj).encode()

    return [("invalid_json", "chat/completions", b'{"model": "x", "messages": [', 400),
            ("not_an_object", "chat/completions", b"[1, 2]", 400),
            ("invalid_utf8", "completions", b'{"model": "m", "prompt": "\xff\xfe"}', 400),
            ("messages_wrong_type", "chat/completions", js({"model": model, "messages": "hi"}), 400),
            ("messages_empty", "chat/completions", js({"model": model, "messages": []}), 400),
            ("unknown_role", "chat/completions", js({"model": model, "messages": [{"role": "wizard", "content": "x"}]}),
             400),
            ("negative_max_tokens", "chat/completions", js({"model": model, "messages": msg, "max_tokens": -3}), 400),
            ("temperature_string", "completions", js({"model": model, "prompt": "x", "temperature": "hot"}), 400),
            ("prompt_wrong_type", "completions", js({"model": model, "prompt": {"a": 1}}), 400),
            ("bad_schema", "chat/completions", js({"model": model, "messages": msg, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}), 400),
            ("unknown_model", "completions", js({"model": "no-such-model", "prompt": "x"}), 404),
            ("oversize_budget", "completions", js({"model": model, "prompt": "x", "max_tokens": max_context * 4}), 400)]


def error_shape(body: str) -> str | None:
    """None when ``body`` is an OpenAI error object with a message and a type, else what is wrong."""
    try:
        err = json.loads(body)["error"]
        if isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str):
            return None
    except (ValueError, KeyError, TypeError):
        pass
    return f"not an OpenAI error object: {body[:200]!r}"


def oversize_prompt(model: str, max_context: int) -> Item:
    """A prompt longer than the context: 400 ``context_length_exceeded``."""
    return Item("completions", {"model": model, "prompt": " ".join(["value"] * (max_context * 2)), "max_tokens": 4})


async def disconnect_mid_stream(client: httpx.AsyncClient, item: Item, after: int) -> str | None:
    """Read ``after`` data lines of ``item``'s stream, then close the connection; None, or what went wrong."""
    body = {**item.body, "stream": True, "max_tokens": max(item.body["max_tokens"], 24)}
    async with client.stream("POST", f"/v1/{item.route}", json=body) as r:
        if r.status_code not in (200, 429):
            return f"stream to disconnect got {r.status_code}"
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= after:
                break
    return None


async def abort_early(client: httpx.AsyncClient, item: Item, after_s: float) -> None:
    """Send ``item`` and give up after ``after_s`` seconds (a client deadline), usually before the answer."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(client.post(f"/v1/{item.route}", json={**item.body, "max_tokens": 32}), after_s)
