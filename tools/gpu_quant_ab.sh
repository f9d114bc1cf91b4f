#!/usr/bin/env bash
# One device call for the quantized decode A/B (issue 32): the CUDA-core against the tensor-core decode GEMVs
# (NINFER_QUANT_GEMV=cuda against the default auto), kernel by kernel, then end to end on the same random 9B-shape
# weights.
#   1. tools/gpu_quant_gemv_sweep.py: the engine's GEMV, its tensor-core GEMV (engine_tc), the GEMM and the bf16
#      baselines at 1 and 8 rows of x on the 9B projections, for q4, q8 and fp8;
#   2. tools/gpu_quant_speed.py: `ninfer bench` (B = 1 and 8, one prefill length) of each RECIPE@cuda and RECIPE,
#      and bf16, one artifact at a time.
# Each step has its own time limit; results under $OUT (quant_gemv_sweep.json, sweep.log, quant_speed.json,
# bench_*.json, quant.log).
#
#   bash tools/gpu_quant_ab.sh                     # on the device, carry .gpu-wheels
#   RECIPES=q4@cuda,q4,bf16 SWEEP_S=60 bash tools/gpu_quant_ab.sh
#   RECIPES=bf16,q4,q8,fp8+a8 SWEEP_S=0 QUANT_S=540 bash tools/gpu_quant_ab.sh   # end to end only
#   PROFILE=q4 QUANT_S=0 ...                                                 # the q4 decode step's kernels
#   VARIANTS=engine_tc,engine_tc_sum1,engine_tc_sum2 ...                     # the sweep's variants
#   RECIPES=q4,q4@wave,q4@pf,q4@sep,q4@wave/sep SWEEP_S=0 ...               # the decode candidates end to end
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
out="${OUT:-$PWD/quant-ab-results}"
work=/tmp/ninfer_quant_ab
recipes="${RECIPES:-q4@cuda,q4,q8@cuda,q8,fp8+a8@cuda,fp8+a8,bf16}"
sweep_s="${SWEEP_S:-100}"   # PREFILL: the prefill lengths benched (default 1024)
quant_s="${QUANT_S:-420}"
mkdir -p "$out" "$work"
cd "$root"
. tools/gpu_setup.sh
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
say() { echo "[quant-ab $(( $(date +%s) - t0 ))s] $*"; }

say "installing the carried wheels and this checkout"
install_checkout || exit 1
make_tokenizer "$work/tokenizer.json" || exit 1

if [ "$sweep_s" -gt 0 ]; then  # SWEEP_S=0 skips the kernel sweep (`timeout 0` would mean no limit)
    say "kernel sweep (${sweep_s}s)"
    timeout "$sweep_s" python3 tools/gpu_quant_gemv_sweep.py --out "$out" --rows 1,8 \
        --formats q4_g64_fp16,q8_g32_fp16,fp8_e4m3fn_row_bf16 --shapes "gdn in,lm head,mlp down" \
        --variants "${VARIANTS:-engine_tc,gemm}" > "$out/sweep.log" 2>&1
    say "sweep rc $?"
    grep -v '^{' "$out/sweep.log" | tail -40
fi

if [ -n "${PROFILE:-}" ]; then   # PROFILE=q4: where a decode step's GPU time goes with that recipe (9B, B=1 and 8)
    say "kernel profile of $PROFILE (${PROFILE_S:-200}s)"
    timeout "${PROFILE_S:-200}" python3 tools/gpu_kernel_profile.py --shape 9b --layers 32 --quantize "$PROFILE" \
        --prefill 1024 --steps 20 --tokenizer "$work/tokenizer.json" --out "$out" > "$out/profile.log" 2>&1
    say "profile rc $?"
    grep -A28 "^== decode B=" "$out/profile.log" | grep -v "timeline" | head -70
fi
[ "$quant_s" -gt 0 ] || exit 0   # QUANT_S=0: no end-to-end benches

say "end to end: $recipes (${quant_s}s)"
timeout "$quant_s" python3 tools/gpu_quant_speed.py --tokenizer "$work/tokenizer.json" --out "$out" \
    --recipes "$recipes" --prefill-lengths "${PREFILL:-1024}" --budget-s $(( quant_s - 20 )) > "$out/quant.log" 2>&1
say "quant rc $?"
grep -v '^\[' "$out/quant.log" | tail -30
