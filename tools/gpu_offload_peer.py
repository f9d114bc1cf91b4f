#!/usr/bin/env python3
"""Host experts against llama.cpp's CPU experts, on the same weights in the same run (issue 36, docs/memory.md).

Two phases, so that the slow preparation and the measurement can go in separate device calls (the work folder
lives as long as the device machine stays warm):

``prepare``: a random Qwen3.5-MoE model at the 35B-A3B shape (tools/gpu_bench_shapes.py, ``--layers`` of the 40,
bf16), saved as a Hugging Face folder, converted to a NInfer artifact (``ninfer.conversion.convert``) and to a
bf16 GGUF (llama.cpp's ``convert_hf_to_gguf.py`` from ``--lcp``, the peer source tree); the folder is then deleted.

``bench``: for each configuration ``NAME:N[:MIB]``:

- llama.cpp with the first ``N`` layers' experts on the CPU (``-ncmoe N``; 0 keeps every expert on the GPU):
  ``llama-bench`` (8k prefill, 128-token decode at B=1) and ``llama-batched-bench`` (B=8 decode, S_TG);
- ``ninfer bench`` with host experts under ``--vram-budget-mib MIB`` (``MIB`` left out: llama.cpp's peak device
  memory in that configuration minus ``--context-mib``, so both engines use the same memory; ``N`` = 0: our
  resident run, no host experts);

each run's peak device memory sampled by ``nvidia-smi``. Writes ``offload.json`` and ``offload.md`` under ``--out``.
With ``--no-peer`` only our runs (the ``prepare --no-gguf`` model is enough).

    python3 tools/gpu_offload_peer.py prepare --layers 8 --tokenizer /tmp/tok.json --lcp /tmp/lcp --work /tmp/off
    python3 tools/gpu_offload_peer.py bench --work /tmp/off --lcp /tmp/lcp --configs resident:0,24g:6,16g:7 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_shapes as shapes  # noqa: E402


def log(msg: str) -> None:
    print(f"[offload {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- prepare -------------------------------------------------------------------------------------------------------

def prepare(args) -> int:
    import torch
    from ninfer.conversion import convert

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    geometry = shapes.geometry_for(SimpleNamespace(shape="35b-a3b", layers=args.layers, tiny=args.tiny))
    t0 = time.perf_counter()
    model = shapes.build_hf(geometry, args.device, args.seed)
    stats = shapes.weight_stats(model, geometry)
    # The Hugging Face folder, our artifact and the GGUF are all on disk at once before the folder is deleted.
    copies = 2 if args.no_gguf else 3
    free = shutil.disk_usage(work).free
    if free < copies * stats["bytes"] * 1.05:
        log(f"not enough disk under {work}: {copies} copies of {stats['bytes'] / 1e9:.2f} GB need "
            f"{copies * stats['bytes'] * 1.05 / 1e9:.1f} GB, {free / 1e9:.1f} GB free (earlier runs' temporary "
            "artifacts under /tmp?)")
        return 1
    hf = work / "hf"
    model.save_pretrained(hf)
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    shapes.write_frontend(hf, args.tokenizer)
    # llama.cpp's converter reads the tokenizer through transformers, which needs the class named.
    (hf / "tokenizer_config.json").write_text(json.dumps({**shapes.TOKENIZER_CONFIG,
                                                          "tokenizer_class": "Qwen2TokenizerFast"}))
    log(f"model: {geometry['num_hidden_layers']} layers, {stats['bytes'] / 1e9:.2f} GB "
        f"({stats['expert_bytes'] / 1e9:.2f} GB routed experts), saved in {time.perf_counter() - t0:.0f} s")
    t1 = time.perf_counter()
    result = convert(hf, work / "model.ninfer", name="qwen3_5-35b-a3b-random", progress=False,
                     quantize=args.quantize)
    log(f"ninfer artifact ({args.quantize or 'bf16'}): {result.tensor_bytes / 1e9:.2f} GB in "
        f"{time.perf_counter() - t1:.0f} s")
    # Written before the GGUF: if llama.cpp's converter fails, the bench of our side still has what it reads, and
    # the GGUF can be written again from the kept folder (its command is in the log).
    (work / "prepared.json").write_text(json.dumps({"geometry": geometry, "weights": stats, "quantize": args.quantize,
                                                    "artifact": [str(p) for p in result.paths]}, indent=1))
    if not args.no_gguf:   # --no-gguf: our side only (the peer's from an earlier prepare of the same seed)
        rc = _gguf(args, hf, work)
        if rc:
            log(f"kept {hf} for a retry of the GGUF")
            return rc
    shutil.rmtree(hf)
    return 0


def _gguf(args, hf: Path, work: Path) -> int:
    """llama.cpp's bf16 GGUF of the checkpoint ``hf`` (its own converter), as ``work/m.gguf``."""
    t2 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(args.lcp / "gguf-py"))
    cmd = [sys.executable, str(args.lcp / "convert_hf_to_gguf.py"), str(hf), "--outfile", str(work / "m.gguf"),
           "--outtype", "bf16", "--no-mtp"]
    log("$ PYTHONPATH=" + env["PYTHONPATH"] + " " + " ".join(cmd))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        log(f"convert_hf_to_gguf exited {proc.returncode}")
        return 1
    log(f"gguf: {(work / 'm.gguf').stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t2:.0f} s")
    return 0


# -- bench ---------------------------------------------------------------------------------------------------------

class PeakMemory:
    """The device's peak used memory (MiB, nvidia-smi) while the block runs; None without nvidia-smi."""

    def __init__(self, gpu: int = 0) -> None:
        self.gpu, self.peak, self._stop = gpu, None, threading.Event()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", f"--id={self.gpu}", "--query-gpu=memory.used",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
                used = int(out.stdout.strip().splitlines()[0])
                self.peak = used if self.peak is None else max(self.peak, used)
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _run(cmd: list[str], timeout: float) -> tuple[str, int | None]:
    log("$ " + " ".join(cmd))
    with PeakMemory() as peak:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s", peak.peak
    if proc.returncode != 0:
        return f"exited {proc.returncode}: {proc.stderr[-1500:]}", peak.peak
    return proc.stdout, peak.peak


def llama(args, n_cpu_moe: int) -> dict:
    bins = args.lcp / "build" / "bin"
    gguf = str(args.work / args.gguf)
    out, peak = _run([str(bins / "llama-bench"), "-m", gguf, "-ngl", "99", "-fa", "1", "-ncmoe", str(n_cpu_moe),
                      "-p", str(args.prefill), "-n", "128", "-r", str(args.repeats), "-o", "json"], args.step_timeout)
    row: dict = {"n_cpu_moe": n_cpu_moe, "peak_mib": peak}
    try:
        for test in json.loads(out):
            key = "prefill_tok_s" if test["n_prompt"] else "decode_b1_tok_s"
            row[key] = test["avg_ts"]
    except (json.JSONDecodeError, KeyError, TypeError):
        row["error"] = out[-1500:]
        return row
    out, peak2 = _run([str(bins / "llama-batched-bench"), "-m", gguf, "-ngl", "99", "-fa", "on", "--n-cpu-moe",
                       str(n_cpu_moe), "-c", "4096", "-npp", "128", "-ntg", "128", "-npl", "8"], args.step_timeout)
    row["peak_mib"] = max(p for p in (peak, peak2) if p is not None) if (peak or peak2) else None
    # The table row: |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
    rows = [line for line in out.splitlines() if re.match(r"^\|\s+\d+\s+\|", line)]
    if rows:
        row["decode_b8_tok_s"] = float(rows[-1].strip("|").split("|")[7])
    else:
        row["error_b8"] = out[-1500:]
    return row


def ours(args, budget_mib: int | None, label: str) -> dict:
    """Our side of one configuration: ``ninfer bench`` under ``budget_mib`` (None: every expert on the device).
    With ``--peer-workloads``, two engines sized as llama.cpp's two runs are: B=1 decode and the prefill with one
    request of the prefill's context (llama-bench), B=8 decode with 8 requests sharing 4,096 tokens of KV
    (llama-batched-bench ``-c 4096``); else one engine for all three, holding KV for 8 requests at that context."""
    context = args.prefill + 256
    if args.peer_workloads:
        runs = [("b1", ["--batches", "1", "--prefill-lengths", str(args.prefill), "--max-context", str(context)]),
                ("b8", ["--batches", "8", "--no-prefill", "--max-context", "512"])]
    else:
        runs = [("", ["--batches", "1,8", "--prefill-lengths", str(args.prefill), "--max-context", str(context)])]
    row: dict = {"vram_budget_mib": budget_mib, "peak_mib": None}
    for suffix, sizes in runs:
        report = args.out / f"ninfer_{label}{'_' + suffix if suffix else ''}.json"
        cmd = [sys.executable, "-m", "ninfer.cli.main", "bench", str(args.work / "model.ninfer"), "--output",
               str(report), *sizes, "--repeats", str(args.repeats), "--decode-steps", "64", "--quiet",
               *shlex.split(args.ninfer_args)]
        cmd += ["--no-host-experts"] if budget_mib is None else ["--host-experts", "--vram-budget-mib", str(budget_mib)]
        text, peak = _run(cmd, args.step_timeout)
        row["peak_mib"] = max(p for p in (row["peak_mib"], peak) if p is not None) if (peak or row["peak_mib"]) \
            else None
        if not report.exists():
            row["error" + (f"_{suffix}" if suffix else "")] = text[-1500:]
            continue
        _read_report(json.loads(report.read_text()), row)
    return row


def _read_report(rep: dict, row: dict) -> None:
    """Adds one ``ninfer bench`` report's figures and placement to ``row`` (several reports: the same placement
    keys, the last one's)."""
    for r in rep["decode"]:
        row[f"decode_b{r['batch']}_tok_s"] = r["tokens_per_s"]
    for r in rep["prefill"]:
        row["prefill_tok_s"] = r["tokens_per_s"]
    hosted = rep["engine"].get("host_experts")
    if hosted:
        hits, misses = sum(hosted["cache_hits"]), sum(hosted["cache_misses"])
        layers = (row.get("device_expert_layers_by_run") or []) + [hosted.get("device_expert_layers")]
        row["device_expert_layers_by_run"] = layers
        row["device_expert_layers"] = hosted.get("device_expert_layers")
        row["host_expert_threads"] = hosted.get("host_expert_threads")
        row["cache_slots"] = hosted["expert_cache_slots"]
        row["hit_rate"] = hits / (hits + misses) if hits + misses else None
        row["hit_rate_by_layer"] = [h / (h + m) if h + m else None
                                    for h, m in zip(hosted["cache_hits"], hosted["cache_misses"], strict=True)]
    row.setdefault("memory_by_run", []).append(rep.get("memory"))
    row["memory"] = rep.get("memory")


def _fmt(x, spec=",.1f") -> str:
    return "-" if x is None else format(x, spec)


def bench(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    prepared = json.loads((args.work / "prepared.json").read_text())
    results = []
    for config in args.configs.split(","):
        name, n, *mib = config.split(":")
        if args.no_peer and int(n) and not mib:
            raise SystemExit(f"--no-peer needs each configuration's MIB (NAME:N:MIB), got {config!r}")
        row = {"config": name, "llama": {"n_cpu_moe": int(n), "skipped": "--no-peer"} if args.no_peer
               else llama(args, int(n))}
        log(f"llama.cpp {name}: {row['llama']}")
        if int(n) == 0:
            budget = None
        elif mib:
            budget = int(mib[0])
        elif row["llama"].get("peak_mib"):
            budget = row["llama"]["peak_mib"] - args.context_mib
        else:
            row["ours"] = {"error": "no llama.cpp peak memory to match and no MIB given"}
            results.append(row)
            continue
        row["ours"] = ours(args, budget, name)
        log(f"ninfer {name}: { {k: v for k, v in row['ours'].items() if k != 'memory'} }")
        results.append(row)
        (args.out / "offload.json").write_text(json.dumps({"prepared": prepared, "results": results}, indent=1))
    lines = [f"35B-A3B shape, {prepared['geometry']['num_hidden_layers']} layers, bf16 "
             f"({prepared['weights']['bytes'] / 1e9:.2f} GB, routed experts "
             f"{prepared['weights']['expert_bytes'] / 1e9:.2f} GB)", "",
             "| config | engine | device MiB (peak) | B=1 tok/s | B=8 tok/s | 8k prefill tok/s | device layers, "
             "cache slots, hit rate |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lam, our = r["llama"], r.get("ours", {})
        lines.append(f"| {r['config']} | llama.cpp -ncmoe {lam['n_cpu_moe']} | {_fmt(lam.get('peak_mib'), 'd')} | "
                     f"{_fmt(lam.get('decode_b1_tok_s'))} | {_fmt(lam.get('decode_b8_tok_s'))} | "
                     f"{_fmt(lam.get('prefill_tok_s'))} | |")
        hit = our.get("hit_rate")
        lines.append(f"| {r['config']} | NInfer budget {_fmt(our.get('vram_budget_mib'), 'd')} MiB | "
                     f"{_fmt(our.get('peak_mib'), 'd')} | {_fmt(our.get('decode_b1_tok_s'))} | "
                     f"{_fmt(our.get('decode_b8_tok_s'))} | {_fmt(our.get('prefill_tok_s'))} | "
                     f"{'/'.join(_fmt(n, 'd') for n in our.get('device_expert_layers_by_run') or [None])}, "
                     f"{_fmt(our.get('cache_slots'), 'd')}, "
                     f"{'-' if hit is None else f'{hit:.1%}'} |")
    (args.out / "offload.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="phase", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny widths: a CPU smoke run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-gguf", action="store_true", help="write our artifact only, not llama.cpp's GGUF")
    p.add_argument("--quantize", default=None,
                   help="our artifact's ninfer-convert --quantize recipe (default: bf16 as built); the GGUF stays "
                        "bf16: quantize it with llama-quantize and name it to bench with --gguf")
    b = sub.add_parser("bench")
    b.add_argument("--configs", default="resident:0,24g:6,16g:7",
                   help="NAME:N[:MIB],...: llama.cpp -ncmoe N, ours under MIB (default: llama.cpp's peak minus "
                        "--context-mib); N=0 is the resident run of both")
    b.add_argument("--context-mib", type=int, default=0,
                   help="MiB taken off llama.cpp's peak for our budget (default 0: the same device memory; both "
                        "peaks are measured by nvidia-smi, CUDA context included, and our plan keeps its "
                        "headroom inside the budget)")
    b.add_argument("--ninfer-args", default="--prefill-chunk-size 2048",
                   help="more `ninfer bench` arguments (default: llama.cpp-sized prefill chunks, whose workspace fits "
                        "small budgets)")
    b.add_argument("--prefill", type=int, default=8192)
    b.add_argument("--peer-workloads", action="store_true",
                   help="our side as two engines sized as llama.cpp's two runs (B=1 and the prefill with one request; "
                        "B=8 with 8 requests sharing 4,096 tokens of KV) instead of one engine holding KV for 8 "
                        "requests at the prefill's context")
    b.add_argument("--gguf", default="m.gguf", help="llama.cpp's model file in --work (default: the bf16 one)")
    b.add_argument("--repeats", type=int, default=2)
    b.add_argument("--step-timeout", type=float, default=240.0)
    b.add_argument("--no-peer", action="store_true",
                   help="our runs only (each configuration then names its MIB): when the machine that built llama.cpp "
                        "is gone and the peer's figures on the same seed are in an earlier report")
    b.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    for q in (p, b):
        q.add_argument("--work", type=Path, required=True)
        q.add_argument("--lcp", type=Path, required=True, help="the llama.cpp peer tree (built for bench)")
    args = ap.parse_args(argv)
    return prepare(args) if args.phase == "prepare" else bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
