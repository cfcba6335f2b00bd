/*
 * test_gemm_stride: products that run on weight tiles stored at a stride of
 * their own (gemm_onednn.c, tile_ld) against a float64 reference.
 *
 * oneDNN's no-copy kernels read B in place, and B rows a multiple of 4 KiB
 * apart (H = 1024) fall on one cache set: a short grad_hidden product,
 * C[M, N] (+)= A[M, K] · W[K, N], then runs at half speed. The GEMM layer
 * copies W tile by tile to a stride that no set aliases (f32, where oneDNN
 * runs AVX2 kernels: restride_f32) and stores the bf16 tile path's converted
 * tiles at that stride too. Checked here:
 *   - which products take the tiles (a counted property): f32 at a stride of
 *     1024 floats, M below fg_gemm_fast_rows and tiles of two K pieces or
 *     more, where oneDNN runs AVX2 kernels; never at a stride of 1040, with
 *     smaller tiles, or M past the packed kernels' rule; bf16 always;
 *   - each product, accumulating into C (bf16: over six tiles of 512 rows),
 *     against float64: |C - ref| within TOL of sum_k |A[m,k]| |W[k,n]| (the
 *     scale of f32 summation's error).
 * Shapes: M = 5, 37, 188 (no-copy) and 400 (packed), N = 1024, f32 and bf16 W.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

#include "gemm_onednn.h"
#include "test_util.h"

enum { N = 1024, K = 3001 };
/* Tile caps: two K pieces of N floats (the f32 route's least, one tile here)
 * and 512 rows (six tiles: the bf16 path's sums over tiles; too few rows for
 * the f32 route, which then reads W in place) */
#define TWO_PIECES ((size_t)2 * FG_GEMM_MIN_PIECE_K * N * sizeof(float))
#define SMALL_TILE ((size_t)512 * N * sizeof(float))
/* Worst measured (AVX2, 2026-11-26): 5.3e-8, f32 and bf16 alike. */
#define TOL 2e-7

static double worst;

static void check(fg_gemm_cache *gc, int64_t M, int64_t ld, fg_dtype wt, size_t tile_bytes,
                  int avx2, uint64_t seed)
{
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    const size_t we = tu_dtype_size(wt);
    float *A = tu_xmalloc_aligned((size_t)(M * K) * sizeof(float));
    unsigned char *W = tu_xmalloc_aligned((size_t)(K * ld) * we);
    float *C = tu_xmalloc_aligned((size_t)(M * N) * sizeof(float));
    double *ref = tu_xmalloc((size_t)(M * N) * sizeof(double));
    double *mag = tu_xmalloc((size_t)(M * N) * sizeof(double));
    double *w = tu_xmalloc((size_t)(K * N) * sizeof(double));
    for (int64_t i = 0; i < M * K; i++)
        A[i] = (float)tu_normal(&rng);
    for (int64_t k = 0; k < K; k++)
        for (int64_t n = 0; n < ld; n++) {
            const double v = tu_round_to(wt, 0.1 * tu_normal(&rng));
            if (wt == FG_DTYPE_BF16) {
                const float f = (float)v;
                uint32_t bits;
                memcpy(&bits, &f, sizeof bits);
                const uint16_t hi = (uint16_t)(bits >> 16);
                memcpy(W + (size_t)(k * ld + n) * we, &hi, sizeof hi);
            } else {
                const float f = (float)v;
                memcpy(W + (size_t)(k * ld + n) * we, &f, sizeof f);
            }
            if (n < N)
                w[k * N + n] = v;
        }
    for (int64_t i = 0; i < M * N; i++) {
        C[i] = (float)tu_normal(&rng);
        ref[i] = C[i];
        mag[i] = fabs(C[i]);
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) {
            const double a = A[m * K + k];
            for (int64_t n = 0; n < N; n++) {
                ref[m * N + n] += a * w[k * N + n];
                mag[m * N + n] += fabs(a * w[k * N + n]);
            }
        }
    /* grad_hidden's shape (linear_grpo.c, shape_dhidden), accumulating */
    const fg_gemm_shape s = {M, N, K, FG_DTYPE_F32, wt, FG_DTYPE_F32, K, 1, ld, 1, N, 1, 0,
                             tile_bytes, FG_BLOCK_DHIDDEN_M, FG_BLOCK_DHIDDEN_N, 0, 0,
                             FG_BLOCK_DHIDDEN_SPLIT_K};
    /* bf16 W with an f32 A always converts (a CPU with bf16 GEMMs gets bf16 A);
     * f32 W where a tile holds two K pieces of FG_GEMM_MIN_PIECE_K rows */
    const int want_tiles = wt == FG_DTYPE_BF16 ||
                           (avx2 && ld % 1024 == 0 && M < fg_gemm_fast_rows(N) &&
                            tile_bytes >= TWO_PIECES);
    CHECK(fg_gemm_tiled(gc, &s) == want_tiles, "M=%lld ld=%lld %s: tiled %d, expected %d",
          (long long)M, (long long)ld, wt == FG_DTYPE_BF16 ? "bf16" : "f32", fg_gemm_tiled(gc, &s),
          want_tiles);
    fg_error err;
    fg_gemm_scratch need = {0, 0};
    int ok = fg_gemm_prepare(gc, &s, 2, &need, &err) == FG_OK;
    void *scratch = tu_xmalloc_aligned(fg_gemm_scratch_bytes(&need, 2) + 64);
    ok = ok && fg_gemm_run(gc, &s, A, W, C, NULL, scratch, 2, NULL, &err) == FG_OK;
    CHECK(ok, "M=%lld ld=%lld: GEMM failed", (long long)M, (long long)ld);
    double e = 0;
    for (int64_t i = 0; ok && i < M * N; i++)
        e = fmax(e, fabs(C[i] - ref[i]) / mag[i]);
    worst = fmax(worst, e);
    CHECK(ok && e <= TOL, "M=%lld ld=%lld %s: error %.3g > %.3g", (long long)M, (long long)ld,
          wt == FG_DTYPE_BF16 ? "bf16" : "f32", e, TOL);
    printf("M=%lld ld=%lld %s tile %zu KiB, tiled=%d: error %.3g\n", (long long)M,
           (long long)ld, wt == FG_DTYPE_BF16 ? "bf16" : "f32", tile_bytes >> 10,
           fg_gemm_tiled(gc, &s), e);
    free(A);
    free(W);
    free(C);
    free(ref);
    free(mag);
    free(w);
    free(scratch);
}

int main(void)
{
    const int avx2 = (dnnl_get_effective_cpu_isa() & ~dnnl_cpu_isa_avx2) == 0;
    fg_gemm_cache *gc = NULL;
    CHECK(fg_gemm_cache_create(&gc) == FG_OK, "%s", "GEMM cache");
    if (gc) {
        static const int64_t Ms[] = {5, 37, 188, 400};
        uint64_t seed = 3;
        for (size_t m = 0; m < sizeof Ms / sizeof Ms[0]; m++) {
            check(gc, Ms[m], 1024, FG_DTYPE_F32, TWO_PIECES, avx2, seed++);
            check(gc, Ms[m], 1024, FG_DTYPE_F32, SMALL_TILE, avx2, seed++);
            check(gc, Ms[m], 1040, FG_DTYPE_F32, TWO_PIECES, avx2, seed++);
            check(gc, Ms[m], 1024, FG_DTYPE_BF16, SMALL_TILE, avx2, seed++);
        }
        fg_gemm_cache_destroy(gc);
    }
    printf("worst error %.3g (TOL %.3g)\n", worst, TOL);
    return tu_finish();
}
