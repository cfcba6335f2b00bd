/*
 * The steps every entry point shares once the sweeps are done: the scalar
 * loss and metrics, and the per-token outputs with zeros at masked positions.
 */
#ifndef FG_FINISH_H
#define FG_FINISH_H

#include "loss_math.h"
#include "sweep.h"
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

/* The outputs every entry point shares: loss and metrics (loss NULL: the
 * loss is the caller's, nothing is evaluated), the per-token logp and
 * entropy when wanted (NULL: not). */
void fg_common_finish(fg_common *c, const fg_batch *batch, double *loss, fg_metrics *metrics,
                      float *logp, float *entropy);

#endif
