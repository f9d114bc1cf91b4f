"""Constrained decoding on a CUDA device: correctness of masked sampling and the mask's cost there.

1. Brute force, as tests/constrained/test_masked_sampling.py does on the CPU: every non-empty allowed
   set of a 10-token vocabulary, masks applied on the GPU, drawn with the reference ``sample`` op and
   (when present) the Triton one: every token is allowed and equals the CPU reference draw.
2. ``apply_bitmask`` at B=8 over the real Qwen3.5 vocabulary size (248,077): pinned host words ->
   device, unpack, -inf; CUDA-event median.
3. The default model on the GPU: 50 seeds of the JSON schema of test_default_model_constrained at
   temperature 1.0, B=8 -> all valid; and the wall time per generated token of 8 constrained vs 8
   unconstrained requests.

Run from the repo root on the GPU machine (not collected by pytest)::

    python3 tests/constrained/gpu_check_constrained.py --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def brute_force(sample, device: str) -> dict:
    from ninfer.ops.reference.sampling import sample as reference_sample
    from ninfer.program.token_bitmask import apply_bitmask, fill_bitmasks

    from constrained.test_masked_sampling import MASKS, SetMask, V, allowed_ids

    g = torch.Generator().manual_seed(11)
    checked = 0
    for temperature, top_k, top_p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 3, 1.0), (1.2, 0, 0.7)]:
        logits = torch.randint(-3, 4, (len(MASKS), V), generator=g).float() * 0.5
        words = fill_bitmasks([SetMask(b) for b in MASKS], V)
        n = len(MASKS)
        args = (torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.int32), torch.full((n,), top_p),
                torch.zeros(n), torch.full((n,), 3, dtype=torch.int64), torch.arange(n, dtype=torch.int64))
        cpu = reference_sample(apply_bitmask(logits.clone(), words), *args)
        dev = sample(apply_bitmask(logits.to(device), words), *(a.to(device) for a in args)).cpu()
        for bits, a, b in zip(MASKS, cpu.tolist(), dev.tolist(), strict=True):
            assert b in allowed_ids(bits), (bits, b)
            assert a == b, (bits, a, b)
            checked += 1
    return {"rows_checked": checked, "all_allowed_and_equal_to_cpu": True}


def apply_timing(device: str, vocab: int = 248077, batch: int = 8, reps: int = 200) -> dict:
    from ninfer.program.token_bitmask import apply_bitmask, words_per_row

    words = torch.randint(-2**31, 2**31 - 1, (batch, words_per_row(vocab)), dtype=torch.int32).pin_memory()
    logits = torch.randn(batch, vocab, device=device)
    times = []
    for _ in range(reps):
        x = logits.clone()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        apply_bitmask(x, words)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    times.sort()
    return {"b8_apply_median_us": times[len(times) // 2], "b8_apply_p90_us": times[int(0.9 * len(times))]}


def engine_check(device: str, dtype: str) -> dict:
    import jsonschema
    from ninfer import Engine
    from ninfer.contracts.constraint import OutputConstraint
    from ninfer.contracts.frontend import OutputOptions
    from ninfer.model_source import resolve_model

    from constrained.test_default_model_constrained import PROMPT, SCHEMA

    os.environ["NINFER_CACHE_DIR"] = tempfile.mkdtemp(prefix="ninfer-cache-")
    out: dict = {"dtype": dtype}
    with Engine.start(resolve_model(None), device=device, dtype=dtype, max_concurrency=8) as engine:
        def run(seeds, constrained: bool):
            opts = OutputOptions(constraint=OutputConstraint.json_schema(SCHEMA) if constrained else None)
            t0 = time.perf_counter()
            hs = [engine.submit(PROMPT, sampling=engine.sampling_params(
                temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=s, max_tokens=400 if constrained else 60,
                ignore_eos=not constrained), output=opts) for s in seeds]
            rs = [h.result() for h in hs]
            return rs, time.perf_counter() - t0

        run(range(8), True)   # warm-up: compile, kernels
        run(range(8), False)
        results, _ = run(range(50), True)
        validator = jsonschema.Draft202012Validator(SCHEMA)
        bad = [r.output.content for r in results
               if r.finish_reason != "stop" or list(validator.iter_errors(json.loads(r.output.content)))]
        out["json_schema_50_seeds_invalid"] = bad
        for constrained in (False, True):
            rs, wall = run(range(100, 108), constrained)
            tokens = sum(len(r.token_ids) for r in rs)
            out["constrained" if constrained else "unconstrained"] = {
                "tokens": tokens, "wall_s": wall, "ms_per_token_b8": 1000 * wall / tokens}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from ninfer.ops.reference.sampling import sample as reference_sample

    report: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    report["brute_force_reference"] = brute_force(reference_sample, args.device)
    try:
        from ninfer.ops.triton.sampling import sample as triton_sample
    except ImportError as exc:
        report["brute_force_triton"] = f"not available: {exc}"
    else:
        report["brute_force_triton"] = brute_force(triton_sample, args.device)
    report["apply"] = apply_timing(args.device)
    for dtype in ("float32", "bfloat16"):
        report[f"engine_{dtype}"] = engine_check(args.device, dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check_constrained.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
