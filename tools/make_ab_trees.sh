#!/bin/sh
# Export the distributions of each given revision into .ab/<rev>/ (git-ignored), for A/B benchmarks of several
# builds on one artifact in one device call (tools/gpu_ab_bench.sh puts each tree's src folders on PYTHONPATH;
# tools/gpu_ab_arch.py pip-installs each tree into a site of its own). Only what they need travels: each
# distribution's pyproject.toml and src/ without the embedded default model's data, and tools/gpu_bench_shapes.py
# (the device tool carries at most 64 MiB in all).
#
#   sh tools/make_ab_trees.sh 917fa72 HEAD~2 HEAD       # then carry ".ab" (plus .clean for the artifact build)
set -e
cd "$(git rev-parse --show-toplevel)"
rm -rf .ab && mkdir .ab
for rev in "$@"; do
    sha=$(git rev-parse --short "$rev")
    mkdir -p ".ab/$sha"
    paths=""
    for p in ninfer-core ninfer-qwen3_5 ninfer-qwen4exp ninfer-convert ninfer-serve; do
        for f in "$p/pyproject.toml" "$p/src"; do
            git cat-file -e "$sha:$f" 2>/dev/null && paths="$paths $f"
        done
    done
    git cat-file -e "$sha:tools/gpu_bench_shapes.py" 2>/dev/null && paths="$paths tools/gpu_bench_shapes.py"
    # shellcheck disable=SC2086  # paths is a list of repository paths without spaces
    git archive "$sha" $paths | tar -x -C ".ab/$sha"
    find ".ab/$sha/ninfer-qwen3_5/src/ninfer_qwen3_5/default_model" -mindepth 1 ! -name '*.py' -prune -exec rm -rf {} +
    echo "$rev -> .ab/$sha"
done
du -sh .ab
