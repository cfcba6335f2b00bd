#!/usr/bin/env bash
# Robustness checks (docs/ROBUSTNESS.md). Exits non-zero on any finding.
#
#   asan      clang, ASan + UBSan (-fno-sanitize-recover=all, leaks checked):
#             the C tests (ctest -R '^test_') and the fuzz corpus replays
#             (fuzz_replay_*); with the library's fault hook compiled in when
#             src/api/internal.h has it (test_alloc_failure is skipped otherwise)
#   pyasan    the NumPy front end's tests (tests/python/test_numpy.py) on the
#             ASan library, CPython allocating through malloc (catches the
#             library writing past a ctypes or NumPy buffer); of the 48 cases
#             of the bf16-gradient bound (numerics, ~1.5 min under ASan) one
#             option set's three budgets, as under qemu
#   valgrind  gcc build, memcheck (definite leaks and every error fatal) on
#             test_api, test_bad_input, test_alloc_failure, test_edges and the
#             API corpus replay
#   tsan      clang, ThreadSanitizer with LLVM's OpenMP runtime and its Archer
#             tool (OpenMP synchronization made visible to TSan) on the
#             threaded tests; oneDNN is not instrumented (see the doc)
#   (the MPI component is built in none of these: OpenMPI's own allocations
#   and threads are not instrumented and trip LeakSanitizer/TSan; the library's
#   side of it, the collective protocol, is test_sharding / test_shard_faults)
#   fuzz      each libFuzzer target for FUZZ_SECONDS (default 20) from the
#             seed corpus in fuzz/corpus/<target>/; new inputs go to the build
#             directory, crashes to <dir>/fuzz-artifacts/
#
# Environment: FUZZ_SECONDS (20), FG_ROBUSTNESS_DIR (build-robustness),
# FG_ROBUSTNESS_STEPS (asan,pyasan,valgrind,tsan,fuzz), JOBS (2).
# The whole run takes about 6-8 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${FG_ROBUSTNESS_DIR:-$ROOT/build-robustness}
FUZZ_SECONDS=${FUZZ_SECONDS:-20}
STEPS=${FG_ROBUSTNESS_STEPS:-asan,pyasan,valgrind,tsan,fuzz}
JOBS=${JOBS:-2}
export OMP_WAIT_POLICY=PASSIVE # many tiny calls: no spinning at barriers
mkdir -p "$OUT"

summary=()
failed=0
note() { summary+=("$(printf '%-9s %-6s %5ss  %s' "$1" "$2" "$3" "$4")"); }
has_step() { [[ ",$STEPS," == *",$1,"* ]]; }

# ------------------------------------------------------------ prerequisites
need=()
command -v clang >/dev/null || need+=(clang)
command -v valgrind >/dev/null || need+=(valgrind)
command -v ninja >/dev/null || need+=(ninja-build)
command -v cmake >/dev/null || need+=(cmake)
dpkg -s libyaml-dev >/dev/null 2>&1 || need+=(libyaml-dev)
dpkg -s libdnnl-dev >/dev/null 2>&1 || need+=(libdnnl-dev)
# LLVM's OpenMP tool that tells TSan about OpenMP synchronization.
find_archer() {
  local c
  c=$(readlink -f "$(command -v clang 2>/dev/null || echo /nonexistent)" 2>/dev/null || true)
  for f in "$(dirname "$c")/../lib/libarcher.so" /usr/lib/llvm-*/lib/libarcher.so; do
    [[ -f $f ]] && { readlink -f "$f"; return; }
  done
}
if command -v clang >/dev/null; then
  [[ -f $(clang -print-file-name=libclang_rt.fuzzer-x86_64.a) ]] || need+=(libclang-rt-14-dev)
  [[ -n $(find_archer) ]] || need+=(libomp-14-dev)
else
  need+=(libclang-rt-14-dev libomp-14-dev)
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "robustness: installing ${need[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
ARCHER=$(find_archer)

# The fault hook exists once src/ has it (tests/test_alloc_failure.c).
FAULT_FLAGS=""
if grep -q "FG_FAULT_INJECTION" src/api/internal.h 2>/dev/null; then
  FAULT_FLAGS="-DFG_FAULT_INJECTION=1"
fi

configure() { # dir compiler sanitize extra-cmake-args...
  local dir=$1 cc=$2 san=$3
  shift 3
  cmake -S "$ROOT" -B "$dir" -G Ninja -DCMAKE_C_COMPILER="$cc" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DFG_SANITIZE="$san" -DFG_BUILD_TOOLS=OFF -DCMAKE_C_FLAGS="$FAULT_FLAGS" -DFG_MPI=OFF -DFG_CUDA=OFF "$@" >/dev/null
}
build() { # dir targets... (output only on failure)
  local dir=$1
  shift
  if ! cmake --build "$dir" -j"$JOBS" ${1:+--target "$@"} >"$dir/build.log" 2>&1; then
    tail -n 40 "$dir/build.log"
    echo "robustness: build in $dir failed"
    exit 1
  fi
}

# ------------------------------------------------------------------- asan
if has_step asan; then
  t0=$SECONDS
  dir=$OUT/asan
  configure "$dir" clang address,undefined -DFG_BUILD_FUZZ=ON
  build "$dir"
  log=$dir/ctest.log
  if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1:check_initialization_order=1 \
     UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     ctest --test-dir "$dir" -R '^(test_|fuzz_replay_)' --output-on-failure -j"$JOBS" >"$log" 2>&1; then
    res=ok
  else
    res=FAIL
    failed=1
  fi
  [ "$res" = ok ] && tail -n 4 "$log" || tail -n 60 "$log"
  skipped=$(grep -o '[a-z_]* \.*\*\*\*Skipped' "$log" | cut -d' ' -f1 | tr '\n' ' ' || true)
  note asan "$res" $((SECONDS - t0)) "$(grep -E 'tests passed' "$log" | head -1); skipped: ${skipped:-none}"
fi

# ----------------------------------------------------------------- pyasan
# The ctypes bindings restate the C structs by hand; a binding struct smaller
# than the C one lets the library write past a Python buffer (it happened:
# fg_memory_stats grew, the Python copy did not, and CPython crashed later in
# its garbage collector). The NumPy front end's tests run here against the
# ASan library, with CPython allocating through malloc so that every ctypes
# buffer and NumPy array has redzones.
if has_step pyasan; then
  t0=$SECONDS
  dir=$OUT/asan
  if [ ! -f "$dir/libfusedgrpo.so" ]; then
    configure "$dir" clang address,undefined -DFG_BUILD_FUZZ=ON
    build "$dir"
  fi
  log=$OUT/pyasan.log
  py="${PYTHON:-python3}"
  set +e
  if "$py" -c "import numpy, pytest" 2>/dev/null; then
    FUSEDGRPO_LIBRARY="$dir/libfusedgrpo.so" PYTHONPATH="$ROOT/python" PYTHONMALLOC=malloc \
      LD_PRELOAD="$(clang -print-file-name=libclang_rt.asan-x86_64.so)" \
      ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      "$py" -m pytest -q -p no:cacheprovider "$ROOT/tests/python/test_numpy.py" \
        -k "not bf16_gradients_within or dapo-token-vespo_params" >"$log" 2>&1
    rc=$?
  else
    echo "numpy or pytest missing: run scripts/python_test.sh first" >"$log"
    rc=1
  fi
  set -e
  if [ $rc -eq 0 ]; then
    note pyasan ok $((SECONDS - t0)) "$(tail -n 1 "$log")"
  else
    failed=1
    grep -B2 -A30 "ERROR: AddressSanitizer\|runtime error" "$log" | head -n 60 || tail -n 40 "$log"
    note pyasan FAIL $((SECONDS - t0)) "rc $rc (log: $log)"
  fi
fi

# --------------------------------------------------------------- valgrind
if has_step valgrind; then
  t0=$SECONDS
  dir=$OUT/valgrind
  configure "$dir" gcc "" -DFG_BUILD_FUZZ=ON
  build "$dir" test_api test_bad_input test_alloc_failure test_edges replay_api
  vg=(valgrind -q --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite
      --show-leak-kinds=definite --smc-check=all-non-file --num-callers=30)
  res=ok
  runs=()
  for cmd in "tests/test_api" "tests/test_bad_input" "tests/test_alloc_failure" "tests/test_edges" \
             "fuzz/replay_api $ROOT/fuzz/corpus/api"; do
    set +e
    # shellcheck disable=SC2086
    # oneDNN's AVX2 JIT GEMM kernels make memcheck report 32-byte reads just
    # past oneDNN's own buffers (masked tail loads checked as full loads):
    # oneDNN is held to AVX here (docs/ROBUSTNESS.md); no suppressions.
    (cd "$dir" && DNNL_MAX_CPU_ISA=AVX "${vg[@]}" ./$cmd) >"$dir/vg.log" 2>&1
    rc=$?
    set -e
    name=${cmd%% *}
    if [ $rc -eq 0 ] || { [ $rc -eq 77 ] && [[ $name == *test_alloc_failure ]]; }; then
      runs+=("${name##*/}:$([ $rc -eq 77 ] && echo skip || echo ok)")
    else
      runs+=("${name##*/}:FAIL($rc)")
      res=FAIL
      failed=1
      tail -n 60 "$dir/vg.log"
    fi
  done
  note valgrind "$res" $((SECONDS - t0)) "${runs[*]}"
fi

# ------------------------------------------------------------------- tsan
if has_step tsan; then
  t0=$SECONDS
  dir=$OUT/tsan
  configure "$dir" clang thread
  build "$dir" test_threads test_determinism test_sharding test_shard_faults test_api
  res=ok
  runs=()
  for t in test_threads test_determinism test_sharding test_shard_faults test_api; do
    set +e
    TSAN_OPTIONS="halt_on_error=1 exitcode=66 ignore_noninstrumented_modules=1 second_deadlock_stack=1" \
      OMP_TOOL_LIBRARIES="$ARCHER" "$dir/tests/$t" >"$dir/$t.log" 2>&1
    rc=$?
    set -e
    if [ $rc -eq 0 ] && ! grep -q "WARNING: ThreadSanitizer" "$dir/$t.log"; then
      runs+=("$t:ok")
    else
      runs+=("$t:FAIL($rc)")
      res=FAIL
      failed=1
      grep -A30 "WARNING: ThreadSanitizer" "$dir/$t.log" | head -n 60 || tail -n 30 "$dir/$t.log"
    fi
  done
  note tsan "$res" $((SECONDS - t0)) "${runs[*]}"
fi

# ------------------------------------------------------------------- fuzz
if has_step fuzz; then
  dir=$OUT/asan
  if [ ! -x "$dir/fuzz/fuzz_api" ]; then
    configure "$dir" clang address,undefined -DFG_BUILD_FUZZ=ON
    build "$dir"
  fi
  mkdir -p "$OUT/fuzz-artifacts"
  for t in api npy config; do
    t0=$SECONDS
    work=$OUT/fuzz-work/$t
    mkdir -p "$work"
    log=$OUT/fuzz-$t.log
    set +e
    ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      "$dir/fuzz/fuzz_$t" -max_total_time="$FUZZ_SECONDS" -timeout=60 -rss_limit_mb=4096 \
      -print_final_stats=1 -artifact_prefix="$OUT/fuzz-artifacts/$t-" \
      "$work" "$ROOT/fuzz/corpus/$t" >"$log" 2>&1
    rc=$?
    set -e
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
    if [ $rc -eq 0 ]; then
      note "fuzz_$t" ok $((SECONDS - t0)) "$execs executions, corpus $(ls "$work" | wc -l) new + $(ls "$ROOT/fuzz/corpus/$t" | wc -l) seeds"
    else
      failed=1
      grep -B5 -A40 "ERROR\|PROPERTY VIOLATED\|runtime error" "$log" | head -n 80 || tail -n 40 "$log"
      note "fuzz_$t" FAIL $((SECONDS - t0)) "rc $rc, input saved under $OUT/fuzz-artifacts/ (copy it to fuzz/corpus/$t/ as a regression)"
    fi
  done
fi

echo
echo "robustness summary (FUZZ_SECONDS=$FUZZ_SECONDS, fault hook: ${FAULT_FLAGS:-absent})"
printf '%s\n' "${summary[@]}"
exit $failed
