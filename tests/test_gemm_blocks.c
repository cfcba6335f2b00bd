/*
 * test_gemm_blocks: how a short chunk's grad_hidden product is cut into
 * blocks when its rows give fewer than FG_BLOCK_DHIDDEN_SPLIT_K (gemm_onednn.c,
 * blocked_prepare), and that the cut product is right and the same for any
 * thread count.
 *
 * Where oneDNN runs AVX2 kernels the columns are halved first, while a
 * block's rows still take the packed kernels (fg_gemm_fast_rows), then K is
 * cut into pieces; elsewhere K alone. Counted here through the partials the
 * shared scratch holds ((pieces - 1) x blocks of [rows, columns] floats):
 *   C[360, 2048], K = 8200: AVX2 2 x 2 blocks of [360, 1024] (2 partials),
 *                           else 4 pieces of [360, 2048] (3 partials);
 *   C[360, 1024], K = 8200: 4 pieces everywhere (512 columns would need 542
 *                           rows for the packed kernels);
 *   C[1083, 1024], K = 8200: row blocks of 542 and 541: the shorter one
 *                           keeps 1024 columns, so 2 pieces (1 partial a
 *                           block); C[1084, 1024]: 542 and 542, AVX2 halves
 *                           the columns to 4 blocks and K stays whole.
 * Each product against float64 on sampled rows (every column, so every
 * column block): |C - ref| within TOL of sum_k |A[m,k]| |W[k,n]|; and one
 * worker's C bitwise equal to two workers'.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

#include "gemm_onednn.h"
#include "test_util.h"

enum { K = 8200 };
/* Worst measured (AVX2, 2026-11-26): 1.9e-8. */
#define TOL 1e-7

static double worst;

static size_t partials(int64_t pieces, int64_t blocks, int64_t rows, int64_t cols)
{
    return (size_t)((pieces - 1) * blocks * rows * cols) * sizeof(float);
}

static void check(fg_gemm_cache *gc, int64_t M, int64_t N, size_t want_partials, uint64_t seed)
{
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    float *A = tu_xmalloc_aligned((size_t)(M * K) * sizeof(float));
    float *W = tu_xmalloc_aligned((size_t)(K * N) * sizeof(float));
    float *C[2];
    for (int64_t i = 0; i < M * K; i++)
        A[i] = (float)tu_normal(&rng);
    for (int64_t i = 0; i < K * N; i++)
        W[i] = (float)(0.1 * tu_normal(&rng));
    /* grad_hidden's shape (linear_grpo.c, shape_dhidden), W read in place */
    const fg_gemm_shape s = {M, N, K, FG_DTYPE_F32, FG_DTYPE_F32, FG_DTYPE_F32, K, 1, N, 1, N, 0, 0,
                             0, FG_BLOCK_DHIDDEN_M, FG_BLOCK_DHIDDEN_N, 0, FG_BLOCK_DHIDDEN_SPLIT_K};
    fg_error err;
    fg_gemm_scratch need = {0, 0};
    int ok = fg_gemm_prepare(gc, &s, 2, &need, &err) == FG_OK;
    /* the shared scratch is the partials, rounded up to the workspace's granule */
    CHECK(ok && need.shared >= want_partials && need.shared < want_partials + 4096,
          "M=%lld N=%lld: shared scratch %zu, want the partials' %zu", (long long)M, (long long)N, need.shared,
          want_partials);
    void *scratch = tu_xmalloc_aligned(fg_gemm_scratch_bytes(&need, 2) + 64);
    for (int w = 0; w < 2; w++) {
        C[w] = tu_xmalloc_aligned((size_t)(M * N) * sizeof(float));
        ok = ok && fg_gemm_run(gc, &s, A, W, C[w], NULL, scratch, w + 1, NULL, &err) == FG_OK;
    }
    CHECK(ok, "M=%lld N=%lld: GEMM failed", (long long)M, (long long)N);
    CHECK(ok && memcmp(C[0], C[1], (size_t)(M * N) * sizeof(float)) == 0,
          "M=%lld N=%lld: one worker's C differs from two workers'", (long long)M, (long long)N);
    const int64_t rows[] = {0, 1, M / 2 - 1, M / 2, M - 2, M - 1};
    double e = 0;
    for (size_t r = 0; ok && r < sizeof rows / sizeof rows[0]; r++)
        for (int64_t n = 0; n < N; n++) {
            const int64_t m = rows[r];
            double ref = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                const double t = (double)A[m * K + k] * (double)W[k * N + n];
                ref += t;
                mag += fabs(t);
            }
            e = fmax(e, fabs(C[1][m * N + n] - ref) / mag);
        }
    worst = fmax(worst, e);
    CHECK(ok && e <= TOL, "M=%lld N=%lld: error %.3g > %.3g", (long long)M, (long long)N, e, TOL);
    printf("C[%lld, %lld], K=%d: shared scratch %zu B (partials %zu), error %.3g\n", (long long)M, (long long)N, K,
           need.shared, want_partials, e);
    free(A);
    free(W);
    free(C[0]);
    free(C[1]);
    free(scratch);
}

int main(void)
{
    const int avx2 = (dnnl_get_effective_cpu_isa() & ~dnnl_cpu_isa_avx2) == 0;
    fg_gemm_cache *gc = NULL;
    CHECK(fg_gemm_cache_create(&gc) == FG_OK, "%s", "GEMM cache");
    if (gc) {
        check(gc, 360, 2048, avx2 ? partials(2, 2, 360, 1024) : partials(4, 1, 360, 2048), 11);
        check(gc, 360, 1024, partials(4, 1, 360, 1024), 12);
        check(gc, 1083, 1024, partials(2, 2, 542, 1024), 13);
        check(gc, 1084, 1024, avx2 ? 0 : partials(2, 2, 542, 1024), 14);
        fg_gemm_cache_destroy(gc);
    }
    printf("oneDNN ISA: %s; worst error %.3g (TOL %.3g)\n", avx2 ? "AVX2 or less" : "past AVX2", worst,
           TOL);
    return tu_finish();
}
