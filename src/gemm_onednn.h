/*
 * The GEMM layer: C[M,N] (+)= A[M,K] · B[K,N] (+ bias[N]) through oneDNN's
 * matmul primitive, with explicit strides so that transposed views (Wᵀ,
 * dlogitsᵀ) cost nothing. C is cut into fixed blocks run side by side, one
 * single-threaded primitive call each (results independent of the thread
 * count). Primitives are cached per block shape in an fg_gemm_cache (the
 * context owns one); oneDNN's scratchpad is user-managed (one per worker
 * thread) and comes from the caller, whose workspace counts it.
 *
 * The layer knows nothing of contexts or budgets: the caller passes the
 * thread count, the scratch and an error sink, and gets time and flops back
 * in an fg_gemm_stats. The driver (linear_grpo.c) and the tool's bench both
 * build on it.
 *
 * bf16: where oneDNN has bf16 kernels for this CPU (AVX-512 BF16 / AMX) the
 * product runs natively. Elsewhere (oneDNN 2.x needs AVX-512 for bf16) a bf16
 * B operand (the weight) is converted to f32 one cache-sized tile of weight
 * rows at a time, and a bf16 C is written through an f32 tile: the weight is
 * never copied whole, and the extra traffic is one read of it per product.
 * A must then be f32: fg_gemm_native_bf16() tells the caller which to pass.
 * Tiles are stored at a stride no cache set aliases, and short f32
 * grad_hidden products whose weight rows lie 4 KiB multiples apart take the
 * same path (fg_gemm_tiled).
 */
#ifndef FG_GEMM_ONEDNN_H
#define FG_GEMM_ONEDNN_H

#include "fusedgrpo.h"
#include "error.h"

typedef struct fg_gemm_shape {
    int64_t M, N, K;
    fg_dtype a_type, b_type; /* f32 accumulation always */
    fg_dtype c_type;
    int64_t a_rs, a_cs; /* A element (m,k) at m*a_rs + k*a_cs */
    int64_t b_rs, b_cs; /* B element (k,n) at k*b_rs + n*b_cs */
    int64_t c_ld;
    int accumulate;     /* C += A·B instead of C = A·B */
    int has_bias;       /* bias[N], in b_type, added to every row */
    size_t tile_bytes;  /* tile path: cap of one converted weight tile (the caller's
                           plan decides it; not part of a primitive's key; 0: f32
                           products never take the tile path) */
    int64_t block_m, block_n; /* C is computed in fixed blocks of this size (<= 0:
                                 whole), each by one thread with its whole K */
    int64_t row_granule; /* > 1: C's rows are computed in whole groups of this
                            many, whatever M, so that a row's bits do not
                            depend on where it lies (FG_LOGITS_ROW_GRANULE) */
    int64_t col_granule; /* > 1: the tile path cuts N only at multiples of this
                            (FG_LOGITS_COL_GRANULE); block_n must be one */
    int64_t split_k;    /* > 0 (f32 C, no row granule): rows are cut into
                           max(1, M / block_m) blocks of about equal rows (so
                           about block_m or more), and when C then has fewer than
                           split_k blocks, the columns are halved (where oneDNN
                           runs AVX2 kernels) while every block's rows still take
                           the packed kernels (fg_gemm_fast_rows), then K is
                           cut into fixed pieces (>= FG_GEMM_MIN_PIECE_K long) until
                           it has, computed side by side and summed in order */
} fg_gemm_shape;

/* The blocks of the LM head's three products, [rows x cols] of C. They
 * depend only on the shape, never on the thread count, which makes every
 * path bitwise identical for any thread count. Sized so that each block is
 * a full-speed single-thread GEMM and there are enough blocks to share:
 *   logits      [tokens, V]  = hidden · Wᵀ     K = H: 504 x 1008
 *   grad_hidden [tokens, H]  = dlogits · W     K = V: >= 512 x up to 2048,
 *                                               then (AVX2) columns halved
 *                                               while packed, K in pieces,
 *                                               until 4 blocks
 *   grad_weight [V, H]      += dlogitsᵀ · h    K = tokens: 1024 x whole H
 * grad_hidden's blocks are wide and tall because oneDNN 2.6's sgemm runs a
 * block whose rows m and columns n have 1/m + 1/n >= 0.0038 with its no-copy
 * kernels, which read W in place: with W's rows a multiple of 4 KiB apart
 * (H = 1024, 2048, 4096) at half speed (AVX2, measured: 38-40 GFLOP/s a core
 * against 72-80 packed; 70 at a stride of 1040 floats, see
 * fg_gemm_tiled). A chunk of a few hundred rows is then one
 * block, so its columns are halved while still packed (AVX2), then K (the
 * vocabulary) is cut, to share it among threads. On the bf16 tile path K is
 * a weight tile's rows (32 MiB of f32 at most): at H = 4096 that is 2048
 * rows, too few to cut, but N then gives two blocks (four on AVX2 from 355
 * rows, columns halved). */
#define FG_BLOCK_LOGITS_M 504  /* a multiple of FG_LOGITS_ROW_GRANULE */
#define FG_BLOCK_LOGITS_N 1008 /* a multiple of FG_LOGITS_COL_GRANULE */
#define FG_BLOCK_DHIDDEN_M 512
#define FG_BLOCK_DHIDDEN_N 2048
#define FG_BLOCK_DHIDDEN_SPLIT_K 4
#define FG_GEMM_MIN_PIECE_K 2048 /* measured at full speed from K = 2048 (m = 410, n = 1024) */
#define FG_BLOCK_DWEIGHT_M 1024

/* The logits product's granules: a token's logits, so its log-prob, must not
 * depend on where its row lies in the call, nor on the chunk size. A training
 * loop scores the same tokens in passes that order and chunk them
 * differently (TRL shuffles the batch between the old/reference passes and
 * the loss), and a k3 KL of 1e-13 where it should be 0 is a gradient that
 * Adam turns into a full step. oneDNN's sgemm computes C in register tiles
 * and runs a last partial tile with other code whose rounding differs:
 *   rows: measured on AVX2, groups of 6 within a product (4, 8 and 16 do
 *     not; before this, 1-2 rows of 115-333 moved by up to 2e-6 when
 *     permuted); 8 assumed on AVX-512 (its 48x8 sgemm kernel, not measured);
 *     24 measured under DNNL_MAX_CPU_ISA=SSE41. 24 on every ISA: with 6 on
 *     AVX2 (tried, and 3% faster at T = 2048, H = 1024, f32), a row of a
 *     product's last group moved by up to 3e-6 when the same rows ran one
 *     group later (M = 336 against 342, K = 301, oneDNN's no-copy kernels;
 *     tests/test_row_position.c, the GEMM layer's check (c)), which 24 does
 *     not. The M % 24 rows past the last whole group run padded to a whole
 *     group (gemm_onednn.c, blocking): 24 x 96 blocks at 34.5 GFLOP/s a core
 *     (bench/block_probe.c), about 0.1 s a 410-row chunk at H = 1024, so the
 *     driver pads its chunks to whole groups where the budget holds it
 *     (linear_grpo.c).
 *   regimes: past one of oneDNN's K blocks (K = 1031, not 301), a block of
 *     C run with the packed kernels (1/m + 1/n < 0.0038, see below) sums in
 *     another order than one run with the no-copy kernels, so a row is
 *     guaranteed its bits only among products whose blocks holding it take the same
 *     kind: measured 333 of 333 rows apart between a 336- and a 360-row
 *     product at K = 1031 (docs/LOSS_SPEC.md states the guarantee).
 *   columns: the tile path (bf16 weights on CPUs without bf16 GEMMs) cuts N
 *     into tiles whose width followed the chunk size, and a column's bits
 *     moved with it (measured on AVX2: a third of the rows of a 1-row-chunk
 *     call differed from a one-chunk call); tiles and column blocks are
 *     whole multiples of 48 (16 on AVX2, 48 assumed on AVX-512), so a
 *     column sits at the same place of a kernel tile in every call.
 * tests/test_row_position.c checks both (bitwise where oneDNN runs at most
 * AVX2 and the rows stay in one kind of block; on AVX-512 it prints how many
 * rows were not, until measured). */
#define FG_LOGITS_ROW_GRANULE 24
#define FG_LOGITS_COL_GRANULE 48

/* The most a converted bf16 weight tile holds (tile path only): >= 1024
 * weight rows at H = 4096, enough for the per-tile GEMMs to run at full
 * speed. Drivers size tiles below it (fg_gemm_shape.tile_bytes). The cap
 * counts rows x H floats; a tile's rows are stored up to 32 floats apart
 * more (gemm_onednn.c, tile_ld), and the scratch need counts that. */
#define FG_TILE_CAP_BYTES ((size_t)32 << 20)

/* The fewest rows m of a block n columns wide that oneDNN 2.6's sgemm runs
 * with its packed kernels: it takes its no-copy kernels when 1/m + 1/n >=
 * 0.0038 (nocopy_checker_avx2; on AVX2 at half the speed where B's rows lie
 * a multiple of 4 KiB apart, see the blocks above); INT64_MAX when no m is
 * packed (n <= 263). Used on every ISA:
 * a longer chunk is never slower where the rule differs. */
int64_t fg_gemm_fast_rows(int64_t n);

typedef struct fg_gemm_cache fg_gemm_cache;

/* An engine, per-worker streams and up to FG_GEMM_CACHE_SLOTS block
 * primitives. Probes once whether bf16 products run natively. */
#define FG_GEMM_CACHE_SLOTS 128
fg_status fg_gemm_cache_create(fg_gemm_cache **out);
void fg_gemm_cache_destroy(fg_gemm_cache *cache); /* NULL is fine */

/* 1 when bf16·bf16 products run natively on this CPU. */
int fg_gemm_native_bf16(const fg_gemm_cache *cache);

/* 1 when the product runs on converted weight tiles stored at a stride that
 * no cache set aliases (the tile path): bf16 weights without native kernels,
 * and, where oneDNN runs AVX2 kernels, f32 grad_hidden products too short
 * for its packed kernels whose weight rows lie a multiple of 4 KiB apart and
 * whose tile_bytes hold two K pieces (gemm_onednn.c, restride_f32; at H =
 * 1024 and V = 151936 a chunk of 56 rows or more, H = 2048 of 111 or more).
 * Such a product runs at full speed at any M. */
int fg_gemm_tiled(const fg_gemm_cache *cache, const fg_gemm_shape *shape);

/* Time and work issued to GEMMs, accumulated by fg_gemm_run. */
typedef struct fg_gemm_stats {
    double seconds;
    int64_t flops;
} fg_gemm_stats;

/* What a product's scratch needs: a part shared by all workers (converted
 * bf16 weight tiles) and one scratchpad per worker thread. */
typedef struct fg_gemm_scratch {
    size_t shared, per_worker;
} fg_gemm_scratch;

/* Creates (or finds) the primitives of shape's blocks, with memory objects
 * for up to `threads` workers, and raises *need to cover this product. Call
 * before writing any output, so backend failures surface while outputs are
 * untouched. */
fg_status fg_gemm_prepare(fg_gemm_cache *cache, const fg_gemm_shape *shape, int threads,
                          fg_gemm_scratch *need, fg_error *err);

/* Bytes of scratch for `workers` concurrent workers. */
size_t fg_gemm_scratch_bytes(const fg_gemm_scratch *need, int workers);

/* Runs a prepared product on `workers` threads (at most the `threads` it was
 * prepared for). The blocks, and so the result's bits, are the same for any
 * worker count. scratch (64-byte aligned) must hold
 * fg_gemm_scratch_bytes(need, workers). Adds its time and flops to *stats
 * (NULL: not wanted). */
fg_status fg_gemm_run(fg_gemm_cache *cache, const fg_gemm_shape *shape, const void *A,
                      const void *B, void *C, const void *bias, void *scratch, int workers,
                      fg_gemm_stats *stats, fg_error *err);

#endif
