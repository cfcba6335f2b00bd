#!/usr/bin/env bash
# The GPU run of the CUDA backend, end to end, in a few minutes:
#   bash scripts/gpu_test.sh OUTDIR
# Builds cuda/ on its own (CUDA toolkit, cmake and ninja; no oneDNN, no
# libyaml) for sm_90a plus PTX, runs test_cuda (then again under
# compute-sanitizer's memcheck when it is installed) and bench_cuda at the
# headline shape and at N = 32768, and writes their output, the JSON and the
# GPU's description under OUTDIR. Without a GPU it still builds, and the
# programs print why they skipped. Exit status: 0 when every part that ran
# passed (a skip passes), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ $# -ne 1 ]; then
  echo "usage: bash scripts/gpu_test.sh OUTDIR" >&2
  exit 2
fi
out=$1
mkdir -p "$out"
out=$(cd "$out" && pwd)
build=${FG_GPU_BUILD_DIR:-build-gpu}
failed=0

step() { printf '\n== %s (at %ds)\n' "$1" "$SECONDS"; }

# Runs "$@" with a time limit, its output also into the file $log; rc in $rc.
run_logged() {
  local limit=$1 log=$2
  shift 2
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "gpu_test: $1 ran past ${limit}s and was stopped"
}

step "machine"
nvcc_path=$(command -v nvcc || true)
[ -z "$nvcc_path" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc_path=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc_path" ]; then
  echo "gpu_test: no nvcc in PATH or /usr/local/cuda/bin: cannot build the CUDA backend"
  exit 1
fi
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "nvcc: $("$nvcc_path" --version | tail -1)"
  echo "cmake: $(cmake --version | head -1)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
                 --format=csv,noheader 2>&1)"
  else
    echo "gpu: nvidia-smi not found"
  fi
} | tee "$out/machine.txt"

step "build (cuda/ standalone, sm_90a + PTX)"
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
if ! cmake -S cuda -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
       -DCMAKE_CUDA_COMPILER="$nvcc_path" -DCMAKE_CUDA_ARCHITECTURES="90a-real;90-virtual" \
       -DFG_CUDA_WERROR=OFF >"$out/configure.txt" 2>&1; then
  tail -30 "$out/configure.txt"
  echo "gpu_test: configure failed"
  exit 1
fi
if ! cmake --build "$build" -j "$(nproc)" >"$out/build.txt" 2>&1; then
  tail -40 "$out/build.txt"
  echo "gpu_test: build failed"
  exit 1
fi
echo "built in ${SECONDS}s; $(grep -ci warning "$out/build.txt") lines mention a warning" \
     "(build.txt; CI builds with warnings as errors)"

step "test_cuda"
run_logged 120 "$out/test_cuda.txt" "$build/test_cuda"
test_rc=$rc
if [ "$test_rc" -eq 77 ]; then
  echo "gpu_test: test_cuda skipped (no usable GPU); the benchmark is skipped too"
  echo "gpu_test: build ok, tests skipped, ${SECONDS}s"
  exit 0
fi
[ "$test_rc" -ne 0 ] && failed=1

step "test_cuda under compute-sanitizer memcheck"
sanitizer=$(command -v compute-sanitizer || true)
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -z "$sanitizer" ] && [ -x "$c" ] && sanitizer=$c
done
if [ -n "$sanitizer" ]; then
  run_logged 90 "$out/test_cuda_memcheck.txt" "$sanitizer" --tool memcheck --error-exitcode 3 \
    "$build/test_cuda"
  # A run stopped by the time limit says nothing about memory errors.
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] && failed=1
  tail -3 "$out/test_cuda_memcheck.txt"
else
  echo "compute-sanitizer not found: skipped"
fi

step "bench_cuda, N = 8192"
run_logged 150 "$out/bench.txt" "$build/bench_cuda" "$out/bench.json" 8192
[ "$rc" -ne 0 ] && failed=1

step "bench_cuda, N = 32768"
run_logged 120 "$out/bench_32768.txt" "$build/bench_cuda" "$out/bench_32768.json" 32768
[ "$rc" -ne 0 ] && failed=1

step "summary"
grep -E "^(FAIL|[0-9]+ checks)" "$out/test_cuda.txt"
echo "gpu_test: test_cuda rc $test_rc; $([ $failed -eq 0 ] && echo passed || echo FAILED)" \
     "in ${SECONDS}s; output in $out"
exit $failed
