#!/usr/bin/env bash
# Copies this machine's oneDNN into .gpu-carry/onednn/{include,lib} so that
# the GPU machine (which has no oneDNN) can build the whole project with the
# CUDA backend: scripts/gpu_test.sh passes DNNL_INCLUDE_DIR / DNNL_LIBRARY
# from there, and LD_LIBRARY_PATH for the run. The folder travels with the
# device tool's `carry` (64 MiB at most; this is ~41 MB):
#   bash scripts/gpu_carry.sh
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
echo "gpu_carry: $(du -sh .gpu-carry | cut -f1) in .gpu-carry (headers from $header, $base)"
