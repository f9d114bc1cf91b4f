#!/usr/bin/env bash
# One device call measuring serving at the 9B shape (random bf16 weights) and MTP on the default model:
#   1. tools/serve_bursts.py: burst TTFT, inter-token latency and an 8k arrival per step-budget configuration,
#      and the start-up cost of the warm-up (the `nowarmup` configuration);
#   2. `ninfer bench` with the context cache off, then on (one pair: B=1, B=8 decode and the 8k prefill);
#   3. tools/spec_speed.py: MTP, DFlash and DFlash2 acceptance and speed on the embedded default model;
#   4. `ninfer bench-serve` (vLLM's bench serve protocol) against `ninfer serve` at 1, 2, 4 and 8 streams.
#   5. tools/gpu_mixed_step_profile.py: a mixed step's kernels (7 decoding streams beside an 8k prompt's chunks) at
#      step budgets 256, 512 and 2048, prefill-step graphs on and off (not in the default PHASES: PHASES=5);
#      MIXED_AB=NINFER_ATTN_SPLIT (any 0/1 switch) profiles it again with that switch on, graphs on, into $OUT/ab/.
# Each phase has its own time limit, so a slow one cannot take the others' results with it.
#
#   bash tools/gpu_serving_run.sh          # on the device, carry .gpu-wheels; results under $OUT
#   CONFIGS=default,ttft bash tools/gpu_serving_run.sh
#   PHASES=2,3 bash tools/gpu_serving_run.sh   # some phases only (a call's 600 s may not hold all three); a
#                                              # warm machine's artifact from an earlier call is reused
#   TINY=1 OUT=/tmp/sr bash tools/gpu_serving_run.sh      # every step on the CPU at tiny sizes (no installs)
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
out="${OUT:-$PWD/serving-results}"
work=/tmp/ninfer_serving
configs="${CONFIGS:-default,eager2048,128,256,ttft,nowarmup}"
phases=",${PHASES:-1,2,3,4},"
mixed_args=(--budgets 256,512,2048)
device=cuda shape=(--shape 9b) bursts=() bench=() mtp=() install=1 per_stream=16 serve_io=(110 256)
if [ "${TINY:-0}" = 1 ]; then
    device=cpu shape=(--tiny) bursts=(--tiny) install=0 mtp=(--tokens 24 --prompts 2 --runs none,mtp:2,dflash:3) per_stream=2 serve_io=(12 8)
    bench=(--decode-prompt-tokens 16 --decode-base-tokens 2 --decode-steps 4 --repeats 1 --copy-mib 16 --matmul-size 128)
    mixed_args=(--device cpu --budgets 8,32 --graphs on --streams 2 --short 5 --long 40 --stream-tokens 400 --vocab 0,256)
fi
mkdir -p "$out" "$work"
cd "$root"
. tools/gpu_setup.sh
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
say() { echo "[serving $(( $(date +%s) - t0 ))s] $*"; }

if [ "$install" = 1 ]; then
    say "installing the carried wheels and this checkout"
    install_checkout || exit 1
fi

art=$(ls "$work"/art/*.ninfer 2>/dev/null | head -1)
if [ -n "$art" ]; then
    say "reusing the artifact $art"
else
say "tokenizer and the 9B artifact"
make_tokenizer "$work/tokenizer.json" || exit 1
timeout 200 python3 tools/gpu_bench_shapes.py "${shape[@]}" --tokenizer "$work/tokenizer.json" --out "$work/shapes" \
    --no-hf --no-ours --keep-artifact --work "$work/art" --device $device > "$out/artifact.log" 2>&1 || { say "artifact failed"; tail -20 "$out/artifact.log"; exit 1; }
art=$(ls "$work"/art/*.ninfer | head -1)
say "artifact $art"
fi

case "$phases" in *,1,*)
say "phase 1: serve bursts ($configs)"
timeout 330 python3 tools/serve_bursts.py "$art" --out "$out" --configs "$configs" --device $device --log-dir "$work" "${bursts[@]}" 2>&1 | tee "$out/bursts.log" ;;
esac

case "$phases" in *,2,*)
say "phase 2: ninfer bench, context cache off / on"
for flag in --no-context-cache --context-cache; do
    timeout 90 python3 -m ninfer.cli.main bench "$art" --device $device --batches 1,8 --prefill-lengths 8192 "${bench[@]}" \
        --output "$work/bench${flag}.json" $flag 2>&1 | grep -v '^\[bench\]' | tee -a "$out/cache_ab.log"
done ;;
esac

case "$phases" in *,3,*)
say "phase 3: MTP on the default model"
timeout 150 python3 tools/spec_speed.py --device $device "${mtp[@]}" --out "$out" 2>&1 | tee "$out/mtp.log" ;;
esac
case "$phases" in *,5,*)
say "phase 5: a mixed step's kernels"
timeout 400 python3 tools/gpu_mixed_step_profile.py "$art" --out "$out" "${mixed_args[@]}" 2>&1 | tee "$out/mixed.log"
# MIXED_AB=NAME: the same again with the 0/1 switch NAME on (a Triton candidate), into $out/ab/
if [ -n "${MIXED_AB:-}" ]; then
    mkdir -p "$out/ab"
    say "phase 5, again with $MIXED_AB=1"
    env "$MIXED_AB=1" timeout 400 python3 tools/gpu_mixed_step_profile.py "$art" --out "$out/ab" --graphs on \
        "${mixed_args[@]}" 2>&1 | tee "$out/ab/mixed.log"
fi ;;
esac
case "$phases" in *,4,*)
say "phase 4: ninfer bench-serve at 1, 2, 4, 8 streams"
port=18431
python3 -m ninfer.cli.main serve "$art" --device $device --host 127.0.0.1 --port $port --max-concurrency 8 \
    --model-id bench --log-level warning > "$out/bench_serve_server.log" 2>&1 &
server=$!
python3 - "$port" <<'PY'
import sys, time, urllib.request
for _ in range(1200):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2)
        break
    except OSError:
        time.sleep(0.25)
PY
for c in 1 2 4 8; do
    timeout 120 python3 -m ninfer.cli.main bench-serve --base-url "http://127.0.0.1:$port" \
        --num-prompts $((c * per_stream)) --random-input-len ${serve_io[0]} --random-output-len ${serve_io[1]} \
        --max-concurrency $c --ignore-eos --result-file "$out/bench_serve_c$c.json" 2>&1 | tee -a "$out/bench_serve.log"
done
kill $server; wait $server 2>/dev/null ;;
esac
say "done"
