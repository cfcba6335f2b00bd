#!/usr/bin/env bash
# The measurements behind docs/BENCHMARKS.md, in the order they appear there.
# Long: about an hour on the 2-core reference machine. Results go to
# bench/results/ (JSON lines, text tables, the PNG plot). Run on an idle
# machine: every figure is a ratio of runs made back to back.
#   bash bench/run_benchmarks.sh [scaled|sweep|headline|budget|gemms|peers]...
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
FG=./build/tools/fusedgrpo
out=bench/results
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(scaled sweep headline budget gemms peers)
for part in "${parts[@]}"; do
  case "$part" in
    scaled)   # T=2048, H=2048, V=151936: all three impls, f32, one run
      $FG bench --config configs/scaled_t2048.yaml --set steps=2 --set roofline_reps=1 \
          --json "$out/scaled_f32.jsonl" | tee "$out/scaled_f32.txt" ;;
    sweep)    # fused vs baseline over seq_len, with the plot
      $FG bench --config configs/scaled_t2048.yaml --impls fused,baseline --set steps=1 \
          --set roofline_reps=0 --sweep seq_len=512,1024,2048 \
          --json "$out/sweep_f32.jsonl" | tee "$out/sweep_f32.txt"
      python3 bench/plot_bench.py "$out/sweep_f32.jsonl" -o "$out/sweep_f32.png" ;;
    headline) # the seeds' shape: B=1, T=8192, H=4096, V=151936, bf16 weights
      $FG bench --config configs/seeds_t8192_bf16.yaml --impls fused,baseline --set warmup=1 \
          --set steps=1 --set roofline_reps=0 \
          --json "$out/headline_bf16.jsonl" | tee "$out/headline_bf16.txt" ;;
    budget)   # what the budget buys: fused at 128 and 256 MiB vs the baseline, scaled shape
      $FG bench --config configs/scaled_t2048.yaml --impls fused,baseline --set steps=1 \
          --set roofline_reps=1 --sweep memory_budget=128MiB,256MiB \
          --json "$out/budget_f32.jsonl" | tee "$out/budget_f32.txt" ;;
    gemms)    # each chunk GEMM alone at the 128 and 256 MiB chunk sizes (205, 410 rows)
      cc -O2 -o build/gemm_probe bench/gemm_probe.c -ldnnl
      OMP_NUM_THREADS=2 ./build/gemm_probe 2048 151936 205 410 | tee "$out/gemm_probe_f32.txt" ;;
    peers)    # PyTorch eager, Liger, pure JAX and fusedgrpo's front ends at the scaled shape
      python3 bench/peers/run_peers.py --batch 1 --seq-len 2048 --hidden 2048 --vocab 151936 \
          --dtype float32 --reps 2 --warmup 1 --threads 2 --timeout 1500 \
          --json "$out/peers_t2048_f32.json" | tee "$out/peers_t2048_f32.md"
      # torch eager in bf16 takes hours here (no bf16 GEMM on AVX2: see BENCHMARKS.md)
      python3 bench/peers/run_peers.py --batch 1 --seq-len 2048 --hidden 2048 --vocab 151936 \
          --dtype bfloat16 --reps 1 --warmup 1 --threads 2 --timeout 1500 \
          --peers liger,jax_pure,fusedgrpo_numpy,fusedgrpo_torch,fusedgrpo_jax \
          --json "$out/peers_t2048_bf16.json" | tee "$out/peers_t2048_bf16.md" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
