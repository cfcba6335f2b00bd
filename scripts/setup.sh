#!/usr/bin/env bash
# Installs what fusedgrpo needs on a Debian 12 machine (only what is missing)
# and builds it into ./build. Called by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(gcc g++ make cmake ninja-build pkg-config libdnnl-dev libyaml-dev libcjson-dev
          libopenmpi-dev openmpi-bin iproute2)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# matplotlib draws the bench plots (bench/plot_bench.py; checked by the tool tests).
if ! python3 -c "import matplotlib" >/dev/null 2>&1; then
  echo "setup: installing matplotlib"
  python3 -m pip install -q matplotlib
fi

build_type="${FG_BUILD_TYPE:-Release}"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="$build_type" >/dev/null
cmake --build build
