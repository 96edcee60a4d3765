#!/usr/bin/env bash
# ptxas advisories that cost performance without failing the build, checked on the CPU:
#   scripts/check_ptxas.sh BUILD_DIR
# recompiles the grouped-GEMM kernel translation units of BUILD_DIR (a Ninja build) with -Xptxas -v and
# fails if ptxas serialized any kernel's wgmmas (C7512: "insufficient register resources", C7513:
# control flow between a wgmma and its wait), ignored a setmaxnreg (C7507), or gave a tma kernel local
# memory (spills, or a stack frame: an array indexed at run time, e.g. a loop over a width list).
# Why: the tma kernel's per-tile width lists (tile_config.hpp, tma_widths) and its configs sit at
# ptxas's limits; one more width or a heavier epilogue serializes the wgmmas and still builds
# (bench/NOTES.md).
set -euo pipefail
B=${1:?usage: check_ptxas.sh BUILD_DIR}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pids=()
for e in plain swiglu gptoss; do
  obj=CMakeFiles/fp4moe_core.dir/src/sm80_nvfp4_grouped_gemm_$e.cu.o
  cmd=$(ninja -C "$B" -t commands "$obj" | tail -n 1)
  [ -n "$cmd" ] || { echo "check_ptxas: no compile command for $obj in $B" >&2; exit 2; }
  # the same command, without the dependency file, into a temporary object, with ptxas's report
  cmd=$(printf '%s' "$cmd" | sed -e 's# -MD -MT [^ ]* -MF [^ ]*##' -e "s# -o [^ ]*# -o $tmp/$e.o#")
  (cd "$B" && eval "$cmd -Xptxas -v") > "$tmp/$e.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || { cat "$tmp"/*.log >&2; echo "check_ptxas: a compile failed" >&2; exit 2; }; done
bad=0
for e in plain swiglu gptoss; do
  log=$tmp/$e.log
  n=$(grep -c "Compiling entry function" "$log" || true)
  [ "$n" -gt 0 ] || { echo "check_ptxas: $e: ptxas reported no kernels" >&2; exit 2; }
  if grep -E 'C7507|C7512|C7513' "$log" >/dev/null; then
    grep -E 'C7507|C7512|C7513' "$log" | sed -E "s/.*\((C75[0-9]+)\)[^']*'([^']*)'.*/\1 \2/" |
      while read -r code fn; do echo "$e: $code in $(echo "$fn" | c++filt)"; done
    bad=1
  fi
  # local memory of the tma kernels: "Function properties for F" is followed by its line "A bytes stack
  # frame, B bytes spill stores, C bytes spill loads" (the GPU test PlannerGpu checks the same at run time)
  spills=$(awk '/Function properties for/ { fn = $NF; next }
                /spill stores/ && fn ~ /grouped_tma_kernel/ && ($1 != 0 || $5 != 0 || $9 != 0) { print fn }' "$log")
  if [ -n "$spills" ]; then
    for fn in $spills; do echo "$e: local memory (stack frame or spills) in $(echo "$fn" | c++filt)"; done
    bad=1
  fi
  echo "$e: $n kernels checked"
done
if [ "$bad" != 0 ]; then
  echo "check_ptxas: FAILED (see the kernels above; tile_config.hpp and bench/NOTES.md say what bounds them)" >&2
  exit 1
fi
echo "check_ptxas: no serialized wgmmas, no ignored setmaxnreg, no local memory in the tma kernels"
