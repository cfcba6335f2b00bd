/* Oracle or float32-baseline references: see reference.h. */
#include "reference.h"

#include "bigbuf.h"
#include "fusedgrpo.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ORACLE_MAX_NV 1.5e8 /* [N, V] doubles: 1.2 GB per array */

int ft_reference_pick(const ft_config *cfg, const ft_problem *p)
{
    if (cfg->reference != FT_REF_AUTO)
        return cfg->reference;
    double nv = (double)ft_problem_tokens(p) * (double)p->s.vocab;
    return nv * (double)p->s.hidden <= cfg->oracle_limit && nv <= ORACLE_MAX_NV ? FT_REF_ORACLE
                                                                               : FT_REF_BASELINE;
}

static double *widen64(const void *src, int dtype, int64_t n)
{
    double *d = malloc((size_t)(n > 0 ? n : 1) * sizeof *d);
    if (d)
        for (int64_t i = 0; i < n; i++)
            d[i] = ft_load(src, dtype, i);
    return d;
}

static int run_oracle(ft_reference *ref, const ft_config *cfg, const ft_problem *p, int impl,
                      const void *logits, char *err, size_t errlen)
{
    fg_loss_config loss;
    fg_batch batch;
    if (ft_loss_config_from(cfg, &loss, err, errlen) != 0)
        return -1;
    ft_batch_from(p, &batch);
    const int64_t N = ft_problem_tokens(p), H = p->s.hidden, V = p->s.vocab;
    int rc;
    if (impl == FT_IMPL_LOGITS) {
        double *z = widen64(logits, p->s.dtype, N * V);
        if (z == NULL) {
            snprintf(err, errlen, "out of memory for the oracle's logits");
            return -1;
        }
        rc = fg_oracle_logits(&loss, &batch, z, V, &ref->oracle);
        free(z);
    } else {
        double *h = widen64(p->hidden, p->s.dtype, N * H);
        double *w = widen64(p->weight, p->s.dtype, V * H);
        double *b = p->bias ? widen64(p->bias, p->s.dtype, V) : NULL;
        if (h == NULL || w == NULL || (p->bias && b == NULL))
            rc = -1;
        else
            rc = fg_oracle_linear(&loss, &batch, h, w, b, H, V, &ref->oracle);
        free(h);
        free(w);
        free(b);
    }
    if (rc != 0) {
        snprintf(err, errlen, "the float64 oracle refused the batch (bad input or out of memory)");
        return -1;
    }
    ref->has_oracle = 1;
    ref->loss = ref->oracle.loss;
    ref->metrics = ref->oracle.metrics;
    ref->logp = ft_view_make(ref->oracle.logp, FT_VIEW_F64);
    ref->entropy = ft_view_make(ref->oracle.entropy, FT_VIEW_F64);
    ref->grad_logits = ft_view_make(ref->oracle.grad_logits, FT_VIEW_F64);
    ref->grad_hidden = ft_view_make(ref->oracle.grad_hidden, FT_VIEW_F64);
    ref->grad_weight = ft_view_make(ref->oracle.grad_weight, FT_VIEW_F64);
    ref->grad_bias = ft_view_make(ref->oracle.grad_bias, FT_VIEW_F64);
    return 0;
}

/* A float32 copy of a bf16 problem (the baseline reference reads float32). */
static int widen_problem(const ft_problem *p, ft_problem *out, char *err, size_t errlen)
{
    ft_problem_shape s = p->s;
    s.dtype = FT_DTYPE_F32;
    if (ft_problem_create(&s, out, err, errlen) != 0)
        return -1;
    const int64_t N = ft_problem_tokens(p), H = s.hidden, V = s.vocab;
    for (int64_t i = 0; i < N * H; i++)
        ((float *)out->hidden)[i] = ft_load(p->hidden, p->s.dtype, i);
    for (int64_t i = 0; i < V * H; i++)
        ((float *)out->weight)[i] = ft_load(p->weight, p->s.dtype, i);
    if (p->bias)
        for (int64_t i = 0; i < V; i++)
            ((float *)out->bias)[i] = ft_load(p->bias, p->s.dtype, i);
    memcpy(out->token_ids, p->token_ids, (size_t)N * sizeof(int64_t));
    memcpy(out->mask, p->mask, (size_t)N);
    memcpy(out->advantages, p->advantages, (size_t)s.batch * sizeof(float));
    if (p->old_logp)
        memcpy(out->old_logp, p->old_logp, (size_t)N * sizeof(float));
    if (p->ref_logp)
        memcpy(out->ref_logp, p->ref_logp, (size_t)N * sizeof(float));
    if (p->is_ratio)
        memcpy(out->is_ratio, p->is_ratio,
               (size_t)(s.is_ratio == FT_ISR_TOKEN ? N : s.batch) * sizeof(float));
    return 0;
}

static int run_baseline_linear(ft_reference *ref, const ft_config *cfg, const ft_problem *p,
                               char *err, size_t errlen)
{
    const ft_problem *src = p;
    if (p->s.dtype != FT_DTYPE_F32) {
        if (widen_problem(p, &ref->f32p, err, errlen) != 0)
            return -1;
        src = &ref->f32p;
    }
    ft_config c = *cfg;
    c.round_logits = 0;
    c.dtype = FT_DTYPE_F32;
    ref->has_base = 1;
    if (ft_runner_init(&ref->base, &c, src, FT_IMPL_BASELINE, 1) != 0 ||
        ft_runner_step(&ref->base) != 0) {
        snprintf(err, errlen, "baseline reference: %s", ref->base.err);
        return -1;
    }
    ref->loss = ref->base.loss_value;
    ref->metrics = ref->base.metrics;
    ref->logp = ft_view_make(ref->base.logp, FT_VIEW_F32);
    ref->entropy = ft_view_make(ref->base.entropy, FT_VIEW_F32);
    ref->grad_hidden = ft_view_make(ref->base.grad_hidden, FT_VIEW_F32);
    ref->grad_weight = ft_view_make(ref->base.grad_weight, FT_VIEW_F32);
    ref->grad_bias = ft_view_make(ref->base.grad_bias, FT_VIEW_F32);
    return 0;
}

static int run_baseline_logits(ft_reference *ref, const ft_config *cfg, const ft_problem *p,
                               const void *logits, char *err, size_t errlen)
{
    const int64_t N = ft_problem_tokens(p), V = p->s.vocab;
    ref->buf_bytes = (size_t)(2 * N * V + 2 * N) * sizeof(float);
    ref->buf = ft_big_alloc(ref->buf_bytes);
    if (ref->buf == NULL) {
        snprintf(err, errlen, "out of memory for the baseline reference");
        return -1;
    }
    float *z = ref->buf, *dz = z + N * V, *logp = dz + N * V, *ent = logp + N;
    for (int64_t i = 0; i < N * V; i++)
        z[i] = ft_load(logits, p->s.dtype, i);
    fg_loss_config loss;
    fg_batch batch;
    fg_context *ctx = NULL;
    ft_config c = *cfg;
    if (ft_loss_config_from(&c, &loss, err, errlen) != 0 || ft_context_from(&c, &ctx, err, errlen) != 0)
        return -1;
    ft_batch_from(p, &batch);
    fg_matrix zm = fg_matrix_make(z, FG_DTYPE_F32, N, V);
    fg_outputs o;
    memset(&o, 0, sizeof o);
    o.logp = logp;
    o.entropy = ent;
    o.grad_logits = fg_matrix_make(dz, FG_DTYPE_F32, N, V);
    fg_status st = fg_logits_grpo(ctx, &loss, &zm, &batch, &o);
    if (st != FG_OK) {
        char msg[900];
        ft_describe_status(ctx, st, msg, sizeof msg);
        snprintf(err, errlen, "baseline reference: fg_logits_grpo: %s", msg);
        fg_context_destroy(ctx);
        return -1;
    }
    fg_context_destroy(ctx);
    ref->loss = o.loss;
    ref->metrics = o.metrics;
    ref->logp = ft_view_make(logp, FT_VIEW_F32);
    ref->entropy = ft_view_make(ent, FT_VIEW_F32);
    ref->grad_logits = ft_view_make(dz, FT_VIEW_F32);
    return 0;
}

int ft_reference_run(ft_reference *ref, int kind, const ft_config *cfg, const ft_problem *p,
                     int impl, const void *logits, char *err, size_t errlen)
{
    memset(ref, 0, sizeof *ref);
    ref->f32p.fd = -1;
    ref->kind = kind;
    if (kind == FT_REF_ORACLE)
        return run_oracle(ref, cfg, p, impl, logits, err, errlen);
    if (impl == FT_IMPL_LOGITS)
        return run_baseline_logits(ref, cfg, p, logits, err, errlen);
    return run_baseline_linear(ref, cfg, p, err, errlen);
}

void ft_reference_free(ft_reference *ref)
{
    if (ref->has_oracle)
        fg_oracle_result_free(&ref->oracle);
    if (ref->has_base)
        ft_runner_free(&ref->base);
    if (ref->f32p.base)
        ft_problem_destroy(&ref->f32p);
    ft_big_free(ref->buf, ref->buf_bytes);
    memset(ref, 0, sizeof *ref);
}
