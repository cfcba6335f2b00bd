/*
 * test_row_position: a token's log-prob and entropy do not depend on where
 * its row lies in the call, bit for bit, on every CPU.
 *
 * A training loop scores the same tokens several times in differently
 * ordered batches (TRL shuffles between the old/reference passes and the
 * loss), and the k3 KL of a token against itself must then be exactly 0, as
 * TRL's is: a KL of 1e-13 is a gradient that Adam turns into a full step.
 * oneDNN picks kernels and K blocking from a product's shape, so the library
 * runs every primitive call of the logits product as one whole block of
 * FG_BLOCK_LOGITS_M rows (src/backends/cpu/gemm_onednn.h). Checked here, all bitwise:
 *   - the rows permuted (reversed, and a random permutation): each row's
 *     logp and entropy equal those of the unpermuted call;
 *   - fused with the default budget (one chunk), with the smallest budget
 *     that runs (found by raising it from 64 KiB: chunks of a few rows) and
 *     with one between (chunks of some odd size), and materialized: all agree;
 *   - fused with a plan whose first chunk holds the rows past whole blocks
 *     (check_lead, found by scanning budgets), against materialized;
 *   - the GEMM layer alone (check_gemm_layer): rows reversed, the rows one
 *     and 149 rows later inside a longer product, and inside a product
 *     longer by a whole block;
 * at row counts below, at and above a block, H below and above oneDNN's K
 * blocking (301, 1031: before the fixed blocks, AVX2 moved 333 of 333 rows
 * between a 336- and a 360-row product at 1031, Zen 4 19 of 115 rows),
 * V over more than one column block, f32 and bf16. Nothing here depends on
 * the ISA: the same assertions hold wherever oneDNN runs.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_onednn.h"
#include "test_util.h"

enum { V = 2100 };

static int64_t rows_compared, rows_not_bitwise;

typedef struct run_out {
    float *logp, *ent;
} run_out;

static fg_status run(fg_context *ctx, fg_impl impl, size_t budget, const fg_linear_inputs *in,
                     const int64_t *tok, const uint8_t *mask, int64_t M, run_out *o)
{
    const fg_linear_options lo = {impl, 0, 0.0};
    fg_exec ex;
    fg_exec_init(&ex);
    ex.memory_budget = budget;
    const fg_tokens t = {1, M, tok, mask};
    return fg_linear_logprobs(ctx, &lo, 0.9, in, &t, o->logp, o->ent, &ex);
}

/* Rows of `a` (in its own order) that differ from `b` read through perm:
 * a[i] against b[perm[i]]; *max_diff: the largest |logp| or |entropy|
 * difference. Prints the first few. */
static int64_t differing(const run_out *a, const run_out *b, const int64_t *perm, int64_t M,
                         double *max_diff)
{
    int64_t n = 0;
    *max_diff = 0;
    for (int64_t i = 0; i < M; i++) {
        const int64_t j = perm ? perm[i] : i;
        const int dd = memcmp(&a->logp[i], &b->logp[j], sizeof(float)) != 0 ||
                       memcmp(&a->ent[i], &b->ent[j], sizeof(float)) != 0;
        const double d = fmax(fabs((double)a->logp[i] - b->logp[j]),
                              fabs((double)a->ent[i] - b->ent[j]));
        *max_diff = d > *max_diff || isnan(d) ? d : *max_diff;
        if (dd && n < 3)
            printf("  row %lld (row %lld unpermuted): logp %.9g vs %.9g, entropy %.9g vs %.9g\n",
                   (long long)i, (long long)j, a->logp[i], b->logp[j], a->ent[i], b->ent[j]);
        n += dd;
    }
    rows_compared += M;
    return n;
}

/* Every row bitwise equal; *max_diff only tells by how much they were not. */
static int rows_agree(int64_t differ, double max_diff)
{
    (void)max_diff;
    rows_not_bitwise += differ;
    return differ == 0;
}

/* The smallest budget (within 25%) that runs the fused call: raised from
 * 64 KiB until it does. What a CPU needs (GEMM scratch, weight tiles) is
 * measured here rather than assumed. 0 when none up to 1 GiB did. */
static size_t smallest_budget(fg_context *ctx, const fg_linear_inputs *in, const int64_t *tok,
                              const uint8_t *mask, int64_t M, run_out *o)
{
    for (size_t b = (size_t)64 << 10; b <= (size_t)1 << 30; b += b / 4)
        if (run(ctx, FG_IMPL_FUSED, b, in, tok, mask, M, o) == FG_OK)
            return b;
    return 0;
}

static void check_case(fg_context *ctx, fg_dtype dt, int64_t M, int64_t H, uint64_t seed)
{
    const char *dn = dt == FG_DTYPE_BF16 ? "bf16" : "f32";
    tu_problem p;
    tu_problem_make(&p, 1, M, H, V, dt, 1, seed);
    const fg_linear_inputs in = tu_problem_inputs(&p);
    const size_t es = tu_dtype_size(dt), row = (size_t)p.ldh * es;

    int64_t *perm = tu_xmalloc((size_t)M * sizeof *perm);
    int64_t *tok = tu_xmalloc((size_t)M * sizeof *tok), *ptok = tu_xmalloc((size_t)M * sizeof *ptok);
    uint8_t *mask = tu_xmalloc((size_t)M);
    unsigned char *ph = tu_xmalloc((size_t)M * row);
    run_out base, other;
    base.logp = tu_xmalloc((size_t)M * sizeof(float));
    base.ent = tu_xmalloc((size_t)M * sizeof(float));
    other.logp = tu_xmalloc((size_t)M * sizeof(float));
    other.ent = tu_xmalloc((size_t)M * sizeof(float));
    for (int64_t i = 0; i < M; i++) {
        tok[i] = tu_randint(&p.rng, V);
        mask[i] = 1;
    }

    CHECK(run(ctx, FG_IMPL_MATERIALIZED, 0, &in, tok, mask, M, &base) == FG_OK,
          "%s M=%lld: %s", dn, (long long)M, fg_last_error(ctx));

    /* The same rows through the fused path: one chunk, the smallest chunks
     * and chunks of about a third of the rows (the budget a third of the rows'
     * logits and hidden rows, at most 8 bytes an element, past the smallest) */
    const size_t small = smallest_budget(ctx, &in, tok, mask, M, &other);
    CHECK(small > 0, "%s M=%lld H=%lld: no budget up to 1 GiB runs", dn, (long long)M,
          (long long)H);
    const size_t budgets[3] = {0, small, small + (size_t)(M / 3) * (size_t)(V + H) * 8};
    for (int b = 0; b < 3; b++) {
        tu_fill_nan(other.logp, (size_t)M);
        tu_fill_nan(other.ent, (size_t)M);
        CHECK(run(ctx, FG_IMPL_FUSED, budgets[b], &in, tok, mask, M, &other) == FG_OK,
              "%s M=%lld: %s", dn, (long long)M, fg_last_error(ctx));
        fg_memory_stats ms;
        fg_get_memory_stats(ctx, &ms);
        double md;
        const int64_t d = differing(&other, &base, NULL, M, &md);
        CHECK(rows_agree(d, md), "%s M=%lld H=%lld fused (%lld chunks of %lld rows) vs "
              "materialized: %lld of %lld rows differ, by up to %.2g", dn, (long long)M,
              (long long)H, (long long)ms.chunks, (long long)ms.chunk_rows, (long long)d,
              (long long)M, md);
    }

    /* Permuted rows: reversed, then random. Row i of the permuted call is
     * row perm[i] of the original. */
    for (int kind = 0; kind < 2; kind++) {
        for (int64_t i = 0; i < M; i++)
            perm[i] = kind == 0 ? M - 1 - i : i;
        if (kind == 1)
            for (int64_t i = M - 1; i > 0; i--) {
                const int64_t j = tu_randint(&p.rng, i + 1), t = perm[i];
                perm[i] = perm[j];
                perm[j] = t;
            }
        for (int64_t i = 0; i < M; i++) {
            memcpy(ph + (size_t)i * row, (const unsigned char *)p.hidden_s + (size_t)perm[i] * row,
                   row);
            ptok[i] = tok[perm[i]];
        }
        fg_linear_inputs pin = in;
        pin.hidden.data = ph;
        for (int impl = 0; impl < 2; impl++) {
            CHECK(run(ctx, impl ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED, budgets[2], &pin,
                      ptok, mask, M, &other) == FG_OK,
                  "%s M=%lld: %s", dn, (long long)M, fg_last_error(ctx));
            double md;
            const int64_t d = differing(&other, &base, perm, M, &md);
            CHECK(rows_agree(d, md), "%s M=%lld H=%lld %s rows %s: %lld of %lld rows differ, "
                  "by up to %.2g", dn, (long long)M, (long long)H, impl ? "materialized" : "fused",
                  kind ? "shuffled" : "reversed", (long long)d, (long long)M, md);
        }
    }
    free(perm);
    free(tok);
    free(ptok);
    free(mask);
    free(ph);
    free(base.logp);
    free(base.ent);
    free(other.logp);
    free(other.ent);
    tu_problem_free(&p);
}

/* A plan whose first chunk holds the rows past whole logits blocks
 * (linear_grpo.c, lead_rows): M = 900 rows in three chunks, where equal ones
 * (300 rows) rounded up to whole blocks (432) do not fit but 288 + 288 and a
 * first of 324 do. Found by scanning budgets upward from where the chunks
 * are more than three (counted: chunk rows above an equal split, not a whole
 * number of blocks); each row's logp and entropy then bitwise equal to the
 * materialized call's. Such budgets exist on every CPU: what a CPU changes
 * (GEMM scratch) adds the same bytes to every plan. */
static void check_lead(fg_context *ctx, fg_dtype dt, uint64_t seed)
{
    const int64_t M = 900, H = 301, g = FG_BLOCK_LOGITS_M;
    const char *dn = dt == FG_DTYPE_BF16 ? "bf16" : "f32";
    tu_problem p;
    tu_problem_make(&p, 1, M, H, V, dt, 1, seed);
    const fg_linear_inputs in = tu_problem_inputs(&p);
    int64_t *tok = tu_xmalloc((size_t)M * sizeof *tok);
    uint8_t *mask = tu_xmalloc((size_t)M);
    for (int64_t i = 0; i < M; i++) {
        tok[i] = tu_randint(&p.rng, V);
        mask[i] = 1;
    }
    run_out base, other;
    base.logp = tu_xmalloc((size_t)M * sizeof(float));
    base.ent = tu_xmalloc((size_t)M * sizeof(float));
    other.logp = tu_xmalloc((size_t)M * sizeof(float));
    other.ent = tu_xmalloc((size_t)M * sizeof(float));
    CHECK(run(ctx, FG_IMPL_MATERIALIZED, 0, &in, tok, mask, M, &base) == FG_OK, "%s: %s", dn,
          fg_last_error(ctx));
    fg_memory_stats ms = {0};
    size_t b = smallest_budget(ctx, &in, tok, mask, M, &other), found = 0;
    const size_t step = (size_t)(V + H) * 4; /* about a row's logits and hidden row */
    for (; b > 0 && b <= (size_t)1 << 30 && !found; b += (ms.chunks > 4 ? 16 : 1) * step) {
        if (run(ctx, FG_IMPL_FUSED, b, &in, tok, mask, M, &other) != FG_OK)
            continue;
        fg_get_memory_stats(ctx, &ms);
        if (ms.chunks < 3)
            break;
        if (ms.chunk_rows > (M + ms.chunks - 1) / ms.chunks && ms.chunk_rows % g != 0)
            found = b;
    }
    CHECK(found, "%s: no budget gave a plan with a longer first chunk", dn);
    if (found) {
        double md;
        const int64_t d = differing(&other, &base, NULL, M, &md);
        CHECK(rows_agree(d, md), "%s M=%lld fused (%lld chunks, the first %lld rows, budget %zu) "
              "vs materialized: %lld rows differ, by up to %.2g", dn, (long long)M,
              (long long)ms.chunks, (long long)ms.chunk_rows, found, (long long)d, md);
        printf("%s M=%lld: budget %zu gives %lld chunks, the first of %lld rows\n", dn,
               (long long)M, found, (long long)ms.chunks, (long long)ms.chunk_rows);
    }
    free(tok);
    free(mask);
    free(base.logp);
    free(base.ent);
    free(other.logp);
    free(other.ent);
    tu_problem_free(&p);
}

/* The GEMM layer itself, on M rows of A (K = H) times Wᵀ (N = V, two column
 * blocks), the logits product's shape (fixed blocks):
 *   (a) the rows reversed;
 *   (b) the rows 1 and g + 5 rows later inside a longer product (the rows
 *       before them random), so that each row sits at another place of its
 *       block and, for M past a block, in other blocks;
 *   (c) the rows inside a product a whole block longer (the first rows of
 *       a product of M + g rows).
 * Each row of C bitwise equal to the same row of the plain product. The
 * counts are printed and summed into the totals below. */
static int64_t gemm_layer_not_bitwise, gemm_layer_rows;

static int64_t rows_differ(const float *a, const float *b, int64_t M, int64_t N, int reverse_b,
                           double *md)
{
    int64_t n = 0;
    for (int64_t r = 0; r < M; r++) {
        const float *x = a + r * N, *y = b + (reverse_b ? M - 1 - r : r) * N;
        int d = 0;
        for (int64_t j = 0; j < N; j++) {
            d |= memcmp(&x[j], &y[j], sizeof(float)) != 0;
            *md = fmax(*md, fabs((double)x[j] - y[j]));
        }
        n += d;
    }
    gemm_layer_not_bitwise += n;
    gemm_layer_rows += M;
    return n;
}

static int gemm(fg_gemm_cache *gc, int64_t M, int64_t K, const float *A, const float *W, float *C)
{
    const fg_gemm_shape s = {M, V, K, FG_DTYPE_F32, FG_DTYPE_F32, FG_DTYPE_F32, K, 1, 1, K, V, 0,
                             0, 0, FG_BLOCK_LOGITS_M, FG_BLOCK_LOGITS_N, 1, 0};
    fg_error err;
    fg_gemm_scratch need = {0, 0};
    if (fg_gemm_prepare(gc, &s, 2, &need, &err) != FG_OK)
        return 1;
    void *scratch = tu_xmalloc_aligned(fg_gemm_scratch_bytes(&need, 2) + 64);
    const int bad = fg_gemm_run(gc, &s, A, W, C, NULL, scratch, 2, NULL, &err) != FG_OK;
    free(scratch);
    return bad;
}

static void check_gemm_layer(fg_gemm_cache *gc, int64_t M, int64_t K, uint64_t seed)
{
    const int64_t g = FG_BLOCK_LOGITS_M, N = V, Mx = M + g + 5; /* the longest product */
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    float *A = tu_xmalloc_aligned((size_t)(Mx * K) * sizeof(float)); /* rows, then others */
    float *Ar = tu_xmalloc_aligned((size_t)(M * K) * sizeof(float));
    float *Ash = tu_xmalloc_aligned((size_t)(Mx * K) * sizeof(float));
    float *W = tu_xmalloc_aligned((size_t)(N * K) * sizeof(float));
    float *C1 = tu_xmalloc_aligned((size_t)(M * N) * sizeof(float));
    float *C2 = tu_xmalloc_aligned((size_t)(Mx * N) * sizeof(float));
    for (int64_t i = 0; i < Mx * K; i++)
        A[i] = (float)tu_normal(&rng);
    for (int64_t i = 0; i < N * K; i++)
        W[i] = (float)(0.1 * tu_normal(&rng));
    for (int64_t r = 0; r < M; r++)
        memcpy(Ar + r * K, A + (M - 1 - r) * K, (size_t)K * sizeof(float));
    double md = 0;
    int ok = gemm(gc, M, K, A, W, C1) == 0 && gemm(gc, M, K, Ar, W, C2) == 0;
    CHECK(ok, "GEMM M=%lld K=%lld", (long long)M, (long long)K);
    const int64_t d_rev = ok ? rows_differ(C2, C1, M, N, 1, &md) : 0;
    CHECK(d_rev == 0, "GEMM layer M=%lld K=%lld rows reversed: %lld rows differ, by up to %.2g",
          (long long)M, (long long)K, (long long)d_rev, md);
    int64_t d_shift = 0;
    const int64_t shifts[2] = {1, g + 5};
    for (int k = 0; k < 2 && ok; k++) { /* (b): other rows first, then these */
        const int64_t sh = shifts[k];
        memcpy(Ash, A + M * K, (size_t)(sh * K) * sizeof(float));
        memcpy(Ash + sh * K, A, (size_t)(M * K) * sizeof(float));
        md = 0;
        ok = gemm(gc, M + sh, K, Ash, W, C2) == 0;
        CHECK(ok, "GEMM M=%lld K=%lld", (long long)(M + sh), (long long)K);
        const int64_t d = ok ? rows_differ(C2 + sh * N, C1, M, N, 0, &md) : 0;
        CHECK(d == 0, "GEMM layer M=%lld K=%lld rows %lld later: %lld rows differ, by up to %.2g",
              (long long)M, (long long)K, (long long)sh, (long long)d, md);
        d_shift += d;
    }
    int64_t d_long = 0;
    if (ok) { /* (c): then a block of other rows after them */
        md = 0;
        ok = gemm(gc, M + g, K, A, W, C2) == 0;
        CHECK(ok, "GEMM M=%lld K=%lld", (long long)(M + g), (long long)K);
        d_long = ok ? rows_differ(C2, C1, M, N, 0, &md) : 0;
        CHECK(d_long == 0, "GEMM layer M=%lld K=%lld in a product of %lld rows: %lld rows "
              "differ, by up to %.2g", (long long)M, (long long)K, (long long)(M + g),
              (long long)d_long, md);
    }
    printf("GEMM layer M=%lld K=%lld: rows not bitwise equal: reversed %lld, later %lld (of "
           "2 x %lld), in a longer product %lld (of %lld)\n", (long long)M, (long long)K,
           (long long)d_rev, (long long)d_shift, (long long)M, (long long)d_long, (long long)M);
    free(A);
    free(Ar);
    free(Ash);
    free(W);
    free(C1);
    free(C2);
}

int main(void)
{
    fg_context_options opt;
    fg_context_options_init(&opt);
    opt.threads = 2;
    fg_context *ctx = NULL;
    if (fg_context_create(&opt, &ctx) != FG_OK) {
        CHECK(0, "%s", "context create");
        return tu_finish();
    }
    static const int64_t Ms[] = {5, 23, 24, 25, 115, 128, 143, 144, 145, 333, 509, 530};
    static const int64_t Hs[] = {45, 301};
    uint64_t seed = 11;
    for (int d = 0; d < 2; d++) {
        const fg_dtype dt = d ? FG_DTYPE_BF16 : FG_DTYPE_F32;
        for (size_t h = 0; h < sizeof Hs / sizeof Hs[0]; h++)
            for (size_t m = 0; m < sizeof Ms / sizeof Ms[0]; m++)
                check_case(ctx, dt, Ms[m], Hs[h], seed++);
        /* H past oneDNN's K blocking, at row counts whose products (before the
         * fixed blocks) ran no-copy (25, 333) and packed (340, 530) on AVX2 */
        static const int64_t Mk[] = {25, 333, 340, 530};
        for (size_t m = 0; m < sizeof Mk / sizeof Mk[0]; m++)
            check_case(ctx, dt, Mk[m], 1031, seed++);
        check_lead(ctx, dt, seed++);
    }
    fg_context_destroy(ctx);
    fg_gemm_cache *gc = NULL;
    CHECK(fg_gemm_cache_create(&gc) == FG_OK, "%s", "GEMM cache");
    if (gc) {
        static const int64_t Mt[] = {5, 25, 115, 333, 509};
        for (size_t m = 0; m < sizeof Mt / sizeof Mt[0]; m++) {
            check_gemm_layer(gc, Mt[m], 301, seed++);
            check_gemm_layer(gc, Mt[m], 1031, seed++);
        }
        printf("GEMM layer: %lld of %lld rows not bitwise equal to their reference\n",
               (long long)gemm_layer_not_bitwise, (long long)gemm_layer_rows);
        fg_gemm_cache_destroy(gc);
    }
    printf("rows not bitwise equal to their reference: %lld of %lld compared\n",
           (long long)rows_not_bitwise, (long long)rows_compared);
    return tu_finish();
}
