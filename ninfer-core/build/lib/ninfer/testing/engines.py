"""Driving a public :class:`~ninfer.Engine` from a test: greedy generations submitted together, waiting for
the stats to settle, and a thread setting for tiny models."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch


def greedy_tokens(engine, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's ``max_tokens`` greedy tokens (temperature 0, EOS ignored). All prompts are submitted before
    any result is awaited, so they share decode steps up to the engine's ``max_concurrency``."""
    params = engine.sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(engine.submit([int(t) for t in p], sampling=params)) for p in prompts]
        return [list(h.result().token_ids) for h in handles]


def settled(engine, *, wait_s: float = 10.0):
    """The engine's stats once the worker has published the step that settled every request (a result is
    delivered before that step's snapshot); the latest stats after ``wait_s`` seconds otherwise, for the
    caller's assertion to report."""
    deadline = time.monotonic() + wait_s
    while True:
        s = engine.stats()
        if (s.running == 0 and s.queue_depth == 0 and s.outstanding == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.005)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block, restored after. Tiny models run many tiny ops,
    where more threads only add barrier spinning on a small machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
