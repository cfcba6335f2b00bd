/*
 * One token's loss math: its loss term and its derivatives d loss/d logp and
 * d loss/d entropy from its own log-prob and entropy and the plan's
 * per-sequence constants (docs/LOSS_SPEC.md). The single source for every
 * path: loss_math.c compiles it for the host, a device backend for its
 * kernels (FG_HD is __host__ __device__ under nvcc), so that g and e come
 * from the same formulas wherever the logits are. Everything here reads the
 * plan's scalars and its arrays at token n or sequence b only: a plan whose
 * arrays live in a device's memory serves a device kernel unchanged.
 */
#ifndef FG_LOSS_TOKEN_H
#define FG_LOSS_TOKEN_H

#include <math.h>

#include "loss_math.h"

#ifdef __CUDACC__
#define FG_HD __host__ __device__
#else
#define FG_HD
#endif

/* One token's unweighted loss L and its partial derivatives: through the
 * policy ratio (dL_dr) and directly through logp (dL_dlogp: CISPO's and
 * VESPO's logp factor and the KL term). `ratio` is the level's ratio;
 * `in_eff` whether the token is in the entropy mask. */
typedef struct fg_token_terms {
    double L, dL_dr, dL_dlogp, kl;
} fg_token_terms;

FG_HD static inline fg_token_terms fg_token_terms_eval(const fg_loss_plan *p, int64_t b,
                                                       int64_t n, double logp, double ratio,
                                                       int in_eff)
{
    const double A = p->adv[b];
    fg_token_terms r = {0, 0, 0, 0};
    double pol, dpol_dr = 0, dpol_dlogp = 0;
    switch (p->type) {
    case FG_LOSS_CISPO: {
        double coef = ratio < p->eps_high ? ratio : p->eps_high; /* stop-gradient */
        pol = -coef * A * logp;
        dpol_dlogp = -coef * A;
        break;
    }
    case FG_LOSS_VESPO: { /* φ is detached: a per-sequence weight on A·logp */
        pol = -p->seq_phi[b] * A * logp;
        dpol_dlogp = -p->seq_phi[b] * A;
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
    /* The masks and the sampler's ratio scale the policy term only (not the
     * KL); vespo folds the sampler's ratio into φ instead. */
    double f = p->seq_keep[b] * (in_eff ? 1.0 : 0.0);
    if (p->is_ratio && p->type != FG_LOSS_VESPO)
        f *= p->is_per_seq ? p->is_ratio[b] : p->is_ratio[n];
    r.L = pol * f;
    r.dL_dr = dpol_dr * f;
    r.dL_dlogp = dpol_dlogp * f;
    if (p->beta != 0) {
        double d = (double)p->ref[n] - logp;
        double ed = exp(d);
        double kl = ed - d - 1.0, dkl = 1.0 - ed;
        r.kl = kl;
        if (p->bias_corr) {
            /* KL times the level's ratio (TRL multiplies by coef_1): its
             * gradient flows through the ratio too. */
            r.L += p->beta * kl * ratio;
            r.dL_dr += p->beta * kl;
            r.dL_dlogp += p->beta * dkl * ratio;
            r.kl = kl * ratio; /* the metric reports the corrected KL, as TRL does */
        } else {
            r.L += p->beta * kl;
            r.dL_dlogp += p->beta * dkl;
        }
    }
    return r;
}

/* The policy ratio of token n: token level exp(logp − old), sequence level
 * the sequence's exp(mean log ratio). */
FG_HD static inline double fg_token_ratio(const fg_loss_plan *p, int64_t b, int64_t n,
                                          double logp)
{
    if (p->level == FG_LEVEL_SEQUENCE)
        return exp(p->seq_log_ratio[b]);
    return p->old ? exp(logp - (double)p->old[n]) : 1.0;
}

FG_HD static inline int fg_token_in_entropy_mask(const fg_loss_plan *p, float entropy)
{
    return entropy >= p->entropy_threshold;
}

/* d loss / d logp of unmasked token n (row n = b*T + t) from its logp and
 * entropy; after fg_loss_prepare (the caller's own, for an external plan). */
FG_HD static inline float fg_token_dlogp(const fg_loss_plan *p, int64_t n, float logp,
                                         float entropy)
{
    if (p->external)
        return p->ext_dlogp ? p->ext_dlogp[n] : 0.0f;
    const int64_t b = n / p->T;
    const double w = p->seq_weight[b];
    const double ratio = fg_token_ratio(p, b, n, logp);
    fg_token_terms tt = fg_token_terms_eval(p, b, n, logp, ratio,
                                            fg_token_in_entropy_mask(p, entropy));
    if (p->level == FG_LEVEL_SEQUENCE) /* d ratio_b / d logp_t = ratio_b · m_t / count_b */
        return (float)(w * (tt.dL_dlogp + p->seq_dratio[b] * ratio / p->seq_count[b]));
    return (float)(w * (tt.dL_dlogp + tt.dL_dr * ratio)); /* d ratio / d logp = ratio */
}

/* d loss / d entropy of unmasked token n: the entropy bonus's over the
 * effective mask, or the caller's. */
FG_HD static inline float fg_token_dentropy(const fg_loss_plan *p, int64_t n, float entropy)
{
    if (p->external)
        return p->ext_dentropy ? p->ext_dentropy[n] : 0.0f;
    return entropy >= p->entropy_threshold ? (float)-p->entropy_weight : 0.0f;
}

/* The plan a kernel reads: a device-reported call's batch scalars loaded
 * from the device's memory (loss_math.h batch_scalars). */
FG_HD static inline fg_loss_plan fg_loss_plan_resolved(const fg_loss_plan *p)
{
    fg_loss_plan q = *p;
    if (q.batch_scalars) {
        q.total_tokens = q.batch_scalars[0];
        q.entropy_weight = q.batch_scalars[1];
        q.entropy_threshold = (float)q.batch_scalars[2];
    }
    return q;
}

/* g and e of token n, as a backend's derivs op writes them: 0 at a token
 * the plan's mask drops (a walk over every row; a plan without its mask
 * sees unmasked tokens only). */
FG_HD static inline void fg_token_derivs(const fg_loss_plan *p, int64_t n, float logp,
                                         float entropy, float *g, float *e)
{
    if (p->mask && !p->mask[n]) {
        *g = 0.0f;
        *e = 0.0f;
        return;
    }
    *g = fg_token_dlogp(p, n, logp, entropy);
    *e = fg_token_dentropy(p, n, entropy);
}

/* What of token n's loss math leaves the float range (fg_loss_token_overflow's
 * order): 0 nothing, 1 d loss/d logp, 2 d loss/d entropy, 3 its loss term,
 * 4 its KL (the last two bounded so that the double sums over every token
 * stay finite); *g and *e get its derivatives. */
enum { FG_TOKEN_FINITE, FG_TOKEN_DLOGP, FG_TOKEN_DENTROPY, FG_TOKEN_LOSS_TERM, FG_TOKEN_KL };

FG_HD static inline int fg_token_overflow(const fg_loss_plan *p, int64_t n, float logp,
                                          float entropy, float *g, float *e)
{
    *g = fg_token_dlogp(p, n, logp, entropy);
    *e = fg_token_dentropy(p, n, entropy);
    if (!isfinite(*g))
        return FG_TOKEN_DLOGP;
    if (!isfinite(*e))
        return FG_TOKEN_DENTROPY;
    if (p->external)
        return FG_TOKEN_FINITE;
    const int64_t b = n / p->T;
    const double cap = 1.7976931348623157e308 / (p->total_tokens > 1 ? p->total_tokens : 1);
    const fg_token_terms tt = fg_token_terms_eval(p, b, n, logp, fg_token_ratio(p, b, n, logp),
                                                  fg_token_in_entropy_mask(p, entropy));
    if (!(fabs(p->seq_weight[b] * tt.L) <= cap))
        return FG_TOKEN_LOSS_TERM;
    if (!(fabs(tt.kl) <= cap))
        return FG_TOKEN_KL;
    return FG_TOKEN_FINITE;
}

#endif
