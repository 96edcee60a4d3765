#!/usr/bin/env bash
# A/B of prebuilt fp4moe binaries and environment knobs on a GPU machine, alternated in one call, so
# that every variant is timed on the same GPU within minutes (H200s differ by a few percent, and so do
# two starts of one). Binaries are built on a CPU machine and carried (`git`-ignored .carry/); use
# ab_patch.sh (beside this file) where the GPU machine should build them itself.
#
#   bench/experiments/ab_bins.sh OUTDIR MODELS TOKENS ROUNDS LABEL=CMD [LABEL=CMD ...]
#
# CMD is the command prefix that runs one fp4moe binary, e.g. 'base=.carry/base/fp4moe' or
# 'pf16=env FP4MOE_EXP_L2_PREFETCH=16 .carry/dev/fp4moe'. Each round runs every variant's
# `bench --model MODELS --tokens TOKENS --no-baseline $AB_ARGS` (AB_ARGS: extra bench
# arguments, e.g. "--mode gemm" for the two expert GEMMs alone); OUTDIR/ab.txt keeps each run's ceilings
# and rows, OUTDIR/ab-summary.txt the median time, read-ceiling and bf16-rate ratios per (model, tokens,
# variant) with the spread over the rounds. Odd rounds run the variants in the order given, even rounds
# in the reverse order (A B, B A, ...), so a variant's place in a round does not favour it
# (bench/NOTES.md, eighteenth session); AB_ORDER=fixed keeps the given order.
set -uo pipefail
cd "$(dirname "$0")/../.."
# Every variant reads the repository's tables unless the caller says otherwise: fp4moe looks for tune/ beside
# its executable, so a binary carried to .carry/x/base/ found none and ran the heuristic's configs, and an
# A/B of two builds became an A/B of the heuristic against the tables (bench/NOTES.md, twenty-seventh
# session). A variant's own `env FP4MOE_TUNE_CACHE=...` still wins.
export FP4MOE_TUNE_CACHE=${FP4MOE_TUNE_CACHE:-$PWD/tune}
OUT=${1:?usage: ab_bins.sh OUTDIR MODELS TOKENS ROUNDS LABEL=CMD ...}
MODELS=${2:?models}
TOKENS=${3:?tokens}
ROUNDS=${4:?rounds}
shift 4
[ $# -ge 1 ] || { echo "ab_bins: at least one LABEL=CMD" >&2; exit 2; }
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  for round in $(seq 1 "$ROUNDS"); do
    order=("$@")
    if [ "${AB_ORDER:-alternate}" != fixed ] && [ $((round % 2)) -eq 0 ]; then
      order=()
      for ((i = $#; i >= 1; --i)); do order+=("${!i}"); done
    fi
    for v in "${order[@]}"; do
      label=${v%%=*}
      cmd=${v#*=}
      echo "== round $round, variant $label ($cmd), $(date +%T)"
      # shellcheck disable=SC2086  # CMD is a command prefix with its own words
      # stderr apart: its progress lines would otherwise land inside the table rows
      $cmd bench --model "$MODELS" --tokens "$TOKENS" --no-baseline ${AB_ARGS:-} 2> "$OUT/stderr.txt" |
        grep -E '^ +[0-9]+ |ceilings|MoE layer|expert GEMMs|rror'
      grep -E 'ceilings|rror' "$OUT/stderr.txt"
    done
  done
} 2>&1 | tee "$OUT/ab.txt"
python3 - "$OUT/ab.txt" <<'PY' | tee "$OUT/ab-summary.txt"
import re, statistics, sys
runs = {}  # (model, tokens, variant) -> [(us, xread)]
variant = model = None
order = []
for line in open(sys.argv[1]):
    m = re.match(r"== round \d+, variant (\S+)", line)
    if m:
        variant = m.group(1)
        if variant not in order:
            order.append(variant)
        continue
    m = re.match(r"(\S+) (MoE layer|expert GEMMs)", line)
    if m:
        model = m.group(1)
        continue
    m = re.match(r"\s+(\d+)\s+\d+\s+([\d.]+)\s+[\d.]+\s+([\d.]+)\s+[\d.]+\s+([\d.]+)", line)
    if m and model and variant:
        runs.setdefault((model, int(m.group(1)), variant), []).append(
            (float(m.group(2)), float(m.group(3)), float(m.group(4))))
print(f"{'model':<14} {'T':>5} " + " ".join(f"{v:>36}" for v in order))
print(f"{'':<14} {'':>5} " + " ".join(f"{'us (min-max) xread xbf16':>36}" for _ in order))
for model, t in sorted({(k[0], k[1]) for k in runs}):
    cells = []
    for v in order:
        r = runs.get((model, t, v), [])
        if not r:
            cells.append(f"{'-':>36}")
            continue
        us = [x[0] for x in r]
        xr = statistics.median(x[1] for x in r)
        xb = statistics.median(x[2] for x in r)
        cells.append(f"{statistics.median(us):8.1f} ({min(us):.1f}-{max(us):.1f}) {xr:.3f} {xb:.3f}".rjust(36))
    print(f"{model:<14} {t:>5} " + " ".join(cells))
PY
