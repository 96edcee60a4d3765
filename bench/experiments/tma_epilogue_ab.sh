#!/usr/bin/env bash
# The device call that decides a tma-kernel epilogue change (first used for the wide tiles' movmatrix tile end):
# the patched build's tma and layer GPU tests, then the GEMMs and the layer, base against patched,
# alternated, at the prefill points where the wide tiles run.
#
#   bench/experiments/tma_epilogue_ab.sh OUTDIR BASE_FP4MOE NEW_FP4MOE [NEW_GPU_TESTS]
#
# Binaries built on the CPU machine and carried (.carry/, git-ignored): the tip's `fp4moe`, and the
# `fp4moe` and `fp4moe_gpu_tests` of the tree with the patch applied. About 5 minutes.
set -u
OUT=${1:?usage: tma_epilogue_ab.sh OUTDIR BASE_FP4MOE NEW_FP4MOE [NEW_GPU_TESTS]}
BASE=${2:?base fp4moe}
NEW=${3:?patched fp4moe}
TESTS=${4:-}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader > "$OUT/gpu.txt" 2>&1
export FP4MOE_TUNE_CACHE=$PWD/tune
if [ -n "$TESTS" ]; then
  timeout 150 "$TESTS" --gtest_filter='*Tma*:*tma*:*MoeLayerGpu*' > "$OUT/tests.txt" 2>&1
  echo "tests rc=$? $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
fi
ALL=glm-5,kimi-k2,gpt-oss-120b,qwen3-30b
AB_ARGS="--mode gemm" timeout 150 bench/experiments/ab_bins.sh "$OUT/ab-gemm" $ALL 2048,4096,8192,16384 4 \
  "base=$BASE" "new=$NEW" > /dev/null 2>&1
echo "gemm ab rc=$? $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
left=$(( ${TOTAL_BUDGET_S:-580} - ($(date +%s) - T0) ))
[ $left -gt 40 ] && timeout $left bench/experiments/ab_bins.sh "$OUT/ab-layer" $ALL 2048,4096,8192 4 \
  "base=$BASE" "new=$NEW" > /dev/null 2>&1
echo "end $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
