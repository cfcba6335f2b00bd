#!/usr/bin/env bash
# The main job: install, build, and run fused vs materialized on the default
# synthetic batch (B=2, T=512, H=1024, V=151936, f32). Extra arguments go to
# the demo, e.g. `bash scripts/demo.sh --dtype bf16`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
./build/fusedgrpo_demo "$@"
