#!/usr/bin/env bash
# The README's main job: set up, build, then benchmark the default model's MoE layer on the GPU, or,
# without a GPU, run the CPU reference layer (and say so). Extra args go to the fp4moe subcommand.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
FP4MOE_TARGET=fp4moe scripts/build.sh
BUILD_DIR=${FP4MOE_BUILD_DIR:-build}
MODEL=${FP4MOE_MODEL:-glm-5}
if "$BUILD_DIR/fp4moe" info --quiet; then
  exec "$BUILD_DIR/fp4moe" bench --model "$MODEL" "$@"
else
  echo "fp4moe: no CUDA GPU found; running the CPU reference layer instead of the GPU benchmark"
  exec "$BUILD_DIR/fp4moe" run --model "$MODEL" --tokens 4 "$@"
fi
