#!/usr/bin/env bash
# The GPU benchmarks scripts/gpu_test.sh has no time for, after it, on the
# same warm machine:
#   bash scripts/gpu_bench.sh OUTDIR
#
# Parts (FG_BENCH_PARTS, default "graph long real"), each within its own limit
# and none started past FG_BENCH_DEADLINE seconds (default 540):
#   graph  bench/cuda/torch_graph.py --out OUTDIR/graph: at the headline shape
#          (T = 8192), the torch op's device-reported call captured with
#          torch.cuda.graph and replayed, against the C API's step (ctypes,
#          host-checked), the eager torch op and the three bare products, in
#          one process. No model needed. Limit FG_BENCH_GRAPH_LIMIT (120 s).
#   long   long context: build-gpu-full/cuda/bench_cuda_api --tokens
#          131072,262144 --budgets 2G (the CUDA backend's default budget)
#          --lean --no-f32 --no-waits --no-graph --reps 5, into OUTDIR/long: the three
#          bare products (over row slices where [N, V] does not fit), the
#          fused step dense and filtered, working memory per row. No model
#          needed. Limit FG_BENCH_LONG_LIMIT (default 300 s).
#   real   real activations: SmolLM2-135M-Instruct samples 128 completions of
#          256 tokens on the GPU (bench/capture_smollm2.py --device cuda, 32768
#          tokens, into a temporary folder: the capture is ~190 MB, more than
#          the device tool brings back), then bench/cuda/real_acts.py: the three bare
#          products, the fused step dense and filtered ("auto"), the share of
#          dlogits kept and the filter's error against the unfiltered call
#          with the spec's bound, into OUTDIR/real. Needs the model stash
#          (scripts/gpu_model_stash.sh, as scripts/gpu_train.sh; skipped
#          without it). Limit FG_BENCH_REAL_LIMIT (default 240 s).
#
# FG_BENCH_GRAPH_ARGS: more arguments of torch_graph.py (a dry run on the
# CPU: "--quick --tokens 64").
# FG_BENCH_DEVICE (cuda; cpu for a dry run of graph and real where no GPU is) and
# FG_BENCH_CAPTURE (the capture's size, default "--prompts 16 --generations 8
# --tokens 256") change the real part.
# The device tool, with the stash: here, bash scripts/gpu_model_carry.sh;
# call 1 carry [".gpu-model-a"], bash scripts/gpu_model_stash.sh .gpu-model-a;
# call 2 carry [".gpu-model-b"],
#   bash scripts/gpu_model_stash.sh .gpu-model-b && bash scripts/gpu_bench.sh "$OUT"
# (without the stash, FG_BENCH_PARTS=long needs no carry but .gpu-carry's
# oneDNN where build-gpu-full is not built yet).
# Libraries: FUSEDGRPO_LIBRARY / FUSEDGRPO_CUDA_LIBRARY where set, else
# FG_GPU_FULL_BUILD_DIR (default build-gpu-full, scripts/gpu_test.sh's whole
# build; configured here where no run made it), targets fusedgrpo,
# fusedgrpo_cuda and bench_cuda_api (scripts/gpu_env.sh). Exit status 0
# when every part that ran passed (a part skipped for want of a device or
# the stash passes), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

if [ $# -ne 1 ]; then
  echo "usage: bash scripts/gpu_bench.sh OUTDIR" >&2
  exit 2
fi
mkdir -p "$1"
out=$(cd "$1" && pwd)
tag=gpu_bench
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh
read -r -a parts <<<"${FG_BENCH_PARTS:-graph long real}"
deadline=${FG_BENCH_DEADLINE:-540}
py=${PYTHON:-python3}
status=0
rcs=()

step() { printf '\n== %s (at %ds)\n' "$1" "$SECONDS"; }

# Runs "$@" within LIMIT seconds or what the deadline leaves, its output also
# into LOG; rc in $rc (125: not started, the deadline is near).
run_part() {
  local limit=$1 log=$2 left=$((deadline - SECONDS - 5))
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "$tag: not run, FG_BENCH_DEADLINE=${deadline}s is near: $*" | tee "$log"
    rc=125
    return
  fi
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "$tag: stopped after ${limit}s: $*"
}

step "machine"
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
  else
    echo "gpu: nvidia-smi not found"
  fi
} | tee "$out/machine.txt"

gpu_onednn
[ -z "${FUSEDGRPO_LIBRARY:-}" ] && step "build ($build_full: fusedgrpo, fusedgrpo_cuda, bench_cuda_api)"
gpu_libraries fusedgrpo fusedgrpo_cuda bench_cuda_api || exit 1
bench_api=$build_full/cuda/bench_cuda_api

for part in "${parts[@]}"; do
  case $part in
  long)
    step "long context: bench_cuda_api, T = 131072 and 262144"
    if [ ! -x "$bench_api" ]; then
      echo "$tag: no $bench_api (FUSEDGRPO_LIBRARY set without the build folder): long not run"
      rcs+=("long:1")
      status=1
      continue
    fi
    run_part "${FG_BENCH_LONG_LIMIT:-300}" "$out/long_run.txt" env \
      FUSEDGRPO_CUDA_LIBRARY="$cuda_lib" "$bench_api" --out "$out/long" \
      --tokens 131072,262144 --budgets 2G --lean --no-f32 --no-waits --no-graph --reps 5
    rcs+=("long:$rc")
    [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && [ "$rc" -ne 125 ] && status=1
    ;;
  graph)
    step "the torch op in a CUDA graph against the C API, T = 8192"
    if [ -z "${tmp:-}" ]; then
      gpu_python || exit 1
    fi
    read -r -a graph_args <<<"${FG_BENCH_GRAPH_ARGS:-}"
    run_part "${FG_BENCH_GRAPH_LIMIT:-120}" "$out/graph_run.txt" "$py" bench/cuda/torch_graph.py \
      --out "$out/graph" --device "${FG_BENCH_DEVICE:-cuda}" "${graph_args[@]}"
    rcs+=("graph:$rc")
    [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && [ "$rc" -ne 125 ] && status=1
    ;;
  real)
    step "real activations: SmolLM2-135M-Instruct's completions, 32768 tokens"
    if [ ! -f "$model/complete" ]; then
      echo "$tag: $model holds no complete model (scripts/gpu_model_stash.sh with both parts" \
           "on this machine): real not run" | tee "$out/real_run.txt"
      rcs+=("real:skipped")
      continue
    fi
    if [ -z "${tmp:-}" ]; then
      gpu_python || exit 1
    fi
    cap=$tmp/capture
    read -r -a size <<<"${FG_BENCH_CAPTURE:---prompts 16 --generations 8 --tokens 256}"
    run_part "${FG_BENCH_REAL_LIMIT:-240}" "$out/real_run.txt" bash -c '
      set -o pipefail
      "$0" bench/capture_smollm2.py --out "$1" --device "$4" --cache "$2/cache" "${@:5}" &&
      "$0" bench/cuda/real_acts.py --inputs "$1" --out "$3" --device "$4"' \
      "$py" "$cap" "$model" "$out/real" "${FG_BENCH_DEVICE:-cuda}" "${size[@]}"
    rcs+=("real:$rc")
    [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && [ "$rc" -ne 125 ] && status=1
    ;;
  *)
    echo "$tag: unknown part $part (FG_BENCH_PARTS: graph, long, real)"
    status=1
    ;;
  esac
done

step "summary"
[ -f "$out/graph/torch_graph.md" ] && cat "$out/graph/torch_graph.md"
[ -f "$out/long/bench_api.txt" ] && cat "$out/long/bench_api.txt"
[ -f "$out/real/real_acts.md" ] && cat "$out/real/real_acts.md"
echo "$tag: ${rcs[*]}; $([ $status -eq 0 ] && echo passed || echo FAILED) in ${SECONDS}s; output in $out"
exit $status
