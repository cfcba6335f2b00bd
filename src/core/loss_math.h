/*
 * The GRPO loss family on [B, T] (docs/LOSS_SPEC.md): importance ratio,
 * per-token policy loss, the sequence and token masks (off-policy, high
 * entropy), KL, aggregation, entropy bonus, metrics, and the derivatives
 * d loss / d logp_t and d loss / d entropy_t. This is the only implementation
 * of the loss math; every path (materialized, logits-level, fused) calls it.
 *
 * Every loss type aggregates as  loss = Σ_b w_b Σ_t m_bt L_bt  (minus the
 * entropy bonus), so a token's gradient needs only its own log-prob and
 * entropy plus per-sequence constants. Most configurations know those
 * constants from the mask up front, and the fused path produces gradients in
 * the same sweep as the forward. Some need every token's (detached) log-prob
 * or entropy first (fg_loss_needs_all_tokens): sequence-level ratios (GSPO),
 * vespo's gamma weight, the off-policy mask, the entropy quantile. For those
 * fg_loss_prepare() runs between a forward sweep and the gradient sweep.
 */
#ifndef FG_LOSS_MATH_H
#define FG_LOSS_MATH_H

#include "fusedgrpo.h"

typedef struct fg_loss_plan {
    fg_loss_type type;
    fg_is_level level;
    double eps_low, eps_high, delta, beta, tau_pos, tau_neg;
    double vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg;
    double off_policy_threshold; /* +INFINITY: off                              */
    double top_entropy_quantile; /* 1: off                                      */
    double entropy_coef;
    int bias_corr;
    int64_t B, T;
    const int64_t *token_ids;
    const uint8_t *mask;
    const float *adv, *old, *ref, *is_ratio, *sampling;
    int is_per_seq;
    double max_len;        /* dr_grpo's divisor: max_completion_length, else T */
    double num_items;      /* dapo, cispo, vespo: num_items_in_batch; < 0: Σ m */
    double total_tokens;   /* Σ m                                              */
    double entropy_weight; /* loss −= entropy_weight · Σ eff·entropy           */
    const double *batch_scalars; /* NULL; a plan whose token count only a device
                                    knows (a device-reported call): total_tokens,
                                    entropy_weight and entropy_threshold there,
                                    [0], [1], [2] (fg_loss_plan_resolved)      */
    float entropy_threshold; /* eff = m · (entropy >= threshold); −INFINITY: all */
    double *seq_weight;    /* [B] w_b                                          */
    double *seq_count;     /* [B] max(Σ_t m, 1)                                */
    double *seq_log_ratio; /* [B] sequence level: Σ_t m (logp − old) / count   */
    double *seq_dratio;    /* [B] sequence level: Σ_t m ∂L_t/∂ratio_b          */
    double *seq_keep;      /* [B] off-policy mask: 1 keep, 0 drop              */
    double *seq_phi;       /* [B] vespo's gamma weight φ(w_b) (detached)       */
    int prepared;          /* fg_loss_prepare has run                          */
    /* A caller's own loss (fg_linear_logprobs_backward): d loss/d logp and
     * d loss/d entropy of every token are given ([B*T]; NULL: 0), and the
     * loss itself is the caller's. */
    int external;
    const float *ext_dlogp, *ext_dentropy;
} fg_loss_plan;

/* Doubles of scratch the plan needs (caller-provided, from the workspace):
 * seq_weight, seq_count, seq_log_ratio, seq_dratio, seq_keep, seq_phi, in
 * this order, [B] each (a device's copy is one copy of the six), then the
 * three batch scalars of a device-reported call. */
static inline int64_t fg_loss_plan_scratch_doubles(int64_t B) { return 6 * B + 3; }

/* Points the plan's per-sequence arrays at `scratch` (the layout above;
 * p->B set): a device's copy of them is the same layout. */
void fg_loss_plan_place(fg_loss_plan *p, double *scratch);

/* cfg and batch are assumed validated. Configurations that need no token's
 * values up front are prepared here already. */
void fg_loss_plan_init(fg_loss_plan *p, const fg_loss_config *cfg, const fg_batch *batch,
                       double *scratch);

/* The plan's scalars and array pointers alone, reading no array (a
 * device-reported call: its per-sequence constants are computed on the
 * device, loss_sequence.h's fg_loss_seq_count / fg_loss_seq_init). */
void fg_loss_plan_init_scalars(fg_loss_plan *p, const fg_loss_config *cfg, const fg_batch *batch);

/* The plan of a caller's own loss: only the per-token derivatives it
 * gives (either may be NULL for 0), token level, no loss to evaluate.
 * batch supplies B, T and the mask (no advantages). */
void fg_loss_plan_init_external(fg_loss_plan *p, const fg_batch *batch, const float *dlogp,
                                const float *dentropy);

/* 1 when the gradient of a token needs every token's log-prob or entropy
 * first: a forward sweep, fg_loss_prepare, then the gradient sweep. */
int fg_loss_needs_all_tokens(const fg_loss_plan *p);

/* fg_loss_prepare's middle step, top_entropy_quantile < 1: the threshold
 * over the unmasked tokens' entropies (sorted in sort_scratch, [B*T]) and
 * the entropy bonus's weight over the tokens at or above it. */
void fg_loss_entropy_quantile(fg_loss_plan *p, const float *entropy, float *sort_scratch);

/* The per-sequence constants and the entropy threshold from every token's
 * logp and entropy ([B*T], masked entries ignored); sort_scratch holds B*T
 * floats. Runs once per plan (later calls return at once): the gradient
 * sweep and the final evaluation share it. */
void fg_loss_prepare(fg_loss_plan *p, const float *logp, const float *entropy,
                     float *sort_scratch);

/* d loss / d logp for unmasked token n (row n = b*T + t), from its logp and
 * entropy; after fg_loss_prepare. */
float fg_loss_dlogp(const fg_loss_plan *p, int64_t n, float logp, float entropy);

/* d loss / d entropy for unmasked token n (loss_token.h's, for the host). */
float fg_loss_dentropy(const fg_loss_plan *p, int64_t n, float entropy);

/* Token n's d loss/d logp and d loss/d entropy (*dlogp, *dentropy, as the
 * gradient sweep computes them), and whether they, its loss term and its KL
 * stay finite: NULL, or the name of the first that does not (the loss term
 * and the KL also bounded so that the loss's sum over the tokens stays
 * finite). After fg_loss_prepare. */
const char *fg_loss_token_overflow(const fg_loss_plan *p, int64_t n, float logp, float entropy,
                                   float *dlogp, float *dentropy);

/* Whether no token can fail fg_loss_token_overflow when every logit lies
 * within ±logit_bound, decided before any log-prob is known: token-level
 * losses without the KL (beta = 0), from the advantages, old_logp, is_ratio
 * and the weights alone. Then *dlogp_max and *dlogp_sum bound |d loss/d logp|
 * of one token and its sum over the tokens (d loss/d entropy is the constant
 * -entropy_weight). 0: unknown until the log-probs are. */
int fg_loss_cannot_overflow(const fg_loss_plan *p, double logit_bound, double log_vocab,
                            double *dlogp_max, double *dlogp_sum);

/* The scalar loss and the metrics from every token's logp and entropy,
 * summed in double in loss_sequence.h's fixed order (segments of a
 * sequence, then sequences), the order a device runs too; after
 * fg_loss_prepare. */
void fg_loss_evaluate(const fg_loss_plan *p, const float *logp, const float *entropy,
                      double *loss, fg_metrics *metrics);

#endif
