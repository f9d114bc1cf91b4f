#!/bin/sh
# Run test files one by one on the device (from tests/), each under its own time limit, and keep for each file
# its failures with their messages (-rf) and its summary line in $OUT/gpu_tests.txt. A device call has one time
# limit for everything; one slow file cut off by it would otherwise leave no result for the others, and a
# failure with no name is a failure nobody can act on.
#
#   sh ../tools/gpu_test_files.sh 60 startup/test_graph_calibration.py ops_triton/test_pdl.py ...
#   sh ../tools/gpu_test_files.sh 120          # every file with GPU-only tests (the list below)
#
# First argument: seconds per file; the rest: test files relative to tests/ (none: all of the GPU files:
# the Triton kernel suite, the GPU startup, engine (warm-up included) and artifact tests).
set -u
limit="$1"
shift
if [ "$#" -eq 0 ]; then
    set -- ops_triton/test_*.py startup/test_graph_calibration.py startup/test_graph_capture.py \
        engine/test_decode_graphs_gpu.py engine/test_engine_gpu.py engine/test_warmup_gpu.py \
        engine/test_engine_vision_gpu.py \
        artifact/test_gpu_load.py artifact/test_host_placement.py
fi
out="${OUT:-.}/gpu_tests.txt"
for f in "$@"; do
    echo "== $f" >> "$out"
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rf "$f" > /tmp/gpu_test_file.log 2>&1
    rc=$?
    grep -E "^(FAILED|ERROR)" /tmp/gpu_test_file.log | cut -c1-400 >> "$out"
    if [ "$rc" -eq 124 ]; then
        echo "cut off after ${limit}s; progress: $(tail -c 200 /tmp/gpu_test_file.log | tr -d '\n')" >> "$out"
    else
        tail -n 1 /tmp/gpu_test_file.log >> "$out"
    fi
    tail -n 2 "$out"
done
