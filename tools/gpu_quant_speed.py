#!/usr/bin/env python3
"""Decode and prefill speed of each stored weight format, on the same random weights in one run (issue 32's method).

Builds the random-weight model of ``--shape`` once (tools/gpu_bench_shapes.py), then for each recipe of
``--recipes`` (``bf16`` = as stored, or an ``ninfer-convert --quantize`` preset such as ``fp8+a8``, ``q8``, ``q4``)
converts it in memory with the converter's own encoders (run on the model's device; consecutive recipes of one
format share the artifact), runs ``ninfer bench`` on the artifact (in the environment of the recipe's ``@``
settings: ``q4@wave/pf`` is the q4 artifact with ``NINFER_QUANT_SPLIT=wave NINFER_QUANT_PREFETCH=1``), and deletes
it. Each decode row's share of the copy ceiling is recomputed from the bytes the step really
reads: ``ninfer bench`` counts every weight at the run dtype, so the quantized objects' bf16 bytes are replaced by
their stored bytes (codes, high bits and scales). Writes ``quant_speed.json`` (every report) and prints a table.

    python3 tools/gpu_quant_speed.py --tokenizer tok.json --out $OUT                           # 9B, on the H200
    python3 tools/gpu_quant_speed.py --tiny --device cpu --tokenizer tok.json --out /tmp/qs    # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_shapes as shapes  # noqa: E402

START = time.perf_counter()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="9b")
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--recipes", default="q4,q8,fp8+a8,bf16",
                    help="in the order run (default q4,q8,fp8+a8,bf16); RECIPE@SETTING[/SETTING...] benches the "
                         "recipe's artifact with settings: auto, tc, cuda (NINFER_QUANT_GEMV), fill, wave, streamk "
                         "(NINFER_QUANT_SPLIT), pf (NINFER_QUANT_PREFETCH=1), sep (NINFER_QUANT_NORM=separate), l2 "
                         "(NINFER_QUANT_L2_PREFETCH=1); consecutive recipes of one format share one conversion")
    ap.add_argument("--batches", default=None, help="default 1,8 (tiny: 1,2)")
    ap.add_argument("--prefill-lengths", default=None, help="default 8192 (tiny: 32)")
    ap.add_argument("--bench-args", default="")
    ap.add_argument("--budget-s", type=float, default=560.0, help="a recipe starts only if the slowest so far fits")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ninfer_quant_speed"))
    return ap.parse_args(argv)


def read_bytes_ratio(row: dict, quantized: dict, embedding_ids: set[str]) -> dict:
    """``row`` (a ``ninfer bench`` decode row) with the bytes its step reads when the quantized objects are read as
    stored; the copy ceiling is the one its bench measured."""
    copy = row["achieved_bytes_per_s"] / row["copy_bandwidth_ratio"]
    saved = sum(q["source_bytes"] - q["stored_bytes"] for oid, q in quantized.items() if oid not in embedding_ids)
    step = row["bytes_per_step"] - saved
    return {"batch": row["batch"], "tokens_per_s": row["tokens_per_s"], "step_ms": row["step_ms"],
            "read_bytes_per_step": step, "copy_ratio": step / (row["step_ms"] / 1e3) / copy}


SETTINGS = {"auto": ("NINFER_QUANT_GEMV", "auto"), "tc": ("NINFER_QUANT_GEMV", "tc"),
            "cuda": ("NINFER_QUANT_GEMV", "cuda"), "fill": ("NINFER_QUANT_SPLIT", "fill"),
            "wave": ("NINFER_QUANT_SPLIT", "wave"), "streamk": ("NINFER_QUANT_SPLIT", "streamk"),
            "pf": ("NINFER_QUANT_PREFETCH", "1"),
            "sep": ("NINFER_QUANT_NORM", "separate"), "l2": ("NINFER_QUANT_L2_PREFETCH", "1")}


def setting_env(settings: str) -> dict[str, str]:
    """The environment of a recipe's ``@SETTING/SETTING`` part (``--recipes``)."""
    env = {}
    for word in filter(None, settings.split("/")):
        if word not in SETTINGS:
            raise ValueError(f"recipe setting {word!r}: expected one of {', '.join(SETTINGS)}")
        name, value = SETTINGS[word]
        env[name] = value
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    batches = args.batches or ("1,2" if args.tiny else "1,8")
    lengths = args.prefill_lengths or ("32" if args.tiny else "8192")
    bench_args = args.bench_args or ("--decode-prompt-tokens 16 --decode-base-tokens 2 --decode-steps 4 --repeats 1"
                                     if args.tiny else "")
    sargs = shapes.parse_args(["--shape", args.shape, "--tokenizer", str(args.tokenizer), "--device", args.device,
                               "--no-hf", *(["--tiny"] if args.tiny else [])])
    geometry = shapes.geometry_for(sargs)
    device = torch.device(args.device)
    model = shapes.build_hf(geometry, device, 0)
    folder = args.work / "src"
    folder.mkdir(exist_ok=True)
    shapes.write_frontend(folder, args.tokenizer)
    results, slowest = [], 0.0
    converted = None   # (format, artifact path, conversion report) of the artifact on disk

    def drop(conv) -> None:
        if conv is not None:
            for p in args.work.glob(f"{conv[1].stem}*"):
                p.unlink(missing_ok=True)

    for recipe in args.recipes.split(","):
        left = args.budget_s - (time.perf_counter() - START)
        if slowest and left < slowest * 1.1:
            results.append({"recipe": recipe, "skipped": f"{left:.0f} s left, the slowest recipe took {slowest:.0f} s"})
            continue
        t0 = time.perf_counter()
        # "q4@cuda": the q4 artifact benched with NINFER_QUANT_GEMV=cuda (no tensor-core decode GEMV), an A/B in one run.
        fmt, _, settings = recipe.partition("@")
        tag = recipe.replace("+", "_").replace("@", "_").replace("/", "_")
        entry: dict = {"recipe": recipe}
        try:
            env = dict(os.environ, **setting_env(settings))
            if converted is None or converted[0] != fmt:
                drop(converted)
                converted = None
                artifact = args.work / f"{fmt.replace('+', '_')}.ninfer"
                converted = (fmt, artifact, shapes.convert_in_memory(model, folder, artifact, f"quant-speed-{tag}",
                                                                      quantize=None if fmt == "bf16" else fmt))
                entry["convert_s"] = round(time.perf_counter() - t0, 1)
            _, artifact, conv = converted
            entry["artifact_bytes"] = sum(Path(p).stat().st_size for p in conv["paths"])
            entry["quantized"] = conv["quantized"]
            out = args.out / f"bench_{tag}.json"
            cmd = [sys.executable, "-m", "ninfer.cli.main", "bench", str(artifact), "--output", str(out),
                   "--device", args.device, "--batches", batches, "--prefill-lengths", lengths,
                   *(["--dtype", "bfloat16"] if args.device.startswith("cuda") else []), *shlex.split(bench_args)]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=max(60.0, left - 20), env=env)
            if run.returncode != 0:
                entry["error"] = f"ninfer bench exited {run.returncode}: {run.stderr[-3000:]}"
            else:
                report = json.loads(out.read_text())
                embeddings = {oid for oid in conv["quantized"] if "embed" in oid}
                entry["decode"] = [read_bytes_ratio(r, conv["quantized"], embeddings) for r in report["decode"]]
                entry["prefill"] = [{k: r.get(k) for k in ("tokens", "tokens_per_s", "ttft_ms", "matmul_peak_ratio")}
                                    for r in report["prefill"]]
        except Exception as exc:  # noqa: BLE001 - one recipe's failure must not lose the others' figures
            entry["error"] = f"{type(exc).__name__}: {exc}"
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        slowest = max(slowest, entry["seconds"])
        results.append(entry)
        (args.out / "quant_speed.json").write_text(json.dumps({"shape": args.shape, "results": results}, indent=1))
        print(f"[quant] {recipe}: {entry.get('error') or 'ok'} in {entry['seconds']} s", flush=True)
    drop(converted)
    base = next((r for r in results if r["recipe"] == "bf16" and "decode" in r), None)
    print(f"\n{'recipe':<8} {'GB':>6} {'B':>3} {'tok/s':>9} {'x bf16':>7} {'of copy':>8}   {'prefill tok/s':>13} {'x bf16':>7}")
    for r in results:
        if "decode" not in r:
            print(f"{r['recipe']:<8} {r.get('error') or r.get('skipped')}")
            continue
        for d in r["decode"]:
            b = next((x for x in base["decode"] if x["batch"] == d["batch"]), None) if base else None
            print(f"{r['recipe']:<8} {r['artifact_bytes'] / 1e9:>6.2f} {d['batch']:>3} {d['tokens_per_s']:>9,.1f} "
                  f"{d['tokens_per_s'] / b['tokens_per_s'] if b else float('nan'):>7.2f} {d['copy_ratio']:>8.1%}")
        for p in r["prefill"]:
            b = next((x for x in base["prefill"] if x["tokens"] == p["tokens"]), None) if base else None
            print(f"{r['recipe']:<8} {'':>6} {p['tokens']:>3} {'':>9} {'':>7} {'':>8}   {p['tokens_per_s']:>13,.0f} "
                  f"{p['tokens_per_s'] / b['tokens_per_s'] if b else float('nan'):>7.2f}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
