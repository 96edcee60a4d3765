#!/usr/bin/env bash
# A/B of one experiment patch on a GPU machine (README.md beside this file), logs into OUTDIR/ab.txt:
# A = this tree, B = this tree with the patch; the layer benchmark alternated three times, then B's
# GPU tests of the kernels the patch touches.
#   bench/experiments/ab_patch.sh OUTDIR PATCH [MODELS] [TOKENS] [GTEST_FILTER]
# Defaults: glm-5 and qwen3-30b, T = 1,8,64, the stream, layer and checkpoint GPU tests.
# Device time is scarce: prebuilt binaries (built here, carried compressed) spare the two builds; this
# script builds both trees itself for a machine that has the build tools.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: ab_patch.sh OUTDIR PATCH [MODELS] [TOKENS] [GTEST_FILTER]}
PATCH=${2:?usage: ab_patch.sh OUTDIR PATCH [MODELS] [TOKENS] [GTEST_FILTER]}
MODELS=${3:-glm-5,qwen3-30b}
TOKENS=${4:-1,8,64}
FILTER=${5:-*Stream*:MoeLayerGpu.*:GroupedGemmGpu.*:CheckpointGpu.*}
mkdir -p "$OUT"
export PATH="$PATH:/usr/local/cuda/bin"
root=$(pwd)
B=/tmp/fp4moe-ab-b
rm -rf "$B" && mkdir -p "$B"
tar --exclude=./build --exclude='./build-*' --exclude=./.deps -cf - . | tar -xf - -C "$B"
(cd "$B" && git apply "$PATCH") || { echo "$PATCH does not apply" | tee "$OUT/ab.txt"; exit 1; }
build() {  # dir build-dir
  (cd "$1" && cmake -S . -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP4MOE_CUTLASS_TESTS=OFF >/dev/null &&
   cmake --build "$2" -j "$(nproc)" --target fp4moe fp4moe_gpu_tests >/dev/null) || { echo "build of $1/$2 failed"; return 1; }
}
build "$root" build-ab-a && build "$B" build-ab-b || exit 1
{
  echo "patch: $PATCH"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for round in 1 2 3; do
    for v in a b; do
      d=$root; [ $v = b ] && d=$B
      echo "== round $round, tree $v"
      "$d/build-ab-$v/fp4moe" bench --model "$MODELS" --tokens "$TOKENS" --no-baseline 2>&1 |
        grep -E '^ +[0-9]+ |ceilings|MoE layer'
    done
  done
  echo "== B: GPU tests ($FILTER)"
  "$B/build-ab-b/fp4moe_gpu_tests" --gtest_filter="$FILTER" 2>&1 | tail -5
} 2>&1 | tee "$OUT/ab.txt"
