#!/usr/bin/env bash
# The whole test suite: install, build, run every test.
#   1. C tests and tool tests (ctest)
#   2. Python front ends (pip install . + pytest; torch/jax/liger when installable)
#   3. The wheel: `pip wheel .` into a fresh venv, NumPy front end's oracle tests
#      natively and under qemu-x86_64 -cpu Haswell (scripts/wheel_test.sh)
#   4. The C library under qemu-x86_64 -cpu Haswell: the tool's gradcheck of every
#      path, test_paths, test_edges (scripts/qemu_test.sh)
#   5. Robustness: sanitizers, valgrind, bounded fuzzing (scripts/robustness.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir build --output-on-failure -j2
bash scripts/python_test.sh
bash scripts/wheel_test.sh
bash scripts/qemu_test.sh
if [ -f scripts/robustness.sh ]; then
  bash scripts/robustness.sh
fi
