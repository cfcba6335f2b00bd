#!/usr/bin/env bash
# The whole test suite: install, build, run every test.
#   1. C tests and tool tests (ctest); on a CPU with AVX-512 once more with oneDNN
#      capped at its AVX2 kernels (DNNL_MAX_CPU_ISA=AVX2), natively; on every CPU
#      once more on its SSE4.1 kernels (DNNL_MAX_CPU_ISA=SSE41)
#   2. Python front ends (pip install . + pytest; torch/jax/liger when installable)
#   3. The release wheel (scripts/build_wheel.sh): NumPy oracle and JAX handler tests
#      in a clean debootstrap root, NumPy tests under qemu-x86_64 -cpu Haswell
#      (scripts/wheel_test.sh)
#   4. The C library under qemu-x86_64 -cpu Haswell: the tool's gradcheck of every
#      path, test_paths, test_edges (scripts/qemu_test.sh)
#   5. Robustness: sanitizers, valgrind, bounded fuzzing (scripts/robustness.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir build --output-on-failure -j2
# oneDNN picks other kernels, blockings and scratch sizes on AVX-512 than on
# AVX2: on an AVX-512 CPU the same binaries run again on its AVX2 kernels, so
# that one machine tests both ISAs' choices (the qemu Haswell subset below also
# runs the build on an emulated AVX2-only CPU, slowly).
if grep -qw avx512f /proc/cpuinfo; then
  echo "test.sh: AVX-512 CPU: ctest again with oneDNN's AVX2 kernels (DNNL_MAX_CPU_ISA=AVX2)"
  DNNL_MAX_CPU_ISA=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ctest --test-dir build --output-on-failure -j2
else
  echo "test.sh: skipped the ctest run with DNNL_MAX_CPU_ISA=AVX2: this CPU has no AVX-512," \
       "so oneDNN ran its AVX2 kernels (or older ones) in the run above"
fi
# And on every CPU once more on oneDNN's SSE4.1 kernels, a third set of
# blockings and scratch sizes: a test that encodes the host ISA's choices then
# fails on whichever machine CI runs on, not only on the ISA it was not written on.
echo "test.sh: ctest again with oneDNN's SSE4.1 kernels (DNNL_MAX_CPU_ISA=SSE41)"
DNNL_MAX_CPU_ISA=SSE41 ONEDNN_MAX_CPU_ISA=SSE41 ctest --test-dir build --output-on-failure -j2
bash scripts/python_test.sh
bash scripts/wheel_test.sh
bash scripts/qemu_test.sh
if [ -f scripts/robustness.sh ]; then
  bash scripts/robustness.sh
fi
