#!/usr/bin/env bash
# A/B of stream-first-round-inline.patch on a GPU machine (README.md beside this file), logs into $1.
# A = this tree, B = this tree with the patch, BT = B with the stream-kernel timeline compiled in.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: ab_stream_first_round.sh OUTDIR}
mkdir -p "$OUT"
export PATH="$PATH:/usr/local/cuda/bin"
root=$(pwd)
B=/tmp/fp4moe-ab-b
rm -rf "$B" && mkdir -p "$B"
tar --exclude=./build --exclude='./build-*' --exclude=./.deps -cf - . | tar -xf - -C "$B"
(cd "$B" && git apply bench/experiments/stream-first-round-inline.patch) || { echo "patch does not apply" | tee "$OUT/ab.txt"; exit 1; }
build() {  # dir build-dir extra-cmake-args...
  local d=$1 b=$2; shift 2
  (cd "$d" && cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP4MOE_CUTLASS_TESTS=OFF "$@" >/dev/null &&
   cmake --build "$b" -j "$(nproc)" --target fp4moe fp4moe_gpu_tests >/dev/null) || { echo "build of $d/$b failed"; return 1; }
}
build "$root" build-a && build "$B" build-b && build "$B" build-bt -DFP4MOE_STREAM_TRACE=ON || exit 1
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  for round in 1 2 3; do
    for v in a b; do
      d=$root; [ $v = b ] && d=$B
      for m in glm-5 qwen3-30b; do
        echo "== round $round, tree $v, $m"
        "$d/build-$v/fp4moe" bench --model "$m" --tokens 1,8,64 --no-baseline 2>&1 | grep -E '^ +[0-9]+ |ceilings'
      done
    done
  done
  echo "== B: stream-kernel GPU tests"
  "$B/build-b/fp4moe_gpu_tests" --gtest_filter='*Stream*:MoeLayerGpu.*:GroupedGemmGpu.*' 2>&1 | tail -5
  echo "== BT: timelines"
  "$B/build-bt/fp4moe" bench --model glm-5 --mode gemm --tokens 1,8 --no-baseline --trace 2>&1 | tail -40
} 2>&1 | tee "$OUT/ab.txt"
