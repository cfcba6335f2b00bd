/*
 * The seeded synthetic batch of `gradcheck` and `bench`.
 *
 * Chosen to exercise the loss where it is delicate rather than to look like
 * any particular model: hidden ~ N(0, 1) and weight ~ N(0, logit_scale^2/H)
 * so logits spread a few units; right-padded ragged masks (lengths uniform in
 * [mask_min_frac*T, T], so 0 allows an empty sequence); tokens sampled from
 * the model's own softmax (one forward GEMM) so log-probs are realistic;
 * old/ref log-probs equal the true ones plus Gaussian noise so ratios
 * straddle both clip bounds; advantages ~ N(0, 1) (both signs); masked token
 * ids are -1 because the spec says they are never read.
 *
 * Random numbers are counter-based: value i of stream s under seed k is a
 * pure function of (k, s, i), so the batch is identical whatever the thread
 * count or fill order, and one tensor's shape never changes another's values.
 */
#include "synth.h"

#include "gemm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* One stream per tensor so that changing one shape leaves the others alone. */
enum { S_HIDDEN = 1, S_WEIGHT, S_BIAS, S_MASK, S_ADVANTAGES, S_TOKENS, S_OLD, S_REF, S_IS_RATIO };

/* splitmix64's finalizer over a keyed counter. */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in the open interval (0, 1). */
static double uniform(uint64_t seed, uint64_t stream, uint64_t i)
{
    uint64_t key = mix64(seed * 0x9e3779b97f4a7c15ull + stream * 0xd1b54a32d192ed03ull + 1);
    return ((double)(mix64(key + (i + 1) * 0x9e3779b97f4a7c15ull) >> 11) + 0.5) * 0x1.0p-53;
}

/* Standard normals: values 2j and 2j+1 are the Box-Muller pair of draw j. */
static void normal_pair(uint64_t seed, uint64_t stream, uint64_t j, double out[2])
{
    double r = sqrt(-2.0 * log(uniform(seed, stream, 2 * j)));
    double th = 6.283185307179586 * uniform(seed, stream, 2 * j + 1);
    out[0] = r * cos(th);
    out[1] = r * sin(th);
}

static double normal(uint64_t seed, uint64_t stream, uint64_t i)
{
    double pair[2];
    normal_pair(seed, stream, i / 2, pair);
    return pair[i & 1];
}

/* n normals of std `std` from stream, stored in dtype, in parallel pairs. */
static void fill_normal(void *dst, int dtype, int64_t n, uint64_t seed, uint64_t stream, double std)
{
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < (n + 1) / 2; j++) {
        double pair[2];
        normal_pair(seed, stream, (uint64_t)j, pair);
        for (int64_t k = 2 * j; k < 2 * j + 2 && k < n; k++)
            ft_store(dst, dtype, k, (float)(std * pair[k & 1]));
    }
}

/* The true log-prob plus noise, never above 0 (it is a log-probability). */
static float near(double logp, double noise, uint64_t seed, uint64_t stream, int64_t n)
{
    return fminf(0.0f, (float)(logp + noise * normal(seed, stream, (uint64_t)n)));
}

/* Samples each unmasked row's token from softmax(z / temperature), with
 * old/ref log-probs near its true one; the logits are computed ROWS rows at
 * a time. Masked rows keep the zeros of a fresh problem, token -1. */
static int sample_tokens(ft_problem *p, const ft_config *cfg, char *err, size_t errlen)
{
    enum { ROWS = 256 };
    const int64_t N = ft_problem_tokens(p), V = p->s.vocab, H = p->s.hidden;
    const double inv_t = 1.0 / cfg->temperature;
    const uint64_t seed = (uint64_t)cfg->seed;
    float *z = malloc((size_t)ROWS * (size_t)V * sizeof *z);
    ft_gemm g = {0};
    int rc = z ? ft_gemm_init(&g, (int)cfg->threads, 0, err, errlen) : ft_error(err, errlen, "out of memory");
    for (int64_t r0 = 0; r0 < N && rc == 0; r0 += ROWS) {
        const int64_t m = N - r0 < ROWS ? N - r0 : ROWS;
        const char *h = (const char *)p->hidden + (size_t)(r0 * H) * ft_dtype_size(p->s.dtype);
        rc = ft_gemm_logits(&g, p->s.dtype, h, m, p->s.dtype, p->weight, p->bias, V, H, FG_DTYPE_F32, z);
        if (rc != 0) {
            ft_error(err, errlen, "synthetic logits: %s", g.err.msg);
            break;
        }
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t i = 0; i < m; i++) {
            const int64_t n = r0 + i;
            const float *row = z + i * V;
            p->token_ids[n] = -1;
            if (!p->mask[n])
                continue;
            double mx = -INFINITY, sum = 0, acc = 0;
            for (int64_t v = 0; v < V; v++)
                mx = fmax(mx, row[v] * inv_t);
            for (int64_t v = 0; v < V; v++)
                sum += exp(row[v] * inv_t - mx);
            const double target = uniform(seed, S_TOKENS, (uint64_t)n) * sum;
            int64_t tok = V - 1;
            for (int64_t v = 0; v < V && tok == V - 1; v++)
                if ((acc += exp(row[v] * inv_t - mx)) >= target)
                    tok = v;
            p->token_ids[n] = tok;
            const double logp = row[tok] * inv_t - mx - log(sum);
            if (p->old_logp)
                p->old_logp[n] = near(logp, cfg->old_logp_noise, seed, S_OLD, n);
            if (p->ref_logp)
                p->ref_logp[n] = near(logp, cfg->ref_logp_noise, seed, S_REF, n);
        }
    }
    ft_gemm_free(&g);
    free(z);
    return rc;
}

int ft_synth_fill(ft_problem *p, const ft_config *cfg, char *err, size_t errlen)
{
    const int64_t B = p->s.batch, T = p->s.seq_len, H = p->s.hidden, V = p->s.vocab, N = B * T;
    const uint64_t seed = (uint64_t)cfg->seed;
    fill_normal(p->hidden, p->s.dtype, N * H, seed, S_HIDDEN, 1.0);
    fill_normal(p->weight, p->s.dtype, V * H, seed, S_WEIGHT, cfg->logit_scale / sqrt((double)H));
    if (p->bias)
        fill_normal(p->bias, p->s.dtype, V, seed, S_BIAS, 0.5);
    const int64_t min_len = (int64_t)ceil(cfg->mask_min_frac * (double)T);
    for (int64_t b = 0; b < B; b++) {
        int64_t len = min_len + (int64_t)(uniform(seed, S_MASK, (uint64_t)b) * (double)(T - min_len + 1));
        for (int64_t t = 0; t < T; t++)
            p->mask[b * T + t] = t < len;
        p->advantages[b] = (float)normal(seed, S_ADVANTAGES, (uint64_t)b);
    }
    const int64_t ratios = p->s.is_ratio == FT_ISR_TOKEN ? N : p->s.is_ratio == FT_ISR_SEQUENCE ? B : 0;
    for (int64_t i = 0; i < ratios; i++)
        p->is_ratio[i] = (float)exp(0.05 * normal(seed, S_IS_RATIO, (uint64_t)i));
    return sample_tokens(p, cfg, err, errlen);
}
