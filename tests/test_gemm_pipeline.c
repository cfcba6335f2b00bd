/*
 * test_gemm_pipeline: the bf16 tile path's pipelined logits product
 * (gemm_onednn.c, tile_pipeline): the weight converted into two buffers of
 * half a tile, each tile's blocks and the next tile's conversion run in one
 * parallel region without a barrier between tiles.
 *
 * The product is the logits GEMM, C[M, N] (+ bias) = A[M, K] · Wᵀ with W
 * [N, K] in bf16 and A f32 (every CPU converts W then: a bf16 GEMM wants bf16
 * A). Checked on the same product with two tile caps:
 *   - a tile of one column block (half of it would cut a block: one buffer)
 *     and of four (two blocks a half: two buffers), counted through
 *     fg_gemm_tile_buffers;
 *   - C bitwise equal between the two (the blocks are the same) and for 1, 2
 *     and 3 workers (more workers than a tile has blocks);
 *   - C against float64: |C - ref| within TOL of sum_k |A[m,k]| |W[n,k]|.
 * M = 61 (two row groups and a tail of 13: the padded tail block) with a
 * bias, and M = 48 without; N = 1000 (a last block of 40 columns).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_onednn.h"
#include "test_util.h"

enum { N = 1000, K = 67, BLOCK_N = 96, WORKERS = 3 };
/* Worst measured (AVX2, 2026-11-26): 2.6e-7 (sum_k of 67 f32 products). */
#define TOL 1e-6

static double worst;

static uint16_t bf16_bits(double v)
{
    const float f = (float)tu_round_to(FG_DTYPE_BF16, v);
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)(bits >> 16);
}

static double bf16_value(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* C for a tile cap of `tile_cols` weight rows, on 1..WORKERS workers (all
 * bitwise equal, else a failed check); returns the 1-worker C. */
static float *run(fg_gemm_cache *gc, int64_t M, int has_bias, int64_t tile_cols, int want_buffers,
                  const float *A, const uint16_t *W, const uint16_t *bias)
{
    const fg_gemm_shape s = {M, N, K, FG_DTYPE_F32, FG_DTYPE_BF16, FG_DTYPE_F32, K, 1, 1, K, N, 0,
                             has_bias, (size_t)(tile_cols * K) * sizeof(float), FG_BLOCK_LOGITS_M,
                             BLOCK_N, FG_LOGITS_ROW_GRANULE, FG_LOGITS_COL_GRANULE, 0};
    fg_error err;
    fg_gemm_scratch need = {0, 0};
    int ok = fg_gemm_prepare(gc, &s, WORKERS, &need, &err) == FG_OK;
    const int buffers = ok ? fg_gemm_tile_buffers(gc, &s, WORKERS) : -1;
    CHECK(buffers == want_buffers, "M=%lld, tiles of %lld columns: %d tile buffers, want %d",
          (long long)M, (long long)tile_cols, buffers, want_buffers);
    void *scratch = tu_xmalloc_aligned(fg_gemm_scratch_bytes(&need, WORKERS) + 64);
    float *C[WORKERS];
    for (int w = 0; w < WORKERS; w++) {
        C[w] = tu_xmalloc_aligned((size_t)(M * N) * sizeof(float));
        memset(C[w], 0xff, (size_t)(M * N) * sizeof(float)); /* NaN: every element written */
        ok = ok && fg_gemm_run(gc, &s, A, W, C[w], bias, scratch, w + 1, NULL, &err) == FG_OK;
    }
    CHECK(ok, "M=%lld, tiles of %lld columns: GEMM failed: %s", (long long)M, (long long)tile_cols,
          ok ? "" : err.msg);
    for (int w = 1; w < WORKERS; w++) {
        CHECK(ok && memcmp(C[0], C[w], (size_t)(M * N) * sizeof(float)) == 0,
              "M=%lld, tiles of %lld columns: %d workers' C differs from one worker's", (long long)M,
              (long long)tile_cols, w + 1);
        free(C[w]);
    }
    free(scratch);
    return C[0];
}

static void check(fg_gemm_cache *gc, int64_t M, int has_bias, uint64_t seed)
{
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    float *A = tu_xmalloc_aligned((size_t)(M * K) * sizeof(float));
    uint16_t *W = tu_xmalloc_aligned((size_t)(N * K) * sizeof(uint16_t));
    uint16_t *bias = tu_xmalloc_aligned((size_t)N * sizeof(uint16_t));
    for (int64_t i = 0; i < M * K; i++)
        A[i] = (float)tu_normal(&rng);
    for (int64_t i = 0; i < N * K; i++)
        W[i] = bf16_bits(0.1 * tu_normal(&rng));
    for (int64_t n = 0; n < N; n++)
        bias[n] = bf16_bits(tu_normal(&rng));
    float *one = run(gc, M, has_bias, BLOCK_N, 1, A, W, has_bias ? bias : NULL);
    float *two = run(gc, M, has_bias, 4 * BLOCK_N, 2, A, W, has_bias ? bias : NULL);
    CHECK(memcmp(one, two, (size_t)(M * N) * sizeof(float)) == 0,
          "M=%lld: the pipelined C differs from the one-buffer C", (long long)M);
    double e = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double ref = has_bias ? bf16_value(bias[n]) : 0, mag = fabs(ref);
            for (int64_t k = 0; k < K; k++) {
                const double t = (double)A[m * K + k] * bf16_value(W[n * K + k]);
                ref += t;
                mag += fabs(t);
            }
            e = fmax(e, fabs(two[m * N + n] - ref) / mag);
        }
    worst = fmax(worst, e);
    CHECK(e <= TOL, "M=%lld: error %.3g > %.3g", (long long)M, e, TOL);
    printf("C[%lld, %d], K=%d%s: one buffer == two buffers, 1-%d workers; error %.3g\n",
           (long long)M, N, K, has_bias ? ", bias" : "", WORKERS, e);
    free(A);
    free(W);
    free(bias);
    free(one);
    free(two);
}

int main(void)
{
    fg_gemm_cache *gc = NULL;
    CHECK(fg_gemm_cache_create(&gc) == FG_OK, "%s", "GEMM cache");
    if (gc) {
        check(gc, 61, 1, 21);
        check(gc, 48, 0, 22);
        fg_gemm_cache_destroy(gc);
    }
    printf("worst error %.3g (TOL %.3g)\n", worst, TOL);
    return tu_finish();
}
