#!/usr/bin/env bash
# The H200 call that the twentieth and twenty-first sessions could not make (their device starts gave
# H100s): the status of every preset with the tip's kernels, then the quarter buckets (T = 640..1792) of
# GLM-5, gpt-oss-120b and qwen3-30b re-tuned in the layer with more rounds, then the layer with the
# shipped tables against the re-tuned ones at the points the buckets serve (bench/NOTES.md, twentieth
# session: the in-layer score weighs a bucket's two ends, so the points decide what ships).
#
#   bench/experiments/h200_status_buckets.sh OUTDIR FP4MOE_BINARY
#
# On another GPU it writes gpu.txt and stops (the tables are per GPU model).
set -u
OUT=${1:?usage: h200_status_buckets.sh OUTDIR FP4MOE_BINARY}
BIN=${2:?fp4moe binary}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader > "$OUT/gpu.txt" 2>&1
case "$(head -1 "$OUT/gpu.txt")" in *H200*) ;; *) echo "not an H200: nothing run" >> "$OUT/gpu.txt"; exit 0 ;; esac
export FP4MOE_TUNE_CACHE=$PWD/tune
timeout 110 "$BIN" bench --model all --json "$OUT/status.json" > "$OUT/status.txt" 2>&1
echo "status rc=$? $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
TABS=$(mktemp -d)
for m in glm-5 gpt-oss-120b qwen3-30b kimi-k2; do cp "tune/h200-$m.json" "$TABS/"; done
for m in qwen3-30b gpt-oss-120b glm-5; do
  left=$(( ${BUCKETS_BUDGET_S:-400} - ($(date +%s) - T0) ))
  [ $left -lt 60 ] && break
  echo "=== $m quarter buckets $(date +%T)" >> "$OUT/tune.log"
  timeout $left "$BIN" tune --model $m --buckets 640,896,1280,1536,1792 --reps 9 --warmup 2 --in-layer 3 \
    --layer-rounds 5 --quiet --out "$TABS/h200-$m.json" >> "$OUT/tune.log" 2>&1
  echo "rc=$? $(( $(date +%s) - T0 )) s" >> "$OUT/tune.log"
done
tar -C "$TABS" -cJf "$OUT/tabs.txz" .
left=$(( ${TOTAL_BUDGET_S:-585} - ($(date +%s) - T0) ))
if [ $left -gt 40 ]; then
  timeout $left bench/experiments/ab_bins.sh "$OUT/abt" glm-5,gpt-oss-120b,qwen3-30b \
    640,768,896,1023,1100,1280,1535,1792,2047 6 "old=env FP4MOE_TUNE_CACHE=$PWD/tune $BIN" \
    "tabs=env FP4MOE_TUNE_CACHE=$TABS $BIN" > /dev/null 2>&1
fi
echo "end $(( $(date +%s) - T0 )) s" >> "$OUT/gpu.txt"
