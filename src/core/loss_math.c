/* The GRPO loss family: see loss_math.h and docs/LOSS_SPEC.md. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "loss_math.h"
#include "loss_sequence.h"
#include "loss_token.h"

void fg_loss_plan_place(fg_loss_plan *p, double *scratch)
{
    const int64_t B = p->B;
    p->seq_weight = scratch;
    p->seq_count = scratch + B;
    p->seq_log_ratio = scratch + 2 * B;
    p->seq_dratio = scratch + 3 * B;
    p->seq_keep = scratch + 4 * B;
    p->seq_phi = scratch + 5 * B;
}

void fg_loss_plan_init_scalars(fg_loss_plan *p, const fg_loss_config *cfg, const fg_batch *batch)
{
    memset(p, 0, sizeof *p);
    p->type = cfg->loss_type;
    p->level = cfg->importance_sampling_level;
    p->eps_low = cfg->epsilon_low;
    p->eps_high = cfg->epsilon_high < 0 ? cfg->epsilon_low : cfg->epsilon_high;
    p->delta = cfg->delta > 0 ? cfg->delta : 0.0;
    p->beta = cfg->beta;
    p->tau_pos = cfg->sapo_temperature_pos;
    p->tau_neg = cfg->sapo_temperature_neg;
    p->vespo_k_pos = cfg->vespo_k_pos;
    p->vespo_lambda_pos = cfg->vespo_lambda_pos;
    p->vespo_k_neg = cfg->vespo_k_neg;
    p->vespo_lambda_neg = cfg->vespo_lambda_neg;
    p->off_policy_threshold = cfg->off_policy_mask_threshold;
    p->top_entropy_quantile = cfg->top_entropy_quantile;
    p->entropy_coef = cfg->entropy_coef;
    p->bias_corr = cfg->use_bias_correction_kl != 0;
    p->B = batch->batch;
    p->T = batch->seq_len;
    p->token_ids = batch->token_ids;
    p->mask = batch->mask;
    p->adv = batch->advantages;
    p->old = batch->old_logp;
    p->ref = batch->ref_logp;
    p->is_ratio = batch->is_ratio;
    p->is_per_seq = batch->is_ratio_per_sequence != 0;
    p->sampling = batch->sampling_logp;
    p->max_len = cfg->max_completion_length > 0 ? (double)cfg->max_completion_length
                                                : (double)batch->seq_len;
    p->num_items = cfg->num_items_in_batch;
    p->entropy_threshold = -INFINITY;
}

void fg_loss_plan_init(fg_loss_plan *p, const fg_loss_config *cfg, const fg_batch *batch,
                       double *scratch)
{
    fg_loss_plan_init_scalars(p, cfg, batch);
    fg_loss_plan_place(p, scratch);
    /* loss_sequence.h's per-sequence pieces, in order: a device runs the same. */
    double total = 0;
    for (int64_t b = 0; b < p->B; b++)
        total += p->seq_count[b] = fg_loss_seq_count(p, b);
    for (int64_t b = 0; b < p->B; b++)
        fg_loss_seq_init(p, b, p->seq_count[b], total);
    p->total_tokens = total;
    p->entropy_weight = fg_loss_entropy_weight(p, total);
    if (!fg_loss_needs_all_tokens(p))
        fg_loss_prepare(p, NULL, NULL, NULL);
}

void fg_loss_plan_init_external(fg_loss_plan *p, const fg_batch *batch, const float *dlogp,
                                const float *dentropy)
{
    memset(p, 0, sizeof *p);
    p->type = FG_LOSS_GRPO; /* unused: the loss is the caller's */
    p->level = FG_LEVEL_TOKEN;
    p->B = batch->batch;
    p->T = batch->seq_len;
    p->token_ids = batch->token_ids;
    p->mask = batch->mask;
    p->entropy_threshold = -INFINITY;
    p->prepared = 1;
    p->external = 1;
    p->ext_dlogp = dlogp;
    p->ext_dentropy = dentropy;
}

int fg_loss_needs_all_tokens(const fg_loss_plan *p) { return fg_loss_tokens_first(p); }

/* torch.quantile(x, q) of n sorted floats (loss_sequence.h). */
static float quantile_sorted(const float *x, int64_t n, double q)
{
    const fg_quantile_rank r = fg_quantile_rank_of(n, q);
    return fg_quantile_lerp(x[r.lo], x[r.hi], r.w);
}

static int cmp_float(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

void fg_loss_entropy_quantile(fg_loss_plan *p, const float *entropy, float *sort_scratch)
{
    const int64_t N = p->B * p->T;
    int64_t m = 0;
    for (int64_t n = 0; n < N; n++)
        if (p->mask[n])
            sort_scratch[m++] = entropy[n];
    if (m == 0) {
        p->entropy_threshold = INFINITY; /* no token: nothing is effective */
    } else {
        qsort(sort_scratch, (size_t)m, sizeof(float), cmp_float);
        p->entropy_threshold = quantile_sorted(sort_scratch, m, 1.0 - p->top_entropy_quantile);
    }
    double eff = 0;
    for (int64_t n = 0; n < N; n++)
        eff += p->mask[n] && fg_token_in_entropy_mask(p, entropy[n]);
    p->entropy_weight = fg_loss_entropy_weight(p, eff);
}

void fg_loss_prepare(fg_loss_plan *p, const float *logp, const float *entropy,
                     float *sort_scratch)
{
    if (p->prepared)
        return;
    p->prepared = 1;
    const int64_t B = p->B;
    for (int64_t b = 0; b < B; b++)
        fg_loss_seq_prepare(p, b, logp);
    if (p->top_entropy_quantile < 1.0)
        fg_loss_entropy_quantile(p, entropy, sort_scratch);
    if (p->level == FG_LEVEL_SEQUENCE)
        for (int64_t b = 0; b < B; b++)
            fg_loss_seq_dratio(p, b, logp, entropy);
}

float fg_loss_dlogp(const fg_loss_plan *p, int64_t n, float logp, float entropy)
{
    return fg_token_dlogp(p, n, logp, entropy);
}

float fg_loss_dentropy(const fg_loss_plan *p, int64_t n, float entropy)
{
    return fg_token_dentropy(p, n, entropy);
}

const char *fg_loss_token_overflow(const fg_loss_plan *p, int64_t n, float logp, float entropy,
                                   float *dlogp, float *dentropy)
{
    static const char *const what[] = {NULL, "d loss/d logp", "d loss/d entropy",
                                       "the loss term", "the KL"};
    return what[fg_token_overflow(p, n, logp, entropy, dlogp, dentropy)];
}

int fg_loss_cannot_overflow(const fg_loss_plan *p, double logit_bound, double log_vocab,
                            double *dlogp_max, double *dlogp_sum)
{
    /* The KL's exp(ref - logp) reaches far beyond any useful bound, and the
     * losses that need every token run their forward sweep first anyway. */
    if (p->external || p->beta != 0 || fg_loss_needs_all_tokens(p) ||
        !isfinite((float)p->entropy_weight))
        return 0;
    const double logp_max = 2.0 * logit_bound + log_vocab; /* |logp| */
    const double cap = DBL_MAX / 4 / (p->total_tokens > 1 ? p->total_tokens : 1);
    double gmax = 0, gsum = 0;
    for (int64_t n = 0; n < p->B * p->T; n++) {
        if (!p->mask[n])
            continue;
        const int64_t b = n / p->T;
        /* the token-level ratio exp(logp - old) with logp <= 0 */
        const double r = p->old ? exp(-(double)p->old[n]) : 1.0;
        double f = fabs((double)p->adv[b]) * p->seq_weight[b];
        if (p->is_ratio && p->type != FG_LOSS_VESPO)
            f *= fabs((double)(p->is_per_seq ? p->is_ratio[b] : p->is_ratio[n]));
        double g, L; /* |d loss/d logp| and |loss term| over f (token_terms_eval) */
        switch (p->type) {
        case FG_LOSS_CISPO:
            g = r < p->eps_high ? r : p->eps_high;
            L = g * logp_max;
            break;
        case FG_LOSS_VESPO: /* on-policy here: φ is known */
            g = p->seq_phi[b];
            L = g * logp_max;
            break;
        case FG_LOSS_SAPO: /* |d pol/d ratio| = 4 s (1 - s) |A| <= |A| */
            g = r;
            L = 4.0 / (p->adv[b] > 0 ? p->tau_pos : p->tau_neg);
            break;
        default: /* clipped: |d pol/d ratio| <= |A|, |pol| <= |A| max(ratio, 1) */
            g = r;
            L = r > 1 ? r : 1;
            break;
        }
        g *= f;
        if (!(g <= 3.4028234663852886e38 / 8 && f * L <= cap && p->seq_phi[b] <= cap))
            return 0;
        gmax = g > gmax ? g : gmax;
        gsum += g;
    }
    *dlogp_max = gmax;
    *dlogp_sum = gsum;
    return 1;
}

void fg_loss_evaluate(const fg_loss_plan *p, const float *logp, const float *entropy,
                      double *loss, fg_metrics *metrics)
{
    /* loss_sequence.h's pieces in their order: a device runs the same. */
    const int64_t segments = (p->T + FG_EVAL_SEGMENT - 1) / FG_EVAL_SEGMENT;
    fg_loss_acc acc;
    fg_loss_acc_init(&acc);
    for (int64_t b = 0; b < p->B; b++) {
        fg_seq_sums seq = {0, 0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t k = 0; k < segments; k++) {
            const fg_seq_sums seg = fg_seg_eval(p, b, k, logp, entropy);
            fg_seq_sums_add(&seq, &seg);
        }
        fg_loss_acc_add(&acc, p, b, &seq);
    }
    fg_loss_acc_finish(&acc, p, loss, metrics);
}
