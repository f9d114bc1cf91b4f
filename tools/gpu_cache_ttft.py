#!/usr/bin/env python3
"""Context cache on the GPU (issue #11 item 7): time to first token of a conversation's turn 2 with and
without the cache, for first turns of 8k and 32k tokens, through the public Engine.

Turn 1 = a random-token prompt of L tokens (a long first user turn) answered greedily with 64 tokens;
turn 2 = turn 1's prompt + its answer + 128 new tokens (the next user message, at token level: the raw-token
path of the Engine, so the history is kept exactly). The warm run submits turn 2 with the cache (it binds to
turn 1's end-of-response checkpoint); the cold run submits the same turn 2 with ``cache=False``. Each L is
first run once on other random tokens so kernel compilation is excluded. Greedy tokens of both runs are
compared (bf16 on the GPU: equal unless a logit gap is within bf16 noise; the run reports it).

    python3 tools/gpu_cache_ttft.py ARTIFACT --out $OUT [--lengths 8192,32768]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    from ninfer import Engine, EngineOptions
    from ninfer.contracts.sampling import SamplingParams

    lengths = [int(x) for x in args.lengths.split(",")]
    top = max(lengths) + args.answer + args.new + 64
    rng = random.Random(0)
    report: dict = {"artifact": str(args.artifact), "answer_tokens": args.answer, "new_tokens": args.new, "runs": []}
    with Engine.start(args.artifact, EngineOptions(max_concurrency=1, max_context=top, context_cache=True)) as engine:
        report["device"] = engine.info["device"]
        report["dtype"] = engine.info["dtype"]
        report["prefill_chunk_size"] = engine.options.prefill_chunk_size
        vocab = engine.vocab_size
        answer = SamplingParams(temperature=0.0, max_tokens=args.answer, ignore_eos=True)
        probe = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for length in lengths:
            for warm_up in (True, False):
                turn1 = [rng.randrange(vocab) for _ in range(length)]
                first = engine.generate(turn1, sampling=answer)
                turn2 = turn1 + list(first.token_ids) + [rng.randrange(vocab) for _ in range(args.new)]
                before = engine.stats()
                cached = engine.generate(turn2, sampling=probe)
                after = engine.stats()
                cold = engine.generate(turn2, sampling=probe, cache=False)
                if warm_up:
                    continue
                hit = getattr(after, "cache_hit_tokens", 0) - getattr(before, "cache_hit_tokens", 0)
                run = {"turn1_tokens": length, "turn2_tokens": len(turn2),
                       "turn1_ttft_ms": first.timings.ttft_s * 1000,
                       "turn2_ttft_ms_cache": cached.timings.ttft_s * 1000,
                       "turn2_ttft_ms_cold": cold.timings.ttft_s * 1000,
                       "cache_hit_tokens": hit, "prefilled_with_cache": len(turn2) - hit,
                       "same_tokens": cached.token_ids == cold.token_ids}
                report["runs"].append(run)
                print(json.dumps(run), flush=True)
        report["stats"] = {k: v for k, v in vars(engine.stats()).items() if isinstance(v, (int, float))}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cache_ttft.json").write_text(json.dumps(report, indent=1))
    print(f"{'turn 1':>8} {'turn 2':>8} {'cold ms':>9} {'cache ms':>9} {'speed-up':>8} {'prefilled':>9}")
    for r in report["runs"]:
        print(f"{r['turn1_tokens']:>8} {r['turn2_tokens']:>8} {r['turn2_ttft_ms_cold']:>9.1f} "
              f"{r['turn2_ttft_ms_cache']:>9.1f} {r['turn2_ttft_ms_cold'] / r['turn2_ttft_ms_cache']:>7.1f}x "
              f"{r['prefilled_with_cache']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
