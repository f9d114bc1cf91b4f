#!/usr/bin/env python3
"""Prefill time-to-first-token A/B at a published shape (diagnostics): lookahead decode on/off, the GDN input
projections as one GEMM or as the older two, and the KV pool size, each measured in one process on one model.

For each variant: an Engine from the same converted artifact, a few decode requests first (so a lookahead
is outstanding when the prefill arrives, as in ``ninfer bench``), then ``--repeats`` single-token
generations of ``--lengths`` prompts; the median TTFT per length. The last variant's engine steps of one
prefill are profiled with cProfile (host hot spots).

    python3 tools/gpu_prefill_ab.py --shape 35b-a3b --layers 4 --tokenizer /tmp/tok.json --out $OUT
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_kernel_profile import _shapes_module, model_args, random_artifact  # noqa: E402
from worker_profile import profiled_cycles, top_functions  # noqa: E402


def split_gdn_groups(program) -> int:
    """Run each GDN layer's input projections as the older two GEMMs (qkv+z, b+a): zero-copy row views."""
    from ninfer_qwen3_5.layers.fused import RowGroup
    from ninfer_qwen3_5.layers.gdn import GatedDeltaNet

    n = 0
    for layer in program.model.layers:
        m = layer.mixer
        if isinstance(m, GatedDeltaNet) and len(m.in_groups) == 1 and len(m.in_groups[0].sizes) == 4:
            w, (c, vd, hv, _) = m.in_groups[0].weight, m.in_groups[0].sizes
            m.in_groups = [RowGroup(w[: c + vd], (c, vd)), RowGroup(w[c + vd:], (hv, hv))]
            n += 1
    return n


def main() -> int:
    ap = model_args(__doc__)
    ap.add_argument("--lengths", default="128,1024")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = _shapes_module()
    from ninfer import Engine, EngineOptions
    from ninfer.contracts.sampling import SamplingParams

    geometry, artifact = random_artifact(shapes, args.shape, args.layers, args.tokenizer)
    lengths = [int(x) for x in args.lengths.split(",")]
    variants = [("lookahead, one GEMM, context 8k", dict(lookahead=None, max_context=8448), False),
                ("no lookahead, one GEMM, context 8k", dict(lookahead=False, max_context=8448), False),
                ("lookahead, two GEMMs, context 8k", dict(lookahead=None, max_context=8448), True),
                ("lookahead, one GEMM, context 1.1k", dict(lookahead=None, max_context=1100), False),
                ("no lookahead, one GEMM, context 1.1k", dict(lookahead=False, max_context=1100), False)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    dec = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    report = {"shape": args.shape, "layers": args.layers, "variants": []}
    prof_text = ""
    for name, kw, split in variants:
        if max(lengths) >= kw["max_context"]:
            print(f"{name}: skipped (a {max(lengths)}-token prompt does not fit)", flush=True)
            continue
        with Engine.start(artifact, EngineOptions(device="cuda", max_concurrency=8, **kw)) as engine:
            groups = split_gdn_groups(engine._program) if split else 0  # noqa: SLF001 (diagnostics)
            rows = {}
            for n in lengths:
                prompt = torch.randint(0, geometry["vocab_size"], (n,), generator=torch.Generator().manual_seed(n)).tolist()
                samples = []
                for r in range(args.repeats + 1):
                    engine.generate([5, 6, 7, 8 + r], sampling=dec)  # leaves a lookahead outstanding
                    samples.append(engine.generate(prompt, sampling=one).timings.ttft_s * 1000)
                rows[n] = {"ttft_ms": statistics.median(samples[1:]), "samples": samples}
            if name.startswith("lookahead, one GEMM, context 8k"):
                prompt = torch.randint(0, geometry["vocab_size"], (lengths[-1],),
                                       generator=torch.Generator().manual_seed(1)).tolist()
                engine.generate([5, 6, 7, 9], sampling=dec)
                with profiled_cycles(engine) as prof:
                    engine.generate(prompt, sampling=one)
                prof_text = top_functions(prof, own=35)
            line = {"variant": name, "split_layers": groups, "ttft": rows, "stats": engine.stats().as_dict()}
        report["variants"].append(line)
        print(name, {n: round(v["ttft_ms"], 2) for n, v in rows.items()}, flush=True)
    (args.out / f"prefill_ab_{args.shape}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"prefill_ab_{args.shape}_profile.txt").write_text(prof_text)
    print(prof_text[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
