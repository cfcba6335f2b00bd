#!/usr/bin/env bash
# The C library on the other x86-64 CPU family: the `fusedgrpo` tool's gradcheck
# (against the float64 oracle, configs/tiny.yaml: smallest budget, most chunks)
# of every path (fused, materialized baseline, logits-level; float32, bfloat16;
# bf16-rounded logits; sequence level; every loss type) run under
# `qemu-x86_64 -cpu Haswell`, an emulated AVX2-only CPU: the default build must
# run there (baseline x86-64 with run-time dispatch), and oneDNN must pick its
# AVX2 kernels (its ISA line is printed, from ONEDNN_VERBOSE).
#   FG_BUILD_DIR=build    the CMake build whose tools/fusedgrpo is tested
#                         (scripts/setup.sh builds ./build when it is missing)
#   FG_QEMU_CPU=Haswell   the emulated CPU model
#   FG_QEMU_C_TESTS="test_paths test_edges test_logprobs test_bf16_grads"   C test programs of $FG_BUILD_DIR/tests
#                         also run under qemu (every path and dtype against the
#                         oracle, and the budget edges, whose GEMM scratch depends
#                         on the ISA oneDNN picks); "" runs none. Unset, and
#                         oneDNN reports the same ISA natively as under qemu (an
#                         AVX2 host: ctest has just run them on that ISA, and
#                         they took 5 min emulated), none run. They run with
#                         FG_TEST_QUICK=1: test_paths keeps every path, dtype,
#                         loss type, level, option set and shape in 32 of its
#                         352 cases (the full run took 1,917 s emulated on an
#                         AVX-512 Xeon; natively it runs whole in ctest)
#   FG_QEMU_TIMEOUT=300   seconds allowed to each emulated run: past it the run
#                         fails (status 124) rather than holding CI
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/qemu_env.sh

build="${FG_BUILD_DIR:-build}"
tool="$build/tools/fusedgrpo"
if [ ! -x "$tool" ]; then
  if [ "$build" = build ]; then
    bash scripts/setup.sh
  else
    echo "qemu_test: $tool not found (build $build first)" >&2
    exit 1
  fi
fi
fg_qemu_setup
start_all=$SECONDS
export FG_QEMU_TIMEOUT="${FG_QEMU_TIMEOUT:-300}"   # fg_qemu: each emulated run bounded
# One emulated run; past $FG_QEMU_TIMEOUT seconds it fails with status 124.
fg_qemu_timed() {
  local rc=0
  fg_qemu "$@" || rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "qemu_test: timed out after ${FG_QEMU_TIMEOUT}s (FG_QEMU_TIMEOUT; status $rc)" >&2
  fi
  return $rc
}
config=configs/tiny.yaml

# oneDNN's dispatch, natively and emulated: the same binary, two ISAs.
isa_line() { grep -E "^(onednn|dnnl)_verbose,info,cpu,isa" | head -n 1; }
echo "qemu_test: native CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
native_isa="$(ONEDNN_VERBOSE=1 DNNL_VERBOSE=1 "$tool" gradcheck --config "$config" | isa_line || true)"
echo "qemu_test: native:              ${native_isa:-no oneDNN isa line}"
rc=0
out="$(ONEDNN_VERBOSE=1 DNNL_VERBOSE=1 fg_qemu "$tool" gradcheck --config "$config" 2>&1)" || rc=$?
if [ $rc -ne 0 ]; then
  echo "$out" | grep -v "_verbose,exec" >&2 || true
  fg_qemu_hint $rc "$build"
  echo "qemu_test: FAILED: $tool does not run on a $FG_QEMU_CPU CPU (status $rc)" >&2
  exit 1
fi
qemu_isa="$(echo "$out" | isa_line || true)"
echo "qemu_test: qemu -cpu $FG_QEMU_CPU: ${qemu_isa:-no oneDNN isa line}"
case "$qemu_isa" in
  *AVX2*) ;;
  *) echo "qemu_test: FAILED: oneDNN did not report AVX2 under -cpu $FG_QEMU_CPU" >&2; exit 1 ;;
esac

# Each run: key=value pairs for --set (as the tool tests in tests/tool/CMakeLists.txt).
runs=()
for impl in baseline logits fused; do
  for dtype in float32 bfloat16; do
    runs+=("impl=$impl dtype=$dtype")
  done
done
runs+=("impl=baseline dtype=bfloat16 round_logits=true")
for dtype in float32 bfloat16; do
  runs+=("impl=fused dtype=$dtype importance_sampling_level=sequence is_ratio=sequence")
done
for lt in grpo bnpo dr_grpo dapo luspo cispo sapo; do
  runs+=("impl=fused dtype=bfloat16 loss_type=$lt")
done

failed=0
for r in "${runs[@]}"; do
  args=(gradcheck --config "$config")
  for kv in $r; do args+=(--set "$kv"); done
  t0=$(date +%s.%N)
  rc=0
  out="$(fg_qemu_timed "$tool" "${args[@]}" 2>&1)" || rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if [ $rc -eq 0 ] && echo "$out" | grep -q PASS && ! echo "$out" | grep -q FAIL; then
    printf 'qemu_test: PASS  %-76s %5ss\n' "$r" "$secs"
  else
    printf 'qemu_test: FAIL  %-76s status %s\n' "$r" "$rc"
    echo "  \$ qemu-x86_64 -cpu $FG_QEMU_CPU $tool ${args[*]}"
    echo "$out" | sed 's/^/  /'
    fg_qemu_hint $rc "$build"
    failed=$((failed + 1))
  fi
done

# C tests under qemu (status 77: skipped).
# test_threads is left out by default: it checks thread-count invariance, which
# does not depend on the ISA, and took 199 s emulated (add it back through
# FG_QEMU_C_TESTS).
ctests="${FG_QEMU_C_TESTS-test_paths test_edges test_logprobs test_bf16_grads}"
if [ -z "${FG_QEMU_C_TESTS+set}" ] && [ -n "$native_isa" ] && [ "$native_isa" = "$qemu_isa" ]; then
  echo "qemu_test: the C tests are not run under qemu: this CPU's native ISA is the emulated one" \
       "($qemu_isa), and ctest ran them natively (FG_QEMU_C_TESTS=... runs them)"
  ctests=""
fi
for t in $ctests; do
  if [ ! -x "$build/tests/$t" ]; then
    echo "qemu_test: SKIP  $t (not built: $build has FG_BUILD_TESTS=OFF?)"
    continue
  fi
  t0=$SECONDS
  rc=0
  out="$(FG_TEST_QUICK=1 fg_qemu_timed "$build/tests/$t" 2>&1)" || rc=$?
  if [ $rc -eq 0 ] || [ $rc -eq 77 ]; then
    printf 'qemu_test: %s  %-20s %s (%ss)\n' "$([ $rc -eq 0 ] && echo PASS || echo SKIP)" "$t" \
      "$(echo "$out" | tail -n 1)" "$((SECONDS - t0))"
  else
    echo "qemu_test: FAIL  $t (status $rc); its last 60 lines:"
    echo "$out" | tail -n 60 | sed 's/^/  /'
    fg_qemu_hint $rc "$build"
    failed=$((failed + 1))
  fi
done

if [ $failed -ne 0 ]; then
  echo "qemu_test: $failed of ${#runs[@]} gradcheck runs and C tests FAILED under qemu -cpu $FG_QEMU_CPU" >&2
  exit 1
fi
echo "qemu_test: all ${#runs[@]} gradcheck runs${ctests:+ and $ctests} passed under qemu -cpu $FG_QEMU_CPU in $((SECONDS - start_all))s"
