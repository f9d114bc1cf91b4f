"""One generation request as the gateway runs it: a submitted engine handle, read asynchronously.

:class:`Generation` turns the handle's events into :class:`Step` s (published output, after the
request's gateway-side transforms) and one final :class:`Outcome`, records the request's metrics
(TTFT, inter-token latency, tokens, outcome) exactly once, and owns the handle: :meth:`close`
releases it, which cancels an unfinished request in the engine and frees its capacity. Every route
calls ``close`` in a ``finally`` (and streams also from a background task that runs after the
response, because a streaming generator suspended at ``yield`` is not resumed when its client
disconnects), so no request outlives its HTTP exchange.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from litestar import Request
from ninfer.contracts.events import GenerationDelta, GenerationError, GenerationResult, GenerationStart
from ninfer.contracts.frontend import OutputDelta, ToolCall
from ninfer.contracts.program import TokenLogprob

from ninfer_serve.disconnect import unless_disconnected
from ninfer_serve.errors import from_engine_error
from ninfer_serve.metrics import ServerMetrics
from ninfer_serve.tool_choice import DeltaTransform


@dataclass(frozen=True)
class Step:
    deltas: tuple[OutputDelta, ...]
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Outcome:
    finish_reason: str          # the engine's: stop, length, cancelled, deadline
    stop_reason: str | int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0      # prompt tokens restored from the context cache (Usage.cached_tokens)


class Generation:
    def __init__(self, handle, *, request_id: str, prompt_tokens: int, metrics: ServerMetrics, endpoint: str,
                 arrived: float, transforms: Sequence[DeltaTransform] = ()) -> None:
        self.handle = handle
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._metrics = metrics
        self._endpoint = endpoint
        self._arrived = arrived
        self._transforms = tuple(transforms)
        self._last_token_at: float | None = None
        self._recorded = False
        self._source: AsyncIterator | None = None   # the handle's iterator, once wait_admitted started it
        self._head: asyncio.Task | None = None      # its first event, read by wait_admitted

    def _transform(self, deltas: Sequence[OutputDelta], *, final: bool = False) -> tuple[OutputDelta, ...]:
        out = tuple(deltas)
        for t in self._transforms:
            out = t.feed(out)
            if final:  # what a transform releases at the end still goes through the ones after it
                out = out + t.flush()
        return out

    def _record(self, outcome: str, *, completion_tokens: int = 0, prompt_tokens: int | None = None) -> None:
        if self._recorded:
            return
        self._recorded = True
        m = self._metrics
        m.count(self._endpoint, outcome)
        if prompt_tokens:
            m.prompt_tokens.inc(prompt_tokens)
        m.e2e.observe(time.monotonic() - self._arrived)

    def _observe_tokens(self, n: int) -> None:
        now = time.monotonic()
        if self._last_token_at is None:
            self._metrics.ttft.observe(now - self._arrived)
        else:
            self._metrics.itl.observe(now - self._last_token_at)
        self._last_token_at = now
        self._metrics.generation_tokens.inc(n)

    async def wait_admitted(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the engine's first word on the request: admitted, or refused. A
        refusal (a queue timeout, a deadline, a full engine) raises its ApiError here, so a streaming route can
        still answer with that HTTP status instead of a 200 whose stream carries only an error; a request still
        queued after ``timeout`` is left to the stream, which sends keep-alives while it waits. The event read
        here is not lost: :meth:`events` starts with it. Call at most once, before :meth:`events`."""
        self._source = aiter(self.handle)
        self._head = asyncio.ensure_future(anext(self._source))
        try:
            await asyncio.wait({self._head}, timeout=timeout)
        except BaseException:  # the handler was cancelled while waiting: the request goes with it
            self.close()
            raise
        if self._head.done() and not self._head.cancelled() and self._head.exception() is None:
            event = self._head.result()
            if isinstance(event, GenerationError):
                self._head = None
                self._refused(event)

    def _refused(self, event: GenerationError) -> NoReturn:
        err = from_engine_error(event.error)
        self._record("rejected" if err.status in (429, 503) else "error")
        raise err

    async def _engine_events(self) -> AsyncIterator[object]:
        """The handle's events, starting with the one :meth:`wait_admitted` read, if any."""
        if self._head is not None:
            head, self._head = self._head, None
            try:
                yield await head
            except StopAsyncIteration:
                return
        async for event in self._source if self._source is not None else self.handle:
            yield event

    async def events(self) -> AsyncIterator[Step | Outcome]:
        """Steps, then one Outcome. A request-level failure raises its ApiError (before or between
        steps); the handle is released either way."""
        try:
            async for event in self._engine_events():
                if isinstance(event, GenerationDelta):
                    if event.token_ids:
                        self._observe_tokens(len(event.token_ids))
                    deltas = self._transform(event.deltas)
                    if deltas or event.token_ids:
                        yield Step(deltas, event.token_ids, tuple(event.logprobs or ()))
                elif isinstance(event, GenerationResult):
                    tail = self._transform((), final=True)
                    if tail:
                        yield Step(tail)
                    self._record(event.finish_reason, prompt_tokens=event.usage.prompt_tokens)
                    yield Outcome(event.finish_reason, event.stop_reason, event.usage.prompt_tokens,
                                  event.usage.completion_tokens, event.usage.cached_tokens)
                elif isinstance(event, GenerationError):
                    self._refused(event)
                elif not isinstance(event, GenerationStart):
                    raise TypeError(f"unexpected engine event {type(event).__name__}")
        finally:
            self.close()

    def close(self) -> None:
        """Release the handle (cancelling an unfinished request). Idempotent."""
        if self._head is not None and not self._head.done():
            self._head.cancel()  # the event it waits for will not be read
        self.handle.release()
        self._record("cancelled")


@dataclass
class Collected:
    """A whole answer, for non-streaming responses."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    outcome: Outcome | None = None

    @property
    def text(self) -> str:
        return "".join(self.content)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)


async def collect(generation: Generation) -> Collected:
    out = Collected()
    async for item in generation.events():
        if isinstance(item, Outcome):
            out.outcome = item
            continue
        out.token_ids.extend(item.token_ids)
        out.logprobs.extend(item.logprobs)
        for d in item.deltas:
            (out.reasoning if d.channel == "reasoning" else out.content).append(d.text)
            out.tool_calls.extend(d.tool_calls)
    return out


async def collect_response(request: Request, generation: Generation) -> Collected:
    """A non-streaming response's whole generation, cancelled when the client disconnects; the generation
    is closed either way. The result always has its outcome."""
    try:
        got = await unless_disconnected(request, collect(generation))
    finally:
        generation.close()
    assert got.outcome is not None
    return got
