/*
 * The steps every entry point shares once the sweeps are done: the scalar
 * loss and metrics, and the per-token outputs with zeros at masked positions.
 */
#ifndef FG_FINISH_H
#define FG_FINISH_H

#include "loss_math.h"
#include "sweep.h"

/* Workspace the shared per-call state needs: the loss plan's scratch, the
 * list of unmasked rows and the [B*T] per-token arrays. */
size_t fg_common_workspace_bytes(int64_t B, int64_t N);

typedef struct fg_common {
    fg_loss_plan plan;
    fg_token_arrays ta;
    int64_t *active; /* unmasked token indices, ascending */
    int64_t n_active;
} fg_common;

/* Carves the shared state from the reserved workspace and fills it. */
void fg_common_init(fg_context *ctx, fg_common *c, const fg_loss_config *cfg,
                    const fg_batch *batch);

/* loss, metrics, logp and entropy outputs. */
void fg_common_finish(fg_common *c, const fg_batch *batch, fg_outputs *out);

#endif
