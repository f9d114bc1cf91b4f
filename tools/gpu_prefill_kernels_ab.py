#!/usr/bin/env python3
"""The prefill kernels' launch choices A/B'd end to end: one model, one engine, the choices switched in process.

Issue 39 items 2-3. The prefill attention's tile at D = 256 and the MoE grouped path's tiles and GEMMs are chosen
at each call from module state, so one engine can time every combination on the same artifact in one process
(no restart, no second model in memory):

- ``attention``: the 16-bit tile at head dims over 128, ``old`` 64 x 32, ``new`` 128 x 64 (today's default) or
  ``n32`` 128 x 32 (in the sm_90 build at D = 256, ``new`` spills the most registers, ``old`` the fewest, ``n32``
  lies between; docs/dev/perf-log.md has the counts), all with 8 warps, or ``sdpa``: torch's fused attention
  (``NINFER_ATTN_SDPA=1``, a candidate);
- ``moe`` (MoE shapes): ``old`` the 64-row tiles for every call, ``large`` today's ``LARGE_TILES`` for calls of
  16,384 or more pairs, ``grouped_mm`` those calls through torch._grouped_mm (``NINFER_MOE_GROUPED_MM=1``).

For each combination: the median TTFT of ``--repeats`` single-token generations of each ``--lengths`` prompt, the
prefill rate and its share of the bf16 matmul peak measured in the same run (``ninfer bench``'s FLOP count),
and the greedy first token (the roundings differ between combinations, so a random model's near-tie may
flip it; a flip is worth a look, not proof of a fault).

    python3 tools/gpu_prefill_kernels_ab.py --shape 9b --layers 8 --tokenizer /tmp/tok.json --out $OUT
    python3 tools/gpu_prefill_kernels_ab.py --shape 35b-a3b --layers 8 --tokenizer /tmp/tok.json --out $OUT
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_kernel_profile import _shapes_module, model_args, random_artifact  # noqa: E402

# The 16-bit tiles at head dims over 128 that replace today's ("new") in a combination.
TILES = {"old": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
         "n32": {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}}


@contextlib.contextmanager
def choices(attention_tile: str, moe: str):
    """The module state of one combination, restored on exit."""
    from ninfer.ops.triton import attention, attention_sdpa
    from ninfer.ops.triton import moe as tm
    saved = attention._prefill_config, tm.LARGE_PAIRS, tm.GROUPED_MM, attention_sdpa.ENABLED
    try:
        if attention_tile in TILES:
            base, tile = saved[0], TILES[attention_tile]

            def config(d, dtype):
                cfg = base(d, dtype)
                wide = max(16, 1 << (d - 1).bit_length()) > 128
                return dict(tile) if wide and dtype != torch.float32 else cfg
            attention._prefill_config = config
        if moe == "old":
            tm.LARGE_PAIRS = 1 << 62
        tm.GROUPED_MM = moe == "grouped_mm"
        attention_sdpa.ENABLED = attention_tile == "sdpa"
        yield
    finally:
        attention._prefill_config, tm.LARGE_PAIRS, tm.GROUPED_MM, attention_sdpa.ENABLED = saved


def first_tokens_by_length(runs: list[dict]) -> dict[int, dict[str, list[str]]]:
    """For each prompt length, each distinct greedy first token (as text) and the combinations that gave it."""
    seen: dict[int, dict[str, list[str]]] = {}
    for r in runs:
        key = " ".join(str(list(t)) for t in r["first_tokens"])
        seen.setdefault(r["tokens"], {}).setdefault(key, []).append(f"{r['attention']}/{r['moe']}")
    return seen


def main() -> int:
    ap = model_args(__doc__)
    ap.add_argument("--lengths", default="8192")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attention", default="old,new,n32,sdpa", help="the attention choices to run (comma list)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = _shapes_module()
    from ninfer import Engine, EngineOptions
    from ninfer.bench.limits import measure_matmul_peak
    from ninfer.bench.report import prefill_flops
    from ninfer.contracts.sampling import SamplingParams
    from ninfer.planning.planner import artifact_profile

    geometry, artifact = random_artifact(shapes, args.shape, args.layers, args.tokenizer)
    lengths = [int(x) for x in args.lengths.split(",")]
    options = EngineOptions(device="cuda", max_concurrency=1, max_context=max(lengths) + 64)
    profile = artifact_profile(artifact, options).profile
    peak = measure_matmul_peak(torch.device("cuda"), torch.bfloat16, 8192)
    moe_choices = ("old", "large", "grouped_mm") if geometry.get("num_experts") else ("old",)
    combos = [(a, m) for a in args.attention.split(",") for m in moe_choices]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    report = {"shape": args.shape, "layers": args.layers, "matmul_peak_flops": peak, "runs": []}
    with Engine.start(artifact, options) as engine:
        for n in lengths:
            prompt = torch.randint(0, geometry["vocab_size"], (n,), generator=torch.Generator().manual_seed(n)).tolist()
            flops = prefill_flops(profile, n)
            for attention_tile, moe in combos:
                with choices(attention_tile, moe):
                    samples, tokens = [], set()
                    for _ in range(args.repeats + 1):   # the first compiles what this combination launches
                        res = engine.generate(prompt, sampling=one)
                        samples.append(res.timings.ttft_s)
                        tokens.add(tuple(res.token_ids))
                ttft = statistics.median(samples[1:])
                row = {"tokens": n, "attention": attention_tile, "moe": moe, "ttft_ms": ttft * 1e3,
                       "tok_per_s": n / ttft, "of_peak": flops / ttft / peak, "samples_s": samples,
                       "first_tokens": sorted(tokens)}
                report["runs"].append(row)
                print(f"{n} tokens, attention {attention_tile}, moe {moe}: TTFT {ttft * 1e3:.1f} ms, "
                      f"{100 * row['of_peak']:.1f}% of peak, first token {sorted(tokens)}", flush=True)
    report["first_tokens_by_length"] = first_tokens_by_length(report["runs"])
    report["first_tokens_agree"] = all(len(v) == 1 for v in report["first_tokens_by_length"].values())
    print(f"first tokens agree across combinations: {report['first_tokens_agree']}", flush=True)
    for n, seen in report["first_tokens_by_length"].items():
        if len(seen) > 1:
            print(f"  {n} tokens: " + "; ".join(f"{tok} from {', '.join(who)}" for tok, who in seen.items()),
                  flush=True)
    (args.out / f"prefill_kernels_ab_{args.shape}.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
