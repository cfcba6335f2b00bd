/* Shared per-call state and output writing (see finish.h). */
#include <math.h>
#include <string.h>

#include "finish.h"

size_t fg_common_workspace_bytes(int64_t B, int64_t N)
{
    return fg_ws_round((size_t)fg_loss_plan_scratch_doubles(B) * sizeof(double)) +
           fg_ws_round((size_t)N * sizeof(int64_t)) + 5 * fg_ws_round((size_t)N * sizeof(float));
}

/* The per-token arrays and the list of unmasked rows. */
static void init_tokens(fg_arena *arena, fg_common *c, const fg_batch *batch)
{
    const int64_t N = batch->batch * batch->seq_len;
    c->active = fg_arena_take(arena, (size_t)N * sizeof(int64_t));
    c->ta.logp = fg_arena_take(arena, (size_t)N * sizeof(float));
    c->ta.entropy = fg_arena_take(arena, (size_t)N * sizeof(float));
    c->ta.zmax = fg_arena_take(arena, (size_t)N * sizeof(float));
    c->ta.lsum = fg_arena_take(arena, (size_t)N * sizeof(float));
    c->sort = fg_arena_take(arena, (size_t)N * sizeof(float));
    c->n_active = 0;
    for (int64_t n = 0; n < N; n++) {
        c->ta.logp[n] = c->ta.entropy[n] = c->ta.zmax[n] = c->ta.lsum[n] = 0.0f;
        if (batch->mask[n])
            c->active[c->n_active++] = n;
    }
}

void fg_common_init(fg_arena *arena, fg_common *c, const fg_loss_config *cfg,
                    const fg_batch *batch)
{
    const int64_t B = batch->batch;
    double *scratch = fg_arena_take(arena, (size_t)fg_loss_plan_scratch_doubles(B) * sizeof(double));
    fg_loss_plan_init(&c->plan, cfg, batch, scratch);
    init_tokens(arena, c, batch);
}

void fg_common_init_external(fg_arena *arena, fg_common *c, const fg_batch *batch,
                             const float *dlogp, const float *dentropy)
{
    /* The loss scratch is taken all the same: the arena's layout, and so
     * fg_common_workspace_bytes, is the same for every kind of call. */
    (void)fg_arena_take(arena, (size_t)fg_loss_plan_scratch_doubles(batch->batch) * sizeof(double));
    fg_loss_plan_init_external(&c->plan, batch, dlogp, dentropy);
    init_tokens(arena, c, batch);
}

fg_status fg_common_check_tokens(const fg_common *c, fg_error *err, const int64_t *tok,
                                 int64_t count, int scanned, fg_grad_bound *gb)
{
    const int64_t T = c->plan.T;
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = tok[i];
        const float logp = c->ta.logp[n], entropy = c->ta.entropy[n];
        if (!(isfinite(logp) && isfinite(entropy) && isfinite(c->ta.zmax[n]) &&
              isfinite(c->ta.lsum[n]))) {
            if (scanned)
                return fg_fail(err, FG_ERR_OVERFLOW,
                               "token [%lld, %lld]: its log-prob (%g) or entropy (%g) came out "
                               "non-finite from finite inputs",
                               (long long)(n / T), (long long)(n % T), (double)logp,
                               (double)entropy);
            return fg_fail(err, FG_ERR_NONFINITE_INPUT,
                           "token [%lld, %lld]: the logits came out NaN or Inf (the finite check "
                           "was off: the inputs may hold NaN/Inf); results are invalid",
                           (long long)(n / T), (long long)(n % T));
        }
        if (!gb)
            continue;
        float g, e;
        const char *what = fg_loss_token_overflow(&c->plan, n, logp, entropy, &g, &e);
        if (what)
            return fg_fail(err, FG_ERR_OVERFLOW,
                           "token [%lld, %lld]: %s overflows from finite inputs (log-prob %g, "
                           "entropy %g)",
                           (long long)(n / T), (long long)(n % T), what, (double)logp,
                           (double)entropy);
        const fg_status st = fg_grad_bound_add(err, gb, g, e, n, T);
        if (st != FG_OK)
            return st;
    }
    return FG_OK;
}

fg_status fg_common_evaluate(fg_common *c, fg_error *err, double *loss, fg_metrics *metrics)
{
    fg_common_prepare(c); /* no-op if the backward ran it */
    fg_loss_evaluate(&c->plan, c->ta.logp, c->ta.entropy, loss, metrics);
    const struct {
        const char *name;
        double v;
    } sums[] = {{"the loss", *loss},
                {"policy_loss", metrics->policy_loss},
                {"the kl metric", metrics->kl},
                {"the entropy metric", metrics->entropy},
                {"vespo_phi_seq_mean", metrics->vespo_phi_seq_mean}};
    for (size_t i = 0; i < sizeof sums / sizeof sums[0]; i++)
        if (!isfinite(sums[i].v))
            return fg_fail(err, FG_ERR_OVERFLOW, "%s overflows to %g from finite inputs",
                           sums[i].name, sums[i].v);
    return FG_OK;
}

void fg_common_commit(const fg_common *c, const fg_batch *batch, float *logp, float *entropy)
{
    const int64_t N = batch->batch * batch->seq_len;
    if (logp)
        memcpy(logp, c->ta.logp, (size_t)N * sizeof(float));
    if (entropy)
        memcpy(entropy, c->ta.entropy, (size_t)N * sizeof(float));
}

void fg_common_prepare(fg_common *c)
{
    fg_loss_prepare(&c->plan, c->ta.logp, c->ta.entropy, c->sort);
}

void fg_zero_masked_rows(const fg_common *c, int64_t N, void *base, size_t stride_bytes,
                         size_t row_bytes)
{
    int64_t k = 0;
    for (int64_t n = 0; n < N; n++) {
        if (k < c->n_active && c->active[k] == n)
            k++;
        else
            memset((unsigned char *)base + (size_t)n * stride_bytes, 0, row_bytes);
    }
}
