"""Greedy runs with logprobs through a CUDA Engine, one prompt at a time, for the GPU tests that compare kernel
paths (graphs against eager, a candidate kernel against the default): one request at a time keeps every step's
composition the same from run to run, so equal kernels give equal bits."""

from __future__ import annotations

from ninfer import Engine, EngineOptions
from ninfer.contracts.events import GenerationDelta
from ninfer.contracts.sampling import SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def", "for i in range(10):"]


def greedy_runs(artifact, **options) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """(token ids, logprobs) of 24 greedy tokens for each of :data:`PROMPTS`, on CUDA in bf16 with ``options``."""
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=True)
    out = []
    with Engine.start(artifact, EngineOptions(device="cuda", dtype="bfloat16", max_context=128, max_concurrency=4,
                                              **options)) as engine:
        for prompt in PROMPTS:
            with engine.submit(prompt, sampling=sp) as h:
                lps = [lp.logprob for ev in h if isinstance(ev, GenerationDelta) for lp in (ev.logprobs or ())]
                r = h.result()
            out.append((tuple(r.token_ids), tuple(lps)))
    return out
