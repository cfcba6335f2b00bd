/* The GRPO loss family: see loss_math.h and LOSS_SPEC.md. */
#include <math.h>
#include <string.h>

#include "loss_math.h"

void fg_loss_plan_init(fg_loss_plan *p, const fg_loss_config *cfg, const fg_batch *batch,
                       double *scratch)
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

    const int64_t B = p->B, T = p->T;
    p->seq_weight = scratch;
    p->seq_count = scratch + B;
    p->seq_log_ratio = scratch + 2 * B;
    p->seq_dratio = scratch + 3 * B;

    double total = 0;
    for (int64_t b = 0; b < B; b++) {
        double c = 0;
        for (int64_t t = 0; t < T; t++)
            c += p->mask[b * T + t] != 0;
        total += c;
        p->seq_count[b] = c > 1 ? c : 1;
        p->seq_log_ratio[b] = 0;
        p->seq_dratio[b] = 0;
    }
    p->total_tokens = total;
    const double total1 = total > 1 ? total : 1;
    const double max_len = cfg->max_completion_length > 0 ? (double)cfg->max_completion_length : (double)T;
    double items = cfg->num_items_in_batch < 0 ? total : cfg->num_items_in_batch;
    if (items < 1)
        items = 1;
    for (int64_t b = 0; b < B; b++) {
        double w;
        switch (p->type) {
        case FG_LOSS_GRPO:
        case FG_LOSS_SAPO: w = 1.0 / ((double)B * p->seq_count[b]); break;
        case FG_LOSS_BNPO: w = 1.0 / total1; break;
        case FG_LOSS_DR_GRPO: w = 1.0 / ((double)B * max_len); break;
        case FG_LOSS_LUSPO: w = 1.0 / (double)B; break;
        case FG_LOSS_DAPO:
        case FG_LOSS_CISPO:
        default: w = 1.0 / items; break;
        }
        p->seq_weight[b] = w;
    }
    p->entropy_weight = cfg->entropy_coef / total1;
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
    p->external = 1;
    p->ext_dlogp = dlogp;
    p->ext_dentropy = dentropy;
}

/* One token's unweighted loss L and its partial derivatives: through the
 * policy ratio (dL_dr) and directly through logp (dL_dlogp: CISPO's logp
 * factor and the KL term). The spec's per-token formula, in one place. */
typedef struct token_terms {
    double L, dL_dr, dL_dlogp, kl;
} token_terms;

static token_terms token_terms_eval(const fg_loss_plan *p, int64_t b, int64_t n, double logp,
                                    double ratio)
{
    const double A = p->adv[b];
    token_terms r = {0, 0, 0, 0};
    double pol, dpol_dr = 0, dpol_dlogp = 0;
    switch (p->type) {
    case FG_LOSS_CISPO: {
        double coef = ratio < p->eps_high ? ratio : p->eps_high; /* stop-gradient */
        pol = -coef * A * logp;
        dpol_dlogp = -coef * A;
        break;
    }
    case FG_LOSS_SAPO: {
        double tau = A > 0 ? p->tau_pos : p->tau_neg;
        double s = 1.0 / (1.0 + exp(-tau * (ratio - 1.0)));
        pol = -(4.0 / tau) * s * A;
        dpol_dr = -4.0 * s * (1.0 - s) * A;
        break;
    }
    default: { /* grpo, bnpo, dr_grpo, dapo, luspo: PPO clipping */
        /* torch.clamp passes the gradient on the closed interval; torch.min
         * splits it in half on a tie. Clipping uses the unclamped ratio. */
        double rt = ratio, drt = 1;
        if (p->delta > 0 && ratio > p->delta) {
            rt = p->delta;
            drt = 0;
        }
        const double lo = 1.0 - p->eps_low, hi = 1.0 + p->eps_high;
        double c = ratio < lo ? lo : (ratio > hi ? hi : ratio);
        double dc = (ratio >= lo && ratio <= hi) ? 1 : 0;
        double a1 = rt * A, a2 = c * A;
        if (a1 < a2) {
            pol = -a1;
            dpol_dr = -A * drt;
        } else if (a2 < a1) {
            pol = -a2;
            dpol_dr = -A * dc;
        } else {
            pol = -a1;
            dpol_dr = -0.5 * A * (drt + dc);
        }
        break;
    }
    }
    double is = 1;
    if (p->is_ratio)
        is = p->is_per_seq ? p->is_ratio[b] : p->is_ratio[n];
    r.L = pol * is;
    r.dL_dr = dpol_dr * is;
    r.dL_dlogp = dpol_dlogp * is;
    if (p->beta != 0) {
        double d = (double)p->ref[n] - logp;
        double ed = exp(d);
        double kl = ed - d - 1.0, dkl = 1.0 - ed;
        r.kl = kl;
        if (p->bias_corr) {
            /* KL times the token-level ratio exp(logp − old); old is constant
             * (stop-gradient when on-policy), so d ratio / d logp = ratio. */
            double old = p->old ? (double)p->old[n] : logp;
            double tr = exp(logp - old);
            r.L += p->beta * kl * tr;
            r.dL_dlogp += p->beta * (dkl + kl) * tr;
            r.kl = kl * tr; /* the metric reports the corrected KL, as TRL does */
        } else {
            r.L += p->beta * kl;
            r.dL_dlogp += p->beta * dkl;
        }
    }
    return r;
}

/* The policy ratio of token n: token level exp(logp − old), sequence level
 * the sequence's exp(mean log ratio). */
static double policy_ratio(const fg_loss_plan *p, int64_t b, int64_t n, double logp)
{
    if (p->level == FG_LEVEL_SEQUENCE)
        return exp(p->seq_log_ratio[b]);
    return p->old ? exp(logp - (double)p->old[n]) : 1.0;
}

void fg_loss_prepare_sequences(fg_loss_plan *p, const float *logp)
{
    if (p->level != FG_LEVEL_SEQUENCE || p->sequences_ready)
        return;
    p->sequences_ready = 1;
    const int64_t T = p->T;
    for (int64_t b = 0; b < p->B; b++) {
        double s = 0;
        if (p->old)
            for (int64_t t = 0; t < T; t++) {
                int64_t n = b * T + t;
                if (p->mask[n])
                    s += (double)logp[n] - (double)p->old[n];
            }
        p->seq_log_ratio[b] = s / p->seq_count[b];
        double ratio = exp(p->seq_log_ratio[b]), d = 0;
        for (int64_t t = 0; t < T; t++) {
            int64_t n = b * T + t;
            if (p->mask[n])
                d += token_terms_eval(p, b, n, logp[n], ratio).dL_dr;
        }
        p->seq_dratio[b] = d;
    }
}

float fg_loss_dlogp(const fg_loss_plan *p, int64_t n, float logp)
{
    if (p->external)
        return p->ext_dlogp ? p->ext_dlogp[n] : 0.0f;
    const int64_t b = n / p->T;
    const double w = p->seq_weight[b];
    const double ratio = policy_ratio(p, b, n, logp);
    token_terms tt = token_terms_eval(p, b, n, logp, ratio);
    if (p->level == FG_LEVEL_SEQUENCE) /* d ratio_b / d logp_t = ratio_b · m_t / count_b */
        return (float)(w * (tt.dL_dlogp + p->seq_dratio[b] * ratio / p->seq_count[b]));
    return (float)(w * (tt.dL_dlogp + tt.dL_dr * ratio)); /* d ratio / d logp = ratio */
}

void fg_loss_evaluate(const fg_loss_plan *p, const float *logp, const float *entropy,
                      double *loss, fg_metrics *metrics)
{
    const int64_t T = p->T;
    const double lo = 1.0 - p->eps_low, hi = 1.0 + p->eps_high;
    double total = 0, ent = 0, kl = 0, low = 0, high = 0, region = 0, cispo = 0;
    for (int64_t b = 0; b < p->B; b++) {
        const double A = p->adv[b];
        double seq = 0;
        for (int64_t t = 0; t < T; t++) {
            const int64_t n = b * T + t;
            if (!p->mask[n])
                continue;
            const double ratio = policy_ratio(p, b, n, logp[n]);
            token_terms tt = token_terms_eval(p, b, n, logp[n], ratio);
            seq += tt.L;
            ent += entropy[n];
            kl += tt.kl;
            int is_low = ratio < lo && A < 0, is_high = ratio > hi && A > 0;
            low += is_low;
            high += is_high;
            region += is_low || is_high;
            cispo += ratio > p->eps_high;
        }
        total += p->seq_weight[b] * seq;
    }
    const double denom = p->total_tokens > 1 ? p->total_tokens : 1;
    *loss = total - p->entropy_weight * ent;
    metrics->kl = p->beta != 0 ? kl / denom : 0.0;
    metrics->entropy = ent / denom;
    metrics->clip_ratio_low = low / denom;
    metrics->clip_ratio_high = high / denom;
    metrics->clip_ratio_region = region / denom;
    metrics->cispo_clip_ratio = p->type == FG_LOSS_CISPO ? cispo / denom : 0.0;
}
