#!/usr/bin/env bash
# The README's test command: set up, build, run every test. GPU tests (ctest label "gpu", and the Python
# tests that need a GPU) run when a GPU is present and are reported as skipped otherwise. Ends with
# "N passed, N failed, N skipped".
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
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
