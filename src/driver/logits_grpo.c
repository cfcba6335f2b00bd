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

/* grad_logits may be the logits themselves (same data, dtype and ld): the
 * in-place backward, whose rows are all read (the statistics pass) before
 * any is overwritten (the gradient pass). Any other overlap of an output
 * with an input or another output is refused (fusedgrpo.h "Conventions"). */
static fg_status check_aliasing(const fg_call *call, const fg_matrix *logits,
                                const fg_batch *batch, const fg_logits_outputs *out)
{
    const fg_matrix *g = &out->grad_logits;
    const int in_place = g->data == logits->data && g->dtype == logits->dtype &&
                         g->ld == logits->ld;
    const size_t N = (size_t)(batch->batch * batch->seq_len);
    fg_span ins[FG_BATCH_SPANS + 1];
    fg_batch_spans(batch, ins);
    /* In place, grad_logits spans the logits' bytes and is checked as an output. */
    ins[FG_BATCH_SPANS] = in_place ? fg_span_bytes("logits", NULL, 0)
                                   : fg_span_matrix("logits", logits);
    const fg_span outs[] = {fg_span_bytes("logp", out->logp, N * sizeof(float)),
                            fg_span_bytes("entropy", out->entropy, N * sizeof(float)),
                            fg_span_matrix("grad_logits", g)};
    return fg_check_aliasing(call->err, outs, 3, ins, FG_BATCH_SPANS + 1, call->caller_workspace,
                             call->caller_workspace_bytes);
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
    if (out->grad_logits.data &&
        (st = fg_validate_matrix(err, "grad_logits", &out->grad_logits, logits->rows,
                                 logits->cols)) != FG_OK)
        return st;
    if ((st = check_aliasing(call, logits, batch, out)) != FG_OK)
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
