#!/usr/bin/env bash
# Host experts against llama.cpp on the device in two calls on one warm machine (tools/gpu_offload_peer.py does
# the work; docs/benchmarks.md "Reproduce" says what it measures). The llama.cpp build (about 5 minutes on 16
# cores) runs beside the preparation of the weights, so both fit one call.
#
#   bash tools/gpu_offload_run.sh prepare [LAYERS [RECIPE GGUF_TYPE]]   # carry .gpu-wheels and .gpu_assets
#   bash tools/gpu_offload_run.sh bench [CONFIGS [GGUF [NINFER_ARGS...]]]  # the next call, on the same machine
#   bash tools/gpu_offload_run.sh profile MIB [BATCHES [THREADS [ARGS...]]]   # where a host-expert decode step's time goes
#
# e.g. 4-bit experts on both sides: `prepare 8 mixed Q4_K_M`, then `bench 24g:6,16g:7 m-Q4_K_M.gguf`.
#
# prepare: installs the carried wheels and this checkout, builds the test tokenizer, unpacks the llama.cpp source
# into /tmp/lcp and builds llama-bench and llama-batched-bench there in the background while gpu_offload_peer.py
# prepare writes the random 35B-A3B-shape model (LAYERS of 40, default 8) as our artifact (converted with the
# ninfer-convert --quantize RECIPE, if given) and a bf16 GGUF under /tmp/off; with GGUF_TYPE, llama-quantize then
# writes m-GGUF_TYPE.gguf beside it once the build is done. bench: gpu_offload_peer.py bench over CONFIGS (default
# 24g:6,16g:7: the issue's budgets scaled to 8 layers, as docs/benchmarks.md explains) with llama.cpp on GGUF
# (default m.gguf), the rest passed to `ninfer bench` through --ninfer-args.
# profile: tools/host_experts_profile.py on the prepared artifact under --vram-budget-mib MIB with the native kernel,
# at each of BATCHES (default 1,8) and each host thread count of THREADS (default: the engine's own choice, one a
# physical core), ARGS passed on to it (e.g. --device-expert-layers 1 --expert-copy-min-tokens 2): the OpenMP runtimes and
# CPU topology, the host step's phases, cache counts and the engine worker's profile.
# PEER_WORKLOADS=1 (bench): our side as two engines sized as llama.cpp's two runs (B=1 and the prefill with one
# request; B=8 with 8 requests sharing 4,096 tokens of KV), instead of one engine holding KV for 8 long requests.
# NO_PEER=1 (either step): our side only. prepare skips llama.cpp's build and the GGUF (about 4 minutes less), bench
# skips llama.cpp, and each configuration must then name its MiB (NAME:N:MIB): for a fresh machine after the one that
# ran the peer went back, whose figures on the same seed are in an earlier report.
# Results and logs go to $OUT (the device tool brings back 8 files at most: profile keeps its logs on the machine).
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
        recipe="${2:-}"
        gguf_type="${3:-}"
        quantize=()
        [ -n "$recipe" ] && quantize=(--quantize "$recipe")
        # shellcheck source=tools/gpu_setup.sh
        . tools/gpu_setup.sh
        install_checkout .gpu-wheels > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
        make_tokenizer /tmp/tok.json || exit 1
        if [ -n "${NO_PEER:-}" ]; then
            python3 tools/gpu_offload_peer.py prepare --layers "$layers" --device cuda --tokenizer /tmp/tok.json \
                --lcp "$lcp" --work "$work" --no-gguf "${quantize[@]}" 2>&1 | grep -v Warning | tee "$out/prepare.log" | tail -5
            exit "${PIPESTATUS[0]}"
        fi
        mkdir -p "$lcp" && tar -xzf .gpu_assets/llamacpp-src.tgz -C "$lcp" || exit 1
        (
            cd "$lcp" && cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF \
                -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
                -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
                && cmake --build build -j 12 --target llama-bench llama-batched-bench llama-quantize
        ) > "$out/lcp-build.log" 2>&1 &
        build=$!
        python3 tools/gpu_offload_peer.py prepare --layers "$layers" --device cuda --tokenizer /tmp/tok.json \
            --lcp "$lcp" --work "$work" "${quantize[@]}" 2>&1 | grep -v Warning | tee "$out/prepare.log" | tail -15
        prep=${PIPESTATUS[0]}
        wait "$build"
        built=$?
        tail -3 "$out/lcp-build.log"
        quant=0
        if [ -n "$gguf_type" ] && [ "$prep" -eq 0 ] && [ "$built" -eq 0 ]; then
            "$lcp/build/bin/llama-quantize" "$work/m.gguf" "$work/m-$gguf_type.gguf" "$gguf_type" \
                > "$out/quantize.log" 2>&1
            quant=$?
            tail -2 "$out/quantize.log"
        fi
        echo "prepare rc $prep, llama.cpp build rc $built, llama-quantize rc $quant"
        [ "$prep" -eq 0 ] && [ "$built" -eq 0 ] && [ "$quant" -eq 0 ]
        ;;
    bench)
        configs="${1:-24g:6,16g:7}"
        gguf="${2:-m.gguf}"
        shift 2 || shift $#
        extra=()
        [ $# -gt 0 ] && extra=(--ninfer-args "$*")
        peer=()
        if [ -n "${NO_PEER:-}" ]; then
            peer=(--no-peer)
        else
            [ -x "$lcp/build/bin/llama-bench" ] || { echo "no llama.cpp build in $lcp: run the prepare step first"; exit 1; }
        fi
        [ -n "${PEER_WORKLOADS:-}" ] && peer+=(--peer-workloads)
        python3 tools/gpu_offload_peer.py bench --work "$work" --lcp "$lcp" --configs "$configs" --gguf "$gguf" --out "$out" \
            "${peer[@]}" "${extra[@]}" 2>&1 | grep -v Warning | tail -40
        ;;
    profile)
        mib="${1:-}"
        [ -n "$mib" ] || { echo "profile needs a budget in MiB" >&2; exit 2; }
        [ -f "$work/prepared.json" ] || { echo "no prepared model in $work: run the prepare step first"; exit 1; }
        batches="${2:-1,8}"
        thread_counts="${3:-auto}"
        shift 3 2>/dev/null || shift $#
        rc=0
        for b in $(echo "$batches" | tr ',' ' '); do
            for t in $(echo "$thread_counts" | tr ',' ' '); do
                threads=()
                [ "$t" = auto ] || threads=(--host-expert-threads "$t")
                # The reports come back from $OUT (8 files at most); the logs stay on the machine.
                python3 tools/host_experts_profile.py "$work/model.ninfer" --vram-budget-mib "$mib" --batch "$b" \
                    --host-expert-kernel native "${threads[@]}" "$@" --out "$out/host-profile-b$b-t$t.txt" \
                    > "$work/host-profile-b$b-t$t.log" 2>&1 || { rc=1; tail -5 "$work/host-profile-b$b-t$t.log"; }
                grep -v Warning "$work/host-profile-b$b-t$t.log" | head -4
            done
        done
        exit $rc
        ;;
    *)
        echo "gpu_offload_run.sh: prepare [LAYERS [RECIPE GGUF_TYPE]] | bench [CONFIGS [GGUF [NINFER_ARGS...]]] | profile MIB [BATCHES [THREADS [ARGS...]]]" >&2
        exit 2
        ;;
esac
