"""GenerationHandle: the consumer's side of one request, and the thread-safe pieces it shares with the worker.

Threads: the engine worker is the only producer of a request's events; any number of consumer
threads or one asyncio loop read them. Consumers never touch request state or the Program: they
set a cancellation flag and wake the worker.

Outstanding capacity (docs/design.md section 5): a submitted request holds one slot until *both* the
worker published its terminal event (``response_done``) and the consumer released the handle (saw
the terminal event, called :meth:`GenerationHandle.release`, or dropped the handle). The second of
the two calls releases the slot, exactly once. Dropping an unfinished handle also cancels it.

The release path may run inside a garbage-collection finalizer on any thread, possibly while that
thread holds some lock, so it takes no lock: it counts with ``itertools.count`` (atomic under the
GIL) and reports through ``queue.SimpleQueue`` (documented safe in finalizers).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from ninfer.contracts.events import (
    TERMINAL_EVENTS,
    GenerationError,
    GenerationEvent,
    GenerationResult,
)


class ResponseChannel:
    """A one-producer event queue readable from threads (blocking) and from asyncio (awaiting).

    Invariant: after the terminal event is pushed nothing else is; ``terminal`` keeps it so
    :meth:`GenerationHandle.result` still answers after the stream was iterated. Each event but the terminal one
    goes to one reader; the terminal event goes to every reader waiting once the queue is empty, and a reader that
    asks after the handle was released ends its iteration (StopIteration), so no reader waits forever for an end
    another thread took.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._events: deque[GenerationEvent] = deque()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.terminal: GenerationEvent | None = None  # set once, by the producer

    def push(self, event: GenerationEvent) -> None:
        with self._cond:
            if self.terminal is not None:
                raise RuntimeError(f"event {type(event).__name__} pushed after the terminal event")
            self._events.append(event)
            if isinstance(event, TERMINAL_EVENTS):
                self.terminal = event
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        # Wake awaiting coroutines on their own loops; never run their code on this thread.
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # that loop is closed: its consumer is gone
                pass

    def get(self, timeout: float | None = None) -> GenerationEvent:
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._events:
                if self.terminal is not None:   # another reader took it: the end is everyone's
                    return self.terminal
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("no generation event within the timeout")
                self._cond.wait(left)
            return self._events.popleft()

    async def aget(self) -> GenerationEvent:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._events:
                    return self._events.popleft()
                if self.terminal is not None:   # another reader took it: the end is everyone's
                    return self.terminal
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            try:
                await fut
            except asyncio.CancelledError:
                with self._cond:
                    if (loop, fut) in self._waiters:
                        self._waiters.remove((loop, fut))
                raise

    def has_pending(self) -> bool:
        with self._cond:
            return bool(self._events)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class RequestControl:
    """What the worker's record and the consumer's handle share. Holds no reference to either."""

    def __init__(self, request_id: str, wake: Callable[[], None], on_release: Callable[[], None]) -> None:
        self.request_id = request_id
        self.channel = ResponseChannel()
        self.cancel_requested = False  # set by consumers; a bool store is atomic, the worker polls it
        self._wake = wake
        self._on_release = on_release
        self._halves = itertools.count()

    def cancel(self) -> None:
        self.cancel_requested = True
        self._wake()

    def response_done(self) -> None:
        """Worker: the terminal event is published."""
        self._half_released()

    def consumer_released(self) -> None:
        """Consumer: the handle is released or abandoned. Called once (through the handle's finalizer)."""
        if self.channel.terminal is None:
            self.cancel()
        self._half_released()

    def _half_released(self) -> None:
        if next(self._halves) == 1:  # the second of the two halves releases the slot
            self._on_release()


def _abandon(control: RequestControl) -> None:
    control.consumer_released()


class GenerationHandle:
    """One submitted request. Iterate it (sync or async) for events, or call :meth:`result`.

    Every stream ends with exactly one terminal event (GenerationResult or GenerationError); seeing
    it through iteration or :meth:`result` releases the handle. :meth:`cancel` may be called from any
    thread at any time; a finished request ignores it.
    """

    def __init__(self, control: RequestControl) -> None:
        self._control = control
        self._release = weakref.finalize(self, _abandon, control)

    @property
    def request_id(self) -> str:
        return self._control.request_id

    @property
    def done(self) -> bool:
        """The terminal event was published (it may not have been read yet)."""
        return self._control.channel.terminal is not None

    def cancel(self) -> None:
        self._control.cancel()

    def release(self) -> None:
        """Give the handle back; an unfinished request is cancelled. Idempotent."""
        self._release()

    # -- synchronous consumption ------------------------------------------------------------------
    def next_event(self, timeout: float | None = None) -> GenerationEvent:
        """The next event; raises TimeoutError after ``timeout`` seconds, StopIteration after the end."""
        channel = self._control.channel
        if channel.terminal is not None and not channel.has_pending() and not self._release.alive:
            raise StopIteration
        event = channel.get(timeout)
        if isinstance(event, TERMINAL_EVENTS):
            self._release()
        return event

    def __iter__(self) -> Iterator[GenerationEvent]:
        while True:
            try:
                event = self.next_event()
            except StopIteration:
                return
            yield event
            if isinstance(event, TERMINAL_EVENTS):
                return

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the end; return the GenerationResult or raise the GenerationError's error."""
        end = None if timeout is None else time.monotonic() + timeout
        channel = self._control.channel
        while True:
            if channel.terminal is not None and not channel.has_pending():
                self._release()
                return _unwrap(channel.terminal)
            left = None if end is None else max(0.0, end - time.monotonic())
            event = channel.get(left)
            if isinstance(event, TERMINAL_EVENTS):
                self._release()
                return _unwrap(event)

    # -- asynchronous consumption -----------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        return self._aevents()

    async def _aevents(self) -> AsyncIterator[GenerationEvent]:
        channel = self._control.channel
        if channel.terminal is not None and not channel.has_pending() and not self._release.alive:
            return
        while True:
            event = await channel.aget()
            if isinstance(event, TERMINAL_EVENTS):
                self._release()
            yield event
            if isinstance(event, TERMINAL_EVENTS):
                return

    async def aresult(self) -> GenerationResult:
        channel = self._control.channel
        while True:
            if channel.terminal is not None and not channel.has_pending():
                self._release()
                return _unwrap(channel.terminal)
            event = await channel.aget()
            if isinstance(event, TERMINAL_EVENTS):
                self._release()
                return _unwrap(event)

    def __enter__(self) -> GenerationHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self._release()


def _unwrap(event: GenerationEvent) -> GenerationResult:
    if isinstance(event, GenerationError):
        raise event.error
    assert isinstance(event, GenerationResult)
    return event
