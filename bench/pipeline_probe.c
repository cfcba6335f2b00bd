/*
 * pipeline_probe: the fused step's three products (chunks of m token rows, no
 * row work) in two orders, through the library's GEMM layer, in one process
 * with the two taking turns (docs/BENCHMARKS.md, sessions 15 and 18):
 *   A (the driver's): per chunk, logits [m, V] = h·Wᵀ, then
 *     grad_hidden = dlogits·W and grad_weight += dlogitsᵀ·h, each over all of V;
 *   B (vocab-tiled): per chunk and per tile of R weight rows, grad_hidden +=
 *     dlogits[:, tile]·W[tile], grad_weight[tile] += dlogits[:, tile]ᵀ·h, then
 *     the next chunk's logits[:, tile] over the same columns, so a tile of W
 *     is read from memory once for three products while it sits in the L3.
 * With a bf16 weight (on a CPU without bf16 GEMMs) A's two products each take
 * the library's tile path, converting W to f32 tile by tile: 2 passes a chunk.
 * B converts each tile once into an f32 buffer of R rows (tile_ld's stride)
 * and runs its three products on it: one pass a chunk, plus the first logits.
 * Prints each pair's B/A time and the median. With the library's
 * FG_GEMM_MIN_PIECE_K of 2048, a tile's grad_hidden (K = R) under 4096 rows
 * is one block on one thread; session 15 measured B on a build with 1008:
 *   mkdir -p /tmp/p && git archive HEAD | tar -x -C /tmp/p && cd /tmp/p &&
 *   sed -i 's/MIN_PIECE_K 2048/MIN_PIECE_K 1008/' src/gemm_onednn.h &&
 *   cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release && ninja -C build fusedgrpo_static &&
 *   cc -O2 -std=c11 -fopenmp -Isrc -Iinclude -o pipeline_probe bench/pipeline_probe.c \
 *      build/libfusedgrpo.a -ldnnl -lgomp -lm && ./pipeline_probe 1024 408 4032 5
 * Session 18 measured bf16 at 6 chunks of 360 rows (the 256 MiB plan's last is
 * 248, so the probe runs about 5% more rows than the driver, on both sides), built
 * the same way with MIN_PIECE_K 2016, so that a tile of 8064 rows (8 logits
 * column blocks) gives grad_hidden 4 K pieces as A's 8192-row tiles do:
 *   ./pipeline_probe 1024 360 8064 5 6 bf16
 * Arguments: H, m (rows a chunk), R (weight rows a tile), pairs, and
 * optionally the chunk count (5) and the weight's dtype (f32 or bf16).
 */
#define _GNU_SOURCE
#include "gemm_onednn.h"
#include "probe_buffer.h"

#include "row_kernels.h"

#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_PAIRS = 64 };
static const int64_t V = 151936;

static fg_gemm_cache *cache;
static void *scratch;
static size_t scratch_bytes;

static void product(fg_gemm_shape s, const float *A, const float *B, float *C)
{
    fg_error err;
    fg_gemm_scratch need = {0, 0};
    if (fg_gemm_prepare(cache, &s, 2, &need, &err) != FG_OK) {
        fprintf(stderr, "pipeline_probe: %s\n", err.msg);
        exit(1);
    }
    const size_t bytes = fg_gemm_scratch_bytes(&need, 2);
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
        memset(scratch, 0, bytes);
        scratch_bytes = bytes;
    }
    if (fg_gemm_run(cache, &s, A, B, C, NULL, scratch, 2, NULL, &err) != FG_OK) {
        fprintf(stderr, "pipeline_probe: %s\n", err.msg);
        exit(1);
    }
}

/* A bf16 product's converted weight tiles: the most the driver's plan holds.
 * f32 products get none (as in session 15), so they never take the restrided copy. */
static size_t tile_bytes(fg_dtype bt) { return bt == FG_DTYPE_BF16 ? FG_TILE_CAP_BYTES : 0; }

/* C[m, n] = h[m, H] · W[n rows, H]ᵀ, C's rows V apart (the library's logits
 * blocks); W's rows ld apart, in dtype bt (bf16: the library's tile path). */
static fg_gemm_shape logits(int64_t m, int64_t n, int64_t H, fg_dtype bt, int64_t ld)
{
    return (fg_gemm_shape){m, n, H, FG_DTYPE_F32, bt, FG_DTYPE_F32, H, 1, 1, ld, V, 0, 0, tile_bytes(bt),
                           FG_BLOCK_LOGITS_M, FG_BLOCK_LOGITS_N, FG_LOGITS_ROW_GRANULE,
                           FG_LOGITS_COL_GRANULE, 0};
}

/* gh[m, H] (+)= dl[m, k cols, V apart] · W[k rows, H], W's rows ld apart. */
static fg_gemm_shape dhidden(int64_t m, int64_t k, int64_t H, int accumulate, fg_dtype bt, int64_t ld)
{
    return (fg_gemm_shape){m, H, k, FG_DTYPE_F32, bt, FG_DTYPE_F32, V, 1, ld, 1, H, accumulate,
                           0, tile_bytes(bt), FG_BLOCK_DHIDDEN_M, FG_BLOCK_DHIDDEN_N, 0, 0,
                           FG_BLOCK_DHIDDEN_SPLIT_K};
}

/* gw[n, H] (+)= dl[m, n cols]ᵀ · h[m, H]. */
static fg_gemm_shape dweight(int64_t n, int64_t m, int64_t H, int accumulate)
{
    return (fg_gemm_shape){n, H, m, FG_DTYPE_F32, FG_DTYPE_F32, FG_DTYPE_F32, 1, V, H, 1, H, accumulate,
                           0, 0, FG_BLOCK_DWEIGHT_M, 0, 0, 0, 0};
}

/* An odd number of cache lines of floats, >= n (gemm_onednn.c's tile_ld). */
static int64_t odd_lines(int64_t n)
{
    const int64_t lines = (n + 15) / 16;
    return (lines | 1) * 16;
}

int main(int argc, char **argv)
{
    if (argc < 5 || argc > 7) {
        fprintf(stderr, "usage: pipeline_probe H m R pairs [chunks] [f32|bf16]\n");
        return 2;
    }
    const int64_t H = atol(argv[1]), m = atol(argv[2]), R = atol(argv[3]);
    const int pairs = atoi(argv[4]);
    const int64_t chunks = argc > 5 ? atol(argv[5]) : 5;
    const int bf16 = argc > 6 && strcmp(argv[6], "bf16") == 0;
    if (H < 1 || m < 1 || R < 1 || chunks < 1 || pairs < 1 || pairs > MAX_PAIRS ||
        (argc > 6 && !bf16 && strcmp(argv[6], "f32") != 0) || fg_gemm_cache_create(&cache) != FG_OK) {
        fprintf(stderr, "pipeline_probe: bad arguments or no oneDNN\n");
        return 2;
    }
    const fg_dtype wt = bf16 ? FG_DTYPE_BF16 : FG_DTYPE_F32;
    const int64_t ld = bf16 ? odd_lines(H) : H; /* B's f32 weight rows: the converted tile's */
    float *L = probe_buffer((size_t)(m * V), 1e-4f), *gw = probe_buffer((size_t)(V * H), 1e-4f);
    float *Wf = probe_buffer((size_t)(V * H), 1e-4f);
    uint16_t *Wb = (uint16_t *)Wf; /* bf16: the first half of the same buffer */
    if (bf16)
        for (int64_t i = 0; i < V * H; i++)
            Wb[i] = (uint16_t)(0x3800 + (i * 7919) % 1000);
    const void *W = bf16 ? (const void *)Wb : (const void *)Wf;
    float *T = bf16 ? probe_buffer((size_t)(R * ld), 0) : NULL;
    float *h = probe_buffer((size_t)(chunks * m * H), 1e-4f), *gh = probe_buffer((size_t)(chunks * m * H), 1e-4f);
    double t[2][MAX_PAIRS], conv[MAX_PAIRS], r[MAX_PAIRS];
    for (int p = 0; p <= pairs; p++) /* pair 0 (A B) warms up; then B A, A B, ... */
        for (int q = 0; q < 2; q++) {
            const int tiled = p & 1 ? 1 - q : q;
            double conv_s = 0;
            const double t0 = omp_get_wtime();
            if (!tiled) {
                for (int64_t k = 0; k < chunks; k++) {
                    const float *hk = h + k * m * H;
                    product(logits(m, V, H, wt, H), hk, W, L);
                    product(dhidden(m, V, H, 0, wt, H), L, W, gh + k * m * H);
                    product(dweight(V, m, H, k > 0), L, hk, gw);
                }
            } else {
                product(logits(m, V, H, wt, H), h, W, L);
                for (int64_t k = 0; k < chunks; k++) {
                    const float *hk = h + k * m * H;
                    for (int64_t v0 = 0; v0 < V; v0 += R) {
                        const int64_t n = V - v0 < R ? V - v0 : R;
                        const float *Wt = Wf + v0 * H;
                        if (bf16) { /* one conversion for the tile's three products */
                            const double c0 = omp_get_wtime();
#pragma omp parallel for schedule(static) num_threads(2)
                            for (int64_t j = 0; j < n; j++)
                                fg_bf16_to_f32_strided(T + j * ld, Wb + (v0 + j) * H, H, 1);
                            conv_s += omp_get_wtime() - c0;
                            Wt = T;
                        }
                        product(dhidden(m, n, H, v0 > 0, FG_DTYPE_F32, ld), L + v0, Wt, gh + k * m * H);
                        product(dweight(n, m, H, k > 0), L + v0, hk, gw + v0 * H);
                        if (k + 1 < chunks)
                            product(logits(m, n, H, FG_DTYPE_F32, ld), hk + m * H, Wt, L + v0);
                    }
                }
            }
            if (p > 0) {
                t[tiled][p - 1] = omp_get_wtime() - t0;
                if (tiled)
                    conv[p - 1] = conv_s;
            }
        }
    for (int p = 0; p < pairs; p++) {
        r[p] = t[1][p] / t[0][p];
        printf("A %.3f s  B %.3f s (conversions %.3f s)  B/A %.3f\n", t[0][p], t[1][p], conv[p], r[p]);
    }
    for (int i = 0; i < pairs; i++)
        for (int j = i + 1; j < pairs; j++)
            if (r[j] < r[i]) {
                const double x = r[i];
                r[i] = r[j];
                r[j] = x;
            }
    printf("H=%lld m=%lld R=%lld chunks=%lld %s: B/A median %.3f [%.3f, %.3f]\n", (long long)H, (long long)m,
           (long long)R, (long long)chunks, bf16 ? "bf16" : "f32", r[pairs / 2], r[0], r[pairs - 1]);
    return 0;
}
