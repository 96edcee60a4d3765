#!/usr/bin/env bash
# On the GPU machine (no network needed): installs the Python package, runs tests/python (the torch
# oracle GPU suite included) and the Python-overhead benchmark. Logs and results go to --out DIR.
#   scripts/python_gpu_check.sh --out DIR [--python PY] [--wheel FILE]
# The package comes from, in order: --wheel FILE; a wheel in build/wheelhouse/ for this interpreter
# (made on the development machine by `scripts/python_build.sh --wheel python3.12`, which also puts the
# pytest wheels there); else it is built here from the tree with this machine's own scikit-build-core
# and nanobind (pip install --no-build-isolation: needs CMake, nvcc, the Python headers and the fmt /
# nlohmann-json headers). It is installed into a scratch directory, never into the system.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="" PY=python3 WHEEL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --wheel) WHEEL=$2; shift 2 ;;
    *) echo "usage: $0 --out DIR [--python PY] [--wheel FILE]" >&2; exit 2 ;;
  esac
done
[ -n "$OUT" ] || { echo "usage: $0 --out DIR [--python PY] [--wheel FILE]" >&2; exit 2; }
mkdir -p "$OUT"
SITE=${FP4MOE_PY_SITE:-${TMPDIR:-/tmp}/fp4moe-python-site}
rm -rf "$SITE" && mkdir -p "$SITE"
export PATH="$PATH:/usr/local/cuda/bin" CMAKE_BUILD_PARALLEL_LEVEL=${FP4MOE_JOBS:-$(nproc)}
tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')

{
  echo "commit: ${FP4MOE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  "$PY" --version
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
  "$PY" -m pip list 2>/dev/null | grep -iE "^(nanobind|scikit.build.core|numpy|pytest|torch) " || true
  nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"

if [ -z "$WHEEL" ]; then
  WHEEL=$(ls build/wheelhouse/fp4moe-*-"$tag"-*.whl 2>/dev/null | head -1)
fi
t0=$(date +%s)
if [ -n "$WHEEL" ]; then
  echo "installing $WHEEL into $SITE"
  "$PY" -m pip install --no-deps --no-index --target "$SITE" "$WHEEL" > "$OUT/install.log" 2>&1
else
  echo "building the package here (no $tag wheel in build/wheelhouse) into $SITE"
  "$PY" -m pip install -v --no-build-isolation --no-deps --target "$SITE" \
    -C "build-dir=build/py-device/{wheel_tag}" . > "$OUT/install.log" 2>&1
fi
rc=$?
echo "install rc=$rc ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/install.log"
[ $rc -eq 0 ] || { tail -40 "$OUT/install.log"; exit 1; }
if ! "$PY" -c "import pytest" 2>/dev/null; then
  "$PY" -m pip install --no-index --target "$SITE" --find-links build/wheelhouse pytest >> "$OUT/install.log" 2>&1 ||
    echo "pytest is missing and build/wheelhouse has no pytest wheels"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import fp4moe; print("fp4moe", fp4moe.__version__, "from", fp4moe.__file__, "gpu:", fp4moe.gpu_available())' \
  2>&1 | tee "$OUT/import.txt"

timeout ${TEST_TIMEOUT:-1200} "$PY" -m pytest tests/python -v -rs -p no:cacheprovider --durations=15 \
  --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1
test_rc=$?
grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/pytest.log" | grep -vE " PASSED" | head -60
tail -3 "$OUT/pytest.log"
timeout ${BENCH_TIMEOUT:-300} "$PY" python/bench_overhead.py --json "$OUT/bench_overhead.json" > "$OUT/bench_overhead.txt" 2>&1
echo "bench rc=$?"; cat "$OUT/bench_overhead.txt" | tail -40
echo "pytest rc=$test_rc"
exit $test_rc
