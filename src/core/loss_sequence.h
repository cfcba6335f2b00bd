/*
 * The loss and metrics from every token's log-prob and entropy, in pieces a
 * device can run in parallel and a host runs in a loop, with the same bits:
 *
 *   segment   fg_seg_eval: the sums over one segment of a sequence, tokens
 *             t in [s·FG_EVAL_SEGMENT, (s+1)·FG_EVAL_SEGMENT) in order
 *   sequence  the segments' sums added in segment order (fg_seq_sums_add),
 *             then fg_loss_acc_add folds the sequence into the batch's
 *             running sums and the per-sequence metrics, sequences in order
 *   batch     fg_loss_acc_finish: the loss and the metrics
 *
 * fg_loss_evaluate (loss_math.c) is that loop; a device backend runs the
 * segments one thread each and the rest in one thread. Like loss_token.h,
 * everything here reads the plan's scalars and its arrays (mask, adv, the
 * per-sequence constants) only: a plan over a device's memory serves a
 * kernel unchanged (FG_HD).
 */
#ifndef FG_LOSS_SEQUENCE_H
#define FG_LOSS_SEQUENCE_H

#include <math.h>
#include <string.h>

#include "loss_token.h"

/* ------------------------------------------- the per-sequence constants */

/* fg_loss_needs_all_tokens (loss_math.h), for a device too. */
FG_HD static inline int fg_loss_tokens_first(const fg_loss_plan *p)
{
    if (p->external)
        return 0;
    const int off_policy = !isinf(p->off_policy_threshold);
    return p->level == FG_LEVEL_SEQUENCE || (p->type == FG_LOSS_VESPO && p->old) ||
           (off_policy && (p->sampling || p->old)) || p->top_entropy_quantile < 1.0;
}

/* Sequence b's unmasked tokens, counted in double. */
FG_HD static inline double fg_loss_seq_count(const fg_loss_plan *p, int64_t b)
{
    double c = 0;
    for (int64_t t = 0; t < p->T; t++)
        c += p->mask[b * p->T + t] != 0;
    return c;
}

/* Sequence b's constants from its count and the batch's total (Σ of the
 * counts, sequences in order): w_b by the loss type, and the prepared
 * values of a loss that needs no token's log-prob. */
FG_HD static inline void fg_loss_seq_init(fg_loss_plan *p, int64_t b, double count, double total)
{
    const double total1 = total > 1 ? total : 1;
    double items = p->num_items < 0 ? total : p->num_items;
    if (items < 1)
        items = 1;
    p->seq_count[b] = count > 1 ? count : 1;
    p->seq_log_ratio[b] = 0;
    p->seq_dratio[b] = 0;
    p->seq_keep[b] = 1;
    p->seq_phi[b] = 1;
    double w;
    switch (p->type) {
    case FG_LOSS_GRPO:
    case FG_LOSS_SAPO: w = 1.0 / ((double)p->B * p->seq_count[b]); break;
    case FG_LOSS_BNPO: w = 1.0 / total1; break;
    case FG_LOSS_DR_GRPO: w = 1.0 / ((double)p->B * p->max_len); break;
    case FG_LOSS_LUSPO: w = 1.0 / (double)p->B; break;
    case FG_LOSS_DAPO:
    case FG_LOSS_CISPO:
    case FG_LOSS_VESPO:
    default: w = 1.0 / items; break;
    }
    p->seq_weight[b] = w;
}

/* log(1e-8): vespo's lower clamp of log-weights (TRL's get_gamma_weights). */
#define FG_VESPO_LOG_MIN (-18.420680743952367)

FG_HD static inline double fg_clampd(double x, double lo, double hi)
{
    return x < lo ? lo : (x > hi ? hi : x);
}

/* Sequence b's ratio, off-policy keep flag and vespo's φ from its detached
 * log-probs (logp NULL: none needed, the on-policy case, old = logp). */
FG_HD static inline void fg_loss_seq_prepare(fg_loss_plan *p, int64_t b, const float *logp)
{
    const int64_t T = p->T;
    const double A = p->adv[b];
    double lr = 0, lr_clamped = 0, log_is = 0, kl = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t n = b * T + t;
        if (!p->mask[n])
            continue;
        /* logp is NULL when nothing here needs it (fg_loss_needs_all_tokens) */
        const double d = p->old && logp ? (double)logp[n] - (double)p->old[n] : 0.0;
        lr += d;
        lr_clamped += fg_clampd(d, -20.0, 20.0);
        if (p->is_ratio && !p->is_per_seq)
            log_is += fg_clampd(log((double)p->is_ratio[n]), FG_VESPO_LOG_MIN, 20.0);
        /* forward KL of the sampler against the policy: sampling − logp */
        const double s = p->sampling ? (double)p->sampling[n]
                                     : (p->old ? (double)p->old[n] : (logp ? (double)logp[n] : 0));
        const double k = logp ? s - (double)logp[n] : 0.0;
        kl += isnan(k) ? 0.0 : k;
    }
    p->seq_log_ratio[b] = lr / p->seq_count[b];
    if (!isinf(p->off_policy_threshold))
        p->seq_keep[b] = (A >= 0 || kl / p->seq_count[b] <= p->off_policy_threshold) ? 1.0 : 0.0;
    if (p->type == FG_LOSS_VESPO) {
        if (p->is_ratio && p->is_per_seq)
            log_is = fg_clampd(log((double)p->is_ratio[b]), FG_VESPO_LOG_MIN, 20.0);
        const double log_w = fg_clampd(lr_clamped + log_is, FG_VESPO_LOG_MIN, 20.0);
        const double w = exp(log_w);
        const double k = A >= 0 ? p->vespo_k_pos : p->vespo_k_neg;
        double lam = A >= 0 ? p->vespo_lambda_pos : p->vespo_lambda_neg;
        lam = lam > 1e-4 ? lam : 1e-4;
        const double phi = exp(lam + k * log_w - lam * w);
        p->seq_phi[b] = isfinite(phi) ? phi : 0.0;
    }
}

/* Sequence b's Σ_t m ∂L_t/∂ratio_b at the sequence level (after its
 * fg_loss_seq_prepare; entropy NULL: every token in the entropy mask). */
FG_HD static inline void fg_loss_seq_dratio(fg_loss_plan *p, int64_t b, const float *logp,
                                            const float *entropy)
{
    const double ratio = exp(p->seq_log_ratio[b]);
    double d = 0;
    for (int64_t t = 0; t < p->T; t++) {
        const int64_t n = b * p->T + t;
        if (p->mask[n])
            d += fg_token_terms_eval(p, b, n, logp[n], ratio,
                                     entropy ? fg_token_in_entropy_mask(p, entropy[n]) : 1)
                     .dL_dr;
    }
    p->seq_dratio[b] = d;
}

/* The entropy bonus's weight over every unmasked token. */
FG_HD static inline double fg_loss_entropy_weight(const fg_loss_plan *p, double total)
{
    return p->entropy_coef / (total > 1 ? total : 1);
}

/* The entropy quantile's threshold (docs/LOSS_SPEC.md, the high-entropy
 * mask) as torch.quantile(x, q) takes it from n sorted float32 values: rank
 * q·(n−1) in float, between the order statistics lo and hi (0-based), then
 * a float lerp, so that tokens at the threshold fall on TRL's side. */
typedef struct fg_quantile_rank {
    int64_t lo, hi; /* the order statistics it lies between                 */
    float w;        /* its weight on hi                                     */
} fg_quantile_rank;

FG_HD static inline fg_quantile_rank fg_quantile_rank_of(int64_t n, double q)
{
    const float rank = (float)q * (float)(n - 1);
    const float below = floorf(rank);
    fg_quantile_rank r;
    r.lo = (int64_t)below;
    r.w = rank - below;
    if (r.lo > n - 1) { /* past 2^24 values (float)(n − 1) may round up to n */
        r.lo = n - 1;
        r.w = 0.0f;
    }
    r.hi = r.lo + 1 < n ? r.lo + 1 : n - 1;
    return r;
}

/* The threshold from x[lo] = a and x[hi] = b. */
FG_HD static inline float fg_quantile_lerp(float a, float b, float w)
{
    const float d = b - a;
    return w < 0.5f ? a + w * d : b - d * (1.0f - w);
}

/* ------------------------------------------------ the loss and metrics */

/* Tokens of a segment: 1024 keeps a 262144-token sequence at 256 segments. */
#define FG_EVAL_SEGMENT 1024

/* One segment's (or sequence's) sums over its unmasked tokens. */
typedef struct fg_seq_sums {
    double policy;          /* Σ L (unweighted loss terms)                 */
    double ent, ent_eff;    /* Σ entropy, over the entropy mask too        */
    double kl;              /* Σ KL (the metric's)                         */
    double count;           /* unmasked tokens                             */
    double low, high;       /* token level: tokens clipped low / high      */
    double region, cispo;   /* token level: clipped either way; CISPO's    */
} fg_seq_sums;

FG_HD static inline int fg_loss_clipped_type(fg_loss_type t)
{
    return t == FG_LOSS_GRPO || t == FG_LOSS_BNPO || t == FG_LOSS_DR_GRPO || t == FG_LOSS_DAPO ||
           t == FG_LOSS_LUSPO;
}

/* The ratio the clip metrics test: TRL's coef_1 after the two-sided clip
 * (min(ratio, delta) for the clipped types when delta is set). */
FG_HD static inline double fg_loss_metric_ratio(const fg_loss_plan *p, double ratio)
{
    return fg_loss_clipped_type(p->type) && p->delta > 0 && ratio > p->delta ? p->delta : ratio;
}

/* Segment s of sequence b (FG_EVAL_SEGMENT tokens, fewer at the end). */
FG_HD static inline fg_seq_sums fg_seg_eval(const fg_loss_plan *p, int64_t b, int64_t s,
                                            const float *logp, const float *entropy)
{
    const int64_t T = p->T, t0 = s * FG_EVAL_SEGMENT;
    const int64_t t1 = t0 + FG_EVAL_SEGMENT < T ? t0 + FG_EVAL_SEGMENT : T;
    const int token_level = p->level != FG_LEVEL_SEQUENCE;
    const double lo = 1.0 - p->eps_low, hi = 1.0 + p->eps_high, A = p->adv[b];
    fg_seq_sums r = {0, 0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t t = t0; t < t1; t++) {
        const int64_t n = b * T + t;
        if (!p->mask[n])
            continue;
        const double ratio = fg_token_ratio(p, b, n, logp[n]);
        const int eff = fg_token_in_entropy_mask(p, entropy[n]);
        const fg_token_terms tt = fg_token_terms_eval(p, b, n, logp[n], ratio, eff);
        r.policy += tt.L;
        r.ent += entropy[n];
        r.ent_eff += eff ? entropy[n] : 0.0;
        r.kl += tt.kl;
        r.count += 1;
        if (token_level) { /* per-token indicators */
            const double m = fg_loss_metric_ratio(p, ratio);
            const int is_low = m < lo && A < 0, is_high = m > hi && A > 0;
            r.low += is_low;
            r.high += is_high;
            r.region += is_low || is_high;
            r.cispo += m > p->eps_high && A > 0;
        }
    }
    return r;
}

/* a += b, field by field (segments in order). */
FG_HD static inline void fg_seq_sums_add(fg_seq_sums *a, const fg_seq_sums *b)
{
    a->policy += b->policy;
    a->ent += b->ent;
    a->ent_eff += b->ent_eff;
    a->kl += b->kl;
    a->count += b->count;
    a->low += b->low;
    a->high += b->high;
    a->region += b->region;
    a->cispo += b->cispo;
}

/* The batch's running sums, sequence by sequence. */
typedef struct fg_loss_acc {
    double total, ent, ent_eff, kl, phi;
    double low, high, region, cispo;
    double low_min, high_max; /* NaN until a sequence counts (nanmin / nanmax) */
} fg_loss_acc;

FG_HD static inline void fg_loss_acc_init(fg_loss_acc *a)
{
    fg_loss_acc z = {0, 0, 0, 0, 0, 0, 0, 0, 0, NAN, NAN};
    *a = z;
}

/* Sequence b, its sums s (every segment added), into a. */
FG_HD static inline void fg_loss_acc_add(fg_loss_acc *a, const fg_loss_plan *p, int64_t b,
                                         const fg_seq_sums *s)
{
    const double A = p->adv[b];
    a->total += p->seq_weight[b] * s->policy;
    a->ent += s->ent;
    a->ent_eff += s->ent_eff;
    a->kl += s->kl;
    a->phi += p->seq_phi[b];
    double seq_low, seq_high; /* the sequence's clip fractions */
    if (p->level == FG_LEVEL_SEQUENCE) { /* one ratio a sequence: every sequence counts */
        const double lo = 1.0 - p->eps_low, hi = 1.0 + p->eps_high;
        const double ratio = fg_loss_metric_ratio(p, exp(p->seq_log_ratio[b]));
        seq_low = ratio < lo && A < 0;
        seq_high = ratio > hi && A > 0;
        a->low += seq_low;
        a->high += seq_high;
        a->region += seq_low || seq_high;
        a->cispo += ratio > p->eps_high && A > 0;
    } else { /* token level: the tokens' indicators; a sequence without tokens
                counts in no fraction */
        if (s->count == 0)
            return;
        a->low += s->low;
        a->high += s->high;
        a->region += s->region;
        a->cispo += s->cispo;
        seq_low = s->low / s->count;
        seq_high = s->high / s->count;
    }
    a->low_min = isnan(a->low_min) || seq_low < a->low_min ? seq_low : a->low_min;
    a->high_max = isnan(a->high_max) || seq_high > a->high_max ? seq_high : a->high_max;
}

/* The loss and the metrics from every sequence's sums. */
FG_HD static inline void fg_loss_acc_finish(const fg_loss_acc *a, const fg_loss_plan *p,
                                            double *loss, fg_metrics *metrics)
{
    const double denom = p->total_tokens > 1 ? p->total_tokens : 1;
    const double clip_denom = p->level == FG_LEVEL_SEQUENCE ? (double)p->B : denom;
    *loss = a->total - p->entropy_weight * a->ent_eff;
    memset(metrics, 0, sizeof *metrics);
    metrics->policy_loss = a->total;
    metrics->kl = p->beta != 0 ? a->kl / denom : 0.0;
    metrics->entropy = a->ent / denom;
    if (fg_loss_clipped_type(p->type)) {
        metrics->clip_ratio_low = a->low / clip_denom;
        metrics->clip_ratio_high = a->high / clip_denom;
        metrics->clip_ratio_region = a->region / clip_denom;
        metrics->clip_ratio_low_min = a->low_min;
        metrics->clip_ratio_high_max = a->high_max;
    }
    if (p->type == FG_LOSS_CISPO)
        metrics->cispo_clip_ratio = a->cispo / clip_denom;
    if (p->type == FG_LOSS_VESPO)
        metrics->vespo_phi_seq_mean = a->phi / (double)p->B;
}

/* The loss and metrics from every segment's sums (sums[b * segments + k],
 * fg_seg_eval's): each sequence's segments added in order, then the
 * sequences in order. */
FG_HD static inline void fg_loss_from_segments(const fg_loss_plan *p, const fg_seq_sums *sums,
                                               int64_t segments, double *loss,
                                               fg_metrics *metrics)
{
    fg_loss_acc acc;
    fg_loss_acc_init(&acc);
    for (int64_t b = 0; b < p->B; b++) {
        fg_seq_sums seq = {0, 0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t k = 0; k < segments; k++)
            fg_seq_sums_add(&seq, &sums[b * segments + k]);
        fg_loss_acc_add(&acc, p, b, &seq);
    }
    fg_loss_acc_finish(&acc, p, loss, metrics);
}

#endif
