#!/usr/bin/env python3
"""Speculative decoding on the embedded default model (MTP, DFlash, DFlash2): acceptance and real speed against
plain decoding.

For each run of ``--runs`` (``none``: plain decoding; ``BACKEND:K``: ``--speculative BACKEND
--num-speculative-tokens K``) it starts the public Engine on the default model (with ``dflash`` / ``dflash2``,
the default model converted with its shipped drafter of that kind, as ``Engine.start`` resolves it), generates
greedily from prompts cut from the source of the standard-library modules the default model never saw in
training (tools/default_model_corpus.py's held-out list), and reports per run:

- B=1: the prompts one at a time; decode rate = (tokens - 1) / (last token - first token), summed over prompts;
- B=8: eight prompts submitted together; aggregate rate = all output tokens / wall time;
- mean accepted length (tokens committed per verify step: 1 + accepted / verifies) and the acceptance rate per
  draft position (``EngineStats``);
- whether every output equals plain decoding's, and where the first one parts from it. Greedy speculation is
  exact in fp32 (``--dtype float32``; a False there is a bug); in bf16 the verify step computes its k+1
  positions with the chunk kernels and plain decoding with the decode kernels, whose roundings differ, so a
  near-tie between two tokens can go either way and a long output may part (as it may between batch sizes).

    python3 tools/spec_speed.py --device cuda --out $OUT
    python3 tools/spec_speed.py --device cuda --dtype float32 --runs none,mtp:2,dflash:7 --tokens 64 --out $OUT
    python3 tools/spec_speed.py --device cpu --tokens 24 --prompts 2 --runs none,mtp:2,dflash2:3 --out /tmp/spec
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time
from pathlib import Path

HELDOUT = ("fractions", "statistics", "textwrap", "graphlib", "sched", "queue", "colorsys", "json.decoder")


def prompts(count: int, chars: int) -> list[str]:
    """``count`` pieces of held-out module source, each starting at a line that opens a def."""
    out: list[str] = []
    sources = [inspect.getsource(importlib.import_module(m)) for m in HELDOUT]
    while len(out) < count:
        for src in sources:
            starts = [i for i in range(len(src)) if src.startswith("\n    def ", i) or src.startswith("\ndef ", i)]
            pick = starts[(len(out) * 7) % len(starts)] + 1 if starts else 0
            out.append(src[pick:pick + chars])
            if len(out) == count:
                break
    return out


def timed(handle) -> tuple[list[int], float | None, float | None]:
    tokens: list[int] = []
    first = last = None
    for event in handle:
        ids = getattr(event, "token_ids", None) or ()
        if ids:
            now = time.perf_counter()
            first = now if first is None else first
            last = now
            tokens.extend(ids)
    return tokens, first, last


def parse_runs(text: str) -> list[tuple[str | None, int]]:
    runs = []
    for item in text.split(","):
        if item == "none":
            runs.append((None, 0))
            continue
        backend, _, k = item.partition(":")
        if not backend or not k.isdigit() or int(k) < 1:
            raise SystemExit(f"--runs: {item!r} is neither 'none' nor BACKEND:K with K >= 1")
        runs.append((backend, int(k)))
    return runs


def run_k(backend: str | None, k: int, args, texts: list[str]) -> dict:
    from ninfer import Engine, EngineOptions, SamplingParams

    opts = dict(device=args.device, max_concurrency=8)
    if args.dtype:
        opts["dtype"] = args.dtype
    if backend:
        opts.update(speculative=backend, num_speculative_tokens=k)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    with Engine.start(None, EngineOptions(**opts)) as engine:
        engine.generate(texts[0], sampling=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        base = engine.stats()
        outputs, rate_tokens, rate_time = [], 0, 0.0
        for text in texts[: args.prompts]:
            result = engine.generate(text, sampling=greedy)
            outputs.append(list(result.token_ids))
        # Timed B=1 runs (same prompts again: the outputs above are the exactness check).
        for text in texts[: args.prompts]:
            h = engine.submit(text, sampling=greedy)
            toks, first, last = timed(h)
            if first is not None and last is not None and len(toks) > 1:
                rate_tokens += len(toks) - 1
                rate_time += last - first
        t0 = time.perf_counter()
        handles = [engine.submit(t, sampling=greedy) for t in texts[:8]]
        total = sum(len(h.result().token_ids) for h in handles)
        wall8 = time.perf_counter() - t0
        s = engine.stats()
    verifies = s.spec_verifies - base.spec_verifies
    accepted = s.spec_accepted - base.spec_accepted
    by_pos = s.spec_acceptance_by_position() if backend else ()
    return {"run": f"{backend}:{k}" if backend else "none", "backend": backend, "k": k, "b1_tok_s": rate_tokens / rate_time if rate_time else None, "b8_tok_s": total / wall8,
            "verifies": verifies, "drafted": s.spec_drafted - base.spec_drafted, "accepted": accepted,
            "mean_accepted_length": 1 + accepted / verifies if verifies else None,
            "acceptance_by_position": list(by_pos), "outputs": outputs}


def first_divergence(outputs: list[list[int]], plain: list[list[int]]) -> dict:
    """The first prompt whose output differs from plain decoding's, and the index of its first differing token."""
    for i, (a, b) in enumerate(zip(outputs, plain, strict=True)):
        if a != b:
            j = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            return {"prompt": i, "token": j}
    return {"prompt": len(plain), "token": 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="the run dtype (default: the engine's for the device)")
    ap.add_argument("--runs", default="none,mtp:1,mtp:2,mtp:3,mtp:4,dflash:7,dflash2:7",
                    help="none or BACKEND:K, comma-separated")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8, help="B=1 prompts (B=8 always uses 8)")
    ap.add_argument("--chars", type=int, default=1200)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    texts = prompts(max(8, args.prompts), args.chars)
    results = [run_k(backend, k, args, texts) for backend, k in parse_runs(args.runs)]
    plain = next((r for r in results if r["backend"] is None), None)
    print(f"Speculative decoding on the default model ({args.device}), greedy, {args.tokens} tokens, held-out "
          f"stdlib prompts")
    print(f"{'run':>9} {'B=1 tok/s':>10} {'x plain':>8} {'B=8 tok/s':>10} {'x plain':>8} {'accepted len':>12} "
          f"{'by position':<28} identical")
    for r in results:
        same = plain is None or r["outputs"] == plain["outputs"]
        r["identical_to_plain"] = same
        r["first_divergence"] = None if same else first_divergence(r["outputs"], plain["outputs"])
        x1 = r["b1_tok_s"] / plain["b1_tok_s"] if plain and r["b1_tok_s"] and plain["b1_tok_s"] else None
        x8 = r["b8_tok_s"] / plain["b8_tok_s"] if plain else None
        pos = " ".join(f"{p:.2f}" for p in r["acceptance_by_position"])
        mal = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else "-"
        print(f"{r['run']:>9} {r['b1_tok_s'] or 0:>10,.1f} {x1 or 0:>8.2f} {r['b8_tok_s']:>10,.1f} {x8 or 0:>8.2f} "
              f"{mal:>12} {pos:<28} {same}"
              + ("" if same else " (prompt {prompt}, token {token})".format(**r["first_divergence"])), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for r in results:
        r.pop("outputs")
    Path(args.out, "spec_speed.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0 if all(r["identical_to_plain"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
