#!/usr/bin/env bash
# The fused decode probe's device call (bench/probes/fused_decode_probe.cu; bench/NOTES.md, twenty-second
# session): a first look that fails fast if the kernel hangs, compute-sanitizer memcheck and racecheck on
# one small config, then every preset at T = 1, 2, 4, 8 with the per-warp trace. Runs on an H100 or an
# H200: the probe measures the read ceiling and the library's layer in the same run.
#
#   bench/experiments/fused_decode_probe.sh OUTDIR [PROBE_BINARY]
#
# PROBE_BINARY defaults to build/fp4moe_probe_fused_decode (built here if missing); a binary built on the
# CPU machine (`ninja fp4moe_probe_fused_decode`, stripped and xz-compressed into the git-ignored .carry/)
# saves the device the build.
set -u
OUT=${1:?usage: fused_decode_probe.sh OUTDIR [PROBE_BINARY]}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
BIN=${2:-build/fp4moe_probe_fused_decode}
if [ ! -x "$BIN" ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP4MOE_BUILD_TESTS=OFF > "$OUT/build.log" 2>&1 &&
    ninja -C build fp4moe_probe_fused_decode >> "$OUT/build.log" 2>&1 || { echo "build failed: $OUT/build.log"; exit 1; }
fi
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader > "$OUT/gpu.txt" 2>&1
export FP4MOE_TUNE_CACHE=$PWD/tune
timeout 60 "$BIN" --model qwen3-30b --tokens 1,3 --variant w12_d4_c2 --reps 3 --trace 1 > "$OUT/first.txt" 2>&1
rc=$?
echo "first rc=$rc $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
# memcheck says where a crash comes from; after a hang (rc 124) only memcheck runs, briefly
tools="memcheck racecheck"; [ $rc -eq 124 ] && tools=memcheck
for tool in $tools; do
  # the tiny preset (H = 256, I = 128, 8 experts, a shared expert), pieces down to one chunk so that both
  # GEMMs split; T = 3 and 8 (the second cp.async row)
  timeout 60 compute-sanitizer --tool $tool "$BIN" --model tiny --tokens 3,8 --variant w8_d8_c2 --min-chunks 1 \
    --ceilings 0 --reps 1 > "$OUT/san-$tool.txt" 2>&1
  echo "$tool rc=$? $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
done
[ $rc -eq 124 ] && exit 1
# the sweep, one preset per process so that a hang costs one preset's share
for m in qwen3-30b glm-5 gpt-oss-120b kimi-k2; do
  left=$(( ${FUSED_PROBE_BUDGET_S:-570} - ($(date +%s) - T0) ))
  [ $left -lt 20 ] && break
  share=$(( left < 150 ? left : 150 ))
  timeout $share "$BIN" --model $m --trace 1 > "$OUT/sweep-$m.txt" 2>&1
  echo "sweep $m rc=$? $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
done
