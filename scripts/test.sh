#!/usr/bin/env bash
# The README's test command: set up, build, run every test. GPU tests (ctest label "gpu", and the Python
# tests that need a GPU) run when a GPU is present and are reported as skipped otherwise. Ends with
# "N passed, N failed, N skipped".
# Two builds, both with warnings as errors: build/ for the default architecture (sm_90a), whose tests
# run, and build-blackwell/ for sm_90a, sm_100a and sm_120a, which proves that the library, CLI and
# tests compile for Blackwell (its tests are the same and are not run twice).
# FP4MOE_SKIP_BLACKWELL_BUILD=1 skips the second build (local iteration; CI always builds it).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
t0=$SECONDS
scripts/build.sh -DFP4MOE_WERROR=ON -DFP4MOE_CUTLASS_TESTS=ON
echo "build (sm_90a): $((SECONDS - t0)) s"
if [ "${FP4MOE_SKIP_BLACKWELL_BUILD:-0}" != 1 ]; then
  t0=$SECONDS
  FP4MOE_BUILD_DIR=${FP4MOE_BLACKWELL_BUILD_DIR:-build-blackwell} scripts/build.sh -DFP4MOE_WERROR=ON \
    -DFP4MOE_CUDA_ARCHS="90a;100a;120a" -DFP4MOE_CUTLASS_TESTS=OFF
  echo "build (sm_90a, sm_100a, sm_120a): $((SECONDS - t0)) s"
fi
BUILD_DIR=${FP4MOE_BUILD_DIR:-build}
# The Python package into $BUILD_DIR/pyenv (its tests carry the ctest label "python"); if this fails,
# ctest reports a failing python test that says so.
scripts/python_build.sh || echo "test: the Python package did not build; its tests will fail" >&2
set +e
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" "$@" 2>&1 | tee "$BUILD_DIR/ctest.log"
rc=${PIPESTATUS[0]}
set -e
total=$(grep -Eo 'tests passed, [0-9]+ tests failed out of [0-9]+' "$BUILD_DIR/ctest.log" | grep -Eo '[0-9]+$' || echo 0)
failed=$(grep -Eo '[0-9]+ tests failed out of' "$BUILD_DIR/ctest.log" | grep -Eo '^[0-9]+' || echo 0)
skipped=$(grep -Ec '\*\*\*Skipped|Not Run' "$BUILD_DIR/ctest.log" || true)
passed=$((total - failed - skipped))
echo "tests: ${passed} passed, ${failed} failed, ${skipped} skipped"
if [ "$total" -eq 0 ]; then echo "no tests ran" >&2; exit 1; fi
exit "$rc"
