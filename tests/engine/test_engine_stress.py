"""Mixed traffic on the toy Program with a tiny KV pool: one terminal event per handle, every page,
slot and outstanding capacity unit released at the end."""

from __future__ import annotations

import gc
import time

from .conftest import worker_threads
from .stress import run_stress


def test_stress_toy_engine(make_toy_engine):
    engine, program, _ = make_toy_engine(max_concurrency=8, queue_capacity=24, max_context=64,
                                         prefill_chunk_size=7, program_kwargs=dict(num_pages=20, page_size=4))
    report = run_stress(engine, n=400, vocab=(2, 48), max_prompt=40, max_tokens=16, seed=11)
    assert not report.errors, report.errors[:5]
    consumed = sum(report.outcomes.values())
    assert consumed == report.submitted - report.abandoned
    assert report.outcomes.get("cancelled", 0) > 0 and report.outcomes.get("length", 0) > 0
    # Abandoned handles are cancelled by the engine and release their capacity.
    end = time.monotonic() + 30
    while engine.stats().outstanding and time.monotonic() < end:
        gc.collect()
        time.sleep(0.01)
    stats = engine.stats()
    assert stats.outstanding == 0
    assert stats.preemptions > 0, "the tiny pool should have forced preemption"
    settled = stats.finished + stats.cancelled + stats.deadline + stats.rejected
    assert settled == stats.submitted == report.submitted
    engine.close(timeout=30)
    assert not worker_threads()
    cap = program.capacity()
    assert cap.free_pages == cap.total_pages and cap.free_state_slots == cap.total_state_slots
