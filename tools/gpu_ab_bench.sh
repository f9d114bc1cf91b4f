#!/bin/sh
# On the device: `ninfer bench` of one artifact with each build exported by tools/make_ab_trees.sh, one after the
# other in this call (same machine, same artifact: the A/B a decision needs; across calls the machine and its copy
# bandwidth change by a few percent). Each build's packages go first on PYTHONPATH, so they shadow the installed
# ones; the tokens/s table of each run is printed and its report written to $OUT/ab_<sha>.json.
#
#   sh tools/gpu_ab_bench.sh /tmp/w35/qwen3_5-35b-a3b-12l.ninfer "--dtype bfloat16 --batches 1 --no-prefill" .ab/*
# (AB_DEVICE=cpu runs the same on the CPU, e.g. with the embedded default model, to check the script.)
set -u
art="$1"
opts="$2"
shift 2
for tree in "$@"; do
    sha=$(basename "$tree")
    root=$(cd "$tree" && pwd)
    # shellcheck disable=SC2086  # opts is a list of bench flags
    PYTHONPATH="$root/ninfer-core/src:$root/ninfer-qwen3_5/src:${PYTHONPATH:-}" timeout 120 \
        python3 -m ninfer.cli.main bench "$art" --device "${AB_DEVICE:-cuda}" $opts \
        --output "${OUT:-.}/ab_$sha.json" > "${OUT:-.}/ab_$sha.log" 2>&1
    echo "== $sha (rc $?)"
    grep -A9 "  B      tok/s" "${OUT:-.}/ab_$sha.log" | grep -v "^\[" | head -10
done
