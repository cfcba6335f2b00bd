/*
 * pipeline_probe: the fused step's three products (f32, five chunks of m
 * token rows, no row work) in two orders, through the library's GEMM layer,
 * in one process with the two taking turns (docs/BENCHMARKS.md, session 15):
 *   A (the driver's): per chunk, logits [m, V] = h·Wᵀ, then
 *     grad_hidden = dlogits·W and grad_weight += dlogitsᵀ·h, each over all of V;
 *   B (vocab-tiled): per chunk and per tile of R weight rows, grad_hidden +=
 *     dlogits[:, tile]·W[tile], grad_weight[tile] += dlogits[:, tile]ᵀ·h, then
 *     the next chunk's logits[:, tile] over the same columns, so a tile of W
 *     is read from memory once for three products while it sits in the L3.
 * Prints each pair's B/A time and the median. With the library's
 * FG_GEMM_MIN_PIECE_K of 2048, a tile's grad_hidden (K = R) under 4096 rows
 * is one block on one thread; session 15 measured B on a build with 1008:
 *   git archive HEAD | tar -x -C /tmp/p && cd /tmp/p &&
 *   sed -i 's/MIN_PIECE_K 2048/MIN_PIECE_K 1008/' src/gemm_onednn.h &&
 *   cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release && ninja -C build fusedgrpo_static &&
 *   cc -O2 -std=c11 -Isrc -Iinclude -o pipeline_probe bench/pipeline_probe.c \
 *      build/libfusedgrpo.a -ldnnl -lgomp -lm && ./pipeline_probe 1024 408 4032 5
 * Arguments: H, m (rows a chunk), R (weight rows a tile), pairs.
 */
#define _GNU_SOURCE
#include "gemm_onednn.h"
#include "probe_buffer.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { CHUNKS = 5, MAX_PAIRS = 64 };
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

/* C[m, n] = h[m, H] · W[n rows, H]ᵀ, C's rows V apart (the library's logits blocks). */
static fg_gemm_shape logits(int64_t m, int64_t n, int64_t H)
{
    return (fg_gemm_shape){m, n, H, FG_DTYPE_F32, FG_DTYPE_F32, FG_DTYPE_F32, H, 1, 1, H, V, 0, 0, 0,
                           FG_BLOCK_LOGITS_M, FG_BLOCK_LOGITS_N, FG_LOGITS_ROW_GRANULE,
                           FG_LOGITS_COL_GRANULE, 0};
}

/* gh[m, H] (+)= dl[m, k cols, V apart] · W[k rows, H]. */
static fg_gemm_shape dhidden(int64_t m, int64_t k, int64_t H, int accumulate)
{
    return (fg_gemm_shape){m, H, k, FG_DTYPE_F32, FG_DTYPE_F32, FG_DTYPE_F32, V, 1, H, 1, H, accumulate,
                           0, 0, FG_BLOCK_DHIDDEN_M, FG_BLOCK_DHIDDEN_N, 0, 0, FG_BLOCK_DHIDDEN_SPLIT_K};
}

/* gw[n, H] (+)= dl[m, n cols]ᵀ · h[m, H]. */
static fg_gemm_shape dweight(int64_t n, int64_t m, int64_t H, int accumulate)
{
    return (fg_gemm_shape){n, H, m, FG_DTYPE_F32, FG_DTYPE_F32, FG_DTYPE_F32, 1, V, H, 1, H, accumulate,
                           0, 0, FG_BLOCK_DWEIGHT_M, 0, 0, 0, 0};
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: pipeline_probe H m R pairs\n");
        return 2;
    }
    const int64_t H = atol(argv[1]), m = atol(argv[2]), R = atol(argv[3]);
    const int pairs = atoi(argv[4]);
    if (H < 1 || m < 1 || R < 1 || pairs < 1 || pairs > MAX_PAIRS || fg_gemm_cache_create(&cache) != FG_OK) {
        fprintf(stderr, "pipeline_probe: bad arguments or no oneDNN\n");
        return 2;
    }
    float *L = probe_buffer((size_t)(m * V), 1e-4f), *W = probe_buffer((size_t)(V * H), 1e-4f),
          *gw = probe_buffer((size_t)(V * H), 1e-4f);
    float *h = probe_buffer((size_t)(CHUNKS * m * H), 1e-4f), *gh = probe_buffer((size_t)(CHUNKS * m * H), 1e-4f);
    double t[2][MAX_PAIRS], r[MAX_PAIRS];
    for (int p = 0; p <= pairs; p++) /* pair 0 (A B) warms up; then B A, A B, ... */
        for (int q = 0; q < 2; q++) {
            const int tiled = p & 1 ? 1 - q : q;
            const double t0 = omp_get_wtime();
            if (!tiled) {
                for (int64_t k = 0; k < CHUNKS; k++) {
                    const float *hk = h + k * m * H;
                    product(logits(m, V, H), hk, W, L);
                    product(dhidden(m, V, H, 0), L, W, gh + k * m * H);
                    product(dweight(V, m, H, k > 0), L, hk, gw);
                }
            } else {
                product(logits(m, V, H), h, W, L);
                for (int64_t k = 0; k < CHUNKS; k++) {
                    const float *hk = h + k * m * H;
                    for (int64_t v0 = 0; v0 < V; v0 += R) {
                        const int64_t n = V - v0 < R ? V - v0 : R;
                        product(dhidden(m, n, H, v0 > 0), L + v0, W + v0 * H, gh + k * m * H);
                        product(dweight(n, m, H, k > 0), L + v0, hk, gw + v0 * H);
                        if (k + 1 < CHUNKS)
                            product(logits(m, n, H), hk + m * H, W + v0 * H, L + v0);
                    }
                }
            }
            if (p > 0)
                t[tiled][p - 1] = omp_get_wtime() - t0;
        }
    for (int p = 0; p < pairs; p++) {
        r[p] = t[1][p] / t[0][p];
        printf("A %.3f s  B %.3f s  B/A %.3f\n", t[0][p], t[1][p], r[p]);
    }
    for (int i = 0; i < pairs; i++)
        for (int j = i + 1; j < pairs; j++)
            if (r[j] < r[i]) {
                const double x = r[i];
                r[i] = r[j];
                r[j] = x;
            }
    printf("H=%lld m=%lld R=%lld: B/A median %.3f [%.3f, %.3f]\n", (long long)H, (long long)m,
           (long long)R, r[pairs / 2], r[0], r[pairs - 1]);
    return 0;
}
