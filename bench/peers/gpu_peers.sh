#!/usr/bin/env bash
# The peers' benchmark on a CUDA device (bench/peers/run_peers.py --device cuda):
#   bash bench/peers/gpu_peers.sh OUTDIR
# B=1, H=4096, V=151936, bf16, dapo with beta=0.04 and reference log-probs, at
# T=8192 and T=32768; every peer in its own process, a time limit for each and
# one for the whole run. Writes OUTDIR/peers.md and OUTDIR/peers.json (both
# rewritten after every row, so a run cut short keeps what it measured).
#
# - The peers' pure-Python wheels come from .gpu-carry/wheels
#   (bench/peers/carry_wheels.sh fills it here; FG_PEERS_WHEELS names another
#   folder): liger-kernel 0.8.5, cut-cross-entropy 25.1.1, trl 1.16 (of which
#   run_peers.py runs one file, trl/kernels/chunked_logprob.py, with stubs for
#   the three names it takes from transformers and trl's trainer: a GPU
#   machine has no transformers, accelerate, datasets or pyarrow), and
#   packaging where the machine lacks it. They go into a temporary folder on
#   PYTHONPATH (pip --target, or unzipped where pip is missing).
# - fusedgrpo: python/ on PYTHONPATH; FUSEDGRPO_LIBRARY and
#   FUSEDGRPO_CUDA_LIBRARY as set by the caller (scripts/gpu_test.sh sets
#   both), else from the full build folder FG_GPU_FULL_BUILD (or
#   FG_GPU_FULL_BUILD_DIR; default build-gpu-full): its libfusedgrpo.so and
#   cuda/libfusedgrpo_cuda.so.
# - Time: FG_PEERS_DEADLINE seconds for the whole run, else 15 s less than
#   FG_GPU_PEERS_LIMIT (scripts/gpu_test.sh's limit for this script, 150 s
#   when unset: so 135 s by default; FG_GPU_PEERS_LIMIT=240 gives 225 s, our
#   estimate of what every row needs on an H200); FG_PEERS_TIMEOUT seconds per
#   peer (default 60; compilation, autotuning and JIT warm-ups count). A peer
#   that would start with under 10 s left is a row "not run"; the headline
#   shape's rows run first. Triton's and Inductor's caches are shared by the
#   run's processes.
# - FG_PEERS_TOKENS: the T to run, comma-separated (default 8192,32768; say
#   32768 alone, for a run that gives the long shape the whole time limit).
# Without a CUDA device it prints "skipped: no CUDA device" and exits 0.
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ $# -ne 1 ]; then
  echo "usage: bash bench/peers/gpu_peers.sh OUTDIR" >&2
  exit 2
fi
out=$1
py=${PYTHON:-python3}
start=$SECONDS

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "skipped: no CUDA device"
  exit 0
fi
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "skipped: no CUDA device (torch sees none)"
  exit 0
fi
mkdir -p "$out"

full=${FG_GPU_FULL_BUILD:-${FG_GPU_FULL_BUILD_DIR:-build-gpu-full}}
case $full in /*) ;; *) full=$PWD/$full ;; esac
export FUSEDGRPO_LIBRARY=${FUSEDGRPO_LIBRARY:-$full/libfusedgrpo.so}
export FUSEDGRPO_CUDA_LIBRARY=${FUSEDGRPO_CUDA_LIBRARY:-$full/cuda/libfusedgrpo_cuda.so}
for lib in "$FUSEDGRPO_LIBRARY" "$FUSEDGRPO_CUDA_LIBRARY"; do
  [ -f "$lib" ] || echo "gpu_peers: $lib not found: the fusedgrpo rows will say why they failed"
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
site=$tmp/site
mkdir -p "$site"
wheels=${FG_PEERS_WHEELS:-$PWD/.gpu-carry/wheels}
want=(liger-kernel==0.8.5 cut-cross-entropy==25.1.1 "trl>=1.16,<1.17")
"$py" -c 'import packaging.version' 2>/dev/null || want+=(packaging)
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  if "$py" -m pip --version >/dev/null 2>&1; then
    "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps \
      --find-links "$wheels" --target "$site" "${want[@]}" 2>&1 | grep -v "^WARNING: Running pip as" \
      || true
  else
    # pure-Python wheels are zip files that import from their unpacked tree
    "$py" - "$site" "$wheels" "${want[@]}" <<'PY'
import glob, os, re, sys, zipfile
site, wheels, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
for spec in wanted:
    name = re.split(r"[=<>]", spec)[0].replace("-", "_")
    found = sorted(glob.glob(os.path.join(wheels, name + "-*.whl")))
    if found:
        zipfile.ZipFile(found[-1]).extractall(site)
    else:
        print(f"gpu_peers: no wheel for {spec} in {wheels}")
PY
  fi
  echo "gpu_peers: from $wheels: $(ls "$site" | grep -v '\.dist-info$' | tr '\n' ' ')"
else
  echo "gpu_peers: no wheels in $wheels (bash bench/peers/carry_wheels.sh fills it):" \
       "Liger, CCE and TRL rows will say they are unavailable"
fi

export PYTHONPATH=$PWD/python:$site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1
export TRITON_CACHE_DIR=$tmp/triton TORCHINDUCTOR_CACHE_DIR=$tmp/inductor
export XLA_PYTHON_CLIENT_PREALLOCATE=false

deadline=${FG_PEERS_DEADLINE:-$(( ${FG_GPU_PEERS_LIMIT:-150} - 15 ))}
deadline=$((deadline - (SECONDS - start)))
echo "gpu_peers: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1);" \
     "run limit ${deadline}s, ${FG_PEERS_TIMEOUT:-60}s a peer"
"$py" bench/peers/run_peers.py --device cuda --batch 1 --seq-len "${FG_PEERS_TOKENS:-8192,32768}" \
  --hidden 4096 --vocab 151936 --dtype bfloat16 --loss-type dapo --beta 0.04 --reps 5 --warmup 2 \
  --timeout "${FG_PEERS_TIMEOUT:-60}" --deadline "$deadline" --out "$out"
rc=$?
echo "gpu_peers: rc $rc in $((SECONDS - start))s; $out/peers.md, $out/peers.json"
exit $rc
