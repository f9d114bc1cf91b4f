#!/usr/bin/env python3
"""CausalScoring speed through the public Engine (issue #9 item 3): tokens/s of ``Engine.score`` over one
random-token text, windows of ``--context`` with stride ``--context`` (every token scored once), against the
engine's own prefill speed on the same artifact in the same run.

The whole text is scored once before timing: Triton specialises kernels on length divisibility, so a warm-up
of other shapes would leave compilation inside the timed run. Prefill: one request of ``--context`` tokens
(one output token), TTFT after a warm-up of the same length.

    python3 tools/gpu_score_speed.py ARTIFACT --out $OUT [--tokens 32768 --context 8192]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--context", type=int, default=8192)
    args = ap.parse_args()
    from ninfer import Engine
    from ninfer.contracts.sampling import SamplingParams

    rng = random.Random(7)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    report: dict = {"tokens": args.tokens, "context": args.context}
    with Engine.start(args.artifact, purpose="causal_scoring", max_context=args.context,
                      prefill_chunk_size=args.context) as scorer:
        vocab = scorer.vocab_size
        ids = [rng.randrange(vocab) for _ in range(args.tokens)]
        scorer.score([ids], context=args.context, stride=args.context)
        sync()
        t0 = time.perf_counter()
        rep = scorer.score([ids], context=args.context, stride=args.context)
        sync()
        wall = time.perf_counter() - t0
        report.update(scored_tokens=rep.overall.scored_tokens, wall_s=wall,
                      score_tok_s=rep.overall.scored_tokens / wall, ops=scorer.info.get("ops", {}).get("token_logprobs"))
    with Engine.start(args.artifact, max_concurrency=1, max_context=args.context + 16,
                      prefill_chunk_size=args.context) as engine:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        engine.generate([rng.randrange(vocab) for _ in range(args.context)], sampling=one)
        r = engine.generate([rng.randrange(vocab) for _ in range(args.context)], sampling=one)
        report["prefill_tok_s"] = args.context / r.timings.ttft_s
    report["score_over_prefill"] = report["score_tok_s"] / report["prefill_tok_s"]
    print(json.dumps(report, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "score_speed.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
