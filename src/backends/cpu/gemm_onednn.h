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
    int fixed_blocks;   /* 1 (block_m > 0; row-major A, whole K, no accumulation):
                           every primitive call is one whole block_m x block_n
                           block (the last column block N mod block_n wide), the
                           rows past the last whole block run zero-padded and C
                           goes through a tile, so that a row's bits depend on
                           neither M nor where the row lies (FG_BLOCK_LOGITS_M) */
    int64_t split_k;    /* > 0 (f32 C): rows are cut into
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
 *   logits      [tokens, V]  = hidden · Wᵀ     K = H: 144 x 1008, every call
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
#define FG_BLOCK_DHIDDEN_M 512
#define FG_BLOCK_DHIDDEN_N 2048
#define FG_BLOCK_DHIDDEN_SPLIT_K 4
#define FG_GEMM_MIN_PIECE_K 2048 /* measured at full speed from K = 2048 (m = 410, n = 1024) */
#define FG_BLOCK_DWEIGHT_M 1024

/* The logits product's blocks: a token's logits, so its log-prob, must not
 * depend on where its row lies in the call, nor on the chunk size or the
 * path. A training loop scores the same tokens in passes that order and
 * chunk them differently (TRL shuffles the batch between the old/reference
 * passes and the loss), and a k3 KL of 1e-13 where it should be 0 is a
 * gradient that Adam turns into a full step.
 *
 * oneDNN picks a product's kernel and its K blocking, and so each element's
 * summation order, from the shape it is given: M, N, K, the leading
 * dimensions and transposes (oneDNN 2.6, src/cpu/x64/gemm/gemm_driver.cpp:
 * nocopy_checker_avx2 / nocopy_checker_avx512 choose no-copy or packed
 * kernels from m, n, k, lda, ldb, ldc; get_k_padd and set_thread_opts cut K
 * from the sizes; on AVX-512, src/cpu/matmul/cpu_matmul_list.cpp tries
 * brgemm_matmul_t<avx512_core> first, whose blocking
 * (src/cpu/x64/matmul/brgemm_matmul_utils.cpp) follows M, N and K too). None
 * of it reads the data. Measured: on AVX2, 333 of 333 rows
 * apart between a 336- and a 360-row product at K = 1031; on AVX-512 (Zen 4),
 * 19 of 115 rows apart between a product padded to whole 24-row groups and
 * the same rows inside a longer one, at K = 1031.
 *
 * So every primitive call of the logits product has one shape: 144 rows x
 * 1008 columns x the whole K (the last column block V mod 1008 wide: fixed
 * by V), the same strides and dtypes, C written to a worker's own tile at a
 * stride of 1008 (fg_gemm_shape.fixed_blocks). A product's rows past its last
 * whole block run as a whole block of zero-padded rows; the bf16 tile path's
 * tiles are whole column blocks. oneDNN then makes the same choices for
 * every call, and a row's sums do not depend on M. Within the one shape a
 * row must not depend on its place either: oneDNN's sgemm kernels run a
 * partial register tile with other code (measured on AVX2: groups of 4, 8
 * or 16 rows moved a row's bits, 6 did not). Its tiles hold 4 (AVX2 packed),
 * 6 (AVX2 no-copy) or 8 (AVX-512) of the product's rows (the n of oneDNN's
 * column-major gemm), and 144 is a whole number of each (and of 48, 24, 16,
 * 9 and 3), so every row sits in a full tile at any place; brgemm (AVX-512
 * matmul) blocks the one M the same way in every call. Checked bitwise on
 * AVX2 and SSE4.1 kernels with rows moved by 1 and 149 places
 * (tests/test_row_position.c, which asserts it on every ISA; AVX-512 not
 * yet run). The cost: up to 143 padded rows a product (the planner cuts
 * chunks in whole blocks, linear_grpo.c; a chunk of fewer rows pays for
 * 144), C copied once from the tile, and on AVX2 oneDNN's no-copy kernels
 * (1/144 + 1/1008 >= 0.0038, see fg_gemm_fast_rows) where a chunk of 357 rows
 * or more ran one packed block before: 1.10-1.19x the logits product's time
 * at T = 2048 (docs/BENCHMARKS.md, "Cost of the fixed-shape logits product").
 * A block tall enough to run packed (288 x 4032 or taller) runs within 1-3%
 * of the free product a row, but pads every shorter chunk to its height and
 * the call's last block by up to as much: 2304 rows for T = 2048, 0.96 of
 * the 144-row product's time ("where the cost goes", same page). */
#define FG_BLOCK_LOGITS_M 144
#define FG_BLOCK_LOGITS_N 1008

/* The most a converted bf16 weight tile holds (tile path only): >= 1024
 * weight rows at H = 4096, enough for the per-tile GEMMs to run at full
 * speed. Drivers size tiles below it (fg_gemm_shape.tile_bytes). The cap
 * counts rows x H floats; a tile's rows are stored up to 32 floats apart
 * more (gemm_onednn.c, tile_ld), and the scratch need counts that. A logits
 * tile holds whole column blocks, at least one (FG_BLOCK_LOGITS_N rows,
 * past the cap only for H > 8192). */
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
