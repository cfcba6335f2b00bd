/*
 * fg_logits_grpo: the loss from logits the caller already holds.
 *   logits [B*T, V] -> loss, metrics, logp, entropy, grad_logits (in place ok)
 * Token level: one pass per row computes the statistics and, while the row is
 * still in cache, its gradient. Sequence level: statistics of every row, the
 * sequence ratios, then the gradient pass.
 */
#include <string.h>

#include "finish.h"
#include "validate.h"

static fg_status check_grad_logits(fg_context *ctx, const fg_matrix *logits, const fg_matrix *g)
{
    fg_status st = fg_validate_matrix(ctx, "grad_logits", g, logits->rows, logits->cols);
    if (st != FG_OK)
        return st;
    const size_t ls = fg_dtype_size(logits->dtype), gs = fg_dtype_size(g->dtype);
    const unsigned char *l0 = logits->data, *g0 = g->data;
    const unsigned char *l1 = l0 + ((size_t)(logits->rows - 1) * logits->ld + logits->cols) * ls;
    const unsigned char *g1 = g0 + ((size_t)(g->rows - 1) * g->ld + g->cols) * gs;
    if (g0 == l0 && g->dtype == logits->dtype && g->ld == logits->ld)
        return FG_OK; /* exact in-place */
    if (g0 < l1 && l0 < g1)
        return fg_fail(ctx, FG_ERR_UNSUPPORTED,
                       "grad_logits overlaps logits without being exactly in place "
                       "(same data, dtype and ld)");
    return FG_OK;
}

fg_status fg_logits_grpo(fg_context *ctx, const fg_loss_config *cfg, const fg_matrix *logits,
                         const fg_batch *batch, fg_outputs *out)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_clear_error(ctx);
    fg_status st;
    if (!out)
        return fg_fail(ctx, FG_ERR_NULL_ARGUMENT, "out is NULL");
    if ((st = fg_validate_config(ctx, cfg)) != FG_OK)
        return st;
    if (!logits)
        return fg_fail(ctx, FG_ERR_NULL_ARGUMENT, "logits is NULL");
    if ((st = fg_validate_matrix(ctx, "logits", logits, -1, -1)) != FG_OK)
        return st;
    if ((st = fg_validate_batch(ctx, cfg, batch, logits->cols)) != FG_OK)
        return st;
    const int64_t N = batch->batch * batch->seq_len, V = logits->cols;
    if (logits->rows != N)
        return fg_fail(ctx, FG_ERR_SHAPE_MISMATCH, "logits has %lld rows, B*T = %lld",
                       (long long)logits->rows, (long long)N);
    if (out->grad_hidden.data || out->grad_weight.data || out->grad_bias.data)
        return fg_fail(ctx, FG_ERR_UNSUPPORTED,
                       "fg_logits_grpo computes no grad_hidden/grad_weight/grad_bias "
                       "(use fg_linear_grpo)");
    const int want_grad = out->grad_logits.data != NULL;
    if (want_grad && (st = check_grad_logits(ctx, logits, &out->grad_logits)) != FG_OK)
        return st;
    if (ctx->opts.check_finite &&
        (st = fg_check_finite_matrix(ctx, "logits", logits, batch->mask)) != FG_OK)
        return st;

    if ((st = fg_ws_reserve(ctx, fg_common_workspace_bytes(batch->batch, N))) != FG_OK)
        return fg_fail(ctx, st, "cannot allocate %zu bytes of workspace",
                       fg_common_workspace_bytes(batch->batch, N));
    /* All checks passed: from here on outputs are written. */
    const int saved = fg_threads_enter(ctx);
    ctx->last_gemm_flops = 0;
    ctx->last_gemm_seconds = 0;
    const double call_t0 = fg_now();
    ctx->last_chunks = 1;
    ctx->last_chunk_rows = N;
    fg_common c;
    fg_common_init(ctx, &c, cfg, batch);
    const float inv_temp = (float)(1.0 / cfg->temperature);
    fg_rows rows = {logits->data, logits->dtype, logits->ld,
                    out->grad_logits.data, out->grad_logits.dtype, out->grad_logits.ld,
                    c.n_active, V, c.active, 1, 0};
    int bad;
    if (!want_grad) {
        bad = fg_sweep_forward(ctx, &c.plan, &rows, inv_temp, &c.ta);
    } else if (c.plan.level == FG_LEVEL_TOKEN) {
        bad = fg_sweep_forward_backward(ctx, &c.plan, &rows, inv_temp, &c.ta);
    } else {
        bad = fg_sweep_forward(ctx, &c.plan, &rows, inv_temp, &c.ta);
        fg_loss_prepare_sequences(&c.plan, c.ta.logp);
        fg_sweep_backward(ctx, &c.plan, &rows, inv_temp, &c.ta);
    }
    if (want_grad) { /* masked rows get zero gradient */
        const size_t es = fg_dtype_size(out->grad_logits.dtype);
        for (int64_t n = 0; n < N; n++)
            if (!batch->mask[n])
                memset((unsigned char *)out->grad_logits.data +
                           (size_t)n * (size_t)out->grad_logits.ld * es,
                       0, (size_t)V * es);
    }
    fg_common_finish(&c, batch, out);
    fg_threads_leave(saved);
    ctx->last_call_seconds = fg_now() - call_t0;
    if (bad)
        return fg_fail(ctx, FG_ERR_NONFINITE_INPUT,
                       "the logits hold NaN or Inf (finite check was off); results are invalid");
    return FG_OK;
}
