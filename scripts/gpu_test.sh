#!/usr/bin/env bash
# The GPU run of the CUDA backend, end to end, in under 9 minutes:
#   bash scripts/gpu_test.sh OUTDIR
# 1. Builds cuda/ on its own (CUDA toolkit, cmake and ninja; no oneDNN, no
#    libyaml) for sm_90a plus PTX: the backend, test_cuda and bench_cuda
#    (its source in bench/cuda/, built by cuda/CMakeLists.txt).
# 2. Builds the whole project with the CUDA backend (FG_CUDA=ON, the default
#    architectures: sm_80 to sm_120 and PTX, as the wheel; targets
#    fusedgrpo, fusedgrpo_cuda, test_cuda_api, bench_cuda_api only). It needs
#    oneDNN: where .gpu-carry/onednn exists (scripts/gpu_carry.sh, carried to
#    a GPU machine that has none) its headers and library are used, and its
#    lib/ goes on LD_LIBRARY_PATH for the runs. A failure here is reported
#    and the standalone steps still run.
# 3. Correctness first, so that its results survive a cut-off: test_cuda
#    (then again under compute-sanitizer's memcheck when it is installed),
#    test_cuda_api, the C API's CUDA path against its CPU path and the
#    backend's ops against the reference backend, the filter and derivs ops
#    included (FUSEDGRPO_CUDA_LIBRARY = the built libfusedgrpo_cuda.so; under
#    memcheck too), then the Python GPU tests: tests/python/test_device_backends.py
#    (the torch op on CUDA tensors against the CPU op) and
#    tests/python/test_torch_reported.py (device-reported calls captured in
#    CUDA graphs: torch.cuda.graph, torch.compile "reduce-overhead"), then
#    tests/python/test_trl_gpu.py (fusedgrpo.trl.FusedGRPOTrainer against
#    trl.GRPOTrainer with the model on the GPU), then
#    tests/python/test_torch_distributed_nccl.py (fusedgrpo.torch_distributed
#    on CUDA tensors, a group of one rank on NCCL), then
#    tests/python/test_jax_cuda.py (the JAX handler's CUDA targets). The
#    Python packages are the machine's; what it lacks (trl, datasets, dill,
#    multiprocess; pytest where it has none) comes from the wheels in
#    .gpu-carry/wheels, placed after the machine's own (prepare_python).
# 4. The benchmarks (sources in bench/cuda/; FG_GPU_SKIP_BENCH=1 leaves them
#    out): bench_cuda_api (the C API's fused step at budgets 512 MiB to
#    3 GiB, dense (and with the finite check off: a host wait a chunk, the
#    walk before the derivs op; and device-reported, captured in a CUDA graph
#    and replayed) and with gradient filtering at its auto
#    threshold, against
#    the bare products and the materialized path, T = 8192 and 32768), the
#    peers'
#    benchmark when bench/peers/gpu_peers.sh exists (FG_GPU_PEERS_LIMIT
#    seconds, default 240; FG_PEERS_TOKENS, say 32768, runs only those T,
#    comma-separated; FG_PEERS_TIMEOUT seconds a peer, default 60), then
#    bench_cuda (the kernels and products piece by piece, N = 8192 and 32768).
# Every step has its own time limit, and none runs past FG_GPU_DEADLINE
# seconds from the start (default 540): a step that would start too late is
# listed as not run. Output, JSON and the GPU's description go under OUTDIR.
# FG_GPU_BUILD_DIR, FG_GPU_FULL_BUILD_DIR: the build folders (build-gpu,
# build-gpu-full); FG_GPU_JOBS: build jobs (nproc); FG_GPU_FULL_ARCHS: the
# whole project's CMAKE_CUDA_ARCHITECTURES (default the wheel's; "90a-real"
# builds this H100/H200's image alone, a shorter build when time is short).
# Parts to leave out (a shorter run, once a full one has passed; by default
# every part runs): FG_GPU_SKIP_MEMCHECK=1 both compute-sanitizer steps,
# FG_GPU_SKIP_JAX=1 test_jax_cuda.py, FG_GPU_SKIP_API_BENCH=1 bench_cuda_api,
# FG_GPU_SKIP_PIECES=1 the two bench_cuda runs, FG_GPU_SKIP_BENCH=1 every
# benchmark.
# Without a GPU it still builds both and runs the Python tests' host part;
# the GPU programs print why they skipped. Exit status: 0 when every part
# that ran passed (a skip passes), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

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
wheels=$PWD/.gpu-carry/wheels
deadline=${FG_GPU_DEADLINE:-540}
jobs=${FG_GPU_JOBS:-$(nproc)}
failed=0
not_run=()

step() { printf '\n== %s (at %ds)\n' "$1" "$SECONDS"; }

# The time a step may take: its own limit, or less where the deadline is
# nearer (0: too late to start one).
limit_for() {
  local want=$1 left=$((deadline - SECONDS - 5))
  if [ "$left" -lt 15 ]; then echo 0; elif [ "$left" -lt "$want" ]; then echo "$left"; else echo "$want"; fi
}

# Runs "$@" with a time limit, its output also into the file $log; rc in $rc
# (124: stopped by the limit; 125: not started, past the deadline).
run_logged() {
  local limit log=$2
  limit=$(limit_for "$1")
  shift 2
  if [ "$limit" -eq 0 ]; then
    echo "gpu_test: not run, FG_GPU_DEADLINE=${deadline}s is near: $*" | tee "$log"
    not_run+=("$(basename "$log")")
    rc=125
    return
  fi
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

# A build's limit: 300 s, or what the deadline leaves (at least 1 s, as
# timeout 0 would mean none).
build_limit() { local l; l=$(limit_for 300); echo $((l > 0 ? l : 1)); }

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
if ! timeout --kill-after=10 "$(build_limit)" cmake --build "$build" -j "$jobs" >"$out/build.txt" 2>&1; then
  tail -40 "$out/build.txt"
  echo "gpu_test: build failed"
  exit 1
fi
echo "built in ${SECONDS}s; $(grep -ci warning "$out/build.txt") lines mention a warning" \
     "(build.txt; CI builds with warnings as errors)"

step "build (the whole project with the CUDA backend: fusedgrpo, fusedgrpo_cuda, test_cuda_api, bench_cuda_api)"
# The tests under tests/ and the tool are not needed (the tool needs libyaml
# and libcjson); test_cuda_api (cuda/) and bench_cuda_api (bench/cuda/) are
# cuda/CMakeLists.txt's targets and are built either way, into
# $build_full/cuda.
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
# The whole project for cuda/CMakeLists.txt's default architectures (every GPU
# from Ampere on, as the wheel): the run then loads the image the wheel ships.
if ! cmake -S . -B "$build_full" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
       -DCMAKE_CUDA_COMPILER="$nvcc_path" \
       -DFG_CUDA=ON -DFG_CUDA_WERROR=OFF -DFG_BUILD_TOOLS=OFF -DFG_BUILD_TESTS=OFF -DFG_MPI=OFF \
       ${FG_GPU_FULL_ARCHS:+-DCMAKE_CUDA_ARCHITECTURES="$FG_GPU_FULL_ARCHS"} \
       "${dnnl_args[@]}" >"$out/configure_full.txt" 2>&1; then
  tail -30 "$out/configure_full.txt"
  echo "gpu_test: configuring the whole project failed (configure_full.txt)"
  failed=1
elif ! timeout --kill-after=10 "$(build_limit)" cmake --build "$build_full" -j "$jobs" \
       --target fusedgrpo fusedgrpo_cuda test_cuda_api bench_cuda_api >"$out/build_full.txt" 2>&1; then
  tail -40 "$out/build_full.txt"
  echo "gpu_test: building the whole project failed (build_full.txt)"
  failed=1
else
  full_ok=1
  echo "built in $((SECONDS - full_start))s; $(grep -ci warning "$out/build_full.txt") lines" \
       "mention a warning (build_full.txt)"
fi
full_dir=$PWD/$build_full
case $build_full in /*) full_dir=$build_full ;; esac
cuda_lib=$full_dir/cuda/libfusedgrpo_cuda.so

step "test_cuda"
run_logged 120 "$out/test_cuda.txt" "$build/test_cuda"
test_rc=$rc
[ "$test_rc" -ne 0 ] && [ "$test_rc" -ne 77 ] && failed=1

# Runs test_cuda_api (rc in $rc; 77: skipped); "$@" goes before it (a sanitizer).
# FUSEDGRPO_CUDA_STRICT=1: a filtered chunk's graph that cannot be made fails
# the call with its CUDA error, rather than turning the backend's sparse
# products off.
run_api() {
  local limit=$1 log=$2
  shift 2
  if [ "$full_ok" -ne 1 ]; then
    echo "gpu_test: the whole project did not build: test_cuda_api not run" | tee "$log"
    rc=1
    return
  fi
  run_logged "$limit" "$log" env FUSEDGRPO_CUDA_LIBRARY="$cuda_lib" FUSEDGRPO_CUDA_STRICT=1 "$@" \
    "$build_full/cuda/test_cuda_api"
}

# The Python tests' PYTHONPATH ($pypath), made once by prepare_python; $py_state
# is "ready", or why the Python tests cannot run. The carried wheels
# (.gpu-carry/wheels: pytest and its dependencies, trl, datasets, dill,
# multiprocess) are unpacked into a temporary folder, $pylib (pure Python:
# wheels are zip files that import from their unpacked tree), all but the
# peers' kernel packages (Liger-Kernel, Cut Cross-Entropy), which no test
# here uses. That folder must come after the machine's own packages, so that
# its torch, transformers, numpy and pytest win and only what it lacks comes
# from the wheels; but PYTHONPATH goes before the interpreter's own entries.
# So PYTHONPATH names python/, then the interpreter's sys.path as it stands
# (its site-packages and the folders its .pth files add), then $pylib: site
# drops the repeats at start-up, and subprocesses inherit the order (a
# sys.path.append in the test process would not). FG_GPU_PYTEST=carried puts
# $pylib before the machine's packages (pytest from the wheels even where the
# machine has one). OUTDIR/python_env.txt says where each package the tests
# use comes from, and its version.
py=${PYTHON:-python3}
pypath=""
pylib=""
pytmp=""
py_state=""
trap '[ -n "$pytmp" ] && rm -rf "$pytmp"' EXIT
prepare_python() {
  [ -n "$py_state" ] && return
  local machine
  if ! command -v "$py" >/dev/null 2>&1; then
    py_state="no $py"
    return
  fi
  if ! machine=$("$py" -c 'import os, sys; print(os.pathsep.join(p for p in sys.path if p))'); then
    py_state="$py does not start"
    return
  fi
  pytmp=$(mktemp -d)
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    pylib=$pytmp/site
    "$py" - "$pylib" "$wheels"/*.whl <<'PY'
import os, sys, zipfile
for w in sys.argv[2:]:
    if not os.path.basename(w).startswith(("liger_kernel-", "cut_cross_entropy-")):
        zipfile.ZipFile(w).extractall(sys.argv[1])
PY
  fi
  if [ "${FG_GPU_PYTEST:-auto}" = carried ] && [ -n "$pylib" ]; then
    pypath=$PWD/python:$pylib:$machine
  else
    pypath=$PWD/python:$machine${pylib:+:$pylib}
  fi
  echo "Python: $("$py" --version 2>&1); carried wheels: ${pylib:+$(ls "$wheels" | tr '\n' ' ')}"
  # Importing torch, transformers and trl takes seconds: a limit for a
  # machine where one hangs.
  timeout -k 5 60 env PYTHONPATH="$pypath" HF_HUB_OFFLINE=1 "$py" - "$pylib" <<'PY' 2>&1 | tee "$out/python_env.txt"
import importlib, os, sys
carried = sys.argv[1]
for name in ("pytest", "numpy", "torch", "transformers", "accelerate", "trl", "datasets", "dill",
             "multiprocess", "pyarrow", "pandas", "fsspec", "huggingface_hub", "xxhash",
             "packaging"):
    try:
        m = importlib.import_module(name)
    except Exception as e:
        print(f"  {name:16} not importable: {type(e).__name__}: {str(e)[:200]}")
        continue
    f = os.path.abspath(getattr(m, "__file__", None) or "")
    where = "carried" if carried and f.startswith(os.path.abspath(carried) + os.sep) else "machine"
    print(f"  {name:16} {str(getattr(m, '__version__', '?')):14} {where}")
PY
  if ! PYTHONPATH=$pypath "$py" -c 'import pytest' >/dev/null 2>&1; then
    py_state="pytest is not importable, from the machine or from $wheels (bash scripts/gpu_carry.sh fills it)"
    return
  fi
  py_state=ready
}

# Runs one Python test file: run_pytest LIMIT LOG REPORT FILE (REPORT: pytest's
# -r characters); rc in $prc (0 also where it cannot run: no Python or pytest).
# HF_HUB_OFFLINE and HF_DATASETS_OFFLINE: a GPU machine reaches no network, and
# the tests read only what they write (the tiny model); the Hugging Face and
# Triton caches go to a temporary folder.
run_pytest() {
  local limit=$1 log=$2 report=$3 file=$4
  prc=0
  if [ "$full_ok" -ne 1 ]; then
    echo "gpu_test: the whole project did not build: no libfusedgrpo.so, $file not run" | tee "$log"
    prc=1
    return
  fi
  prepare_python
  if [ "$py_state" != ready ]; then
    echo "gpu_test: skipped: $py_state" | tee "$log"
    return
  fi
  # The log keeps everything; the console leaves out the tolerance table that
  # tests/python/conftest.py prints (it covers the other test files), up to
  # the next section (pytest's short summary) or the last line.
  run_logged "$limit" "$log" env PYTHONPATH="$pypath" PYTHONDONTWRITEBYTECODE=1 \
    FUSEDGRPO_LIBRARY="$full_dir/libfusedgrpo.so" FUSEDGRPO_CUDA_LIBRARY="$cuda_lib" \
    FUSEDGRPO_JAX_BACKEND=callback HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
    HF_HOME="$pytmp/hf" TRITON_CACHE_DIR="$pytmp/triton" \
    "$py" -m pytest -q -r"$report" -p no:cacheprovider "$file" >/dev/null
  prc=$rc
  awk '/tolerances: normwise/ {skip = 1; next}
       skip && (/^=/ || /passed|failed|error|no tests ran|skipped/) {skip = 0}
       !skip' "$log"
  [ "$prc" -eq 124 ] && echo "gpu_test: pytest ran past its limit and was stopped"
}

# tests/python/test_device_backends.py: the torch op through the reference
# backend (any machine) and on CUDA tensors against the CPU op; then
# tests/python/test_torch_reported.py: device-reported calls, captured with
# torch.cuda.graph and under torch.compile(mode="reduce-overhead") (rc in
# $py_rc: the first failure's).
run_python_tests() {
  run_pytest 180 "$out/pytest_device.txt" fE tests/python/test_device_backends.py
  py_rc=$prc
  run_pytest 120 "$out/pytest_reported.txt" fEs tests/python/test_torch_reported.py
  [ "$py_rc" -eq 0 ] && py_rc=$prc
}

# tests/python/test_trl_gpu.py: fusedgrpo.trl.FusedGRPOTrainer against
# trl.GRPOTrainer with the model on the GPU (rc in $trl_rc). It skips without
# a CUDA device or without trl, transformers, accelerate and datasets (-rs
# says why: python_env.txt says which of them is missing). Its time limit:
# FG_GPU_TRL_LIMIT seconds (default 150; 30 tests, two trainers built in
# each).
run_trl_tests() {
  run_pytest "${FG_GPU_TRL_LIMIT:-150}" "$out/pytest_trl_gpu.txt" fEs tests/python/test_trl_gpu.py
  trl_rc=$prc
}

# tests/python/test_torch_distributed_nccl.py: fusedgrpo.torch_distributed's
# ops on CUDA tensors in a group of one rank on NCCL against fusedgrpo.torch's
# on the same tensors and against the CPU op (rc in $nccl_rc). It skips without
# a CUDA device or without NCCL (-rs says why). Limit: 90 seconds.
run_nccl_tests() {
  run_pytest 90 "$out/pytest_nccl.txt" fEs tests/python/test_torch_distributed_nccl.py
  nccl_rc=$prc
}

# tests/python/test_jax_cuda.py: the JAX handler's CUDA targets against the
# CPU path (rc in $jax_rc; 77: skipped). The handler is built here from
# python/fusedgrpo/_jax_ffi.cc against this machine's jax (it links no CUDA
# library; its copies go through libcuda.so.1, opened at run time).
run_jax_tests() {
  local log=$out/jax_cuda.txt py=${PYTHON:-python3} inc
  jax_rc=0
  if [ "$full_ok" -ne 1 ]; then
    echo "gpu_test: the whole project did not build: JAX tests not run" | tee "$log"
    jax_rc=1
    return
  fi
  if ! inc=$("$py" -c 'import jax.ffi; print(jax.ffi.include_dir())' 2>/dev/null); then
    echo "gpu_test: skipped: jax (with jax.ffi) is not importable" | tee "$log"
    jax_rc=77
    return
  fi
  if ! g++ -std=c++17 -O2 -Wall -Wextra -Werror -fPIC -shared -DFG_JAX_FFI_CUDA_H \
         -isystem /usr/local/cuda/include -Iinclude -isystem "$inc" python/fusedgrpo/_jax_ffi.cc \
         -o "$full_dir/libfusedgrpo_jax_ffi.so" -L"$full_dir" -lfusedgrpo -ldl \
         -Wl,--no-undefined -Wl,-rpath,"$full_dir" >"$out/jax_ffi_build.txt" 2>&1; then
    echo "gpu_test: the JAX handler did not build:" | tee "$log"
    tail -20 "$out/jax_ffi_build.txt" | tee -a "$log"
    jax_rc=1
    return
  fi
  run_logged 240 "$log" env PYTHONPATH="$PWD/python" PYTHONDONTWRITEBYTECODE=1 \
    FUSEDGRPO_LIBRARY="$full_dir/libfusedgrpo.so" FUSEDGRPO_CUDA_LIBRARY="$cuda_lib" \
    FUSEDGRPO_JAX_FFI_LIBRARY="$full_dir/libfusedgrpo_jax_ffi.so" \
    "$py" tests/python/test_jax_cuda.py
  jax_rc=$rc
}

# bench_cuda_api at T = 8192 and 32768 (rc in $rc; 77: skipped). Writes
# OUTDIR/bench_api.json and OUTDIR/bench_api.txt.
run_bench_api() {
  if [ "$full_ok" -ne 1 ]; then
    echo "gpu_test: the whole project did not build: bench_cuda_api not run" | tee "$out/bench_api_run.txt"
    rc=1
    return
  fi
  run_logged 240 "$out/bench_api_run.txt" env FUSEDGRPO_CUDA_LIBRARY="$cuda_lib" \
    "$full_dir/cuda/bench_cuda_api" --out "$out" --tokens 8192,32768 --budgets 512M,1G,2G,3G
}

if [ "$test_rc" -eq 77 ]; then
  echo "gpu_test: test_cuda skipped (no usable GPU); memcheck and the benchmarks are skipped too"
  step "test_cuda_api"
  run_api 120 "$out/test_cuda_api.txt"
  api_rc=$rc
  [ "$api_rc" -ne 0 ] && [ "$api_rc" -ne 77 ] && failed=1
  step "Python: tests/python/test_device_backends.py (its CUDA tests skip)"
  run_python_tests
  [ "$py_rc" -ne 0 ] && failed=1
  step "Python: tests/python/test_trl_gpu.py (skips)"
  run_trl_tests
  [ "$trl_rc" -ne 0 ] && failed=1
  step "Python: tests/python/test_torch_distributed_nccl.py (its NCCL tests skip)"
  run_nccl_tests
  [ "$nccl_rc" -ne 0 ] && failed=1
  step "bench_cuda_api (skips without a device)"
  run_bench_api
  [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && failed=1
  echo "gpu_test: builds $([ $failed -eq 0 ] && echo ok || echo FAILED), GPU tests skipped" \
       "(test_cuda rc $test_rc, test_cuda_api rc $api_rc, pytest rc $py_rc," \
       "trl pytest rc $trl_rc, nccl pytest rc $nccl_rc, bench_cuda_api rc $rc), ${SECONDS}s"
  exit $failed
fi

step "test_cuda under compute-sanitizer memcheck"
sanitizer=$(command -v compute-sanitizer || true)
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -z "$sanitizer" ] && [ -x "$c" ] && sanitizer=$c
done
skip_memcheck=0
[ "${FG_GPU_SKIP_MEMCHECK:-0}" = 1 ] && skip_memcheck=1
if [ "$skip_memcheck" -eq 1 ]; then
  echo "gpu_test: FG_GPU_SKIP_MEMCHECK=1: skipped"
elif [ -n "$sanitizer" ]; then
  run_logged 90 "$out/test_cuda_memcheck.txt" "$sanitizer" --tool memcheck --error-exitcode 3 \
    "$build/test_cuda"
  # A run stopped by the time limit (or not started) says nothing about
  # memory errors.
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 125 ] && [ "$rc" -ne 137 ] && failed=1
  tail -3 "$out/test_cuda_memcheck.txt"
else
  echo "compute-sanitizer not found: skipped"
fi

step "test_cuda_api (the C API's CUDA path against its CPU path)"
run_api 120 "$out/test_cuda_api.txt"
api_rc=$rc
[ "$api_rc" -ne 0 ] && failed=1

step "test_cuda_api under compute-sanitizer memcheck"
if [ "$skip_memcheck" -eq 1 ]; then
  echo "gpu_test: FG_GPU_SKIP_MEMCHECK=1: skipped"
elif [ -n "$sanitizer" ] && [ "$full_ok" -eq 1 ]; then
  run_api 120 "$out/test_cuda_api_memcheck.txt" "$sanitizer" --tool memcheck --error-exitcode 3
  # A run stopped by the time limit (or not started) says nothing about
  # memory errors.
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 125 ] && [ "$rc" -ne 137 ] && failed=1
  tail -3 "$out/test_cuda_api_memcheck.txt"
else
  echo "compute-sanitizer not found, or no test_cuda_api: skipped"
fi

step "Python: tests/python/test_device_backends.py (the torch op on CUDA tensors)"
run_python_tests
[ "$py_rc" -ne 0 ] && [ "$py_rc" -ne 125 ] && failed=1

step "Python: tests/python/test_trl_gpu.py (FusedGRPOTrainer against TRL's GRPOTrainer on the GPU)"
run_trl_tests
[ "$trl_rc" -ne 0 ] && [ "$trl_rc" -ne 125 ] && failed=1

step "Python: tests/python/test_torch_distributed_nccl.py (torch_distributed on CUDA tensors over NCCL)"
run_nccl_tests
[ "$nccl_rc" -ne 0 ] && [ "$nccl_rc" -ne 125 ] && failed=1

step "Python: tests/python/test_jax_cuda.py (the JAX handler's CUDA targets)"
if [ "${FG_GPU_SKIP_JAX:-0}" = 1 ]; then
  echo "gpu_test: FG_GPU_SKIP_JAX=1: skipped"
else
  run_jax_tests
  [ "$jax_rc" -ne 0 ] && [ "$jax_rc" -ne 77 ] && [ "$jax_rc" -ne 125 ] && failed=1
fi

summary() {
  step "summary"
  grep -E "^(FAIL|[0-9]+ checks)" "$out/test_cuda.txt" "$out/test_cuda_api.txt"
  [ -f "$out/pytest_device.txt" ] && tail -1 "$out/pytest_device.txt"
  [ -f "$out/pytest_trl_gpu.txt" ] && tail -1 "$out/pytest_trl_gpu.txt"
  [ -f "$out/pytest_nccl.txt" ] && tail -1 "$out/pytest_nccl.txt"
  [ ${#not_run[@]} -gt 0 ] && echo "gpu_test: not run (deadline ${deadline}s): ${not_run[*]}"
  echo "gpu_test: test_cuda rc $test_rc, test_cuda_api rc $api_rc, pytest rc $py_rc," \
       "trl pytest rc $trl_rc, nccl pytest rc ${nccl_rc:-not run}, jax rc ${jax_rc:-not run};" \
       "$([ $failed -eq 0 ] && echo passed || echo FAILED) in ${SECONDS}s; output in $out"
  exit $failed
}

if [ "${FG_GPU_SKIP_BENCH:-0}" = 1 ]; then
  echo "gpu_test: FG_GPU_SKIP_BENCH=1: no benchmark"
  summary
fi

# A benchmark that crashes or runs past its limit fails the run; one the
# deadline left unstarted (rc 125) is listed in the summary.
step "bench_cuda_api (the C API's fused step, T = 8192 and 32768)"
if [ "${FG_GPU_SKIP_API_BENCH:-0}" = 1 ]; then
  echo "gpu_test: FG_GPU_SKIP_API_BENCH=1: skipped"
else
  run_bench_api
  [ "$rc" -ne 0 ] && [ "$rc" -ne 125 ] && failed=1
fi

step "peers benchmark (bench/peers/gpu_peers.sh${FG_PEERS_TOKENS:+, T = $FG_PEERS_TOKENS})"
if [ -f bench/peers/gpu_peers.sh ]; then
  mkdir -p "$out/peers"
  # gpu_peers.sh sizes its own deadline from FG_GPU_PEERS_LIMIT (15 s less):
  # it gets the limit this step runs under, the deadline's cut included.
  peers_limit=$(limit_for "${FG_GPU_PEERS_LIMIT:-240}")
  run_logged "${FG_GPU_PEERS_LIMIT:-240}" "$out/peers_run.txt" env \
    FUSEDGRPO_LIBRARY="$full_dir/libfusedgrpo.so" FUSEDGRPO_CUDA_LIBRARY="$cuda_lib" \
    FG_GPU_PEERS_LIMIT="$peers_limit" bash bench/peers/gpu_peers.sh "$out/peers"
  [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && [ "$rc" -ne 125 ] && failed=1
else
  echo "bench/peers/gpu_peers.sh not found: skipped"
fi

if [ "${FG_GPU_SKIP_PIECES:-0}" = 1 ]; then
  step "bench_cuda (the pieces of a step)"
  echo "gpu_test: FG_GPU_SKIP_PIECES=1: skipped"
else
  step "bench_cuda, N = 8192 (the pieces of a step)"
  run_logged 100 "$out/bench.txt" "$build/bench_cuda" "$out/bench.json" 8192
  [ "$rc" -ne 0 ] && [ "$rc" -ne 125 ] && failed=1

  step "bench_cuda, N = 32768"
  run_logged 100 "$out/bench_32768.txt" "$build/bench_cuda" "$out/bench_32768.json" 32768
  [ "$rc" -ne 0 ] && [ "$rc" -ne 125 ] && failed=1
fi

summary
