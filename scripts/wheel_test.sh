#!/usr/bin/env bash
# Wheel portability: the release wheel (scripts/build_wheel.sh: `pip wheel .`,
# then `auditwheel repair`, oneDNN and the OpenMP runtime bundled, a manylinux
# tag) must install and pass the NumPy front end's tests against the float64
# reference (tests/python/test_numpy.py, test_install.py) where nothing else of
# this project's build is present:
#   1. the wheel: its tag (py3-none-manylinux_*) and its bundled libraries;
#      where nvcc is found (build_wheel.sh then builds with FG_CUDA=ON), the
#      CUDA backend libfusedgrpo_cuda.so, and never a CUDA library bundled;
#   2. natively, in a clean root that debootstrap makes from Debian's packages
#      (python3 and python3-venv, i.e. Python and pip, and nothing else: no
#      oneDNN, no OpenMP runtime, no compiler, checked): the wheel, numpy and
#      pytest (downloaded here, installed there with --no-index) in a venv;
#      every library the package loads resolves inside the wheel or to the
#      root's glibc, libstdc++ and libgcc_s (ldd), but the CUDA backend's
#      libcudart and libcublasLt, which are not found there (no CUDA: the
#      package must import and serve the CPU, and refuse the CUDA backend with
#      FG_ERR_UNSUPPORTED, test_install.py); then the tests, and the JAX
#      handler's tests with jax installed from PyPI's wheels when the wheel
#      carries the handler (it does when jax is importable by the build);
#   3. under `qemu-x86_64 -cpu Haswell` (an AVX2-only CPU, no AVX-512), which a
#      wheel compiled for the build machine's CPU fails with SIGILL, in a venv
#      of the build machine.
# oneDNN's dispatched ISA is printed for both CPUs (ONEDNN_VERBOSE).
#   PYTHON=python3.11       the interpreter that builds the wheel and the qemu venv
#   FG_QEMU_CPU=Haswell     the emulated CPU model
#   FG_WHEEL_PIP_ARGS="..." extra `pip wheel` arguments, e.g.
#                           "-C cmake.define.FG_NATIVE=ON" (which must fail under qemu)
#   FG_WHEEL_ROOT=DIR       where the clean root is kept between runs (made once,
#                           never written to after: each run works in DIR/fg-wheel-test,
#                           removed at exit); default /var/cache/fusedgrpo/wheel-root-SUITE
#   FG_WHEEL_ROOT_SUITE=bookworm   the Debian release of the clean root (Debian 12:
#                           glibc 2.36, Python 3.11)
#   FG_WHEEL_KEEP=1         keep the work directory (wheel, venv) and print it
# Needs root (or sudo) for debootstrap and chroot. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/qemu_env.sh

py="${PYTHON:-python3}"
command -v "$py" >/dev/null || py=python
start_all=$SECONDS
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"

# System packages: the build deps (scripts/setup.sh), qemu-user, debootstrap.
if ! dpkg -s libdnnl-dev >/dev/null 2>&1 || ! command -v cmake >/dev/null; then
  bash scripts/setup.sh
fi
fg_qemu_setup
if ! command -v debootstrap >/dev/null && [ ! -x /usr/sbin/debootstrap ]; then
  echo "wheel_test: installing debootstrap"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq debootstrap >/dev/null
fi

suite="${FG_WHEEL_ROOT_SUITE:-bookworm}"
root="${FG_WHEEL_ROOT:-/var/cache/fusedgrpo/wheel-root-$suite}"
work="$(mktemp -d "${TMPDIR:-/tmp}/fusedgrpo-wheel-test.XXXXXX")"
in_root="$root/fg-wheel-test"  # this run's files inside the clean root
cleanup() {
  if mountpoint -q "$root/proc" 2>/dev/null; then $sudo umount "$root/proc" || true; fi
  $sudo rm -rf "$in_root"
  [ "${FG_WHEEL_KEEP:-0}" = 1 ] || rm -rf "$work"
}
trap cleanup EXIT
[ "${FG_WHEEL_KEEP:-0}" = 1 ] && echo "wheel_test: keeping $work"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
unset FUSEDGRPO_LIBRARY FUSEDGRPO_JAX_FFI_LIBRARY FUSEDGRPO_CUDA_LIBRARY

# 1. The release wheel, from a clean CMake build directory of its own (not the
# persistent build/python-* of `pip install .`, whose cached options, e.g. a
# -C cmake.define.FG_NATIVE=ON given once, would carry over).
t=$SECONDS
wheel="$(PYTHON="$py" bash scripts/build_wheel.sh "$work/wheelhouse" | tail -n 1)"
echo "wheel_test: built $(basename "$wheel") in $((SECONDS - t))s; contents:"
# build_wheel.sh's condition for FG_CUDA=ON (FG_WHEEL_PIP_ARGS may set it otherwise).
cuda_expected=no
case " ${FG_WHEEL_PIP_ARGS:-} " in
  *FG_CUDA=ON*) cuda_expected=yes ;;
  *FG_CUDA=*) ;;
  *) if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then cuda_expected=yes; fi ;;
esac
info="$("$py" - "$wheel" "$cuda_expected" <<'EOF'
import re, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
for n in names:
    if not n.endswith((".py", "RECORD", "METADATA", "WHEEL")):
        print("  " + n, file=sys.stderr)
fail = []
if not re.search(r"-py3-none-manylinux_2_\d+_x86_64\.whl$", sys.argv[1]):
    fail.append("its tag is not py3-none-manylinux_2_X_x86_64")
fail += [f"it lacks {n}" for n in ("fusedgrpo/libfusedgrpo.so.0", "fusedgrpo/include/fusedgrpo.h",
                                    "fusedgrpo/__init__.py", "fusedgrpo/_lib.py", "fusedgrpo/jax.py")
         if n not in names]
fail += [f"it does not bundle {lib}" for lib in ("libdnnl", "libgomp")
         if not any(n.startswith("fusedgrpo.libs/" + lib) for n in names)]
cuda = "fusedgrpo/libfusedgrpo_cuda.so" in names
if sys.argv[2] == "yes" and not cuda:
    fail.append("it lacks fusedgrpo/libfusedgrpo_cuda.so (nvcc is here: build_wheel.sh asked for it)")
# The CUDA runtime and cuBLASLt are the GPU machine's, never the wheel's.
fail += [f"it bundles {n}" for n in names
         if n.startswith(("fusedgrpo.libs/libcudart", "fusedgrpo.libs/libcublas",
                          "fusedgrpo.libs/libcuda"))]
if fail:
    sys.exit("wheel_test: the wheel is wrong: " + "; ".join(fail))
print("yes" if "fusedgrpo/libfusedgrpo_jax_ffi.so" in names else "no", "yes" if cuda else "no")
EOF
)"
read -r handler cuda <<<"$info"
echo "wheel_test: JAX FFI handler in the wheel: $handler; CUDA backend: $cuda"
# test_install.py then checks the installed backend (beside the library, its RUNPATH).
expect_cuda=0
[ "$cuda" = yes ] && expect_cuda=1

# The CUDA backend's architectures: an image for every GPU from Ampere on and
# PTX for the newest (cuda/CMakeLists.txt), unless FG_WHEEL_PIP_ARGS chose
# others. cuobjdump is the CUDA toolkit's, or the one in triton's wheel.
if [ "$cuda" = yes ]; then
  cuobjdump="$(command -v cuobjdump || true)"
  [ -z "$cuobjdump" ] && [ -x /usr/local/cuda/bin/cuobjdump ] && cuobjdump=/usr/local/cuda/bin/cuobjdump
  [ -z "$cuobjdump" ] && cuobjdump="$("$py" -c "import os, triton; p = os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/cuobjdump'); print(p if os.access(p, os.X_OK) else '')" 2>/dev/null || true)"
  if [ -n "$cuobjdump" ]; then
    "$py" -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('fusedgrpo/libfusedgrpo_cuda.so'))" \
      "$wheel" "$work/libfusedgrpo_cuda.so"
    archs() { { "$cuobjdump" "$1" "$work/libfusedgrpo_cuda.so" 2>&1 || true; } |
              sed -n 's/.*\.\(sm_[0-9a-z]*\)\.[a-z]*$/\1/p' | sort -u | tr '\n' ' '; }
    elf="$(archs --list-elf)"; ptx="$(archs --list-ptx)"
    echo "wheel_test: CUDA backend images: ${elf:-none read}; PTX: ${ptx:-none read} ($cuobjdump)"
    # cuda/CMakeLists.txt's default: Blackwell from nvcc 12.8 on
    nvcc_bin="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
    want_elf="sm_80 sm_86 sm_89 sm_90a" want_ptx=sm_90
    if "$nvcc_bin" --version | grep -qE "release (1[3-9]|12\.(8|9))"; then
      want_elf="$want_elf sm_100 sm_120" want_ptx=sm_120
    fi
    if [ -z "$elf" ]; then
      echo "wheel_test: this cuobjdump read no image of the backend: its architectures are not checked"
    elif [[ " ${FG_WHEEL_PIP_ARGS:-} " != *CMAKE_CUDA_ARCHITECTURES=* ]]; then
      for a in $want_elf; do
        [[ " $elf " == *" $a "* ]] || { echo "wheel_test: the CUDA backend lacks $a" >&2; exit 1; }
      done
      [[ " $ptx " == *" $want_ptx "* ]] || { echo "wheel_test: the CUDA backend lacks $want_ptx PTX" >&2; exit 1; }
    fi
  else
    echo "wheel_test: no cuobjdump here: the CUDA backend's architectures are not listed"
  fi
fi

# 2. The clean root: made once, then only read (each run's files go to $in_root).
if [ ! -x "$root/usr/bin/python3" ]; then
  echo "wheel_test: debootstrap --variant=minbase --include=python3,python3-venv $suite $root"
  t=$SECONDS
  $sudo rm -rf "$root.partial"
  $sudo mkdir -p "$(dirname "$root")"
  $sudo debootstrap --variant=minbase --include=python3,python3-venv "$suite" "$root.partial" \
    >"$work/debootstrap.log" 2>&1 || { tail -n 20 "$work/debootstrap.log"; exit 1; }
  $sudo mv "$root.partial" "$root"
  echo "wheel_test: clean root made in $((SECONDS - t))s"
fi
in_chroot() {  # in_chroot [NAME=VALUE...] 'COMMAND': in $in_root, with nothing of this environment
  local vars=()
  while [ $# -gt 1 ]; do vars+=("$1"); shift; done
  $sudo env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "${vars[@]}" \
    /usr/sbin/chroot "$root" /bin/sh -c "cd /fg-wheel-test && $1"
}
# Nothing of the build machine's: no oneDNN, no OpenMP runtime, no compiler.
present=""
for f in "$root"/usr/lib/x86_64-linux-gnu/lib{dnnl,gomp}* "$root"/usr/bin/{cc,gcc,x86_64-linux-gnu-gcc}*; do
  [ -e "$f" ] && present+=" ${f#"$root"/}"
done
if [ -n "$present" ]; then
  echo "wheel_test: the clean root $root is not clean: $present" >&2
  exit 1
fi
rpy="$($sudo /usr/sbin/chroot "$root" /usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
echo "wheel_test: clean root $root: Debian $suite, Python $rpy," \
     "$($sudo /usr/sbin/chroot "$root" ldd --version | head -n 1)"
$sudo rm -rf "$in_root"
$sudo mkdir -p "$in_root/wheels" "$in_root/tests"
$sudo cp "$wheel" "$in_root/wheels/"
$sudo cp -r tests/python "$in_root/tests/"
t=$SECONDS
pkgs=(numpy pytest)
[ "$handler" = yes ] && pkgs+=("jax==$("$py" -c 'import jax; print(jax.__version__)')")
"$py" -m pip download -q --only-binary=:all: --python-version "$rpy" -d "$work/deps" "${pkgs[@]}"
$sudo cp "$work"/deps/*.whl "$in_root/wheels/"
# A mounted /proc, as on any real system.
$sudo mount -t proc proc "$root/proc" 2>/dev/null || echo "wheel_test: (no /proc in the clean root)"
in_chroot "python3 -m venv venv && venv/bin/pip install -q --no-index --find-links wheels fusedgrpo pytest"
echo "wheel_test: clean root venv ready in $((SECONDS - t))s"

# Every library the package and its bundled libraries load, as the root's
# dynamic linker resolves them: inside the wheel, or the root's C and C++ runtime;
# the CUDA backend's CUDA runtime and cuBLASLt are not there (no CUDA in the root).
cat >"$work/deps.sh" <<'EOF'
site="$(venv/bin/python -c 'import fusedgrpo, os; print(os.path.dirname(os.path.dirname(fusedgrpo.__file__)))')"
bad=0
for so in "$site"/fusedgrpo/*.so* "$site"/fusedgrpo.libs/*.so*; do
  echo "  ${so#"$site"/}:"
  ldd "$so" | while read -r name arrow path rest; do
    case "${so##*/} $name" in
      "libfusedgrpo_cuda.so libcudart.so."*|"libfusedgrpo_cuda.so libcublasLt.so."*)
        echo "    $name: the CUDA backend's, not the wheel's (a GPU machine's; here: $path $rest)"
        continue ;;
    esac
    case "$arrow $path" in
      "=> $site"/*) echo "    $name: in the wheel" ;;
      "=> /lib/x86_64-linux-gnu/"*|"=> /usr/lib/x86_64-linux-gnu/"*)
        case "$name" in
          libc.so.6|libm.so.6|libstdc++.so.6|libgcc_s.so.1|libpthread.so.0|libdl.so.2|librt.so.1)
            echo "    $name: the system's C/C++ runtime" ;;
          *) echo "    $name: the SYSTEM's $path (not bundled)"; exit 1 ;;
        esac ;;
      "=> not") echo "    $name: NOT FOUND"; exit 1 ;;
    esac
  done || bad=1
done
exit $bad
EOF
$sudo cp "$work/deps.sh" "$in_root/"
if ! in_chroot "sh deps.sh"; then
  echo "wheel_test: FAILED: the installed package loads a library the wheel does not bundle" >&2
  exit 1
fi

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
# The bf16-gradient bound's 48 cases (numerics of the same sources) already ran
# in python_test.sh against the source build: one option set's three here.
select="not bf16_gradients_within or dapo-token-vespo_params"
echo "wheel_test: native CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
echo "$probe" >"$work/probe.py"
$sudo cp "$work/probe.py" "$in_root/"
in_chroot ONEDNN_VERBOSE=1 DNNL_VERBOSE=1 "venv/bin/python probe.py" | isa
echo "wheel_test: native, clean root: pytest ${tests[*]}"
t=$SECONDS
in_chroot FUSEDGRPO_EXPECT_CUDA_BACKEND="$expect_cuda" "venv/bin/python -m pytest -q -p no:cacheprovider ${tests[*]} -k '$select'"
echo "wheel_test: native tests passed in $((SECONDS - t))s"
if [ "$handler" = yes ]; then
  # The handler as a wheel's user gets it: jax from PyPI beside the wheel.
  # The handler's own calls and the sharded phases; test_jax.py's 43 cases
  # (5 min here) run against the source build in python_test.sh.
  t=$SECONDS
  in_chroot "venv/bin/pip install -q --no-index --find-links wheels jax"
  in_chroot "venv/bin/python -m pytest -q -p no:cacheprovider tests/python/test_jax.py -k \
    'backend_is_the_ffi_handler or call_totals or aux_metrics or bfloat16_inputs or vocab_axis_bfloat16'"
  echo "wheel_test: JAX handler tests passed in $((SECONDS - t))s"
fi

# 3. Under qemu, in a venv of the build machine (the real interpreter binary
# behind the venv's symlinks is fine: qemu runs bin/python with argv[0] kept,
# so Python finds pyvenv.cfg). The per-call overhead test times the front end
# and means nothing emulated.
t=$SECONDS
if ! "$py" -m venv "$work/venv" >/dev/null 2>&1; then
  # Debian's own python3 makes venvs only with python3-venv (ensurepip).
  echo "wheel_test: $py -m venv failed; installing python3-venv"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >/dev/null
  rm -rf "$work/venv"
  "$py" -m venv "$work/venv"
fi
vpy="$work/venv/bin/python"
"$vpy" -m pip install -q numpy pytest "$wheel"
echo "wheel_test: build machine's venv ready in $((SECONDS - t))s"
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
FUSEDGRPO_EXPECT_CUDA_BACKEND="$expect_cuda" fg_qemu "$vpy" -m pytest -q -p no:cacheprovider "${tests[@]}" -k "$select" || rc=$?
if [ $rc -ne 0 ]; then
  fg_qemu_hint $rc
  echo "wheel_test: FAILED under qemu -cpu $FG_QEMU_CPU (status $rc)" >&2
  exit 1
fi
echo "wheel_test: qemu tests passed in $((SECONDS - t))s"
echo "wheel_test: all passed in $((SECONDS - start_all))s"
