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
 *   - each product, accumulating into C (bf16: over three tiles of 512 rows),
 *     against float64: |C - ref| within TOL of sum_k |A[m,k]| |W[k,n]| (the
 *     scale of f32 summation's error).
 * Shapes: M = 5, 37, 120 (no-copy) and 360 (packed), N = 1024, f32 and bf16 W.
 * And the library itself (check_library): the restrided grad_hidden inside
 * fg_linear_grpo, against the same call with W read in place; and the chunk
 * planner's rules for slow grad_hidden chunks (check_planner).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <oneapi/dnnl/dnnl.h>

#include "gemm_onednn.h"
#include "test_util.h"

enum { N = 1024, K = 1201 };
/* Tile caps: two K pieces of N floats (the f32 route's least, one tile here)
 * and 512 rows (three tiles: the bf16 path's sums over tiles; too few rows for
 * the f32 route, which then reads W in place) */
#define TWO_PIECES ((size_t)2 * FG_GEMM_MIN_PIECE_K * N * sizeof(float))
#define SMALL_TILE ((size_t)512 * N * sizeof(float))
/* Worst measured (AVX2, 2026-11-26): 9.4e-8, f32 and bf16 alike. */
#define TOL 3e-7

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
                             tile_bytes, FG_BLOCK_DHIDDEN_M, FG_BLOCK_DHIDDEN_N, 0,
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

/* The library: fg_linear_grpo, materialized, on 300 tokens (one product of
 * 300 rows, below fg_gemm_fast_rows(1024)) at H = 1024, V = 60013, with the
 * weight's rows 1024 floats apart (grad_hidden restrided: its tiles counted
 * in the peak working memory, >= two K pieces more) and 1040 apart (read in
 * place). logp bitwise equal where oneDNN runs AVX2 kernels (the logits
 * product is the same either way); the gradients within TOL_LIB (relative
 * L2: grad_hidden sums its K pieces in another order). */
#define TOL_LIB 1e-6 /* worst measured (AVX2, grad_hidden): 3.1e-7 */

static void check_library(int avx2)
{
    const int64_t T = 300, H = 1024, V = 60013;
    tu_rng rng;
    tu_rng_seed(&rng, 77);
    tu_batch tb;
    CHECK(tu_batch_make(&tb, 1, T, V, 0, &rng) == 0, "%s", "batch");
    float *hidden = tu_xmalloc_aligned((size_t)(T * H) * sizeof(float));
    float *w[2] = {tu_xmalloc_aligned((size_t)(V * 1024) * sizeof(float)),
                   tu_xmalloc_aligned((size_t)(V * 1040) * sizeof(float))};
    for (int64_t i = 0; i < T * H; i++)
        hidden[i] = (float)tu_normal(&rng);
    for (int64_t v = 0; v < V; v++)
        for (int64_t h = 0; h < 1040; h++) {
            const float x = (float)(0.05 * tu_normal(&rng));
            if (h < H)
                w[0][v * 1024 + h] = x;
            w[1][v * 1040 + h] = h < H ? w[0][v * 1024 + h] : NAN;
        }
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    fg_context *ctx = NULL;
    CHECK(fg_context_create(NULL, &ctx) == FG_OK, "%s", "context");
    const fg_linear_options mat = {FG_IMPL_MATERIALIZED, 0, 0.0};
    tu_linear_outs o[2];
    size_t peak[2] = {0, 0};
    for (int k = 0; k < 2 && ctx; k++) {
        const int64_t ld = k ? 1040 : 1024;
        fg_linear_inputs in;
        memset(&in, 0, sizeof in);
        in.hidden = fg_matrix_make(hidden, FG_DTYPE_F32, T, H);
        in.weight = (fg_matrix){w[k], FG_DTYPE_F32, V, H, ld};
        tu_linear_outs_make(&o[k], T, H, V, 0);
        fg_release_workspace(ctx);
        fg_reset_peak_memory(ctx);
        CHECK(fg_linear_grpo(ctx, &mat, &cfg, &in, tu_batch_view(&tb), &o[k].out, NULL) == FG_OK,
              "ld %lld: %s", (long long)ld, fg_last_error(ctx));
        fg_memory_stats ms;
        fg_get_memory_stats(ctx, &ms);
        peak[k] = ms.peak_bytes;
    }
    if (ctx) {
        const size_t tiles = TWO_PIECES;
        CHECK(!avx2 || peak[0] >= peak[1] + tiles, "peak working memory %zu (stride 1024) vs %zu "
              "(1040): the restrided tiles (>= %zu) not counted", peak[0], peak[1], tiles);
        const int same_logp = memcmp(o[0].logp, o[1].logp, (size_t)T * sizeof(float)) == 0;
        CHECK(!avx2 || same_logp, "%s", "logp differs between the weight's strides");
        const double eh = tu_rel_l2f(o[0].grad_hidden, o[1].grad_hidden, T * H);
        const double ew = tu_rel_l2f(o[0].grad_weight, o[1].grad_weight, V * H);
        const double el = fabs(o[0].out.loss - o[1].out.loss) / fmax(fabs(o[1].out.loss), 1e-3);
        CHECK(eh <= TOL_LIB && ew <= TOL_LIB && el <= TOL_LIB,
              "library: grad_hidden %.3g, grad_weight %.3g, loss %.3g > %.3g", eh, ew, el, TOL_LIB);
        printf("library T=%lld H=%lld V=%lld: peak %zu vs %zu bytes, logp %s, grad_hidden %.3g, "
               "grad_weight %.3g, loss %.3g\n", (long long)T, (long long)H, (long long)V, peak[0],
               peak[1], same_logp ? "bitwise" : "differs", eh, ew, el);
        tu_linear_outs_free(&o[0]);
        tu_linear_outs_free(&o[1]);
        fg_context_destroy(ctx);
    }
    free(hidden);
    free(w[0]);
    free(w[1]);
    tu_batch_free(&tb);
}

/* The planner (fg_linear_grpo_plan, fused, f32) at H = 1031, whose weight
 * rows are not 4 KiB apart, so a grad_hidden product below
 * fg_gemm_fast_rows(1031) reads W in place at half speed: over budgets from
 * one row to one chunk, in steps of a row's logits and dlogits, the chunks
 * (the first chunk_rows, the others later_chunk_rows, the last fewer) cover
 * the tokens, and no plan whose first chunk is fast has a slow one after it
 * but the last (counted). The planner's rules: equal chunks too short give
 * way to full ones and a shorter last (chunk_rows), and neither whole-group
 * chunks (group_rows) nor a longer first chunk (lead_rows) may turn a fast
 * chunk slow; a first version of lead_rows did, [376, 312, 312] where
 * [376, 376, 248] keeps the middle chunk fast (n = 1000: 43 of the scan's
 * plans failed with it). */
static void check_planner(int64_t T)
{
    const int64_t H = 1031, V = 2003;
    tu_rng rng;
    tu_rng_seed(&rng, 5);
    tu_batch tb;
    CHECK(tu_batch_make(&tb, 1, T, V, 0, &rng) == 0, "%s", "batch");
    const int64_t n = tu_batch_unmasked(&tb), fast = fg_gemm_fast_rows(H);
    float *hidden = tu_xmalloc_aligned((size_t)(T * H) * sizeof(float));
    float *w = tu_xmalloc_aligned((size_t)(V * H) * sizeof(float));
    memset(hidden, 0, (size_t)(T * H) * sizeof(float));
    memset(w, 0, (size_t)(V * H) * sizeof(float));
    fg_linear_inputs in;
    memset(&in, 0, sizeof in);
    in.hidden = fg_matrix_make(hidden, FG_DTYPE_F32, T, H);
    in.weight = fg_matrix_make(w, FG_DTYPE_F32, V, H);
    tu_linear_outs o;
    tu_linear_outs_make(&o, T, H, V, 0);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    fg_context *ctx = NULL;
    CHECK(fg_context_create(NULL, &ctx) == FG_OK, "%s", "context");
    const fg_linear_options fused = {FG_IMPL_FUSED, 0, 0.0};
    fg_linear_plan_info pi;
    fg_exec ex;
    fg_exec_init(&ex);
    int64_t plans = 0, fast_first = 0, longer_first = 0;
    if (ctx && fg_linear_grpo_plan(ctx, &fused, &cfg, &in, tu_batch_view(&tb), &o.out, &ex, &pi) ==
                   FG_OK) {
        const size_t lo = pi.min_budget_bytes, row = (size_t)V * 8;
        for (size_t b = lo; b < lo + (size_t)n * row; b += row) {
            ex.memory_budget = b;
            if (fg_linear_grpo_plan(ctx, &fused, &cfg, &in, tu_batch_view(&tb), &o.out, &ex, &pi) !=
                FG_OK)
                continue;
            plans++;
            const int64_t F = pi.chunk_rows, g = pi.later_chunk_rows, k = pi.chunks;
            CHECK(g >= 1 && g <= F && F + (k - 1) * g >= n && (k == 1 || F + (k - 2) * g < n),
                  "budget %zu: %lld chunks of %lld then %lld rows do not cover %lld tokens", b,
                  (long long)k, (long long)F, (long long)g, (long long)n);
            longer_first += g < F;
            if (k >= 3 && F >= fast) {
                fast_first++;
                CHECK(g >= fast, "budget %zu: %lld chunks, the first %lld rows (fast), the next "
                      "%lld (slow, < %lld)", b, (long long)k, (long long)F, (long long)g,
                      (long long)fast);
            }
        }
    }
    printf("planner H=%lld n=%lld: %lld plans, %lld of 3 chunks or more with a fast first chunk, "
           "%lld with a longer first chunk\n", (long long)H, (long long)n, (long long)plans,
           (long long)fast_first, (long long)longer_first);
    CHECK(fast_first > 0, "%s", "no plan with a fast first chunk was seen");
    fg_context_destroy(ctx);
    tu_linear_outs_free(&o);
    free(hidden);
    free(w);
    tu_batch_free(&tb);
}

int main(void)
{
    const int avx2 = (dnnl_get_effective_cpu_isa() & ~dnnl_cpu_isa_avx2) == 0;
    fg_gemm_cache *gc = NULL;
    CHECK(fg_gemm_cache_create(&gc) == FG_OK, "%s", "GEMM cache");
    if (gc) {
        static const int64_t Ms[] = {5, 37, 120, 360};
        uint64_t seed = 3;
        for (size_t m = 0; m < sizeof Ms / sizeof Ms[0]; m++) {
            check(gc, Ms[m], 1024, FG_DTYPE_F32, TWO_PIECES, avx2, seed++);
            check(gc, Ms[m], 1024, FG_DTYPE_F32, SMALL_TILE, avx2, seed++);
            check(gc, Ms[m], 1040, FG_DTYPE_F32, TWO_PIECES, avx2, seed++);
            check(gc, Ms[m], 1024, FG_DTYPE_BF16, SMALL_TILE, avx2, seed++);
        }
        fg_gemm_cache_destroy(gc);
    }
    check_library(avx2);
    check_planner(1000);
    printf("worst error %.3g (TOL %.3g)\n", worst, TOL);
    return tu_finish();
}
