#!/usr/bin/env bash
# The whole test suite: install, build, run every test (C tests through ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir build --output-on-failure -j2
