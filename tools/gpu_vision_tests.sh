#!/usr/bin/env bash
# The GPU lane's vision call (docs/dev/gpu-tests.md): the tests that decode images and videos, which need PyAV. Its
# wheel cannot travel in one device call beside the working tree, so `sh tools/gpu_wheels.sh --vision-halves` cuts
# the vision set in two folders: carry .gpu-wheels-vision-1 in an earlier call on the same warm machine (the Triton
# step's), then .gpu-wheels-vision-2 in this one. The script joins PyAV's wheel, checks its SHA-256, installs the
# set and this checkout, and runs the vision tests; the last line printed is the one-line result.
#
#   bash tools/gpu_vision_tests.sh --commit abc1234       # results in $OUT (vision_tests.log, junit_vision.xml)
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
out="${OUT:-$PWD/gpu-test-results}"
commit=""
workers=4
while [ $# -gt 0 ]; do
    case "$1" in
        --commit) commit="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --workers) workers="$2"; shift 2 ;;
        *) echo "gpu_vision_tests.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
cd "$root" || exit 2
[ -n "$commit" ] || commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
mkdir -p "$out"
log="$out/vision_tests.log"
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
one=.gpu-wheels-vision-1 two=.gpu-wheels-vision-2
for d in "$one" "$two"; do
    [ -d "$d" ] || { echo "vision tests $commit: NOT RUN, $d is not here (carry it: see the header)" | tee "$log"; exit 2; }
done
wheels=$(mktemp -d)
cp "$one"/*.whl "$one"/requirements.txt "$wheels"/ 2>/dev/null
name=$(awk '{print $2}' "$one/av.sha256")
cat "$one/av.part1" "$two/av.part2" > "$wheels/$name"
if ! (cd "$wheels" && sha256sum -c --quiet "$root/$one/av.sha256"); then
    echo "vision tests $commit: NOT RUN, the joined $name does not match its SHA-256 (halves of two different builds?)" \
        | tee "$log"
    exit 2
fi
. tools/gpu_setup.sh
install_checkout "$wheels" > "$log" 2>&1 || { echo "vision tests $commit: install FAILED" | tee -a "$log"; exit 1; }
python3 -m pytest -q -n "$workers" --junitxml "$out/junit_vision.xml" -o junit_family=xunit2 \
    tests/engine/test_engine_vision_gpu.py tests/ops/test_vision_ops.py tests/ops_triton/test_qwen35_vision_triton.py \
    tests/frontend/test_vision_preprocess.py tests/engine/test_engine_vision.py \
    tests/engine/test_engine_vision_qwen4exp.py tests/models/qwen4exp/test_qwen4exp_vision.py 2>&1 | tee -a "$log" \
    | grep -E "^(FAILED|ERROR) | in [0-9.]+s( \(|=|$)"
rc=${PIPESTATUS[0]}
verdict=$([ "$rc" -eq 0 ] && echo PASS || echo "FAIL (pytest rc $rc)")
echo "vision tests $commit $(date -u '+%Y-%m-%d %H:%M') UTC: $verdict" | tee -a "$log"
