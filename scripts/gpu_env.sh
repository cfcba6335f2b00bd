# Sourced by scripts/gpu_train.sh and scripts/gpu_bench.sh from the
# repository root: the libraries and the Python environment a GPU run after
# scripts/gpu_model_stash.sh needs. The caller sets, before sourcing:
#   out          the run's output folder (build.txt goes there)
#   tag          the name its messages start with
# and before calling gpu_python, py (the Python interpreter). Sourcing sets
#   model        FG_MODEL_DIR (default /tmp/fg-model), the stash (its onednn/
#                and site/)
#   build_full   FG_GPU_FULL_BUILD_DIR (default build-gpu-full, scripts/
#                gpu_test.sh's whole build), made absolute
# The caller then calls, in order:
#   gpu_onednn                  oneDNN: the stash's, else .gpu-carry/onednn
#                               (scripts/gpu_carry.sh); its lib/ on
#                               LD_LIBRARY_PATH; sets $onednn ("" when none)
#   gpu_libraries TARGET...     sets $lib and $cuda_lib: FUSEDGRPO_LIBRARY and
#                               FUSEDGRPO_CUDA_LIBRARY where set, else
#                               $build_full's libfusedgrpo.so and
#                               cuda/libfusedgrpo_cuda.so, the TARGETs built
#                               there (configured as scripts/gpu_test.sh's
#                               whole-project build where that folder is not
#                               configured yet, for sm_90a + PTX only: a build
#                               of the same folder with other flags would
#                               rebuild everything). Returns 1 when it cannot.
#   gpu_python                  PYTHONPATH: python/, then the interpreter's
#                               own sys.path, then $model/site (the machine's
#                               torch, transformers and accelerate win; only
#                               what it lacks comes from the site), the
#                               libraries, offline Hugging Face and Triton
#                               caches in a temporary folder ($tmp, removed at
#                               exit). Returns 1 when the interpreter does not
#                               start.

model=${FG_MODEL_DIR:-/tmp/fg-model}
build_full=${FG_GPU_FULL_BUILD_DIR:-build-gpu-full}
case $build_full in /*) ;; *) build_full=$PWD/$build_full ;; esac

gpu_onednn() {
  onednn=""
  local d
  for d in "$model/onednn" "$PWD/.gpu-carry/onednn"; do
    if [ -f "$d/lib/libdnnl.so.2" ]; then onednn=$d; break; fi
  done
  [ -n "$onednn" ] && export LD_LIBRARY_PATH="$onednn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  return 0
}

gpu_libraries() {
  if [ -n "${FUSEDGRPO_LIBRARY:-}" ]; then
    lib=$FUSEDGRPO_LIBRARY
    cuda_lib=${FUSEDGRPO_CUDA_LIBRARY:-}
    echo "libraries from the environment: $lib${cuda_lib:+ $cuda_lib}"
    return 0
  fi
  local nvcc_path generator=() start=$SECONDS
  nvcc_path=$(command -v nvcc || true)
  [ -z "$nvcc_path" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc_path=/usr/local/cuda/bin/nvcc
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  if [ ! -f "$build_full/CMakeCache.txt" ]; then
    if [ -z "$nvcc_path" ] || [ -z "$onednn" ]; then
      echo "$tag: cannot build: nvcc ${nvcc_path:-not found}, oneDNN ${onednn:-not found}" >&2
      return 1
    fi
    if ! cmake -S . -B "$build_full" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
           -DCMAKE_CUDA_COMPILER="$nvcc_path" -DCMAKE_CUDA_ARCHITECTURES="90a-real;90-virtual" \
           -DFG_CUDA=ON -DFG_CUDA_WERROR=OFF -DFG_BUILD_TOOLS=OFF -DFG_BUILD_TESTS=OFF -DFG_MPI=OFF \
           -DDNNL_INCLUDE_DIR="$onednn/include" -DDNNL_LIBRARY="$onednn/lib/libdnnl.so" \
           >"$out/build.txt" 2>&1; then
      tail -30 "$out/build.txt"
      echo "$tag: configuring failed (build.txt)" >&2
      return 1
    fi
  fi
  if ! timeout --kill-after=10 300 cmake --build "$build_full" -j "$(nproc)" \
         --target "$@" >>"$out/build.txt" 2>&1; then
    tail -40 "$out/build.txt"
    echo "$tag: building failed (build.txt)" >&2
    return 1
  fi
  echo "built in $((SECONDS - start))s"
  lib=$build_full/libfusedgrpo.so
  cuda_lib=$build_full/cuda/libfusedgrpo_cuda.so
}

gpu_python() {
  local machine
  if ! machine=$("$py" -c 'import os, sys; print(os.pathsep.join(p for p in sys.path if p))'); then
    echo "$tag: $py does not start" >&2
    return 1
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  export PYTHONPATH=$PWD/python:$machine:$model/site
  export FUSEDGRPO_LIBRARY=$lib
  [ -n "$cuda_lib" ] && export FUSEDGRPO_CUDA_LIBRARY=$cuda_lib
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=$tmp/hf TRITON_CACHE_DIR=$tmp/triton
  export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1
}
