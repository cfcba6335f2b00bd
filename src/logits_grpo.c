/*
 * fg_logits_grpo: the loss from logits the caller already holds.
 *   logits [B*T, V] -> loss, metrics, logp, entropy, grad_logits (in place ok)
 * Token level: one pass per row computes the statistics and, while the row is
 * still in cache, its gradient. Sequence level: statistics of every row, the
 * sequence ratios, then the gradient pass.
 */
#include <string.h>

#include "call.h"
#include "finish.h"
#include "validate.h"

static fg_status check_grad_logits(fg_error *err, const fg_matrix *logits, const fg_matrix *g)
{
    fg_status st = fg_validate_matrix(err, "grad_logits", g, logits->rows, logits->cols);
    if (st != FG_OK)
        return st;
    const size_t ls = fg_dtype_size(logits->dtype), gs = fg_dtype_size(g->dtype);
    const unsigned char *l0 = logits->data, *g0 = g->data;
    const unsigned char *l1 = l0 + ((size_t)(logits->rows - 1) * logits->ld + logits->cols) * ls;
    const unsigned char *g1 = g0 + ((size_t)(g->rows - 1) * g->ld + g->cols) * gs;
    if (g0 == l0 && g->dtype == logits->dtype && g->ld == logits->ld)
        return FG_OK; /* exact in-place */
    if (g0 < l1 && l0 < g1)
        return fg_fail(err, FG_ERR_UNSUPPORTED,
                       "grad_logits overlaps logits without being exactly in place "
                       "(same data, dtype and ld)");
    return FG_OK;
}

static fg_status validate_logits(fg_call *call, const fg_loss_config *cfg, const fg_matrix *logits,
                                 const fg_batch *batch, const fg_logits_outputs *out)
{
    fg_error *err = call->err;
    fg_status st;
    int64_t n_active;
    if (!out)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "out is NULL");
    if ((st = fg_validate_config(err, cfg)) != FG_OK)
        return st;
    if (!logits)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "logits is NULL");
    if ((st = fg_validate_matrix(err, "logits", logits, -1, -1)) != FG_OK)
        return st;
    if ((st = fg_validate_batch(err, cfg, batch, logits->cols, &n_active)) != FG_OK)
        return st;
    const int64_t N = batch->batch * batch->seq_len;
    if (logits->rows != N)
        return fg_fail(err, FG_ERR_SHAPE_MISMATCH, "logits has %lld rows, B*T = %lld",
                       (long long)logits->rows, (long long)N);
    if (out->grad_logits.data && (st = check_grad_logits(err, logits, &out->grad_logits)) != FG_OK)
        return st;
    if (call->check_finite &&
        (st = fg_check_finite_matrix(err, call->threads, "logits", logits, batch->mask)) != FG_OK)
        return st;
    return fg_call_reserve(call, fg_common_workspace_bytes(batch->batch, N));
}

fg_status fg_logits_grpo(fg_context *ctx, const fg_loss_config *cfg, const fg_matrix *logits,
                         const fg_batch *batch, fg_logits_outputs *out, const fg_exec *exec)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_call call;
    fg_status st = fg_call_begin(ctx, exec, &call);
    if (st != FG_OK)
        return st;
    if ((st = validate_logits(&call, cfg, logits, batch, out)) != FG_OK)
        return fg_call_end(&call, st);
    /* All checks passed and the memory is in hand: from here on outputs are written. */
    const int64_t N = batch->batch * batch->seq_len, V = logits->cols;
    const int want_grad = out->grad_logits.data != NULL;
    call.chunks = 1;
    call.chunk_rows = N;
    fg_common c;
    fg_common_init(call.arena, &c, cfg, batch);
    const float inv_temp = (float)(1.0 / cfg->temperature);
    fg_rows rows = {logits->data, logits->dtype, logits->ld,
                    out->grad_logits.data, out->grad_logits.dtype, out->grad_logits.ld,
                    c.n_active, V, c.active, 1, 0};
    const int nt = call.threads;
    int bad;
    if (!want_grad) {
        bad = fg_sweep_forward(nt, &c.plan, &rows, inv_temp, &c.ta);
    } else if (!fg_loss_needs_all_tokens(&c.plan)) {
        bad = fg_sweep_forward_backward(nt, &c.plan, &rows, inv_temp, &c.ta);
    } else {
        bad = fg_sweep_forward(nt, &c.plan, &rows, inv_temp, &c.ta);
        fg_common_prepare(&c);
        fg_sweep_backward(nt, &c.plan, &rows, inv_temp, &c.ta);
    }
    if (want_grad) { /* masked rows get zero gradient */
        const size_t es = fg_dtype_size(out->grad_logits.dtype);
        fg_zero_masked_rows(&c, N, out->grad_logits.data, (size_t)out->grad_logits.ld * es,
                            (size_t)V * es);
    }
    fg_common_finish(&c, batch, &out->loss, &out->metrics, out->logp, out->entropy);
    if (bad)
        st = fg_fail(call.err, FG_ERR_NONFINITE_INPUT,
                     "the logits hold NaN or Inf (finite check was off); results are invalid");
    return fg_call_end(&call, st);
}
