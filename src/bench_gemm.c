/*
 * fg_time_bare_gemms: the roofline of a step — the three GEMM-sized products
 * alone, through the same GEMM layer and at the same chunk shapes as the
 * fused path, on random data (never zeros: they can run faster).
 */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "gemm_onednn.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void fill_random(void *p, fg_dtype t, size_t n, uint32_t seed, float scale)
{
    uint32_t x = seed * 2654435761u + 1u;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        float v = ((float)(x >> 8) * (1.0f / 16777216.0f) - 0.5f) * scale;
        if (t == FG_DTYPE_BF16)
            ((uint16_t *)p)[i] = fg_bf16_store(v);
        else
            ((float *)p)[i] = v;
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

fg_status fg_time_bare_gemms(fg_context *ctx, fg_dtype dtype, int64_t n_tokens, int64_t hidden,
                             int64_t vocab, int64_t rows_per_gemm, int reps, double *seconds)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_clear_error(ctx);
    if (!seconds)
        return fg_fail(ctx, FG_ERR_NULL_ARGUMENT, "seconds is NULL");
    if (n_tokens <= 0 || hidden <= 0 || vocab <= 0 || reps <= 0)
        return fg_fail(ctx, FG_ERR_INVALID_SIZE, "sizes and reps must be >= 1");
    if (dtype != FG_DTYPE_F32 && dtype != FG_DTYPE_BF16)
        return fg_fail(ctx, FG_ERR_UNSUPPORTED, "unknown dtype %d", (int)dtype);
    const size_t es = fg_dtype_size(dtype);
    int64_t m = rows_per_gemm;
    if (m <= 0) { /* about the fused path's choice: logits f32 (+ bf16 dlogits) + hbuf + ghbuf */
        size_t row = (size_t)vocab * 4 + (es == 2 && fg_gemm_native_bf16(ctx) ? (size_t)vocab * 2 : 0) +
                     (size_t)hidden * 8;
        m = (int64_t)(ctx->budget / row);
        if (m < 1)
            m = 1;
    }
    if (m > n_tokens)
        m = n_tokens;
    const int64_t blocks = (n_tokens + m - 1) / m;
    m = (n_tokens + blocks - 1) / blocks;
    /* The operands the fused path passes: weight in its storage dtype, the
     * token-side operands in the compute dtype (see gemm_onednn.h). */
    const fg_dtype ct = (dtype == FG_DTYPE_BF16 && fg_gemm_native_bf16(ctx)) ? FG_DTYPE_BF16 : FG_DTYPE_F32;
    const size_t cs = fg_dtype_size(ct);
    fg_gemm_shape g1 = {m, vocab, hidden, ct, dtype, FG_DTYPE_F32, hidden, 1, 1, hidden, vocab, 0, 0, (size_t)32 << 20, FG_BLOCK_LOGITS_M, FG_BLOCK_LOGITS_N};
    fg_gemm_shape g2 = {m, hidden, vocab, ct, dtype, FG_DTYPE_F32, vocab, 1, hidden, 1, hidden, 0, 0, (size_t)32 << 20, FG_BLOCK_DHIDDEN_M, FG_BLOCK_DHIDDEN_N};
    fg_gemm_shape g3 = {vocab, hidden, m, ct, ct, FG_DTYPE_F32, 1, vocab, hidden, 1, hidden, 1, 0, (size_t)32 << 20, FG_BLOCK_DWEIGHT_M, 0};
    const int saved = fg_threads_enter(ctx);
    fg_gemm_scratch need = {0, 0};
    fg_status st = FG_OK;
    if ((st = fg_gemm_prepare(ctx, &g1, &need)) == FG_OK &&
        (st = fg_gemm_prepare(ctx, &g2, &need)) == FG_OK)
        st = fg_gemm_prepare(ctx, &g3, &need);
    const int workers = fg_threads(ctx);
    const size_t sp = fg_gemm_scratch_bytes(&need, workers);
    void *h = malloc((size_t)m * hidden * cs), *w = malloc((size_t)vocab * hidden * es);
    float *logits = malloc((size_t)m * vocab * 4), *gh = malloc((size_t)m * hidden * 4);
    void *dl = malloc((size_t)m * vocab * cs);
    float *gw = malloc((size_t)vocab * hidden * 4);
    void *scratch = sp ? malloc(sp) : NULL;
    double *times = malloc((size_t)reps * sizeof(double));
    if (st == FG_OK && (!h || !w || !logits || !gh || !dl || !gw || (sp && !scratch) || !times))
        st = fg_fail(ctx, FG_ERR_OUT_OF_MEMORY, "cannot allocate the roofline buffers");
    if (st == FG_OK) {
        fill_random(h, ct, (size_t)m * hidden, 1, 2.0f);
        fill_random(w, dtype, (size_t)vocab * hidden, 2, 0.1f);
        fill_random(dl, ct, (size_t)m * vocab, 3, 1e-4f);
        /* First-touch every buffer outside the timings (page faults cost ~3 s/GiB
         * here), then one untimed pass so primitives and caches are warm. */
        memset(gw, 0, (size_t)vocab * hidden * 4);
        memset(logits, 0, (size_t)m * vocab * 4);
        memset(gh, 0, (size_t)m * hidden * 4);
        if (scratch)
            memset(scratch, 0, sp);
        if ((st = fg_gemm_run(ctx, &g1, h, w, logits, NULL, scratch, workers)) == FG_OK &&
            (st = fg_gemm_run(ctx, &g2, dl, w, gh, NULL, scratch, workers)) == FG_OK)
            st = fg_gemm_run(ctx, &g3, dl, h, gw, NULL, scratch, workers);
        for (int r = 0; r < reps && st == FG_OK; r++) {
            double t0 = now_s();
            for (int64_t b = 0; b < blocks && st == FG_OK; b++) {
                if ((st = fg_gemm_run(ctx, &g1, h, w, logits, NULL, scratch, workers)) == FG_OK &&
                    (st = fg_gemm_run(ctx, &g2, dl, w, gh, NULL, scratch, workers)) == FG_OK)
                    st = fg_gemm_run(ctx, &g3, dl, h, gw, NULL, scratch, workers);
            }
            times[r] = now_s() - t0;
        }
    }
    if (st == FG_OK) {
        qsort(times, (size_t)reps, sizeof(double), cmp_double);
        *seconds = times[reps / 2];
    }
    free(h);
    free(w);
    free(logits);
    free(gh);
    free(dl);
    free(gw);
    free(scratch);
    free(times);
    fg_threads_leave(saved);
    return st;
}
