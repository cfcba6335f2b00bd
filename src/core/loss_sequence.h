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

#endif
