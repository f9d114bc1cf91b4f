"""GenerationHandle and its shared pieces, without an engine: event order, sync/async consumption,
cancellation, and the exactly-once release of outstanding capacity."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest
from ninfer.contracts.errors import QueueTimeoutError
from ninfer.contracts.events import (
    GenerationDelta,
    GenerationError,
    GenerationResult,
    GenerationStart,
    Timings,
    Usage,
)
from ninfer.engine.handle import GenerationHandle, RequestControl


class Counters:
    def __init__(self) -> None:
        self.wakes = 0
        self.releases = 0

    def control(self, rid: str = "r") -> RequestControl:
        return RequestControl(rid, wake=self._wake, on_release=self._release)

    def _wake(self) -> None:
        self.wakes += 1

    def _release(self) -> None:
        self.releases += 1


def result_event(rid: str = "r", reason: str = "stop") -> GenerationResult:
    return GenerationResult(rid, reason, (5,), None, Usage(1, 1), Timings(0.0, 0.0, 0.0))


def test_sync_iteration_ends_at_the_terminal_event_and_releases_once():
    c = Counters()
    control = c.control()
    handle = GenerationHandle(control)
    events = [GenerationStart("r", 3), GenerationDelta("r", (5,)), result_event()]
    for e in events:
        control.channel.push(e)
    control.response_done()
    assert c.releases == 0  # the consumer has not seen the end yet
    assert list(handle) == events
    assert c.releases == 1
    assert handle.result() == events[-1]  # still answerable after iteration
    handle.release()
    del handle
    gc.collect()
    assert c.releases == 1 and c.wakes == 0  # nothing cancelled, released exactly once


@pytest.mark.parametrize("consumer_first", [True, False])
def test_release_needs_both_halves_in_either_order(consumer_first):
    c = Counters()
    control = c.control()
    handle = GenerationHandle(control)
    if consumer_first:
        control.channel.push(result_event())
        handle.release()
        assert c.releases == 0
        control.response_done()
    else:
        control.channel.push(result_event())
        control.response_done()
        assert c.releases == 0
        handle.release()
    assert c.releases == 1
    handle.release()
    assert c.releases == 1


def test_abandoned_handle_cancels_and_releases_after_the_worker_finishes():
    c = Counters()
    control = c.control()
    handle = GenerationHandle(control)
    control.channel.push(GenerationStart("r", 3))
    del handle
    gc.collect()
    assert control.cancel_requested and c.wakes == 1
    assert c.releases == 0  # the worker still holds the request
    control.channel.push(result_event(reason="cancelled"))
    control.response_done()
    assert c.releases == 1


def test_result_raises_the_request_error_and_times_out():
    c = Counters()
    control = c.control()
    handle = GenerationHandle(control)
    with pytest.raises(TimeoutError):
        handle.result(timeout=0.05)
    control.channel.push(GenerationError("r", QueueTimeoutError("waited too long")))
    with pytest.raises(QueueTimeoutError, match="waited too long"):
        handle.result()
    with pytest.raises(QueueTimeoutError):  # the terminal event is kept
        handle.result()


def test_nothing_may_follow_the_terminal_event():
    control = Counters().control()
    control.channel.push(result_event())
    with pytest.raises(RuntimeError, match="after the terminal event"):
        control.channel.push(GenerationDelta("r", (1,)))


def test_async_iteration_is_woken_from_another_thread():
    c = Counters()
    control = c.control()
    handle = GenerationHandle(control)
    events = [GenerationStart("r", 3)] + [GenerationDelta("r", (i,)) for i in range(5)] + [result_event()]

    def produce():
        for e in events:
            time.sleep(0.01)
            control.channel.push(e)
        control.response_done()

    async def consume():
        got = []
        async for e in handle:
            got.append(e)
        return got

    producer = threading.Thread(target=produce)
    producer.start()
    got = asyncio.run(asyncio.wait_for(consume(), timeout=10))
    producer.join()
    assert got == events
    assert c.releases == 1


def test_async_result_and_cancelled_waiter():
    c = Counters()
    control = c.control()
    handle = GenerationHandle(control)

    async def main():
        waiter = asyncio.ensure_future(control.channel.aget())
        await asyncio.sleep(0.01)
        waiter.cancel()  # a cancelled awaiting consumer must not break later pushes
        with pytest.raises(asyncio.CancelledError):
            await waiter
        threading.Timer(0.02, lambda: control.channel.push(result_event())).start()
        return await asyncio.wait_for(handle.aresult(), timeout=10)

    assert asyncio.run(main()).finish_reason == "stop"


def test_every_reader_of_one_handle_sees_the_end():
    """Two threads reading one handle split its events, but the terminal event reaches both: the reader whose
    event another thread took does not wait forever (blocking and asyncio readers alike)."""
    c = Counters()
    control = c.control()
    handle = GenerationHandle(control)
    seen: list[list] = [[], []]
    started = threading.Barrier(3)

    def read(i: int) -> None:
        started.wait()
        seen[i] = list(handle)

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
    for t in readers:
        t.start()
    started.wait()
    time.sleep(0.05)   # both readers wait in get(); ordering is not what the test depends on
    events = [GenerationStart("r", 3), GenerationDelta("r", (5,)), GenerationDelta("r", (6,)), result_event()]
    for e in events:
        control.channel.push(e)
    control.response_done()
    for t in readers:
        t.join(10)
    assert not any(t.is_alive() for t in readers)
    assert seen[0][-1] is seen[1][-1] is events[-1]
    assert sorted(map(id, seen[0][:-1] + seen[1][:-1])) == sorted(map(id, events[:-1]))
    assert handle.result(timeout=1) is events[-1]

    async def late_reader():   # an asyncio reader after the queue emptied gets the end, not a wait
        return await asyncio.wait_for(control.channel.aget(), 1)

    assert asyncio.run(late_reader()) is events[-1]
    assert c.releases == 1
