#!/usr/bin/env bash
# The CPU fused step of a git revision (before, default 51b4590) against this
# working tree's build (after), processes alternating: every round runs
# bench/ab_tools.sh once per H (before f32, after f32, before bf16, after bf16;
# the order swapped every other round), fused impl, default budget. Pools the
# warm steps of all rounds per side: median [min, max] ms, after / before of
# the medians (gate: <= LIMIT at every shape), the pair ratios (a round's after
# median over its before median), the time outside the products (call - GEMM).
#   bash bench/driver_ab.sh                       # T=2048, H=1024 2048, V=151936
#   BEFORE=<rev> AFTER_REV=<rev> ROUNDS=2 T=64 HIDDENS=64 V=1000 OUT=/tmp/x bash bench/driver_ab.sh
# BEFORE and AFTER_REV are built (tool only, Release, no CUDA, no tests; FG_NATIVE
# and FG_MPI as AFTER_BUILD's cache has them) from `git archive` under $AB_TMP;
# without AFTER_REV, after is AFTER_BUILD's tool (default build/, configured as
# scripts/setup.sh does when absent), rebuilt first. ROUNDS processes per side
# and shape, STEPS warm steps each after the cold one. FUSEDGRPO_BF16_PRODUCTS
# pins the bf16 products choice for both sides (default native where the CPU has
# AVX-512 BF16, so that no process's timing probe flips it; "" leaves it to the
# probe). Raw JSON, logs, machine.txt and table.md in OUT. Exit 1 if a shape's
# ratio is over LIMIT.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${BEFORE:-51b4590}
AFTER_REV=${AFTER_REV:-}
AFTER_BUILD=${AFTER_BUILD:-build}
T=${T:-2048}
HIDDENS=${HIDDENS:-"1024 2048"}
V=${V:-151936}
DTYPES=${DTYPES:-"float32 bfloat16"}
ROUNDS=${ROUNDS:-5}
STEPS=${STEPS:-1}
LIMIT=${LIMIT:-1.01}
AB_TMP=${AB_TMP:-/tmp/fg_ab}
isa=avx2
grep -qw avx512_bf16 /proc/cpuinfo && isa=avx512_bf16
OUT=${OUT:-bench/results/one_driver/$isa}
if [ -z "${FUSEDGRPO_BF16_PRODUCTS+set}" ] && [ "$isa" = avx512_bf16 ]; then
  export FUSEDGRPO_BF16_PRODUCTS=native
fi
[ -n "${FUSEDGRPO_BF16_PRODUCTS:-}" ] || unset FUSEDGRPO_BF16_PRODUCTS
mkdir -p "$OUT" "$AB_TMP"
OUT=$(cd "$OUT" && pwd)
rm -rf "$OUT"/r[0-9]*_h* "$OUT/table.md"  # a previous run's rounds

cache_opt() { sed -n "s/^$1:[A-Z]*=//p" "$AFTER_BUILD/CMakeCache.txt" 2>/dev/null | head -1; }
native=OFF; mpi=ON
if [ -z "$AFTER_REV" ]; then
  [ -f "$AFTER_BUILD/CMakeCache.txt" ] ||
    cmake -S . -B "$AFTER_BUILD" -G Ninja -DCMAKE_BUILD_TYPE="${FG_BUILD_TYPE:-Release}" >/dev/null
  native=$(cache_opt FG_NATIVE); mpi=$(cache_opt FG_MPI)
  [ "$(cache_opt CMAKE_BUILD_TYPE)" = Release ] || echo "driver_ab: $AFTER_BUILD is not a Release build" >&2
fi
build_rev() {  # build_rev REV: the tool of REV's tree, built once under $AB_TMP; prints its path
  local rev dir
  rev=$(git rev-parse --short=12 "$1^{commit}")
  dir=$AB_TMP/$rev-native$native-mpi$mpi
  if [ ! -x "$dir/build/tools/fusedgrpo" ]; then
    rm -rf "$dir" && mkdir -p "$dir/src"
    git archive "$rev" | tar -x -C "$dir/src"
    echo "driver_ab: building $rev in $dir" >&2
    { cmake -S "$dir/src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFG_NATIVE="$native" \
        -DFG_MPI="$mpi" -DFG_CUDA=OFF -DFG_BUILD_TESTS=OFF &&
      cmake --build "$dir/build" --target fusedgrpo_cli; } >"$dir/build.log" 2>&1 ||
      { tail -30 "$dir/build.log" >&2; echo "driver_ab: $rev did not build ($dir/build.log)" >&2; return 1; }
  fi
  echo "$dir/build/tools/fusedgrpo"
}
A=$(build_rev "$BEFORE")
if [ -n "$AFTER_REV" ]; then
  B=$(build_rev "$AFTER_REV"); after_desc="$(git rev-parse --short=12 "$AFTER_REV^{commit}") ($B)"
else
  cmake --build "$AFTER_BUILD" --target fusedgrpo_cli >"$OUT/after_build.log" 2>&1 ||
    { tail -30 "$OUT/after_build.log" >&2; echo "driver_ab: $AFTER_BUILD did not build" >&2; exit 2; }
  B=$(cd "$AFTER_BUILD" && pwd)/tools/fusedgrpo
  src=$(cache_opt CMAKE_HOME_DIRECTORY)
  if git -C "$src" rev-parse -q --verify HEAD >/dev/null 2>&1; then
    after_desc="tree $src at $(git -C "$src" rev-parse --short=12 HEAD), sha1 of its diff $(git -C "$src" diff HEAD | sha1sum | cut -c1-12) ($B); changed: $(git -C "$src" status --short | tr -s ' \n' ' ')"
  else
    after_desc="tree $src, not a git checkout ($B)"
  fi
fi
{
  echo "date: $(date -u +%FT%TZ)"
  echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), family $(lscpu | sed -n 's/^CPU family: *//p'), model $(lscpu | sed -n 's/^Model: *//p'), $(nproc) cpus"
  echo "oneDNN: $(dpkg-query -W -f='${Version}' libdnnl-dev 2>/dev/null || echo '?'), $(ONEDNN_VERBOSE=1 "$B" bench --config configs/tiny.yaml --set steps=1 --impls fused 2>&1 | grep -o 'isa:[^,]*' | head -1 || true)"
  echo "FUSEDGRPO_BF16_PRODUCTS=${FUSEDGRPO_BF16_PRODUCTS:-unset, each process times its own choice}"
  echo "before: $(git rev-parse --short=12 "$BEFORE^{commit}") ($A)"
  echo "after: $after_desc"
  echo "build: Release, FG_NATIVE=$native, FG_MPI=$mpi"
  echo "shapes: T=$T, H in {$HIDDENS}, V=$V, {$DTYPES}; fused, default budget; $ROUNDS rounds x $STEPS warm steps a process"
  echo "load before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT/machine.txt"

for r in $(seq 1 "$ROUNDS"); do
  for h in $HIDDENS; do
    d=$OUT/r${r}_h$h
    if [ $((r % 2)) = 1 ]; then x=$A; y=$B; labels="before after"; else x=$B; y=$A; labels="after before"; fi
    echo "round $r/$ROUNDS, H=$h: $labels" >&2
    A=$x B=$y LABELS=$labels OUT=$d DTYPES=$DTYPES IMPLS=fused CONFIG=configs/scaled_t2048.yaml \
      SETS="--set seq_len=$T --set hidden=$h --set vocab=$V --set memory_budget=0 --set steps=$STEPS" \
      bash bench/ab_tools.sh >"$d.log" 2>&1 || { cat "$d.log" >&2; exit 2; }
  done
done
echo "load after the run: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$OUT/machine.txt"

python3 - "$OUT" "$T" "$V" "$LIMIT" "$ROUNDS" "$HIDDENS" $DTYPES <<'PY' | tee "$OUT/table.md"
import json, statistics as st, sys
out, T, V, limit, rounds, hiddens, dtypes = *sys.argv[1:4], float(sys.argv[4]), int(sys.argv[5]), sys.argv[6].split(), sys.argv[7:]
rd = lambda p: json.loads(open(p).readline())
ms = lambda x: f"{x * 1e3:.{1 if x >= 0.1 else 3}f}"
mr = lambda xs: f"{ms(st.median(xs))} [{ms(min(xs))}, {ms(max(xs))}]"
plan = lambda j: f'{j["chunks"]} x {j["fused_chunk_rows"]}/{j["fused_later_chunk_rows"]}'
print(f"| shape (T={T}, V={V}) | dtype | before median [min, max] ms | after median [min, max] ms "
      f"| after / before | pair ratios median [min, max] | outside products ms, before / after | chunks x rows b / a |")
print("| --- | --- | --- | --- | ---: | --- | --- | --- |")
ok = True
for h in hiddens:
    for dt in dtypes:
        s = {side: [rd(f"{out}/r{r}_h{h}/{side}_{dt}.jsonl") for r in range(1, rounds + 1)] for side in ("before", "after")}
        steps = {k: [t for j in v for t in j["step_s"]] for k, v in s.items()}
        ratio = st.median(steps["after"]) / st.median(steps["before"])
        pairs = [st.median(a["step_s"]) / st.median(b["step_s"]) for a, b in zip(s["after"], s["before"])]
        rest = {k: ms(st.median(j["call_s_mean"] - j["gemm_s_mean"] for j in v)) for k, v in s.items()}
        ok &= ratio <= limit
        flag = "" if ratio <= limit else " **over**"
        print(f'| H={h} | {dt} | {mr(steps["before"])} | {mr(steps["after"])} | {ratio:.3f}{flag} '
              f'| {st.median(pairs):.3f} [{min(pairs):.3f}, {max(pairs):.3f}] '
              f'| {rest["before"]} / {rest["after"]} | {plan(s["before"][0])} / {plan(s["after"][0])} |')
print(f"\n{'PASS' if ok else 'FAIL'}: after / before of the medians <= {limit} at every shape"
      f" ({rounds} processes a side and shape, {len(steps['before'])} warm steps a side)")
sys.exit(0 if ok else 1)
PY
