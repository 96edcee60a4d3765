#!/usr/bin/env bash
# Configures (once) and builds fp4moe into build/ (or $FP4MOE_BUILD_DIR). Extra args go to cmake
# at configure time, e.g. -DFP4MOE_CUDA_ARCHS="90a;120a".
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
BUILD_DIR=${FP4MOE_BUILD_DIR:-build}
if [ ! -f "$BUILD_DIR/build.ninja" ] || [ $# -gt 0 ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
fi
cmake --build "$BUILD_DIR" -j "${FP4MOE_JOBS:-$(nproc)}" ${FP4MOE_TARGET:+--target "$FP4MOE_TARGET"}
