#!/usr/bin/env bash
# Host experts against llama.cpp on the device in two calls on one warm machine (tools/gpu_offload_peer.py does
# the work; docs/benchmarks.md "Reproduce" says what it measures). The llama.cpp build (about 5 minutes on 16
# cores) runs beside the preparation of the weights, so both fit one call.
#
#   bash tools/gpu_offload_run.sh prepare [LAYERS]    # carry .gpu-wheels and .gpu_assets (llamacpp-src.tgz)
#   bash tools/gpu_offload_run.sh bench [CONFIGS] [NINFER_ARGS...]   # the next call, on the same machine
#
# prepare: installs the carried wheels and this checkout, builds the test tokenizer, unpacks the llama.cpp source
# into /tmp/lcp and builds llama-bench and llama-batched-bench there in the background while gpu_offload_peer.py
# prepare writes the random 35B-A3B-shape model (LAYERS of 40, default 8) as our artifact and a bf16 GGUF under
# /tmp/off. bench: gpu_offload_peer.py bench over CONFIGS (default 24g:6,16g:7: the issue's budgets scaled to
# 8 layers, as docs/benchmarks.md explains), the rest passed to `ninfer bench` through --ninfer-args.
# Results and logs go to $OUT (at most 5 files).
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
out="${OUT:-$PWD/offload-results}"
mkdir -p "$out"
lcp=/tmp/lcp
work=/tmp/off
step="${1:-}"
shift || true
case "$step" in
    prepare)
        layers="${1:-8}"
        # shellcheck source=tools/gpu_setup.sh
        . tools/gpu_setup.sh
        install_checkout .gpu-wheels > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
        make_tokenizer /tmp/tok.json || exit 1
        mkdir -p "$lcp" && tar -xzf .gpu_assets/llamacpp-src.tgz -C "$lcp" || exit 1
        (
            cd "$lcp" && cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF \
                -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
                -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
                && cmake --build build -j 12 --target llama-bench llama-batched-bench
        ) > "$out/lcp-build.log" 2>&1 &
        build=$!
        python3 tools/gpu_offload_peer.py prepare --layers "$layers" --device cuda --tokenizer /tmp/tok.json \
            --lcp "$lcp" --work "$work" 2>&1 | grep -v Warning | tee "$out/prepare.log" | tail -15
        prep=${PIPESTATUS[0]}
        wait "$build"
        built=$?
        tail -3 "$out/lcp-build.log"
        echo "prepare rc $prep, llama.cpp build rc $built"
        [ "$prep" -eq 0 ] && [ "$built" -eq 0 ]
        ;;
    bench)
        configs="${1:-24g:6,16g:7}"
        shift || true
        extra=()
        [ $# -gt 0 ] && extra=(--ninfer-args "$*")
        [ -x "$lcp/build/bin/llama-bench" ] || { echo "no llama.cpp build in $lcp: run the prepare step first"; exit 1; }
        python3 tools/gpu_offload_peer.py bench --work "$work" --lcp "$lcp" --configs "$configs" --out "$out" \
            "${extra[@]}" 2>&1 | grep -v Warning | tail -40
        ;;
    *)
        echo "gpu_offload_run.sh: prepare [LAYERS] | bench [CONFIGS] [NINFER_ARGS...] (see the header)" >&2
        exit 2
        ;;
esac
