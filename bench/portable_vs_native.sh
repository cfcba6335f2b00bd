#!/usr/bin/env bash
# The portable build (baseline x86-64 + run-time dispatch, the default) against
# a -march=native build of the same tree, in one run: for each dtype, the
# native tool then the portable tool, fused and materialized, steps=5 after a
# warm-up. Prints p50 [min, max] per build and the portable/native ratio, the
# CPU model and the ISA oneDNN dispatched. JSON lines in OUT.
#   CONFIG=configs/scaled_t2048.yaml DTYPES="float32 bfloat16" bash bench/portable_vs_native.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/scaled_t2048.yaml}
DTYPES=${DTYPES:-"float32 bfloat16"}
SETS=${SETS:-}
OUT=${OUT:-bench/results/portable_vs_native}
mkdir -p "$OUT"
bash scripts/setup.sh >/dev/null
cmake -S . -B build-native -G Ninja -DCMAKE_BUILD_TYPE=Release -DFG_NATIVE=ON -DFG_BUILD_TESTS=OFF >/dev/null
cmake --build build-native >/dev/null

cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
isa=$(ONEDNN_VERBOSE=1 ./build/tools/fusedgrpo bench --config configs/tiny.yaml --set steps=1 \
        --impls fused 2>&1 | grep -o 'isa:[^,]*' | head -1 || true)
echo "CPU: $cpu; oneDNN $isa; config $CONFIG $SETS"
for dt in $DTYPES; do
  for build in native portable; do
    tool=build/tools/fusedgrpo
    [ "$build" = native ] && tool=build-native/tools/fusedgrpo
    json="$OUT/${build}_${dt}.jsonl"
    rm -f "$json"
    # shellcheck disable=SC2086
    "$tool" bench --config "$CONFIG" --set dtype="$dt" --set steps=5 --set warmup=1 \
      --set roofline_reps=0 $SETS --impls fused,baseline --json "$json" >/dev/null
  done
done
python3 - "$OUT" $DTYPES <<'PY'
import json, sys
out, dtypes = sys.argv[1], sys.argv[2:]
def load(b, dt):
    return {r["impl"]: r for r in map(json.loads, open(f"{out}/{b}_{dt}.jsonl"))}
print("| dtype | impl | native p50 s [min, max] | portable p50 s [min, max] | portable / native |")
print("| --- | --- | --- | --- | --- |")
for dt in dtypes:
    n, p = load("native", dt), load("portable", dt)
    for impl in ("fused", "baseline"):
        a, b = n[impl], p[impl]
        f = lambda r: f'{r["step_s_p50"]:.3f} [{r["step_s_min"]:.3f}, {r["step_s_max"]:.3f}]'
        print(f'| {dt} | {impl} | {f(a)} | {f(b)} | {b["step_s_p50"] / a["step_s_p50"]:.3f} |')
PY
