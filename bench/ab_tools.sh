#!/usr/bin/env bash
# Two builds of the tool against each other in one run: for each dtype, A then
# B, fused and materialized, 5 warm steps after one warm-up. Prints p50
# [min, max] per build, the B/A ratio, the library's GEMM and non-GEMM time,
# the CPU model and the ISA oneDNN dispatched. JSON lines in OUT.
#   A=path/to/fusedgrpo B=build/tools/fusedgrpo LABELS="before after" \
#   CONFIG=configs/scaled_t2048.yaml DTYPES="float32 bfloat16" bash bench/ab_tools.sh
# bench/portable_vs_native.sh calls it with a -march=native build as A.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${A:?A=tool binary}" "${B:?B=tool binary}"
read -r LA LB <<<"${LABELS:-A B}"
CONFIG=${CONFIG:-configs/scaled_t2048.yaml}
DTYPES=${DTYPES:-"float32 bfloat16"}
IMPLS=${IMPLS:-fused,baseline}
SETS=${SETS:-}
OUT=${OUT:-bench/results/ab}
mkdir -p "$OUT"
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
isa=$(ONEDNN_VERBOSE=1 "$B" bench --config configs/tiny.yaml --set steps=1 --impls fused 2>&1 |
      grep -o 'isa:[^,]*' | head -1 || true)
echo "CPU: $cpu; oneDNN $isa; config $CONFIG $SETS; A=$LA ($A) B=$LB ($B)"
for dt in $DTYPES; do
  for side in A B; do
    tool=$A; label=$LA
    [ "$side" = B ] && { tool=$B; label=$LB; }
    json="$OUT/${label}_${dt}.jsonl"
    rm -f "$json"
    # shellcheck disable=SC2086
    "$tool" bench --config "$CONFIG" --set dtype="$dt" --set steps=5 --set warmup=1 \
      --set roofline_reps=0 $SETS --impls "$IMPLS" --json "$json" >/dev/null
  done
done
python3 - "$OUT" "$LA" "$LB" $DTYPES <<'PY'
import json, sys
out, la, lb, dtypes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def load(b, dt):
    return {r["impl"]: r for r in map(json.loads, open(f"{out}/{b}_{dt}.jsonl"))}
f = lambda r: f'{r["step_s_p50"]:.3f} [{r["step_s_min"]:.3f}, {r["step_s_max"]:.3f}]'
g = lambda r: f'{r["gemm_s_mean"]:.2f} / {r["call_s_mean"] - r["gemm_s_mean"]:.3f}'
print(f"| dtype | impl | {la} p50 s [min, max] | {lb} p50 s [min, max] | {lb} / {la} "
      f"| GEMM / other s, {la} | GEMM / other s, {lb} |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for dt in dtypes:
    a, b = load(la, dt), load(lb, dt)
    for impl in [i for i in ("fused", "baseline") if i in a and i in b]:
        x, y = a[impl], b[impl]
        print(f'| {dt} | {impl} | {f(x)} | {f(y)} | {y["step_s_p50"] / x["step_s_p50"]:.3f} '
              f'| {g(x)} | {g(y)} |')
PY
