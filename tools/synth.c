/* Seeded synthetic batches: see synth.h for what and why. */
#include "synth.h"

#include "rng.h"
#include "tool_gemm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

void ft_synth_shape(const ft_config *cfg, ft_problem_shape *s)
{
    s->batch = cfg->batch;
    s->seq_len = cfg->seq_len;
    s->hidden = cfg->hidden;
    s->vocab = cfg->vocab;
    s->dtype = cfg->dtype;
    s->has_bias = cfg->use_bias;
    s->has_old = cfg->use_old_logp;
    s->has_ref = cfg->use_ref_logp;
    s->is_ratio = cfg->is_ratio;
}

/* n normals of std `std` from stream, stored in dtype, in parallel blocks. */
static void fill_normal(void *dst, int dtype, int64_t n, uint64_t seed, uint64_t stream, double std)
{
    enum { BLK = 4096 };
#pragma omp parallel for schedule(static)
    for (int64_t b0 = 0; b0 < n; b0 += BLK) {
        float tmp[BLK];
        int64_t len = n - b0 < BLK ? n - b0 : BLK;
        ft_rng_normal_fill(seed, stream, (uint64_t)b0, std, tmp, len);
        for (int64_t k = 0; k < len; k++)
            ft_store(dst, dtype, b0 + k, tmp[k]);
    }
}

/* Samples each unmasked row's token from softmax(z / temperature) and
 * returns its log-prob; rows of logits are computed ROWS at a time. bf16
 * operands are widened to float32 once up front (the parent process can
 * afford the copy) instead of once per row block inside the GEMM helper. */
static int sample_tokens(ft_problem *p, const ft_config *cfg, float *logp, char *err, size_t errlen)
{
    enum { ROWS = 256 };
    const int64_t N = ft_problem_tokens(p), V = p->s.vocab, H = p->s.hidden;
    const int64_t rows = N < ROWS ? N : ROWS;
    const int wide = p->s.dtype != FT_DTYPE_F32;
    const double inv_t = 1.0 / cfg->temperature;
    float *z = malloc((size_t)(rows * V) * sizeof *z);
    float *w32 = wide ? malloc((size_t)(V * H) * sizeof *w32) : NULL;
    float *b32 = wide && p->bias ? malloc((size_t)V * sizeof *b32) : NULL;
    float *h32 = wide ? malloc((size_t)(rows * H) * sizeof *h32) : NULL;
    ft_gemm_ws ws = {NULL, 0};
    int rc = 0;
    if (z == NULL || (wide && (w32 == NULL || h32 == NULL || (p->bias && b32 == NULL)))) {
        snprintf(err, errlen, "out of memory for synthetic logits");
        rc = -1;
    }
    if (rc == 0 && wide) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < V * H; i++)
            w32[i] = ft_load(p->weight, p->s.dtype, i);
        for (int64_t i = 0; b32 && i < V; i++)
            b32[i] = ft_load(p->bias, p->s.dtype, i);
    }
    const void *weight = wide ? (const void *)w32 : p->weight;
    const void *bias = wide ? (const void *)b32 : p->bias;
    for (int64_t r0 = 0; r0 < N && rc == 0; r0 += rows) {
        int64_t m = N - r0 < rows ? N - r0 : rows;
        const void *h = (const char *)p->hidden + (size_t)(r0 * H) * ft_dtype_size(p->s.dtype);
        if (wide) {
            for (int64_t i = 0; i < m * H; i++)
                h32[i] = ft_load(p->hidden, p->s.dtype, r0 * H + i);
            h = h32;
        }
        rc = ft_gemm_logits(&ws, FT_DTYPE_F32, h, m, weight, bias, V, H, z, FT_DTYPE_F32, err,
                            errlen);
        if (rc != 0)
            break;
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t i = 0; i < m; i++) {
            int64_t n = r0 + i;
            if (!p->mask[n]) {
                p->token_ids[n] = -1;
                logp[n] = 0.0f;
                continue;
            }
            const float *row = z + i * V;
            double mx = -INFINITY;
            for (int64_t v = 0; v < V; v++)
                mx = fmax(mx, row[v] * inv_t);
            double sum = 0;
            for (int64_t v = 0; v < V; v++)
                sum += exp(row[v] * inv_t - mx);
            double target = ft_rng_uniform(cfg->seed, FT_STREAM_TOKENS, (uint64_t)n) * sum, acc = 0;
            int64_t tok = V - 1;
            for (int64_t v = 0; v < V; v++) {
                acc += exp(row[v] * inv_t - mx);
                if (acc >= target) {
                    tok = v;
                    break;
                }
            }
            p->token_ids[n] = tok;
            logp[n] = (float)(row[tok] * inv_t - mx - log(sum));
        }
    }
    ft_gemm_ws_free(&ws);
    free(z);
    free(w32);
    free(b32);
    free(h32);
    return rc;
}

int ft_synth_fill(ft_problem *p, const ft_config *cfg, char *err, size_t errlen)
{
    const int64_t B = p->s.batch, T = p->s.seq_len, H = p->s.hidden, V = p->s.vocab, N = B * T;
    const uint64_t seed = cfg->seed;

    fill_normal(p->hidden, p->s.dtype, N * H, seed, FT_STREAM_HIDDEN, 1.0);
    fill_normal(p->weight, p->s.dtype, V * H, seed, FT_STREAM_WEIGHT, cfg->logit_scale / sqrt((double)H));
    if (p->bias)
        fill_normal(p->bias, p->s.dtype, V, seed, FT_STREAM_BIAS, 0.5);

    int64_t min_len = (int64_t)ceil(cfg->mask_min_frac * (double)T);
    for (int64_t b = 0; b < B; b++) {
        double u = ft_rng_uniform(seed, FT_STREAM_MASK, (uint64_t)b);
        int64_t len = min_len + (int64_t)(u * (double)(T - min_len + 1));
        if (len > T)
            len = T;
        for (int64_t t = 0; t < T; t++)
            p->mask[b * T + t] = t < len;
        p->advantages[b] = (float)ft_rng_normal(seed, FT_STREAM_ADVANTAGES, (uint64_t)b);
    }

    float *logp = malloc((size_t)N * sizeof *logp);
    if (logp == NULL) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (sample_tokens(p, cfg, logp, err, errlen) != 0) {
        free(logp);
        return -1;
    }
    /* Near the true log-probs, never above 0 (they are log-probabilities). */
    for (int64_t n = 0; n < N; n++) {
        int on = p->mask[n] != 0;
        if (p->old_logp)
            p->old_logp[n] = on ? fminf(0.0f, logp[n] + (float)(cfg->old_logp_noise *
                                                                 ft_rng_normal(seed, FT_STREAM_OLD, (uint64_t)n)))
                                : 0.0f;
        if (p->ref_logp)
            p->ref_logp[n] = on ? fminf(0.0f, logp[n] + (float)(cfg->ref_logp_noise *
                                                                 ft_rng_normal(seed, FT_STREAM_REF, (uint64_t)n)))
                                : 0.0f;
    }
    if (p->is_ratio) {
        int64_t count = p->s.is_ratio == FT_ISR_TOKEN ? N : B;
        for (int64_t i = 0; i < count; i++)
            p->is_ratio[i] = (float)exp(0.05 * ft_rng_normal(seed, FT_STREAM_IS_RATIO, (uint64_t)i));
    }
    free(logp);
    return 0;
}
