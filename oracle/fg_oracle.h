/*
 * fg_oracle: a float64 reference of docs/LOSS_SPEC.md, written independently of the
 * library's code so that it can judge every path. Slow on purpose: plain loops,
 * everything in double. Used by the tests and by `fusedgrpo gradcheck`.
 *
 * Shapes: N = B*T tokens, row n = b*T + t. All arrays row-major, contiguous.
 */
#ifndef FG_ORACLE_H
#define FG_ORACLE_H

#include "fusedgrpo.h" /* fg_loss_config, fg_batch, fg_metrics: types only */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fg_oracle_result {
    double loss;
    fg_metrics metrics;
    double *logp;        /* [N]; 0 at masked positions            */
    double *entropy;     /* [N]; 0 at masked positions            */
    double *dlogp;       /* [N]  d loss / d logp_t                */
    double *dentropy;    /* [N]  d loss / d entropy_t             */
    double *grad_logits; /* [N, V] d loss / d logits (after the 1/temperature) */
    double *grad_hidden; /* [N, H]  linear only, else NULL        */
    double *grad_weight; /* [V, H]  linear only, else NULL        */
    double *grad_bias;   /* [V]     linear with bias only, else NULL */
} fg_oracle_result;

/* Loss from per-token log-probs and entropies alone (no vocab): the spec's
 * "Importance ratio", "Per-token policy loss" and "Aggregation" sections.
 * logp_detached is the stop-gradient copy of logp: it is `old` when
 * batch->old_logp is NULL (on-policy) and it feeds every stop_gradient
 * quantity (cispo's min(ratio, epsilon_high)). Pass logp itself for a plain
 * evaluation; hold it fixed while perturbing logp for a finite difference.
 * metrics may be NULL. */
double fg_oracle_loss_from_logp(const fg_loss_config *cfg, const fg_batch *batch,
                                const double *logp, const double *logp_detached,
                                const double *entropy, fg_metrics *metrics);

/* Full forward + backward from logits [N, V]. Returns 0, or -1 on bad input /
 * allocation failure. Free with fg_oracle_result_free. */
int fg_oracle_logits(const fg_loss_config *cfg, const fg_batch *batch,
                     const double *logits, int64_t V, fg_oracle_result *out);

/* Full forward + backward from hidden [N, H], weight [V, H], bias [V] or NULL. */
int fg_oracle_linear(const fg_loss_config *cfg, const fg_batch *batch,
                     const double *hidden, const double *weight, const double *bias,
                     int64_t H, int64_t V, fg_oracle_result *out);

/* The LM head's log-probs alone (fg_linear_logprobs and its backward): logp
 * and entropy of every unmasked token of batch (token_ids and mask only are
 * read) at this temperature; with dlogp [N] given (dentropy [N] or NULL: 0),
 * also grad_logits, grad_hidden, grad_weight and grad_bias of a loss whose
 * per-token derivatives those are. loss and metrics stay 0. */
int fg_oracle_linear_head(const fg_batch *batch, const double *hidden, const double *weight,
                          const double *bias, int64_t H, int64_t V, double temperature,
                          const double *dlogp, const double *dentropy, fg_oracle_result *out);

/* Forward only (the scalar loss), for finite differences. */
double fg_oracle_linear_loss(const fg_loss_config *cfg, const fg_batch *batch,
                             const double *hidden, const double *weight,
                             const double *bias, int64_t H, int64_t V);

/* fg_oracle_linear_loss with the stop-gradient copy of logp held fixed at
 * logp_detached [N] (e.g. the unperturbed logp), for finite differences of
 * on-policy and cispo losses. logp_detached NULL: same as fg_oracle_linear_loss. */
double fg_oracle_linear_loss_sg(const fg_loss_config *cfg, const fg_batch *batch,
                                const double *hidden, const double *weight,
                                const double *bias, int64_t H, int64_t V,
                                const double *logp_detached);

/* The loss's natural scale: the same aggregation applied to |L_t| (and
 * |entropy_coef| * mean entropy). A loss can cancel to ~0; relative errors of
 * the loss are measured against max(|loss|, this). */
double fg_oracle_loss_scale(const fg_loss_config *cfg, const fg_batch *batch,
                            const double *logp, const double *entropy);

/* The per-token loss L_t (after is_ratio and the KL term, before
 * aggregation) into token_loss [N]; 0 at masked positions. */
void fg_oracle_token_loss(const fg_loss_config *cfg, const fg_batch *batch,
                          const double *logp, const double *entropy, double *token_loss);

void fg_oracle_result_free(fg_oracle_result *r);

#ifdef __cplusplus
}
#endif
#endif
