#!/usr/bin/env bash
# Fills .gpu-carry, the folder a GPU machine gets beside the working tree
# (the device tool's `carry`, 64 MiB at most with the tree; this script
# refuses more than 60 MiB):
#   bash scripts/gpu_carry.sh
# - .gpu-carry/onednn/{include,lib} (~41 MB): this machine's oneDNN, so that
#   the GPU machine (which has none) can build the whole project with the
#   CUDA backend: scripts/gpu_test.sh passes DNNL_INCLUDE_DIR / DNNL_LIBRARY
#   from there, and LD_LIBRARY_PATH for the run.
# - .gpu-carry/wheels (~4 MB): pure-Python wheels from PyPI for gpu_test.sh's
#   Python tests on a machine without a package registry: pytest and its
#   dependencies (used where the machine has no pytest), and datasets 5.2
#   with dill and multiprocess, which tests/python/test_trl_gpu.py needs
#   beside TRL (a GPU machine has torch, transformers, accelerate, pyarrow,
#   pandas and xxhash, but no trl, datasets, dill or multiprocess);
#   bench/peers/carry_wheels.sh, where it exists, adds the peers' wheels,
#   TRL's among them. gpu_test.sh puts them on the path after the machine's
#   own packages, so that only what the machine lacks comes from here.
# Headers: oneapi/dnnl/ (1 MB). Library: libdnnl.so.2.6 once, libdnnl.so.2
# and libdnnl.so as symlinks beside it (gpu_test.sh makes them again if a
# transfer dropped them), and libOpenCL.so.1, which libdnnl.so.2 needs and a
# GPU machine may lack.
set -euo pipefail
cd "$(dirname "$0")/.."

dest=.gpu-carry/onednn
header=""
for d in /usr/include /usr/local/include; do
  [ -f "$d/oneapi/dnnl/dnnl.h" ] && header=$d && break
done
if [ -z "$header" ]; then
  header=$(find / -path /proc -prune -o -path '*/oneapi/dnnl/dnnl.h' -print 2>/dev/null | head -1)
  header=${header%/oneapi/dnnl/dnnl.h}
fi
if [ -z "$header" ]; then
  echo "gpu_carry: oneapi/dnnl/dnnl.h not found" >&2
  exit 1
fi
lib=/usr/lib/x86_64-linux-gnu/libdnnl.so.2.6
if [ ! -f "$lib" ]; then
  lib=$(readlink -f /usr/lib/x86_64-linux-gnu/libdnnl.so.2 2>/dev/null || true)
fi
if [ -z "$lib" ] || [ ! -f "$lib" ]; then
  echo "gpu_carry: libdnnl.so.2 not found" >&2
  exit 1
fi

rm -rf "$dest"
mkdir -p "$dest/include/oneapi" "$dest/lib"
cp -r "$header/oneapi/dnnl" "$dest/include/oneapi/"
cp "$lib" "$dest/lib/"
base=$(basename "$lib")
ln -s "$base" "$dest/lib/libdnnl.so.2"
ln -s libdnnl.so.2 "$dest/lib/libdnnl.so"
ocl=$(readlink -f /lib/x86_64-linux-gnu/libOpenCL.so.1 2>/dev/null || true)
if [ -n "$ocl" ] && [ -f "$ocl" ]; then
  cp "$ocl" "$dest/lib/libOpenCL.so.1"
fi
echo "gpu_carry: oneDNN: headers from $header, $base"

# pytest 9 needs pluggy, iniconfig, packaging and pygments (exceptiongroup and
# tomli only below Python 3.11); all are py3-none-any wheels.
wheels=.gpu-carry/wheels
rm -rf "$wheels"
mkdir -p "$wheels"
if ! python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
       -d "$wheels" pytest pluggy iniconfig packaging pygments; then
  echo "gpu_carry: downloading the pytest wheels failed" >&2
  exit 1
fi

# datasets and the two packages of its requirements that a GPU machine lacks
# (the others, Requires-Dist of datasets 5.2: filelock, numpy, pyarrow>=24,
# pandas, tqdm, xxhash, fsspec, huggingface-hub>=1.31, packaging, pyyaml, are
# in its image). The versions the CPU tests run with; Python 3.12's wheels, as
# multiprocess has one per Python version (the others are py3-none-any).
if ! python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
       --python-version 3.12 --implementation cp -d "$wheels" \
       datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19; then
  echo "gpu_carry: downloading the datasets wheels failed" >&2
  exit 1
fi
echo "gpu_carry: wheels: $(cd "$wheels" && ls | tr '\n' ' ')"

if [ -f bench/peers/carry_wheels.sh ]; then
  echo "gpu_carry: bench/peers/carry_wheels.sh"
  bash bench/peers/carry_wheels.sh
fi
# TRL itself comes from bench/peers/carry_wheels.sh (the peers' benchmark runs
# one of its files): test_trl_gpu.py needs it too.
if ! ls "$wheels"/trl-*.whl >/dev/null 2>&1; then
  if ! python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
         -d "$wheels" "trl==1.16.*"; then
    echo "gpu_carry: downloading the trl wheel failed" >&2
    exit 1
  fi
fi

kib=$(du -sk .gpu-carry | cut -f1)
echo "gpu_carry: $((kib / 1024)) MiB in .gpu-carry ($(du -sh .gpu-carry/* | tr '\t\n' ': '))"
if [ "$kib" -gt $((60 * 1024)) ]; then
  echo "gpu_carry: .gpu-carry holds more than 60 MiB: it would not travel with the tree" >&2
  exit 1
fi
