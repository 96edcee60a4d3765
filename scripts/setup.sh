#!/usr/bin/env bash
# Installs fp4moe's build dependencies (pinned Debian 12 "bookworm" versions), the pinned CUTLASS
# headers of the CPU proof tests (PyPI nvidia-cutlass, hash-checked, unpacked into .deps/) and the
# pinned cuobjdump and nvdisasm of the CPU-side SASS check (PyPI nvidia-cuda-cuobjdump / -nvdisasm,
# likewise). Idempotent:
# a package already present is left alone, so a second run costs a few dpkg queries and a file test.
# Needs: the CUDA toolkit (nvcc 13.x) on PATH or in /usr/local/cuda; it is not a Debian package.
set -euo pipefail
cd "$(dirname "$0")/.."

PINNED=(
  "cmake=3.25.1-1"
  "ninja-build=1.11.1-2~deb12u1"
  "g++=4:12.2.0-3"
  "libgtest-dev=1.12.1-0.2"
  "libgmock-dev=1.12.1-0.2"
  "libcli11-dev=2.1.2+ds-1"
  "nlohmann-json3-dev=3.11.2-2"
  "libfmt-dev=9.1.0+ds1-2"
  "clang-14=1:14.0.6-12"
  "libclang-rt-14-dev=1:14.0.6-12"
  "python3-pip=23.0.1+dfsg-1"
)

missing=()
for spec in "${PINNED[@]}"; do
  name=${spec%%=*}
  if ! dpkg-query -W -f='${Status}' "$name" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$spec")
  fi
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  if ! $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; then
    # Not Debian 12 (another release or Ubuntu): the pinned versions do not exist there; take the
    # distribution's own versions of the same packages.
    echo "setup: pinned versions unavailable on this distribution; installing its own versions" >&2
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]%%=*}"
  fi
fi

# CUTLASS headers (tests/cutlass/ only): the wheel is a zip; only its C++ include tree is kept.
CUTLASS_DIR=.deps/cutlass-4.2.0.0
if [ ! -f "$CUTLASS_DIR/include/cutlass/arch/arch.h" ]; then
  echo "setup: fetching nvidia-cutlass 4.2.0.0 (C++ headers for the CUTLASS proof tests)"
  rm -rf "$CUTLASS_DIR" .deps/wheels
  mkdir -p .deps/wheels
  python3 -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
    -r scripts/requirements-cutlass.txt -d .deps/wheels
  python3 - "$CUTLASS_DIR" .deps/wheels/nvidia_cutlass-4.2.0.0-py3-none-any.whl <<'PY'
import sys, zipfile, pathlib
dest, wheel = pathlib.Path(sys.argv[1]), sys.argv[2]
prefix = "cutlass_library/source/include/"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = dest / "include" / name[len(prefix):]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(name))
PY
  rm -rf .deps/wheels
fi

# cuobjdump and nvdisasm (the SASS check of the wgmma kernels, scripts/sass_wgmma_loops.py): each
# wheel's one binary is kept, side by side (cuobjdump finds nvdisasm beside itself). Not fatal: without
# them (no network, another platform) that ctest reports itself skipped.
SASS_TOOLS_DIR=.deps/cuobjdump-13.5.37
if [ ! -x "$SASS_TOOLS_DIR/cuobjdump" ] || [ ! -x "$SASS_TOOLS_DIR/nvdisasm" ]; then
  echo "setup: fetching nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm 13.5.37 (the SASS check of the wgmma kernels)"
  rm -rf "$SASS_TOOLS_DIR" .deps/wheels-sass
  mkdir -p .deps/wheels-sass
  if python3 -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
      -r scripts/requirements-sass.txt -d .deps/wheels-sass; then
    python3 - "$SASS_TOOLS_DIR" .deps/wheels-sass/*.whl <<'PY'
import os, sys, zipfile, pathlib
dest = pathlib.Path(sys.argv[1])
dest.mkdir(parents=True, exist_ok=True)
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("nvidia/cu13/bin/") and not name.endswith("/"):
                out = dest / os.path.basename(name)
                out.write_bytes(z.read(name))
                os.chmod(out, 0o755)
PY
  else
    echo "setup: the SASS tools were not fetched: the ctest sass_no_r2ur_in_wgmma_loops will be skipped" >&2
  fi
  rm -rf .deps/wheels-sass
fi

if ! command -v nvcc >/dev/null 2>&1; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    echo "setup: add /usr/local/cuda/bin to PATH (nvcc found there)" >&2
  else
    echo "setup: nvcc (CUDA toolkit 13.x) not found: install the CUDA toolkit first" >&2
    exit 1
  fi
fi
