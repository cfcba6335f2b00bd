#!/usr/bin/env bash
# Wheel portability: build the wheel the way a user or a release would
# (`pip wheel . --no-deps`, pip's build isolation), install it into a fresh venv
# with only numpy and pytest, and run the NumPy front end's tests against the
# float64 reference (tests/python/test_numpy.py, test_install.py) twice:
# natively, and under `qemu-x86_64 -cpu Haswell` (an AVX2-only CPU, no AVX-512),
# which a wheel compiled for the build machine's CPU fails with SIGILL.
# oneDNN's dispatched ISA is printed for both runs (ONEDNN_VERBOSE).
#   PYTHON=python3.11       the interpreter that builds the wheel and makes the venv
#   FG_QEMU_CPU=Haswell     the emulated CPU model
#   FG_WHEEL_PIP_ARGS="..." extra `pip wheel` arguments, e.g.
#                           "-C cmake.define.FG_NATIVE=ON" (which must fail under qemu)
#   FG_WHEEL_KEEP=1         keep the work directory (wheel, venv) and print it
# Idempotent: everything goes into a fresh temporary directory, removed at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/qemu_env.sh

py="${PYTHON:-python3}"
command -v "$py" >/dev/null || py=python
start_all=$SECONDS

# System packages: the build deps (scripts/setup.sh) and qemu-user.
if ! dpkg -s libdnnl-dev >/dev/null 2>&1 || ! command -v cmake >/dev/null; then
  bash scripts/setup.sh
fi
fg_qemu_setup

work="$(mktemp -d "${TMPDIR:-/tmp}/fusedgrpo-wheel-test.XXXXXX")"
if [ "${FG_WHEEL_KEEP:-0}" = 1 ]; then
  echo "wheel_test: keeping $work"
else
  trap 'rm -rf "$work"' EXIT
fi
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
unset FUSEDGRPO_LIBRARY FUSEDGRPO_JAX_FFI_LIBRARY

# 1. The wheel, from a clean CMake build directory of its own (not the
# persistent build/python-* of `pip install .`, whose cached options, e.g. a
# -C cmake.define.FG_NATIVE=ON given once, would carry over).
args=(wheel -q . --no-deps -w "$work/wheelhouse" -C "build-dir=$work/build")
# shellcheck disable=SC2206  # FG_WHEEL_PIP_ARGS is a list of arguments
args+=(${FG_WHEEL_PIP_ARGS:-})
echo "wheel_test: $py -m pip ${args[*]}"
t=$SECONDS
"$py" -m pip "${args[@]}"
wheels=("$work"/wheelhouse/fusedgrpo-*.whl)
if [ ${#wheels[@]} -ne 1 ] || [ ! -f "${wheels[0]}" ]; then
  echo "wheel_test: expected one fusedgrpo wheel in $work/wheelhouse" >&2
  exit 1
fi
wheel="${wheels[0]}"
echo "wheel_test: built $(basename "$wheel") in $((SECONDS - t))s; contents:"
"$py" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
for n in names:
    if not n.endswith((".py", "RECORD", "METADATA", "WHEEL")):
        print("  " + n)
missing = [n for n in ("fusedgrpo/libfusedgrpo.so.0", "fusedgrpo/include/fusedgrpo.h",
                       "fusedgrpo/__init__.py", "fusedgrpo/_lib.py", "fusedgrpo/jax.py")
           if n not in names]
if missing:
    sys.exit(f"wheel_test: the wheel lacks {missing}")
print("  JAX FFI handler: " + ("yes" if "fusedgrpo/libfusedgrpo_jax_ffi.so" in names else
                                "no (jax was not importable by the build)"))
EOF

# 2. A fresh venv with the wheel, numpy and pytest only.
echo "wheel_test: fresh venv $work/venv: pip install numpy pytest $(basename "$wheel")"
t=$SECONDS
if ! "$py" -m venv "$work/venv" >/dev/null 2>&1; then
  # Debian's own python3 makes venvs only with python3-venv (ensurepip).
  echo "wheel_test: $py -m venv failed; installing python3-venv"
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >/dev/null
  rm -rf "$work/venv"
  "$py" -m venv "$work/venv"
fi
vpy="$work/venv/bin/python"
"$vpy" -m pip install -q numpy pytest "$wheel"
echo "wheel_test: venv ready in $((SECONDS - t))s"

probe='import fusedgrpo, numpy as np
r = np.random.default_rng(0)
fusedgrpo.fused_linear_grpo(r.standard_normal((1, 4, 8), np.float32), r.standard_normal((11, 8), np.float32),
                            np.arange(4).reshape(1, 4), np.ones((1, 4), bool), np.ones(1, np.float32))
print("library:", fusedgrpo.library_path())'
isa() {  # the oneDNN lines saying which CPU ISA it dispatched to
  grep -E "^(onednn|dnnl)_verbose,info,(cpu,isa|oneDNN|DNNL)|^library:" || {
    echo "wheel_test: no oneDNN verbose line" >&2; return 1; }
}
tests=(tests/python/test_numpy.py tests/python/test_install.py)

# 3. Natively. Run from the repo root: the tests import grpo_reference from
# tests/python; `fusedgrpo` is the venv's (python/ is not on sys.path).
echo "wheel_test: native CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
ONEDNN_VERBOSE=1 DNNL_VERBOSE=1 "$vpy" -c "$probe" | isa
echo "wheel_test: native: $vpy -m pytest ${tests[*]}"
t=$SECONDS
# The bf16-gradient bound's 48 cases (numerics of the same sources) already ran
# in python_test.sh against the source build: one option set's three here.
"$vpy" -m pytest -q -p no:cacheprovider "${tests[@]}" \
  -k "not bf16_gradients_within or dapo-token-vespo_params"
echo "wheel_test: native tests passed in $((SECONDS - t))s"

# 4. Under qemu (the real interpreter binary behind the venv's symlinks is
# fine: qemu runs bin/python with argv[0] kept, so Python finds pyvenv.cfg).
# The per-call overhead test times the front end and means nothing emulated.
echo "wheel_test: qemu -cpu $FG_QEMU_CPU: oneDNN dispatch"
rc=0
out="$(ONEDNN_VERBOSE=1 DNNL_VERBOSE=1 fg_qemu "$vpy" -c "$probe")" || rc=$?
if [ $rc -ne 0 ]; then
  echo "$out"
  fg_qemu_hint $rc
  echo "wheel_test: FAILED: the wheel does not run on a $FG_QEMU_CPU CPU (status $rc)" >&2
  exit 1
fi
echo "$out" | isa
echo "wheel_test: qemu -cpu $FG_QEMU_CPU: $vpy -m pytest ${tests[*]}"
t=$SECONDS
rc=0
# Emulated, the bf16-gradient bound (48 cases of B=7, T=61 with plan
# queries, 33 s native, ~20 min here) runs one option set's three budgets.
fg_qemu "$vpy" -m pytest -q -p no:cacheprovider "${tests[@]}" \
  -k "not bf16_gradients_within or dapo-token-vespo_params" || rc=$?
if [ $rc -ne 0 ]; then
  fg_qemu_hint $rc
  echo "wheel_test: FAILED under qemu -cpu $FG_QEMU_CPU (status $rc)" >&2
  exit 1
fi
echo "wheel_test: qemu tests passed in $((SECONDS - t))s"
echo "wheel_test: all passed in $((SECONDS - start_all))s"
