/*
 * The GRPO loss family on [B, T] (LOSS_SPEC.md): importance ratio, per-token
 * policy loss, KL, aggregation, entropy bonus, metrics, and the derivatives
 * d loss / d logp_t and d loss / d entropy_t. This is the only implementation
 * of the loss math; every path (materialized, logits-level, fused) calls it.
 *
 * Every loss type aggregates as  loss = Σ_b w_b Σ_t m_bt L_bt  (minus the
 * entropy bonus), so a token's gradient needs only its own log-prob plus
 * per-sequence constants known from the mask up front. That is what lets the
 * fused path produce gradients in the same sweep as the forward for token-level
 * ratios. Sequence-level ratios (GSPO) need every log-prob of a sequence first:
 * fg_loss_prepare_sequences() runs between the two sweeps.
 */
#ifndef FG_LOSS_MATH_H
#define FG_LOSS_MATH_H

#include "fusedgrpo.h"

typedef struct fg_loss_plan {
    fg_loss_type type;
    fg_is_level level;
    double eps_low, eps_high, delta, beta, tau_pos, tau_neg;
    int bias_corr;
    int64_t B, T;
    const int64_t *token_ids;
    const uint8_t *mask;
    const float *adv, *old, *ref, *is_ratio;
    int is_per_seq;
    double total_tokens;   /* Σ m                                              */
    double entropy_weight; /* loss −= entropy_weight · Σ m·entropy             */
    double *seq_weight;    /* [B] w_b                                          */
    double *seq_count;     /* [B] max(Σ_t m, 1)                                */
    double *seq_log_ratio; /* [B] sequence level: Σ_t m (logp − old) / count   */
    double *seq_dratio;    /* [B] sequence level: Σ_t m ∂L_t/∂ratio_b          */
    int sequences_ready;   /* fg_loss_prepare_sequences has run                 */
    /* A caller's own loss (fg_linear_logprobs_backward): d loss/d logp and
     * d loss/d entropy of every token are given ([B*T]; NULL: 0), and the
     * loss itself is the caller's. */
    int external;
    const float *ext_dlogp, *ext_dentropy;
} fg_loss_plan;

/* Doubles of scratch the plan needs (caller-provided, from the workspace). */
static inline int64_t fg_loss_plan_scratch_doubles(int64_t B) { return 4 * B; }

/* cfg and batch are assumed validated. */
void fg_loss_plan_init(fg_loss_plan *p, const fg_loss_config *cfg, const fg_batch *batch,
                       double *scratch);

/* The plan of a caller's own loss: only the per-token derivatives it
 * gives (either may be NULL for 0), token level, no loss to evaluate.
 * batch supplies B, T and the mask (no advantages). */
void fg_loss_plan_init_external(fg_loss_plan *p, const fg_batch *batch, const float *dlogp,
                                const float *dentropy);

/* Sequence level only (no-op otherwise): sequence ratios and the per-sequence
 * sum of ∂L/∂ratio, from every token's logp ([B*T], masked entries ignored).
 * Runs once per plan: the backward sweep and the final evaluation share it. */
void fg_loss_prepare_sequences(fg_loss_plan *p, const float *logp);

/* d loss / d logp for unmasked token n (row n = b*T + t). Token level: needs
 * only that token's logp. Sequence level: after fg_loss_prepare_sequences. */
float fg_loss_dlogp(const fg_loss_plan *p, int64_t n, float logp);

/* d loss / d entropy for unmasked token n: the entropy bonus's (the same for
 * every token), or the caller's. */
static inline float fg_loss_dentropy(const fg_loss_plan *p, int64_t n)
{
    if (p->external)
        return p->ext_dentropy ? p->ext_dentropy[n] : 0.0f;
    return (float)-p->entropy_weight;
}

/* The scalar loss and the metrics from every token's logp and entropy, summed
 * in a fixed order in double. Sequence level: after fg_loss_prepare_sequences. */
void fg_loss_evaluate(const fg_loss_plan *p, const float *logp, const float *entropy,
                      double *loss, fg_metrics *metrics);

#endif
