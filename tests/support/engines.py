"""Helpers for tests that drive a public Engine."""

from __future__ import annotations

import time


def settled(engine):
    """The stats once the worker has published the cycle that settled every request (a result is
    delivered before that cycle's snapshot)."""
    deadline = time.monotonic() + 10
    while True:
        s = engine.stats()
        if (s.running == 0 and s.queue_depth == 0 and s.outstanding == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.005)
