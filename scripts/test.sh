#!/usr/bin/env bash
# The whole test suite: install, build, run every test.
#   1. C tests and tool tests (ctest)
#   2. Python front ends (pip install . + pytest; torch/jax/liger when installable)
#   3. Robustness: sanitizers, valgrind, bounded fuzzing (scripts/robustness.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir build --output-on-failure -j2
bash scripts/python_test.sh
if [ -f scripts/robustness.sh ]; then
  bash scripts/robustness.sh
fi
