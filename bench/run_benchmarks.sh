#!/usr/bin/env bash
# The measurements behind docs/BENCHMARKS.md, in the order they appear there.
# Long: about an hour on the 2-core reference machine. Results go to
# bench/results/ (JSON lines, text tables, the PNG plot). Run on an idle
# machine: every figure is a ratio of runs made back to back.
#   bash bench/run_benchmarks.sh [ab|aa|budgets|sweep|peaked|blocks|scaled|headline|budget|gemms|peers]...
# ab, aa and budgets take FG_AB="H:dtype ..." to run a subset (default: all four); aa takes
# FG_PAIRS (default 8: as many pairs with A first as with B first);
# budgets takes FG_BUDGETS="256MiB,384MiB,..." (default: the five budgets of
# docs/BENCHMARKS.md's session 15, which gave 5 to 1 chunks at H=1024, f32). Session 15's
# other runs (the 384 MiB shapes, one chunk twice) are single commands shown there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
FG=./build/tools/fusedgrpo
out=bench/results
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(ab aa budgets sweep peaked blocks scaled headline budget gemms peers)
ab="$out/issue14_interleaved"
s15="$out/session15"
s16="$out/session16"
mkdir -p "$ab" "$s15" "$s16"
shapes=(${FG_AB:-1024:float32 1024:bfloat16 2048:float32 2048:bfloat16})
for part in "${parts[@]}"; do
  case "$part" in
    scaled)   # T=2048, H=2048, V=151936: all three impls, f32, one run
      $FG bench --config configs/scaled_t2048.yaml --set steps=2 --set roofline_reps=1 \
          --json "$out/scaled_f32.jsonl" | tee "$out/scaled_f32.txt" ;;
    ab)       # fused vs materialized in one process, steps taking turns: T=2048, H=1024/2048, f32/bf16,
              # then the roofline (the products alone, full shape and chunked; FG_ROOFLINE_REPS=0: none)
      for hd in "${shapes[@]}"; do
        $FG bench --config configs/scaled_t2048.yaml --set hidden=${hd%:*} --set dtype=${hd#*:} \
            --set steps=5 --set warmup=1 --set "roofline_reps=${FG_ROOFLINE_REPS:-3}" --impls fused,baseline \
            --interleave --json "$s15/h${hd%:*}_${hd#*:}_roofline.jsonl" | tee "$s15/h${hd%:*}_${hd#*:}_roofline.txt"
      done ;;
    aa)       # the A/A control, then A/B, each shape at the default budget: the materialized step
              # against itself (the pair ratios' spread when nothing differs), then fused against it
      for hd in "${shapes[@]}"; do
        for pair in baseline,baseline fused,baseline; do
          $FG bench --config configs/scaled_t2048.yaml --set hidden=${hd%:*} --set dtype=${hd#*:} \
              --set "steps=${FG_PAIRS:-8}" --set warmup=1 --set roofline_reps=0 --impls $pair --interleave \
              --json "$s16/h${hd%:*}_${hd#*:}_${pair/,/_vs_}.jsonl" | tee "$s16/h${hd%:*}_${hd#*:}_${pair/,/_vs_}.txt"
        done
      done ;;
    budgets)  # the same over budgets: 256 MiB (the default) to one chunk
      for hd in "${shapes[@]}"; do
        $FG bench --config configs/scaled_t2048.yaml --set hidden=${hd%:*} --set dtype=${hd#*:} \
            --sweep "memory_budget=${FG_BUDGETS:-256MiB,384MiB,512MiB,768MiB,3GiB}" --set steps=5 \
            --set warmup=1 --set roofline_reps=0 --impls fused,baseline --interleave \
            --json "$s15/h${hd%:*}_${hd#*:}_budgets.jsonl" | tee "$s15/h${hd%:*}_${hd#*:}_budgets.txt"
      done ;;
    sweep)    # fused vs baseline over seq_len, steps taking turns, with the plot
      $FG bench --config configs/scaled_t2048.yaml --impls fused,baseline --interleave --set steps=5 \
          --set warmup=1 --set roofline_reps=0 --sweep seq_len=512,1024,2048 \
          --json "$ab/sweep_h2048_float32.jsonl" | tee "$ab/sweep_h2048_float32.txt"
      python3 bench/plot_bench.py "$ab/sweep_h2048_float32.jsonl" -o "$ab/sweep_h2048_float32.png" ;;
    peaked)   # the seeds' headline shape on peaked synthetic logits, gradient filtering on (~30 min)
      $FG bench --config configs/peaked_t2048.yaml --set seq_len=8192 --set hidden=4096 \
          --set filter_eps=auto --set steps=5 --set warmup=1 --set roofline_reps=0 \
          --impls fused,baseline --json "$ab/headline_peaked_bf16.jsonl" ;;
    blocks)   # one grad_hidden block on one thread: oneDNN's packed vs no-copy kernels
      cc -O2 -o build/block_probe bench/block_probe.c -ldnnl
      for mn in "410 256" "410 512" "410 576" "410 1024" "512 576" "512 1024" "205 1024"; do
        OMP_NUM_THREADS=1 ./build/block_probe $mn 37984 1024
      done | tee "$ab/block_probe.txt"
      # logits blocks (B = Wᵀ): 1008 columns at the chunk rows of T=2048, and the padded groups
      for a in "342 1008 2048 2048" "342 2016 2048 2048" "372 1008 1024 1024" "408 1008 1024 1024" \
               "504 1008 1024 1024" "316 1008 4096 4096" "316 2016 4096 4096" "6 384 1024 1024" "24 96 1024 1024"; do
        OMP_NUM_THREADS=1 ./build/block_probe $a t
      done | tee "$out/session13/block_probe_logits.txt" ;;
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
          --json "$ab/peers_t2048_f32.json" | tee "$ab/peers_t2048_f32.md"
      python3 bench/peers/run_peers.py --batch 1 --seq-len 2048 --hidden 2048 --vocab 151936 \
          --dtype float32 --reps 2 --warmup 1 --threads 2 --timeout 1500 --peers liger --liger-compiled \
          --json "$ab/peers_t2048_f32_liger_compiled.json" | tee "$ab/peers_t2048_f32_liger_compiled.md"
      # torch eager in bf16 takes hours here (no bf16 GEMM on AVX2: see BENCHMARKS.md)
      python3 bench/peers/run_peers.py --batch 1 --seq-len 2048 --hidden 2048 --vocab 151936 \
          --dtype bfloat16 --reps 1 --warmup 1 --threads 2 --timeout 1500 \
          --peers liger,jax_pure,fusedgrpo_numpy,fusedgrpo_torch,fusedgrpo_jax \
          --json "$ab/peers_t2048_bf16.json" | tee "$ab/peers_t2048_bf16.md" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
