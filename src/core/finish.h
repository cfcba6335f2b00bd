/*
 * The steps every entry point shares once the sweeps are done: the scalar
 * loss and metrics, and the per-token outputs with zeros at masked positions.
 */
#ifndef FG_FINISH_H
#define FG_FINISH_H

#include "loss_math.h"
#include "sweep.h"
#include "validate.h"
#include "workspace.h"

/* Workspace the shared per-call state needs: the loss plan's scratch, the
 * list of unmasked rows and the [B*T] per-token arrays. */

size_t fg_common_workspace_bytes(int64_t B, int64_t N);

typedef struct fg_common {
    fg_loss_plan plan;
    fg_token_arrays ta;
    int64_t *active; /* unmasked token indices, ascending */
    float *sort;     /* [B*T] scratch of fg_loss_prepare (the entropy quantile) */
    int64_t n_active;
} fg_common;

/* Carves the shared state from the reserved arena and fills it: the list
 * of unmasked rows (the call's pass over the mask after validation). */
void fg_common_init(fg_arena *arena, fg_common *c, const fg_loss_config *cfg,
                    const fg_batch *batch);

/* The same for a caller's own loss (fg_loss_plan_init_external): dlogp and
 * dentropy may be NULL (the forward-only log-prob pass). */
void fg_common_init_external(fg_arena *arena, fg_common *c, const fg_batch *batch,
                             const float *dlogp, const float *dentropy);

/* Runs fg_loss_prepare on the call's per-token arrays (once). */
void fg_common_prepare(fg_common *c);

/* Zeroes row n of a [N, ...] output (row_bytes at base + n * stride_bytes)
 * for every masked token n: the complement of the active list, so the mask
 * is not read again. */
void fg_zero_masked_rows(const fg_common *c, int64_t N, void *base, size_t stride_bytes,
                         size_t row_bytes);

/* The checks of tokens tok[0..count) once their logp and entropy are in
 * c->ta, before anything they feed is written. Their statistics must be
 * finite: when not, FG_ERR_OVERFLOW if the inputs were scanned (`scanned`:
 * finite, and the logits bounded), else FG_ERR_NONFINITE_INPUT (the finite
 * check was off). With `gb` (after fg_loss_prepare), each token's loss term,
 * d loss/d logp and d loss/d entropy must be finite too
 * (fg_loss_token_overflow), and the gradient they give within gb
 * (fg_grad_bound_add; its scales 0 when the inputs were not scanned).
 * Messages name the token (b, t) and the quantity. */
fg_status fg_common_check_tokens(const fg_common *c, fg_error *err, const int64_t *tok,
                                 int64_t count, int scanned, fg_grad_bound *gb);

/* The loss and metrics (fg_loss_prepare first, a no-op if the sweep ran
 * it): FG_ERR_OVERFLOW if the loss or a metric is not finite (the clip
 * extremes' NaN of an all-masked batch excepted). Writes only *loss and
 * *metrics, the caller's copies to commit on success. */
fg_status fg_common_evaluate(fg_common *c, fg_error *err, double *loss, fg_metrics *metrics);

/* The per-token outputs: logp and entropy when wanted (NULL: not), 0 at
 * masked positions. */
void fg_common_commit(const fg_common *c, const fg_batch *batch, float *logp, float *entropy);

#endif
