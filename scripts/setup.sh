#!/usr/bin/env bash
# Installs fp4moe's build dependencies (pinned Debian 12 "bookworm" versions). Idempotent: a package
# already present is left alone, so a second run costs a few dpkg queries.
# Needs: the CUDA toolkit (nvcc 13.x) on PATH or in /usr/local/cuda; it is not a Debian package.
set -euo pipefail

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

if ! command -v nvcc >/dev/null 2>&1; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    echo "setup: add /usr/local/cuda/bin to PATH (nvcc found there)" >&2
  else
    echo "setup: nvcc (CUDA toolkit 13.x) not found: install the CUDA toolkit first" >&2
    exit 1
  fi
fi
