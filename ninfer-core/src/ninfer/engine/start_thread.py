"""Start-up work on a thread of its own, which ends before serving starts (:func:`on_start_thread`).

Why: CPU kernels built on OpenMP (torch's CPU ops, the host-expert kernel of a plugin) keep a pool of worker threads
per thread that runs a parallel region, for the life of that thread. GNU OpenMP counts the threads of every pool,
and once the count exceeds the CPUs it stops spinning between regions: its workers sleep after about a hundred
spins, and every region and barrier must wake them (docs/memory.md, "Host threads", has the measurements).
Loading weights, measuring host costs and the warm-up run such regions on the thread that starts the engine, with
the thread count the engine worker will use; the worker then builds a second pool of the same size, and past half
the CPUs the two pools throttle each other for as long as the process runs. Started here, the start-up pool ends
with this thread (OpenMP frees a thread's pool when the thread exits), and the engine worker's team has the
process's CPUs to itself.

Invariants: ``fn`` runs exactly once, on a new daemon thread, and the caller waits for it; its return value is
returned and its exception raised in the caller, unchanged. A KeyboardInterrupt in the caller while it waits is
raised at once; the start-up thread then finishes on its own (a daemon: it never holds the interpreter's exit).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_start_thread(fn: Callable[[], T], name: str = "ninfer-engine-start") -> T:
    """``fn()`` on a thread that exits before this returns (module docstring)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:   # noqa: BLE001 (re-raised in the caller)
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)   # a timed join keeps the caller interruptible
    if error:
        raise error[0]
    return result[0]
