#!/usr/bin/env bash
# Downloads (PyPI) the pure-Python wheels the peers' benchmark needs on a GPU
# machine that has PyTorch, Triton, JAX and NumPy but no package registry:
#   bash bench/peers/carry_wheels.sh [DEST]      # DEST default .gpu-carry/wheels
# scripts/gpu_carry.sh calls it; bench/peers/gpu_peers.sh installs from DEST.
#
# The smallest set, found by importing each peer with only the GPU machine's
# packages on the path (torch, triton, jax and their own dependencies):
# - liger-kernel 0.8.5 and cut-cross-entropy 25.1.1: import with torch and
#   triton alone;
# - trl 1.16: run_peers.py runs its one file trl/kernels/chunked_logprob.py
#   (ChunkedLogProbFunction) on its own, with stubs for the three names it
#   takes from transformers and trl.trainer (run_peers.load_trl_chunked_logprob);
#   TRL's loss is its formulas (run_peers.torch_grpo_loss). So neither
#   transformers (~12 MB), accelerate, datasets nor pyarrow (~40 MB, binary)
#   travels;
# - packaging: chunked_logprob.py imports packaging.version (gpu_peers.sh
#   installs it only where the machine lacks it).
# Prints the wheels' total size and refuses more than 20 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-.gpu-carry/wheels}
py=${PYTHON:-python3}
mkdir -p "$dest"
specs=("liger-kernel==0.8.5" "cut-cross-entropy==25.1.1" "trl==1.16.*" "packaging")
"$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  -d "$dest" "${specs[@]}"

# Which files are the peers': the newest wheel of each name.
files=()
for name in liger_kernel cut_cross_entropy trl packaging; do
  f=$(ls "$dest"/"$name"-*.whl 2>/dev/null | sort -V | tail -1)
  if [ -z "$f" ]; then
    echo "carry_wheels: no $name wheel in $dest" >&2
    exit 1
  fi
  files+=("$f")
done
# The one TRL file the benchmark runs must be in the wheel.
"$py" - "${files[2]}" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["trl/kernels/chunked_logprob.py", "trl/trainer/utils.py"]
missing = [n for n in need if n not in names]
if missing:
    sys.exit(f"carry_wheels: {sys.argv[1]} lacks {missing}")
PY
bytes=$(cat "${files[@]}" | wc -c)
echo "carry_wheels: $(for f in "${files[@]}"; do printf '%s (%d KiB) ' "$(basename "$f")" \
     $(( $(wc -c <"$f") / 1024 )); done)"
echo "carry_wheels: the peers' wheels take $((bytes / 1024)) KiB" \
     "($(awk -v b="$bytes" 'BEGIN{printf "%.2f", b / 1048576}') MiB); $dest holds" \
     "$(du -sk "$dest" | cut -f1) KiB"
if [ "$bytes" -gt $((20 * 1024 * 1024)) ]; then
  echo "carry_wheels: more than 20 MiB: too much to carry beside oneDNN" >&2
  exit 1
fi
