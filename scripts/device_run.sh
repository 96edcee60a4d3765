#!/usr/bin/env bash
# One call on the GPU machine (the device tool): GPU tests, then benchmarks, everything logged under
# $OUT. Binaries are built on the development machine (scripts/build.sh) and carried as build/.
#   scripts/device_run.sh [tests] [bench] [tune] [ncu] [ep]   (default: tests bench)
#   ep: `fp4moe bench --ep $EP_RANKS` (default 1; EP_ARGS adds options, e.g. --capacity-factor 1.25)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fp4moe-out}
B=${FP4MOE_BUILD_DIR:-build}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench)
{
  echo "commit: ${FP4MOE_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
# The expert-parallel layer loads libnccl.so.2 at run time; where it is only in the nvidia-nccl-cu13
# Python package, point FP4MOE_NCCL_LIBRARY at it. NVLink multicast stays off.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
if [ -z "${FP4MOE_NCCL_LIBRARY:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so.2 ' &&
   [ ! -e /usr/local/cuda/lib64/libnccl.so.2 ]; then
  nccl_py=$(python3 -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
  [ -n "$nccl_py" ] && [ -e "$nccl_py" ] && export FP4MOE_NCCL_LIBRARY="$nccl_py"
fi
echo "NCCL: ${FP4MOE_NCCL_LIBRARY:-default lookup}" | tee -a "$OUT/gpu.txt"
for s in "${steps[@]}"; do
  case "$s" in
    tests)
      timeout ${TEST_TIMEOUT:-300} "$B/fp4moe_gpu_tests" --gtest_brief=1 ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} > "$OUT/gpu_tests.log" 2>&1
      echo "gpu tests rc=$?"; grep -E "FAILED|PASSED|SKIPPED|Failure|Expected|Which is|error" "$OUT/gpu_tests.log" | head -60 ;;
    bench)
      timeout ${BENCH_TIMEOUT:-400} "$B/fp4moe" bench --model "${FP4MOE_MODEL:-glm-5}" --json "$OUT/bench${BENCH_TAG:-}.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench${BENCH_TAG:-}.txt" ;;
    tune)
      timeout ${TUNE_TIMEOUT:-300} "$B/fp4moe" tune --model "${FP4MOE_MODEL:-glm-5}" --quiet \
        --buckets "${TUNE_BUCKETS:-1,8,32,128,512,1024,4096,16384}" --out "$OUT/tune-${FP4MOE_MODEL:-glm-5}.json" 2>&1 | tail -40 ;;
    ncu)
      # one decode-sized GEMM pair under Nsight Compute (clocks left alone, as METHOD.md asks)
      timeout ${NCU_TIMEOUT:-240} ncu --clock-control none --kernel-name regex:sm80_nvfp4 --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        --section LaunchStats --section Occupancy \
        "$B/fp4moe" bench --mode gemm --tokens "${NCU_TOKENS:-128}" --no-baseline --reps 1 > "$OUT/ncu.txt" 2>&1
      echo "ncu rc=$?"; grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Issue Slots Busy|Issued Warp|No Eligible|Active Warps Per Scheduler|Eligible Warps|Stall|Achieved Occupancy|Registers Per|L2 Hit|smsp__pcsamp" "$OUT/ncu.txt" | head -60 ;;
    ep)
      timeout ${EP_TIMEOUT:-400} "$B/fp4moe" bench --model "${FP4MOE_MODEL:-glm-5}" --ep "${EP_RANKS:-1}" \
        --json "$OUT/bench-ep${EP_RANKS:-1}${BENCH_TAG:-}.json" ${EP_ARGS:-} 2>&1 | tee "$OUT/bench-ep${EP_RANKS:-1}${BENCH_TAG:-}.txt" ;;
    *) echo "unknown step $s" ;;
  esac
done
