#!/usr/bin/env bash
# The measurements behind docs/BENCHMARKS.md, one part per table. Results go to
# bench/results/<question>/<isa>/, where <isa> is avx512_bf16 on a CPU with
# AVX-512 BF16 and avx2 otherwise, so runs on the two CPU families never mix.
# Run on an idle machine: every figure is a ratio of runs made back to back.
#   bash bench/run_benchmarks.sh [scaled|aa|separate|sweep|budgets|headline|replay|filter|peaked|peers|mpi|portable|blocks|logits_blocks|train]...
# Without a part it runs scaled aa sweep budgets replay filter peaked peers (hours on
# two AVX2 cores); separate, headline, mpi, portable, blocks, logits_blocks and train run only when named.
# scaled, aa and budgets take FG_SHAPES="H:dtype ..." to run a subset (default: all
# four); aa takes FG_PAIRS (default 8: as many pairs with A first as with B first);
# budgets takes FG_BUDGETS (default: the five budgets that give 5 to 1 chunks at
# H=1024, f32).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
FG=./build/tools/fusedgrpo
isa=avx2
grep -qw avx512_bf16 /proc/cpuinfo && isa=avx512_bf16
res=bench/results
capture=/tmp/smollm2_capture
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(scaled aa sweep budgets replay filter peaked peers)
read -r -a shapes <<<"${FG_SHAPES:-1024:float32 1024:bfloat16 2048:float32 2048:bfloat16}"
bench_shape() {  # bench_shape H:dtype OUTFILE_STEM ARGS...: one interleaved run at T=2048
  local hd=$1 stem=$2; shift 2
  $FG bench --config configs/scaled_t2048.yaml --set hidden=${hd%:*} --set dtype=${hd#*:} \
      --set warmup=1 --interleave "$@" --json "$stem.jsonl" | tee "$stem.txt"
}
capture_smollm2() {  # SmolLM2-135M-Instruct's own LM-head inputs, once
  [ -f "$capture/hidden.npy" ] || python3 bench/capture_smollm2.py --out "$capture"
}
for part in "${parts[@]}"; do
  case "$part" in
    scaled)   # fused vs materialized in one process, steps taking turns, with the roofline:
              # T=2048, V=151936, H=1024/2048, f32/bf16, the default budget
      out=$res/fused_vs_materialized/$isa; mkdir -p "$out"
      for hd in "${shapes[@]}"; do
        bench_shape "$hd" "$out/h${hd%:*}_${hd#*:}_roofline" --set steps=7 --set roofline_reps=3 \
            --impls fused,baseline
      done ;;
    aa)       # the A/A control: the materialized step against itself, each side with its own
              # context, so the pair ratios' spread when nothing differs
      out=$res/fused_vs_materialized/$isa; mkdir -p "$out"
      for hd in "${shapes[@]}"; do
        bench_shape "$hd" "$out/h${hd%:*}_${hd#*:}_baseline_vs_baseline" --set "steps=${FG_PAIRS:-8}" \
            --set roofline_reps=0 --impls baseline,baseline
      done ;;
    separate) # the scaled shape (H=2048) in f32 and bf16, each impl in its own process
      out=$res/fused_vs_materialized/$isa; mkdir -p "$out"
      for dt in float32 bfloat16; do
        $FG bench --config configs/scaled_t2048.yaml --set dtype=$dt --set steps=5 --set warmup=1 \
            --set roofline_reps=0 --impls fused,baseline --json "$out/scaled_$dt.jsonl"
      done ;;
    sweep)    # fused vs materialized over seq_len, H=2048, f32, steps taking turns, with the plot
      out=$res/fused_vs_materialized/$isa; mkdir -p "$out"
      $FG bench --config configs/scaled_t2048.yaml --impls fused,baseline --interleave --set steps=5 \
          --set warmup=1 --set roofline_reps=0 --sweep seq_len=512,1024,2048 \
          --json "$out/sweep_h2048_float32.jsonl" | tee "$out/sweep_h2048_float32.txt"
      python3 bench/plot_bench.py "$out/sweep_h2048_float32.jsonl" -o "$out/sweep_h2048_float32.png" ;;
    budgets)  # what the memory budget buys: 256 MiB (the default) to one chunk
      out=$res/memory_budget/$isa; mkdir -p "$out"
      for hd in "${shapes[@]}"; do
        bench_shape "$hd" "$out/h${hd%:*}_${hd#*:}_budgets" --set steps=5 --set roofline_reps=0 \
            --impls fused,baseline --sweep "memory_budget=${FG_BUDGETS:-256MiB,384MiB,512MiB,768MiB,3GiB}"
      done ;;
    headline) # the seeds' shape: B=1, T=8192, H=4096, V=151936, bf16 weights, each impl in its own process
      out=$res/fused_vs_materialized/$isa; mkdir -p "$out"
      $FG bench --config configs/seeds_t8192_bf16.yaml --impls fused,baseline --set warmup=1 \
          --set steps=5 --set roofline_reps=0 \
          --json "$out/headline_bf16.jsonl" | tee "$out/headline_bf16.txt" ;;
    replay)   # SmolLM2's real LM-head inputs, unfiltered, each impl in its own process
      out=$res/gradient_filtering/$isa; mkdir -p "$out"; capture_smollm2
      $FG bench --inputs "$capture" --set dtype=bfloat16 --impls fused,baseline --set steps=7 \
          --set warmup=1 --set roofline_reps=3 --json "$out/replay_unfiltered_bf16.jsonl" ;;
    filter)   # gradient filtering's speed and error over its threshold, on the same capture
      out=$res/gradient_filtering/$isa; mkdir -p "$out"; capture_smollm2
      python3 bench/filter_curve.py --inputs "$capture" --dtype bfloat16 \
          --json "$out/filter_curve_bf16.jsonl" | tee "$out/filter_curve_bf16.md" ;;
    peaked)   # filtering at the real vocabulary on peaked synthetic logits: the scaled shape,
              # then the seeds' headline shape (about 45 minutes on two AVX2 cores)
      out=$res/gradient_filtering/$isa; mkdir -p "$out"
      $FG bench --config configs/peaked_t2048.yaml --set filter_eps=auto --impls fused,baseline \
          --json "$out/peaked_h2048_bf16.jsonl" | tee "$out/peaked_h2048_bf16.txt"
      $FG bench --config configs/peaked_t2048.yaml --set seq_len=8192 --set hidden=4096 \
          --set filter_eps=auto --set steps=5 --set warmup=1 --set roofline_reps=0 \
          --impls fused,baseline --json "$out/headline_peaked_bf16.jsonl" ;;
    peers)    # PyTorch eager, Liger, TRL's fused head, pure JAX and fusedgrpo's front ends at the scaled shape
      out=$res/peers/$isa; mkdir -p "$out"
      peers=(python3 bench/peers/run_peers.py --batch 1 --seq-len 2048 --hidden 2048 --vocab 151936
             --warmup 1 --threads 2 --timeout 1500)
      "${peers[@]}" --dtype float32 --reps 2 \
          --json "$out/peers_t2048_f32.json" | tee "$out/peers_t2048_f32.md"
      "${peers[@]}" --dtype float32 --reps 2 --peers liger --liger-compiled \
          --json "$out/peers_t2048_f32_liger_compiled.json" | tee "$out/peers_t2048_f32_liger_compiled.md"
      # torch eager and TRL's head in bf16 take hours a step without bf16 GEMM kernels (AVX2)
      "${peers[@]}" --dtype bfloat16 --reps 1 \
          --peers liger,jax_pure,fusedgrpo_numpy,fusedgrpo_torch,fusedgrpo_jax \
          --json "$out/peers_t2048_bf16.json" | tee "$out/peers_t2048_bf16.md" ;;
    mpi)      # vocab x data grids at SmolLM2's head, one OpenMP thread a rank; 1x1: one process, 2 threads
      out=$res/mpi_grids/$isa; mkdir -p "$out"
      head=(bench --set batch=8 --set seq_len=128 --set hidden=576 --set vocab=49152 --set steps=5
            --set warmup=1 --impls "fused,baseline")
      $FG "${head[@]}" --set threads=2 --set roofline_reps=0 --json "$out/smollm2_head_1x1.jsonl"
      for grid in 2x1 4x1 1x2 2x2; do
        v=${grid%x*} d=${grid#*x}
        mpirun --oversubscribe -np $((v * d)) $FG "${head[@]}" --set threads=1 \
            --set vocab_shards=$v --set data_shards=$d --json "$out/smollm2_head_$grid.jsonl"
      done ;;
    portable) # the portable build (run-time dispatch) against -march=native of the same tree
      OUT=$res/portable_vs_native/$isa bash bench/portable_vs_native.sh ;;
    blocks)   # one GEMM block on one thread: oneDNN's packed against its no-copy kernels
      out=$res/gemm_blocks/$isa; mkdir -p "$out"
      cc -O2 -o build/block_probe bench/block_probe.c -ldnnl
      for mn in "410 256" "410 512" "410 576" "410 1024" "512 576" "512 1024" "205 1024"; do
        OMP_NUM_THREADS=1 ./build/block_probe $mn 37984 1024
      done | tee "$out/grad_hidden_blocks.txt"
      # logits blocks (B = Wᵀ): 1008 columns at the chunk rows of T=2048, and the padded groups
      for a in "342 1008 2048 2048" "342 2016 2048 2048" "372 1008 1024 1024" "408 1008 1024 1024" \
               "504 1008 1024 1024" "316 1008 4096 4096" "316 2016 4096 4096" "6 384 1024 1024" "24 96 1024 1024"; do
        OMP_NUM_THREADS=1 ./build/block_probe $a t
      done | tee "$out/logits_blocks.txt" ;;
    logits_blocks) # the logits product alone, fixed 144-row blocks against free 504-row ones
      out=$res/row_position_cost/$isa; mkdir -p "$out"
      cc -O2 -fopenmp -Isrc -Iinclude -o build/logits_blocks_ab bench/logits_blocks_ab.c \
          build/libfusedgrpo.a -ldnnl -lm
      for shape in "410 1024 f32" "2048 1024 f32" "410 2048 f32" "2048 2048 f32" \
                   "288 1024 bf16" "2048 1024 bf16" "288 2048 bf16" "2048 2048 bf16"; do
        # shellcheck disable=SC2086
        ./build/logits_blocks_ab $shape 5 fixed:144x1008 free:504x1008 fixed:432x1008
      done | tee "$out/logits_blocks.txt"
      # where the time goes: one block of all the rows against 144-row blocks (free: no
      # padding, C in place), and the weight's rows 4 KiB apart or not
      { ./build/logits_blocks_ab 288 1024 f32 7 fixed:144x1008 free:504x1008 free:144x1008
        ./build/logits_blocks_ab 432 1024 f32 7 fixed:144x1008 free:504x1008 free:144x1008
        ./build/logits_blocks_ab 410 1024 f32 7 fixed:144x1008 free:504x1008 \
            fixed:144x1008:ld1040 free:504x1008:ld1040
      } | tee "$out/logits_blocks_rows.txt"
      # oneDNN's kernel edge for 1008 columns (no-copy up to 356 rows, packed from 357),
      # and a fixed block wide enough to run packed (288 x 4032)
      ./build/logits_blocks_ab 714 1024 f32 5 free:357x1008 free:356x1008 free:357x1008 \
          free:356x1008 | tee "$out/logits_blocks_nocopy_edge.txt"
      { ./build/logits_blocks_ab 2048 1024 f32 5 fixed:144x1008 fixed:288x4032 free:504x1008
        ./build/logits_blocks_ab 288 1024 f32 5 fixed:144x1008 fixed:288x4032 free:504x1008
      } | tee "$out/logits_blocks_288x4032.txt"
      # each block height's own rate, no padding at 576 rows but for 384 (two blocks)
      # and 336 x 2016 (two blocks): how fast a fixed block runs against its height
      { ./build/logits_blocks_ab 576 1024 f32 5 free:576x1008 fixed:48x1008 fixed:96x1008 \
            fixed:144x1008 fixed:288x1008 fixed:384x1008 fixed:576x1008 fixed:288x4032
        ./build/logits_blocks_ab 576 2048 f32 5 free:576x1008 fixed:144x1008 fixed:288x1008 \
            fixed:336x2016 fixed:288x4032 fixed:576x1008
      } | tee "$out/logits_blocks_heights.txt"
      # oneDNN's own pack API (not public): the 144-row blocks against a packed weight block
      cc -O2 -fopenmp -o build/sgemm_pack_probe bench/sgemm_pack_probe.c -ldnnl
      mkdir -p "$res/tried_and_dropped/$isa"
      { ./build/sgemm_pack_probe 432 1024 30240; ./build/sgemm_pack_probe 432 2048 30240
      } | tee "$res/tried_and_dropped/$isa/sgemm_pack_probe.txt"
      # the seeds' headline (T = 8192, H = 4096, bf16): its fused chunks are 288 rows here
      ./build/logits_blocks_ab 288 4096 bf16 5 fixed:144x1008 free:504x1008 \
          | tee "$out/logits_blocks_headline.txt" ;;
    train)    # the 100-step GRPO training A/B of docs/TRAINING.md, one arm after the other
      for arm in trl fusedgrpo fusedgrpo_unfiltered materialized; do
        python3 examples/grpo_smollm2/train.py --config examples/grpo_smollm2/configs/$arm.yaml
      done
      python3 examples/grpo_smollm2/summarize.py
      python3 examples/grpo_smollm2/plot.py ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
