"""A mixed-traffic stress driver shared by the toy and the Qwen engine tests.

Submits ``n`` requests with random prompt lengths and budgets from the main thread while consumer
threads read the streams. Some requests are cancelled (before any event, after a delta, or from a
timer), some get short deadlines, some handles are dropped unread (abandoned = cancelled). A full
queue is waited out. Returns what was observed; the caller checks the invariants.
"""

from __future__ import annotations

import gc
import queue
import random
import threading
import time
from dataclasses import dataclass, field

from ninfer.contracts.errors import QueueFullError
from ninfer.contracts.events import GenerationDelta, GenerationError, GenerationResult
from ninfer.contracts.sampling import SamplingParams

from .conftest import worker_threads
from .streams import check_stream


@dataclass
class StressReport:
    submitted: int = 0
    abandoned: int = 0
    queue_full: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def count(self, key: str) -> None:
        self.outcomes[key] = self.outcomes.get(key, 0) + 1


def run_stress(engine, *, n: int, vocab: tuple[int, int], max_prompt: int, max_tokens: int, seed: int = 0,
               consumers: int = 3, timeout: float = 120.0) -> StressReport:
    rng = random.Random(seed)
    report = StressReport()
    work: queue.Queue = queue.Queue()
    lock = threading.Lock()
    deadline = time.monotonic() + timeout

    def consume() -> None:
        while True:
            item = work.get()
            if item is None:
                return
            handle, cancel_after = item
            events = []
            try:
                while True:
                    left = deadline - time.monotonic()
                    event = handle.next_event(timeout=max(0.0, left))
                    events.append(event)
                    if cancel_after is not None and isinstance(event, GenerationDelta):
                        cancel_after -= 1
                        if cancel_after <= 0:
                            handle.cancel()
                    if isinstance(event, (GenerationResult, GenerationError)):
                        break
                terminal = check_stream(events)
                # Nothing may follow the terminal event, even later.
                assert not handle._control.channel.has_pending()
                key = terminal.finish_reason if isinstance(terminal, GenerationResult) else type(terminal.error).__name__
            except BaseException as exc:  # noqa: BLE001 - collected and asserted by the test
                with lock:
                    report.errors.append(f"{handle.request_id}: {type(exc).__name__}: {exc}")
                continue
            with lock:
                report.count(key)

    threads = [threading.Thread(target=consume, name=f"stress-consumer-{i}") for i in range(consumers)]
    for t in threads:
        t.start()
    try:
        for _ in range(n):
            prompt = [rng.randrange(*vocab) for _ in range(rng.randint(1, max_prompt))]
            sp = SamplingParams(temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([0, 20]),
                                max_tokens=rng.randint(1, max_tokens), seed=rng.randrange(2**31))
            kind = rng.random()
            timeout_s = rng.uniform(0.0005, 0.05) if kind < 0.1 else None
            while True:
                try:
                    handle = engine.submit(prompt, sampling=sp, timeout_s=timeout_s)
                    break
                except QueueFullError:
                    report.queue_full += 1
                    time.sleep(0.002)
                    assert time.monotonic() < deadline, "the engine stopped draining"
            report.submitted += 1
            if 0.1 <= kind < 0.15:
                report.abandoned += 1
                del handle  # dropped unread: the engine must cancel it and free its slot
                continue
            if 0.15 <= kind < 0.2:
                handle.cancel()  # before any event
            elif 0.2 <= kind < 0.25:
                threading.Timer(rng.uniform(0.0, 0.02), handle.cancel).start()
            cancel_after = rng.randint(1, 3) if 0.25 <= kind < 0.35 else None
            work.put((handle, cancel_after))
            handle = None
    finally:
        for _ in threads:
            work.put(None)
        for t in threads:
            t.join(timeout=max(1.0, deadline - time.monotonic()))
        gc.collect()
    return report


def stress_until_closed(engine, **stress):
    """:func:`run_stress` on a real-Program engine, then close it: no stream error, no surviving worker
    thread, every KV page and state slot free again. Returns (report, program, final stats)."""
    program = engine._program
    try:
        report = run_stress(engine, **stress)
        assert not report.errors, report.errors[:5]
    finally:
        engine.close(timeout=60)
    # worker_threads() counts this test's engines only: engines other test folders keep for the whole run stay open.
    assert not worker_threads(), "a worker thread survived"
    cap = program.capacity()
    assert cap.free_pages == cap.total_pages and cap.free_state_slots == cap.total_state_slots
    return report, program, engine.stats()
