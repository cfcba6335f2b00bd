#!/usr/bin/env bash
# The GPU run of the CUDA backend, end to end, in a few minutes:
#   bash scripts/gpu_test.sh OUTDIR
# 1. Builds cuda/ on its own (CUDA toolkit, cmake and ninja; no oneDNN, no
#    libyaml) for sm_90a plus PTX.
# 2. Builds the whole project with the CUDA backend (FG_CUDA=ON; targets
#    fusedgrpo, fusedgrpo_cuda, test_cuda_api only). It needs oneDNN: where
#    .gpu-carry/onednn exists (scripts/gpu_carry.sh, carried to a GPU machine
#    that has none) its headers and library are used, and its lib/ goes on
#    LD_LIBRARY_PATH for the runs. A failure here is reported and the
#    standalone steps still run.
# 3. Runs test_cuda (then again under compute-sanitizer's memcheck when it is
#    installed), then test_cuda_api, the C API's CUDA path against its CPU
#    path (FUSEDGRPO_CUDA_LIBRARY = the built libfusedgrpo_cuda.so; under
#    memcheck too), then bench_cuda at the headline shape and at N = 32768
#    (FG_GPU_SKIP_BENCH=1 leaves the benchmark out), and writes their output,
#    the JSON and the GPU's description under OUTDIR.
# Without a GPU it still builds both, and the programs print why they
# skipped. Exit status: 0 when every part that ran passed (a skip passes),
# 1 otherwise.
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
build_full=${FG_GPU_FULL_BUILD_DIR:-build-gpu-full}
carry=$PWD/.gpu-carry/onednn
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

step "build (the whole project with the CUDA backend: fusedgrpo, fusedgrpo_cuda, test_cuda_api)"
# The tests under tests/ and the tool are not needed (the tool needs libyaml
# and libcjson); test_cuda_api lives in cuda/ and is built either way.
dnnl_args=()
if [ -d "$carry" ]; then
  # A transfer may have dropped the symlinks: make them again.
  for pair in "libdnnl.so.2:libdnnl.so.2.6" "libdnnl.so:libdnnl.so.2"; do
    link=${pair%%:*} target=${pair##*:}
    [ -e "$carry/lib/$link" ] || ln -sf "$target" "$carry/lib/$link"
  done
  dnnl_args=(-DDNNL_INCLUDE_DIR="$carry/include" -DDNNL_LIBRARY="$carry/lib/libdnnl.so")
  export LD_LIBRARY_PATH="$carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "oneDNN from $carry"
fi
full_ok=0
full_start=$SECONDS
if ! cmake -S . -B "$build_full" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
       -DCMAKE_CUDA_COMPILER="$nvcc_path" -DCMAKE_CUDA_ARCHITECTURES="90a-real;90-virtual" \
       -DFG_CUDA=ON -DFG_CUDA_WERROR=OFF -DFG_BUILD_TOOLS=OFF -DFG_BUILD_TESTS=OFF -DFG_MPI=OFF \
       "${dnnl_args[@]}" >"$out/configure_full.txt" 2>&1; then
  tail -30 "$out/configure_full.txt"
  echo "gpu_test: configuring the whole project failed (configure_full.txt)"
  failed=1
elif ! timeout --kill-after=10 300 cmake --build "$build_full" -j "$(nproc)" \
       --target fusedgrpo fusedgrpo_cuda test_cuda_api >"$out/build_full.txt" 2>&1; then
  tail -40 "$out/build_full.txt"
  echo "gpu_test: building the whole project failed (build_full.txt)"
  failed=1
else
  full_ok=1
  echo "built in $((SECONDS - full_start))s; $(grep -ci warning "$out/build_full.txt") lines" \
       "mention a warning (build_full.txt)"
fi
cuda_lib=$PWD/$build_full/cuda/libfusedgrpo_cuda.so
case $build_full in /*) cuda_lib=$build_full/cuda/libfusedgrpo_cuda.so ;; esac

step "test_cuda"
run_logged 120 "$out/test_cuda.txt" "$build/test_cuda"
test_rc=$rc
[ "$test_rc" -ne 0 ] && [ "$test_rc" -ne 77 ] && failed=1

# Runs test_cuda_api (rc in $rc; 77: skipped); "$@" goes before it (a sanitizer).
run_api() {
  local limit=$1 log=$2
  shift 2
  if [ "$full_ok" -ne 1 ]; then
    echo "gpu_test: the whole project did not build: test_cuda_api not run" | tee "$log"
    rc=1
    return
  fi
  run_logged "$limit" "$log" env FUSEDGRPO_CUDA_LIBRARY="$cuda_lib" "$@" \
    "$build_full/cuda/test_cuda_api"
}

if [ "$test_rc" -eq 77 ]; then
  echo "gpu_test: test_cuda skipped (no usable GPU); memcheck and the benchmark are skipped too"
  step "test_cuda_api"
  run_api 120 "$out/test_cuda_api.txt"
  [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && failed=1
  echo "gpu_test: builds $([ $failed -eq 0 ] && echo ok || echo FAILED), tests skipped" \
       "(test_cuda rc $test_rc, test_cuda_api rc $rc), ${SECONDS}s"
  exit $failed
fi

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

step "test_cuda_api (the C API's CUDA path against its CPU path)"
run_api 120 "$out/test_cuda_api.txt"
api_rc=$rc
[ "$api_rc" -ne 0 ] && failed=1

step "test_cuda_api under compute-sanitizer memcheck"
if [ -n "$sanitizer" ] && [ "$full_ok" -eq 1 ]; then
  run_api 120 "$out/test_cuda_api_memcheck.txt" "$sanitizer" --tool memcheck --error-exitcode 3
  # A run stopped by the time limit says nothing about memory errors.
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] && failed=1
  tail -3 "$out/test_cuda_api_memcheck.txt"
else
  echo "compute-sanitizer not found, or no test_cuda_api: skipped"
fi

if [ "${FG_GPU_SKIP_BENCH:-0}" = 1 ]; then
  step "summary (FG_GPU_SKIP_BENCH=1: no benchmark)"
  grep -E "^(FAIL|[0-9]+ checks)" "$out/test_cuda.txt" "$out/test_cuda_api.txt"
  echo "gpu_test: test_cuda rc $test_rc, test_cuda_api rc $api_rc;" \
       "$([ $failed -eq 0 ] && echo passed || echo FAILED) in ${SECONDS}s; output in $out"
  exit $failed
fi

step "bench_cuda, N = 8192"
run_logged 150 "$out/bench.txt" "$build/bench_cuda" "$out/bench.json" 8192
[ "$rc" -ne 0 ] && failed=1

step "bench_cuda, N = 32768"
run_logged 120 "$out/bench_32768.txt" "$build/bench_cuda" "$out/bench_32768.json" 32768
[ "$rc" -ne 0 ] && failed=1

step "summary"
grep -E "^(FAIL|[0-9]+ checks)" "$out/test_cuda.txt" "$out/test_cuda_api.txt"
echo "gpu_test: test_cuda rc $test_rc, test_cuda_api rc $api_rc;" \
     "$([ $failed -eq 0 ] && echo passed || echo FAILED) in ${SECONDS}s; output in $out"
exit $failed
