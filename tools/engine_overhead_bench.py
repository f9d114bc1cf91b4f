#!/usr/bin/env python3
"""The engine's own cost per decode step: the public Engine over a Program whose model is free.

``NullProgram`` is the real ``SequenceProgram`` bookkeeping (ledgers, pages, PendingBatch, sampling) with a
forward that returns preset logits, so the wall time of a decode step is the host work of the engine worker
(scheduling, ``_prepare``, sampling, the Frontend preview, commit, events) and nothing else. The Frontend
is the default model's real one. On a GPU that host work is serial with the model's graph replay, so it
is part of every decode step (see docs/dev/perf-log.md); this measures it on the CPU, where it can be
optimised without a GPU.

    python3 tools/engine_overhead_bench.py [--vocab 6144] [--steps 512]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from worker_profile import profiled_cycles, top_functions


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--profile", action="store_true", help="print the worker's top functions at the largest B")
    args = ap.parse_args()
    from ninfer import Engine, EngineOptions
    from ninfer.contracts.sampling import SamplingParams
    from ninfer.model_source import resolve_model
    from ninfer.ops.reference.plugin import ninfer_ops as reference_ops
    from ninfer.ops.registry import resolve_ops
    from ninfer.program.base import SequenceProgram
    from ninfer.storage.kv_pool import PagedKVCache
    from ninfer.storage.state_image import StateField, StateImageStorage, StateLayout

    with Engine.start(resolve_model(None)) as donor:
        frontend, vocab = donor.frontend, donor.vocab_size

    class NullProgram(SequenceProgram):
        """Real Program bookkeeping, free model: every row's logits put token 65 ("A"-ish) on top."""

        def __init__(self, rows: int) -> None:
            kv = PagedKVCache([0], num_pages=4096, page_size=16, num_kv_heads=1, head_dim=8,
                              dtype=torch.float32, device=torch.device("cpu"))
            states = StateImageStorage(StateLayout((StateField("s", (8,), torch.float32),)), rows,
                                       torch.device("cpu"))
            super().__init__(vocab_size=vocab, kv=kv, states=states,
                             ops=resolve_ops(reference_ops(), "cpu", torch.float32), device=torch.device("cpu"),
                             max_context=8192)
            self._logits = torch.zeros((rows + 1, vocab))
            self._logits[:, 65] = 10.0

        def forward(self, batch):
            return self._logits[: batch.num_logit_rows]

    sp = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    for b in (int(x) for x in args.batches.split(",")):
        engine = Engine.from_parts(NullProgram(b), frontend, EngineOptions(max_concurrency=b, max_context=8192))
        with engine:
            prompts = [[10 + i, 11, 12, 13] for i in range(b)]

            def run(prompts=prompts, engine=engine):
                t0 = time.perf_counter()
                hs = [engine.submit(p, sampling=sp) for p in prompts]
                for h in hs:
                    with h:
                        h.result()
                return time.perf_counter() - t0

            run()
            walls = sorted(run() for _ in range(3))
            print(f"B={b}: {walls[1] / args.steps * 1e6:,.0f} us per decode step (median of 3 runs of {args.steps} "
                  f"steps), {b * args.steps / walls[1]:,.0f} tok/s")
            if args.profile and b == max(int(x) for x in args.batches.split(",")):
                with profiled_cycles(engine) as prof:
                    run()
                print(top_functions(prof, own=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
