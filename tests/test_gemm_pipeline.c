/*
 * test_gemm_pipeline: the tile path's pipelined logits product (gemm_onednn.c,
 * tile_pipeline): the weight converted into two buffers of half a tile, each
 * tile's blocks and the next tile's conversion run in one parallel region
 * without a barrier between tiles.
 *
 * The weight W is bf16 and A f32, so every CPU converts W (a bf16 GEMM wants
 * bf16 A). Checked:
 *   logits, C[M, N] (+ bias) = A[M, K] · Wᵀ, W [N, K], tiled along N:
 *     - the tile buffers (fg_gemm_tile_buffers, a counted property): one
 *       where half a tile would cut a body block or a 96-column tail block,
 *       two where it cuts neither and holds two blocks;
 *     - the pipelined C bitwise equal to the one-buffer C (the same blocks)
 *       and for 1, 2 and 3 workers;
 *   grad_hidden, C[M, N] (+)= A[M, K] · W, W [K, N], tiled along K: one
 *     buffer whatever the tile (pipelining it was measured slower); C for 1,
 *     2 and 3 workers bitwise equal, accumulating onto C and with a bias;
 *   each C against float64: |C - ref| within TOL of the sum of |terms|;
 *   with the library's test-only fault hook: a block failing at each point
 *     of a pipelined product returns FG_ERR_BACKEND (no worker left waiting).
 * M = 61 (two row groups and a 13-row tail: the padded tail block) and 48;
 * N = 1000 (a last block of 40 columns); blocks of 96 and of 144 columns;
 * grad_hidden over K = 9001 (tiles of 4096 rows and of 4095).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_onednn.h"
#include "internal.h"
#include "test_util.h"

enum { N = 1000, K = 67, WORKERS = 3, KB = 9001, NB = 96 };
/* Worst measured (AVX2, 2026-11-26): 2.6e-7 for the logits (sums of 67 f32
 * products against their |terms|), 2.8e-8 for grad_hidden (9001). */
#define TOL 1e-6
#define TOL_DHIDDEN 1e-7

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

/* The k-th fault point of the run fails, for every point of one run: each
 * must end in FG_ERR_BACKEND (a hang here is a worker left waiting). */
static void check_faults(fg_gemm_cache *gc, const fg_gemm_shape *s, const void *A, const void *B,
                         const void *bias, void *scratch, const char *what)
{
#ifdef FG_FAULT_INJECTION
    fg_error err;
    const size_t cbytes = (size_t)(s->M * s->c_ld) * sizeof(float);
    float *C = tu_xmalloc_aligned(cbytes);
    memset(C, 0, cbytes);
    fg_fault_exec_arm(-1);
    const long before = fg_fault_exec_points();
    int ok = fg_gemm_run(gc, s, A, B, C, bias, scratch, 2, NULL, &err) == FG_OK;
    const long points = fg_fault_exec_points() - before;
    int failed = 0;
    for (long k = 0; ok && k < points; k++) {
        fg_fault_exec_arm(k);
        failed += fg_gemm_run(gc, s, A, B, C, bias, scratch, 2, NULL, &err) == FG_ERR_BACKEND;
    }
    fg_fault_exec_arm(-1);
    CHECK(ok && points > 1 && failed == points, "%s: %d of %ld fault points failed the product", what,
          failed, points);
    printf("%s: a failure at each of %ld fault points returned FG_ERR_BACKEND\n", what, points);
    free(C);
#else
    (void)gc, (void)s, (void)A, (void)B, (void)bias, (void)scratch, (void)what;
#endif
}

/* C = C0 (+)= the product on 1..WORKERS workers (all bitwise equal, else a
 * failed check); returns the 1-worker C. */
static float *run(fg_gemm_cache *gc, const fg_gemm_shape *s, int want_buffers, const float *A,
                  const void *B, const void *bias, const float *C0, int faults, const char *what)
{
    fg_error err;
    fg_gemm_scratch need = {0, 0};
    int ok = fg_gemm_prepare(gc, s, WORKERS, &need, &err) == FG_OK;
    const int buffers = ok ? fg_gemm_tile_buffers(gc, s, WORKERS) : -1;
    CHECK(buffers == want_buffers, "%s: %d tile buffers, want %d", what, buffers, want_buffers);
    void *scratch = tu_xmalloc_aligned(fg_gemm_scratch_bytes(&need, WORKERS) + 64);
    const size_t cbytes = (size_t)(s->M * s->c_ld) * sizeof(float);
    float *C[WORKERS];
    for (int w = 0; w < WORKERS; w++) {
        C[w] = tu_xmalloc_aligned(cbytes);
        memcpy(C[w], C0, cbytes);
        ok = ok && fg_gemm_run(gc, s, A, B, C[w], bias, scratch, w + 1, NULL, &err) == FG_OK;
    }
    CHECK(ok, "%s: GEMM failed: %s", what, ok ? "" : err.msg);
    for (int w = 1; w < WORKERS; w++) {
        CHECK(ok && memcmp(C[0], C[w], cbytes) == 0, "%s: %d workers' C differs from one worker's",
              what, w + 1);
        free(C[w]);
    }
    if (ok && faults)
        check_faults(gc, s, A, B, bias, scratch, what);
    free(scratch);
    return C[0];
}

static void check_logits(fg_gemm_cache *gc, int64_t M, int64_t block_n, int has_bias,
                         int64_t tile_one, int64_t tile_two, int64_t tile_not, uint64_t seed)
{
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    float *A = tu_xmalloc_aligned((size_t)(M * K) * sizeof(float));
    uint16_t *W = tu_xmalloc_aligned((size_t)(N * K) * sizeof(uint16_t));
    uint16_t *bias = tu_xmalloc_aligned((size_t)N * sizeof(uint16_t));
    float *C0 = tu_xmalloc_aligned((size_t)(M * N) * sizeof(float));
    for (int64_t i = 0; i < M * K; i++)
        A[i] = (float)tu_normal(&rng);
    for (int64_t i = 0; i < N * K; i++)
        W[i] = bf16_bits(0.1 * tu_normal(&rng));
    for (int64_t n = 0; n < N; n++)
        bias[n] = bf16_bits(tu_normal(&rng));
    memset(C0, 0xff, (size_t)(M * N) * sizeof(float)); /* NaN: every element written */
    fg_gemm_shape s = {M, N, K, FG_DTYPE_F32, FG_DTYPE_BF16, FG_DTYPE_F32, K, 1, 1, K, N, 0,
                       has_bias, 0, FG_BLOCK_LOGITS_M, block_n, FG_LOGITS_ROW_GRANULE,
                       FG_LOGITS_COL_GRANULE, 0};
    char what[96];
    const void *b = has_bias ? bias : NULL;
    s.tile_bytes = (size_t)(tile_one * K) * sizeof(float);
    snprintf(what, sizeof what, "logits M=%lld, blocks of %lld, tiles of %lld", (long long)M,
             (long long)block_n, (long long)tile_one);
    float *one = run(gc, &s, 1, A, W, b, C0, 0, what);
    s.tile_bytes = (size_t)(tile_not * K) * sizeof(float); /* half would cut a tail block */
    snprintf(what, sizeof what, "logits M=%lld, blocks of %lld, tiles of %lld", (long long)M,
             (long long)block_n, (long long)tile_not);
    free(run(gc, &s, 1, A, W, b, C0, 0, what));
    s.tile_bytes = (size_t)(tile_two * K) * sizeof(float);
    snprintf(what, sizeof what, "logits M=%lld, blocks of %lld, tiles of %lld", (long long)M,
             (long long)block_n, (long long)tile_two);
    float *two = run(gc, &s, 2, A, W, b, C0, 1, what);
    CHECK(memcmp(one, two, (size_t)(M * N) * sizeof(float)) == 0,
          "%s: the pipelined C differs from the one-buffer C", what);
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
    CHECK(e <= TOL, "%s: error %.3g > %.3g", what, e, TOL);
    printf("%s%s: == one buffer, 1-%d workers; error %.3g\n", what, has_bias ? ", bias" : "",
           WORKERS, e);
    free(A);
    free(W);
    free(bias);
    free(C0);
    free(one);
    free(two);
}

static void check_dhidden(fg_gemm_cache *gc, int64_t M, int64_t block_m, int accumulate, int has_bias,
                          uint64_t seed)
{
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    float *A = tu_xmalloc_aligned((size_t)(M * KB) * sizeof(float));
    uint16_t *W = tu_xmalloc_aligned((size_t)(KB * NB) * sizeof(uint16_t));
    uint16_t *bias = tu_xmalloc_aligned((size_t)NB * sizeof(uint16_t));
    float *C0 = tu_xmalloc_aligned((size_t)(M * NB) * sizeof(float));
    for (int64_t i = 0; i < M * KB; i++)
        A[i] = (float)tu_normal(&rng);
    for (int64_t i = 0; i < KB * NB; i++)
        W[i] = bf16_bits(0.1 * tu_normal(&rng));
    for (int64_t n = 0; n < NB; n++)
        bias[n] = bf16_bits(tu_normal(&rng));
    for (int64_t i = 0; i < M * NB; i++)
        C0[i] = accumulate ? (float)tu_normal(&rng) : NAN;
    fg_gemm_shape s = {M, NB, KB, FG_DTYPE_F32, FG_DTYPE_BF16, FG_DTYPE_F32, KB, 1, NB, 1, NB,
                       accumulate, has_bias, 0, block_m, FG_BLOCK_DHIDDEN_N, 0, 0,
                       FG_BLOCK_DHIDDEN_SPLIT_K};
    char what[96];
    const void *b = has_bias ? bias : NULL;
    const int64_t two_rows = 2 * FG_GEMM_MIN_PIECE_K;
    s.tile_bytes = (size_t)((two_rows - 1) * NB) * sizeof(float);
    snprintf(what, sizeof what, "grad_hidden M=%lld, tiles of %lld rows", (long long)M,
             (long long)two_rows - 1);
    float *one = run(gc, &s, 1, A, W, b, C0, 0, what);
    s.tile_bytes = (size_t)(two_rows * NB) * sizeof(float);
    snprintf(what, sizeof what, "grad_hidden M=%lld, blocks of %lld rows, tiles of %lld rows%s%s",
             (long long)M, (long long)block_m, (long long)two_rows, accumulate ? ", C +=" : "",
             has_bias ? ", bias" : "");
    float *two = run(gc, &s, 1, A, W, b, C0, 0, what);
    double e = 0, e1 = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < NB; n++) {
            double ref = (accumulate ? C0[m * NB + n] : 0) + (has_bias ? bf16_value(bias[n]) : 0);
            double mag = fabs(ref);
            for (int64_t k = 0; k < KB; k++) {
                const double t = (double)A[m * KB + k] * bf16_value(W[k * NB + n]);
                ref += t;
                mag += fabs(t);
            }
            e = fmax(e, fabs(two[m * NB + n] - ref) / mag);
            e1 = fmax(e1, fabs(one[m * NB + n] - ref) / mag);
        }
    CHECK(e <= TOL_DHIDDEN && e1 <= TOL_DHIDDEN, "%s: error %.3g (tiles of %lld rows: %.3g) > %.3g",
          what, e, (long long)two_rows - 1, e1, TOL_DHIDDEN);
    printf("%s: 1-%d workers bitwise; error %.3g (tiles of %lld rows: %.3g)\n", what, WORKERS, e,
           (long long)two_rows - 1, e1);
    free(A);
    free(W);
    free(bias);
    free(C0);
    free(one);
    free(two);
}

int main(void)
{
    fg_gemm_cache *gc = NULL;
    CHECK(fg_gemm_cache_create(&gc) == FG_OK, "%s", "GEMM cache");
    if (gc) {
        /* blocks of 96: tiles of 1 block (half would cut it: one buffer), of 4 (two) */
        check_logits(gc, 61, 96, 1, 96, 384, 144, 21);
        check_logits(gc, 48, 96, 0, 96, 384, 144, 22);
        /* blocks of 144: half of 576 is 288 (2 blocks, 3 tail blocks: two buffers); half of
           288 is one block but 1.5 tail blocks (one buffer) */
        check_logits(gc, 61, 144, 1, 144, 576, 288, 23);
        /* grad_hidden: tiled along K, one buffer */
        check_dhidden(gc, 37, FG_BLOCK_DHIDDEN_M, 0, 0, 24);
        check_dhidden(gc, 300, 128, 1, 1, 25);
        fg_gemm_cache_destroy(gc);
    }
    printf("worst error %.3g (TOL %.3g; grad_hidden %.3g)\n", worst, TOL, TOL_DHIDDEN);
    return tu_finish();
}
