/*
 * fg_grpo_loss_from_logp: the loss of docs/LOSS_SPEC.md from per-token
 * log-probs and entropies the caller already has (the phase API's (c), or any
 * framework that computed them): loss, metrics, and d loss/d logp,
 * d loss/d entropy per token, through the one loss implementation
 * (loss_math.c).
 *   in : logp [B, T], entropy [B, T], batch [B, T] (token ids not read)
 *   out: loss, metrics, grad_logp [B, T]?, grad_entropy [B, T]?
 */
#include <stdint.h>
#include <string.h>

#include "call.h"
#include "finish.h"
#include "validate.h"

static fg_status validate_logp(fg_call *call, const fg_loss_config *cfg, const fg_batch *batch,
                               const float *logp, const float *entropy, const fg_logp_outputs *out)
{
    fg_error *err = call->err;
    fg_status st;
    int64_t n_active;
    if (!out)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "out is NULL");
    if ((st = fg_validate_config(err, cfg)) != FG_OK)
        return st;
    if (!logp)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "logp is NULL");
    if (!entropy)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "entropy is NULL");
    /* The token ids are not read: any id is in range. */
    if ((st = fg_validate_batch(err, cfg, batch, INT64_MAX, &n_active)) != FG_OK)
        return st;
    const fg_tokens tokens = {batch->batch, batch->seq_len, batch->token_ids, batch->mask};
    const fg_token_input reads[2] = {{"logp", logp}, {"entropy", entropy}};
    if ((st = fg_validate_tokens(err, &tokens, INT64_MAX, reads, 2, &n_active)) != FG_OK)
        return st;
    const size_t bytes = (size_t)(batch->batch * batch->seq_len) * sizeof(float);
    fg_span ins[FG_BATCH_SPANS + 2];
    fg_batch_spans(batch, ins);
    ins[FG_BATCH_SPANS] = fg_span_bytes("logp", logp, bytes);
    ins[FG_BATCH_SPANS + 1] = fg_span_bytes("entropy", entropy, bytes);
    const fg_span outs[2] = {fg_span_bytes("grad_logp", out->grad_logp, bytes),
                             fg_span_bytes("grad_entropy", out->grad_entropy, bytes)};
    if ((st = fg_check_aliasing(err, outs, 2, ins, FG_BATCH_SPANS + 2, call->caller_workspace,
                                call->caller_workspace_bytes)) != FG_OK)
        return st;
    return fg_call_reserve(call, fg_common_workspace_bytes(batch->batch, batch->batch * batch->seq_len));
}

fg_status fg_grpo_loss_from_logp(fg_context *ctx, const fg_loss_config *cfg,
                                 const fg_batch *batch, const float *logp, const float *entropy,
                                 fg_logp_outputs *out, const fg_exec *exec)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_call call;
    fg_status st = fg_call_begin(ctx, exec, &call);
    if (st != FG_OK)
        return st;
    if ((st = fg_call_host_only(&call, "fg_grpo_loss_from_logp")) != FG_OK ||
        (st = validate_logp(&call, cfg, batch, logp, entropy, out)) != FG_OK)
        return fg_call_end(&call, st);
    const int64_t N = batch->batch * batch->seq_len;
    fg_common c;
    fg_common_init(call.arena, &c, cfg, batch);
    for (int64_t k = 0; k < c.n_active; k++) { /* masked tokens stay 0 */
        const int64_t n = c.active[k];
        c.ta.logp[n] = logp[n];
        c.ta.entropy[n] = entropy[n];
    }
    fg_common_prepare(&c);
    /* Every token's derivatives and the loss are checked before any output
     * is written; grad_logp and grad_entropy are the derivatives themselves
     * (no bound beyond finite). */
    fg_grad_bound finite_only = {0, 0, 0, 0, "", "", 0};
    double loss;
    fg_metrics metrics;
    if ((st = fg_common_check_tokens(&c, call.err, c.active, c.n_active, 1, &finite_only)) !=
            FG_OK ||
        (st = fg_common_evaluate(&c, call.err, &loss, &metrics)) != FG_OK)
        return fg_call_end(&call, st);
    if (out->grad_logp)
        memset(out->grad_logp, 0, (size_t)N * sizeof(float));
    if (out->grad_entropy)
        memset(out->grad_entropy, 0, (size_t)N * sizeof(float));
    for (int64_t k = 0; k < c.n_active; k++) {
        const int64_t n = c.active[k];
        if (out->grad_logp)
            out->grad_logp[n] = fg_loss_dlogp(&c.plan, n, c.ta.logp[n], c.ta.entropy[n]);
        if (out->grad_entropy)
            out->grad_entropy[n] = fg_loss_dentropy(&c.plan, n, c.ta.entropy[n]);
    }
    out->loss = loss;
    out->metrics = metrics;
    return fg_call_end(&call, FG_OK);
}
