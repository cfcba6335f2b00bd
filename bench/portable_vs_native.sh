#!/usr/bin/env bash
# The portable build (baseline x86-64 + run-time dispatch, the default) against
# a -march=native build of the same tree, in one run (bench/ab_tools.sh).
#   CONFIG=configs/scaled_t2048.yaml DTYPES="float32 bfloat16" bash bench/portable_vs_native.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
cmake -S . -B build-native -G Ninja -DCMAKE_BUILD_TYPE=Release -DFG_NATIVE=ON -DFG_BUILD_TESTS=OFF >/dev/null
cmake --build build-native >/dev/null
A=build-native/tools/fusedgrpo B=build/tools/fusedgrpo LABELS="native portable" \
  OUT=${OUT:-bench/results/portable_vs_native} bash bench/ab_tools.sh
