/*
 * fg_logits_grpo: the loss from logits the caller already holds.
 *   logits [B*T, V] -> loss, metrics, logp, entropy, grad_logits (in place ok)
 * One pass over the rows computes every token's statistics; the loss math
 * (the sequence ratios first where the loss needs every token) and its
 * overflow checks follow, then the gradient pass writes grad_logits, so a
 * refused call writes nothing.
 */
#include <math.h>
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

/* Every check; `scanned` (the finite check on): the logits were scanned for
 * NaN/Inf and their largest |z| is in float range. */
static fg_status validate_logits(fg_call *call, const fg_loss_config *cfg, const fg_matrix *logits,
                                 const fg_batch *batch, const fg_logits_outputs *out,
                                 int *scanned)
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
    *scanned = call->check_finite;
    if (call->check_finite) {
        fg_magnitude top;
        if ((st = fg_scan_matrix(err, call->threads, "logits", logits, batch->mask, &top)) != FG_OK)
            return st;
        if (top.value / cfg->temperature > FG_OVERFLOW_LIMIT)
            return fg_fail(err, FG_ERR_OVERFLOW,
                           "logits row %lld (token [%lld, %lld]) holds |x| = %g: divided by the "
                           "temperature %g it is beyond float range",
                           (long long)top.index, (long long)(top.index / batch->seq_len),
                           (long long)(top.index % batch->seq_len), top.value, cfg->temperature);
    }
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
    int scanned = 0;
    if ((st = fg_call_host_only(&call, "fg_logits_grpo")) != FG_OK ||
        (st = validate_logits(&call, cfg, logits, batch, out, &scanned)) != FG_OK)
        return fg_call_end(&call, st);
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
    /* Every token's statistics, loss term and derivatives are checked before
     * grad_logits (perhaps the logits themselves) is written: the statistics
     * and the gradient are two passes over the rows, not one. A grad_logits
     * row's entries are at most its d loss/d z row's L1 norm over the
     * temperature (fg_grad_bound with a row scale of 1). */
    fg_sweep_forward(nt, &c.plan, &rows, inv_temp, &c.ta);
    fg_common_prepare(&c);
    fg_grad_bound gb = {1.0 / cfg->temperature, log((double)V), scanned && want_grad ? 1.0 : 0.0,
                        0.0, "grad_logits", "", 0.0};
    double loss;
    fg_metrics metrics;
    if ((st = fg_common_check_tokens(&c, call.err, c.active, c.n_active, scanned, &gb)) != FG_OK ||
        (st = fg_common_evaluate(&c, call.err, &loss, &metrics)) != FG_OK)
        return fg_call_end(&call, st);
    if (want_grad) {
        fg_sweep_backward(nt, &c.plan, &rows, inv_temp, &c.ta);
        const size_t es = fg_dtype_size(out->grad_logits.dtype); /* masked rows: zero gradient */
        fg_zero_masked_rows(&c, N, out->grad_logits.data, (size_t)out->grad_logits.ld * es,
                            (size_t)V * es);
    }
    out->loss = loss;
    out->metrics = metrics;
    fg_common_commit(&c, batch, out->logp, out->entropy);
    return fg_call_end(&call, FG_OK);
}
