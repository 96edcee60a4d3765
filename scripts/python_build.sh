#!/usr/bin/env bash
# Builds the Python package and installs it into build/pyenv, a venv with the pinned build and test
# tools of python/requirements-build.txt (from PyPI). Reuses build/libfp4moe_core.a, so the CUDA core is
# compiled once (run scripts/build.sh first). Idempotent: the venv is made once per requirements file,
# and the package's CMake build directory (build/py-ci) is kept, so a second run only relinks what changed.
#   scripts/python_build.sh                    # install into build/pyenv (what scripts/test.sh does)
#   scripts/python_build.sh --wheel PYTHON     # also a wheel for that interpreter in build/wheelhouse/
#                                              # (e.g. a cp312 wheel to carry to the GPU machine)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${FP4MOE_BUILD_DIR:-build}
PY=${FP4MOE_PYTHON:-python3}
VENV=$BUILD_DIR/pyenv
REQ=python/requirements-build.txt
CORE=$PWD/$BUILD_DIR/libfp4moe_core.a
export PATH="$PATH:/usr/local/cuda/bin"
export CMAKE_BUILD_PARALLEL_LEVEL=${FP4MOE_JOBS:-$(nproc)}

if [ ! -f "$CORE" ]; then
  echo "python_build: $CORE not found; run scripts/build.sh first" >&2
  exit 1
fi
t0=$(date +%s)
if [ ! -x "$VENV/bin/python" ] || ! cmp -s "$REQ" "$VENV/.requirements"; then
  echo "python_build: creating $VENV with $("$PY" --version) and $REQ"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQ"
  cp "$REQ" "$VENV/.requirements"
fi
# --no-build-isolation: the venv's pinned scikit-build-core and nanobind build it.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps --force-reinstall \
  -C "build-dir=$BUILD_DIR/py-ci/{wheel_tag}" -C "cmake.define.FP4MOE_CORE_LIBRARY=$CORE" .
echo "python_build: fp4moe installed into $VENV ($(( $(date +%s) - t0 )) s)"

if [ "${1:-}" = "--wheel" ]; then
  WPY=${2:?"--wheel needs the interpreter to build for"}
  WENV=$BUILD_DIR/pyenv-wheel-$("$WPY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  if [ ! -x "$WENV/bin/python" ] || ! cmp -s "$REQ" "$WENV/.requirements"; then
    rm -rf "$WENV"
    "$WPY" -m venv "$WENV"
    "$WENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQ"
    cp "$REQ" "$WENV/.requirements"
  fi
  "$WENV/bin/python" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
    -C "build-dir=$BUILD_DIR/py-ci/{wheel_tag}" -C "cmake.define.FP4MOE_CORE_LIBRARY=$CORE" -w "$BUILD_DIR/wheelhouse" .
  # pytest for the GPU machine, which has no network (scripts/python_gpu_check.sh installs it from here)
  "$WENV/bin/python" -m pip download -q --disable-pip-version-check --only-binary=:all: -d "$BUILD_DIR/wheelhouse" \
    "$(grep '^pytest==' "$REQ")"
  ls -l "$BUILD_DIR"/wheelhouse/*.whl
fi
