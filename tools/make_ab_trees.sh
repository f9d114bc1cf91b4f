#!/bin/sh
# Export the Python packages of each given revision into .ab/<rev>/ (git-excluded), for A/B benchmarks of several
# builds on one artifact in one device call (tools/gpu_ab_bench.sh). Only the sources the engine imports travel:
# ninfer-core/src and ninfer-qwen3_5/src without the embedded default model's data (the device tool carries at
# most 64 MiB in all).
#
#   sh tools/make_ab_trees.sh 917fa72 HEAD~2 HEAD       # then carry ".ab" (plus .clean for the artifact build)
set -e
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.ab/' .git/info/exclude 2>/dev/null || echo '/.ab/' >> .git/info/exclude
rm -rf .ab && mkdir .ab
for rev in "$@"; do
    sha=$(git rev-parse --short "$rev")
    mkdir -p ".ab/$sha"
    git archive "$sha" ninfer-core/src ninfer-qwen3_5/src | tar -x -C ".ab/$sha"
    find ".ab/$sha/ninfer-qwen3_5/src/ninfer_qwen3_5/default_model" -mindepth 1 ! -name '*.py' -prune -exec rm -rf {} +
    echo "$rev -> .ab/$sha"
done
du -sh .ab
