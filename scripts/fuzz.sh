#!/usr/bin/env bash
# Builds the libFuzzer target over the safetensors header / index parser (fuzz/) with clang, ASan and
# UBSan, and runs it for N seconds (default 45) starting from the committed seed corpus (fuzz/corpus,
# read only; new inputs go to $BUILD_DIR/fuzz/corpus). Exit 0: no crash, leak or sanitizer report.
# Called by ctest (label "fuzz") from scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_TO_RUN=${1:-45}
BUILD_DIR=${FP4MOE_BUILD_DIR:-build}
CXX_FUZZ=${FP4MOE_FUZZ_CXX:-clang++-14}
OUT="$BUILD_DIR/fuzz"
mkdir -p "$OUT/corpus"
BIN="$OUT/fuzz_safetensors"
if [ ! -x "$BIN" ] || [ fuzz/fuzz_safetensors.cpp -nt "$BIN" ] || [ src/safetensors.cpp -nt "$BIN" ] ||
   [ include/fp4moe/safetensors.hpp -nt "$BIN" ] || [ include/fp4moe/error.hpp -nt "$BIN" ]; then
  "$CXX_FUZZ" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -DFMT_HEADER_ONLY -Iinclude fuzz/fuzz_safetensors.cpp src/safetensors.cpp -o "$BIN"
fi
# -rss_limit_mb: a header may be up to 100 MB; ASan's overhead stays well under 2 GB.
"$BIN" -max_total_time="$SECONDS_TO_RUN" -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
  "$OUT/corpus" fuzz/corpus
