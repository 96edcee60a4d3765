#!/usr/bin/env bash
# GPU checks for any contributor with a CUDA GPU: the GPU tests, compute-sanitizer, the benchmarks, the
# tuner and Nsight Compute, each logged (text and JSON) into one output directory, then a summary.
#
#   scripts/gpu_check.sh [tests] [sanitize] [bench] [tune] [ncu] [ep] [python] --out DIR   (default: tests bench)
#
# ep: `fp4moe bench --ep N` on this host's GPUs (EP_RANKS, default: every GPU; EP_ARGS extra arguments).
# python: scripts/python_gpu_check.sh (the package, its torch-oracle GPU tests and the overhead benchmark).
#
# Build: uses $FP4MOE_BUILD_DIR (default build/). If it holds a configured build (build.ninja), it is
# brought up to date (fp4moe and fp4moe_gpu_tests only); if it holds only the two binaries (built
# elsewhere and copied), they are used as they are; if it is empty, it is configured (needs CMake,
# Ninja, nvcc and the Debian packages of scripts/setup.sh; the CUTLASS proof tests are left out, they
# run on CPUs) and built. FP4MOE_NO_BUILD=1 never builds. Nothing here needs a network.
#
# Knobs (environment):
#   FP4MOE_MODEL      model preset of bench, tune and ncu (default glm-5)
#   BENCH_ARGS        extra `fp4moe bench` arguments (e.g. "--mode both --breakdown --compare-heuristic")
#   BENCH_TAG         suffix of the bench files (bench<TAG>.json/.txt)
#   GTEST_FILTER      subset of the GPU tests (tests step)
#   SANITIZE_FILTER   tests run under compute-sanitizer (default: every GEMM config, the layer's small
#                     paths and the tiny preset; see below); SANITIZE_TOOLS (default: all four)
#   TUNE_BUCKETS      token buckets of the tuner (default 1,8,32,128,512,1024,4096,16384)
#   NCU_TOKENS        tokens of the GEMM pair profiled by ncu (default 128); NCU_ARGS extra ncu options
#   FP4MOE_TUNE_CACHE tuner table(s) used by bench (default: the shipped tune/)
#   FP4MOE_COMMIT     commit recorded in the results (default: git rev-parse --short HEAD)
#   TEST_TIMEOUT, SANITIZE_TIMEOUT (per tool), BENCH_TIMEOUT, TUNE_TIMEOUT, NCU_TIMEOUT (seconds)
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

OUT=""
steps=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=${2:-}; shift 2 ;;
    --out=*) OUT=${1#--out=}; shift ;;
    tests | sanitize | bench | tune | ncu | ep | python) steps+=("$1"); shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
if [ -z "$OUT" ]; then echo "gpu_check: --out DIR is required" >&2; usage >&2; exit 2; fi
[ ${#steps[@]} -eq 0 ] && steps=(tests bench)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

export PATH="$PATH:/usr/local/cuda/bin"
B=${FP4MOE_BUILD_DIR:-build}
MODEL=${FP4MOE_MODEL:-glm-5}
if [ -z "${FP4MOE_COMMIT:-}" ]; then
  FP4MOE_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  if [ "$FP4MOE_COMMIT" != unknown ] && ! git diff --quiet HEAD 2>/dev/null; then FP4MOE_COMMIT="$FP4MOE_COMMIT+dirty"; fi
fi
export FP4MOE_COMMIT

# Every GEMM config (both epilogues, ragged experts with empty ones), the tma kernel's claimed and
# static work tiles (many per CTA, the cut last two token tiles), the gpt-oss epilogue, the
# layer's routing, permutation, combine and quantizer kernels, and two small whole layers: a few
# minutes under each compute-sanitizer tool on an H200.
SANITIZE_FILTER=${SANITIZE_FILTER:-"GroupedGemmGpu.EveryConfigBothEpiloguesRaggedExperts:GroupedGemmGpu.TmaConfigsClaimTilesInArrivalOrder:GroupedGemmGpu.TmaConfigsManyTilesPerCta:GroupedGemmGpu.TmaConfigsLastTwoTilesCut:GroupedGemmGpu.GptOssEpilogueWithBiasesAndSeparateUpScale:MoeRoutingGpu.*:MoePermuteGpu.*:MoeSmallPathsGpu.*:QuantizeGpu.*:MoeLayerGpu.TinyPresetMatchesReference:MoeLayerGpu.AllTokensOnOneExpertAndEmptyExperts"}
SANITIZE_TOOLS=${SANITIZE_TOOLS:-"memcheck racecheck synccheck initcheck"}

summary=()   # "step|status|seconds|files|detail"
record() { summary+=("$1|$2|$3|$4|$5"); }

# ---- build ----
build_start=$SECONDS
if [ "${FP4MOE_NO_BUILD:-0}" = 1 ]; then
  build_status="skipped (FP4MOE_NO_BUILD=1)"
elif [ -f "$B/build.ninja" ]; then
  cmake --build "$B" -j "${FP4MOE_JOBS:-$(nproc)}" --target fp4moe fp4moe_gpu_tests > "$OUT/build.log" 2>&1
  build_status=$([ $? -eq 0 ] && echo "up to date" || echo "FAILED")
elif [ -x "$B/fp4moe" ] && [ -x "$B/fp4moe_gpu_tests" ]; then
  build_status="prebuilt binaries"
else
  { cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP4MOE_CUTLASS_TESTS=OFF &&
    cmake --build "$B" -j "${FP4MOE_JOBS:-$(nproc)}" --target fp4moe fp4moe_gpu_tests; } > "$OUT/build.log" 2>&1
  build_status=$([ $? -eq 0 ] && echo "configured and built" || echo "FAILED")
fi
record build "$build_status" $((SECONDS - build_start)) "$([ -f "$OUT/build.log" ] && echo build.log)" "$B"
if [ "$build_status" = FAILED ]; then
  tail -30 "$OUT/build.log"
  echo "gpu_check: the build failed; see $OUT/build.log" >&2
  exit 1
fi

# ---- the machine ----
{
  echo "commit: $FP4MOE_COMMIT"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -srm)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,memory.total \
    --format=csv 2>&1 || echo "nvidia-smi: not available"
  nvcc --version 2>/dev/null | tail -1
  "$B/fp4moe" info 2>&1
} > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"

gtest_counts() {  # passed failed skipped of a gtest JSON report
  python3 - "$1" <<'PY' 2>/dev/null || echo "? ? ?"
import json, sys
d = json.load(open(sys.argv[1]))
p = f = s = 0
for suite in d.get("testsuites", []):
    for t in suite.get("testsuite", []):
        if t.get("failures"): f += 1
        elif t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN": s += 1
        else: p += 1
print(p, f, s)
PY
}

overall=0
for s in "${steps[@]}"; do
  t0=$SECONDS
  case "$s" in
    tests)
      timeout "${TEST_TIMEOUT:-900}" "$B/fp4moe_gpu_tests" --gtest_brief=1 ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} \
        --gtest_output="json:$OUT/gpu_tests.json" > "$OUT/gpu_tests.log" 2>&1
      rc=$?
      read -r p f k <<< "$(gtest_counts "$OUT/gpu_tests.json")"
      grep -E "FAILED|Failure|Expected|Which is|error" "$OUT/gpu_tests.log" | head -40
      record tests "$([ $rc -eq 0 ] && echo ok || echo "FAILED (rc $rc)")" $((SECONDS - t0)) \
        "gpu_tests.log, gpu_tests.json" "$p passed, $f failed, $k skipped"
      [ $rc -eq 0 ] || overall=1 ;;
    sanitize)
      if ! command -v compute-sanitizer > /dev/null; then
        record sanitize "FAILED (compute-sanitizer not found)" 0 "" "install the CUDA toolkit's compute-sanitizer"
        overall=1
        continue
      fi
      for tool in $SANITIZE_TOOLS; do
        t1=$SECONDS
        timeout "${SANITIZE_TIMEOUT:-1200}" compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 50 \
          "$B/fp4moe_gpu_tests" --gtest_brief=1 --gtest_filter="$SANITIZE_FILTER" \
          --gtest_output="json:$OUT/sanitize-$tool.json" > "$OUT/sanitize-$tool.log" 2>&1
        rc=$?
        # racecheck prints its errors inside its own summary line: "RACECHECK SUMMARY: 0 hazards displayed (0 errors, ...)"
        errors=$(grep -Eo "ERROR SUMMARY: [0-9]+ error|hazards displayed \([0-9]+ error" "$OUT/sanitize-$tool.log" | tail -1 |
          grep -Eo "[0-9]+ error" | grep -Eo "[0-9]+" || echo "?")
        hazards=$(grep -Eo "RACECHECK SUMMARY: [0-9]+ hazard" "$OUT/sanitize-$tool.log" | tail -1 | grep -Eo "[0-9]+" || true)
        read -r p f k <<< "$(gtest_counts "$OUT/sanitize-$tool.json")"
        record "sanitize $tool" "$([ $rc -eq 0 ] && echo ok || echo "FAILED (rc $rc)")" $((SECONDS - t1)) \
          "sanitize-$tool.log" "$errors errors${hazards:+, $hazards hazards}; tests $p passed, $f failed, $k skipped"
        [ $rc -eq 0 ] || { overall=1; grep -E "=========" "$OUT/sanitize-$tool.log" | head -20; }
      done ;;
    bench)
      # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
      timeout "${BENCH_TIMEOUT:-900}" "$B/fp4moe" bench --model "$MODEL" --json "$OUT/bench${BENCH_TAG:-}.json" \
        ${BENCH_ARGS:-} > "$OUT/bench${BENCH_TAG:-}.txt" 2>&1
      rc=$?
      cat "$OUT/bench${BENCH_TAG:-}.txt"
      record bench "$([ $rc -eq 0 ] && echo ok || echo "FAILED (rc $rc)")" $((SECONDS - t0)) \
        "bench${BENCH_TAG:-}.txt, bench${BENCH_TAG:-}.json" "fp4moe bench --model $MODEL ${BENCH_ARGS:-}"
      [ $rc -eq 0 ] || overall=1 ;;
    tune)
      timeout "${TUNE_TIMEOUT:-1800}" "$B/fp4moe" tune --model "$MODEL" --quiet \
        --buckets "${TUNE_BUCKETS:-1,8,32,128,512,1024,4096,16384}" --out "$OUT/tune-$MODEL.json" > "$OUT/tune.log" 2>&1
      rc=$?
      tail -40 "$OUT/tune.log"
      record tune "$([ $rc -eq 0 ] && echo ok || echo "FAILED (rc $rc)")" $((SECONDS - t0)) "tune.log, tune-$MODEL.json" \
        "compare with tune/ before committing a table"
      [ $rc -eq 0 ] || overall=1 ;;
    ncu)
      if ! command -v ncu > /dev/null; then
        record ncu "FAILED (ncu not found)" 0 "" "install Nsight Compute"
        overall=1
        continue
      fi
      # One GEMM pair of the size NCU_TOKENS picks (stream, pipeline or tma kernels); clocks left to the GPU
      # (--clock-control none), as in the benchmarks. dram__bytes_read.sum against the GEMM's weight bytes
      # says whether each weight is read from DRAM once (issue 9: <= 1.10x up to T = 1024).
      # shellcheck disable=SC2086
      timeout "${NCU_TIMEOUT:-600}" ncu --clock-control none --kernel-name regex:nvfp4_grouped --launch-skip 2 \
        --launch-count 2 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
        --metrics dram__bytes_read.sum ${NCU_ARGS:-} \
        --export "$OUT/ncu" --force-overwrite \
        "$B/fp4moe" bench --model "$MODEL" --mode gemm --tokens "${NCU_TOKENS:-128}" --no-baseline --reps 1 \
        > "$OUT/ncu.txt" 2>&1
      rc=$?
      grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Issue Slots Busy|No Eligible|Active Warps Per Scheduler|Eligible Warps|Achieved Occupancy|Registers Per|dram__bytes_read" \
        "$OUT/ncu.txt" | head -40
      record ncu "$([ $rc -eq 0 ] && echo ok || echo "FAILED (rc $rc)")" $((SECONDS - t0)) "ncu.txt, ncu.ncu-rep" \
        "T = ${NCU_TOKENS:-128}, $MODEL GEMM pair"
      [ $rc -eq 0 ] || overall=1 ;;
    ep)
      ranks=${EP_RANKS:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)}
      # shellcheck disable=SC2086
      NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} timeout "${EP_TIMEOUT:-900}" "$B/fp4moe" bench --ep "$ranks" \
        --model "$MODEL" --json "$OUT/ep${BENCH_TAG:-}.json" ${EP_ARGS:-} > "$OUT/ep${BENCH_TAG:-}.txt" 2>&1
      rc=$?
      cat "$OUT/ep${BENCH_TAG:-}.txt"
      record ep "$([ $rc -eq 0 ] && echo ok || echo "FAILED (rc $rc)")" $((SECONDS - t0)) \
        "ep${BENCH_TAG:-}.txt, ep${BENCH_TAG:-}.json" "fp4moe bench --ep $ranks --model $MODEL ${EP_ARGS:-}"
      [ $rc -eq 0 ] || overall=1 ;;
    python)
      scripts/python_gpu_check.sh --out "$OUT/python" > "$OUT/python.log" 2>&1
      rc=$?
      tail -30 "$OUT/python.log"
      record python "$([ $rc -eq 0 ] && echo ok || echo "FAILED (rc $rc)")" $((SECONDS - t0)) "python.log, python/" \
        "the Python package's GPU tests and overhead benchmark"
      [ $rc -eq 0 ] || overall=1 ;;
  esac
done

gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo
echo "gpu_check summary: ${gpu_name:-no GPU found}, commit $FP4MOE_COMMIT; files in $OUT" | tee "$OUT/summary.txt"
{
  printf '%-18s %-38s %7s  %-34s %s\n' step status seconds files detail
  for row in "${summary[@]}"; do
    IFS='|' read -r st status secs files detail <<< "$row"
    printf '%-18s %-38s %7s  %-34s %s\n' "$st" "$status" "$secs" "$files" "$detail"
  done
} | tee -a "$OUT/summary.txt"
exit "$overall"
