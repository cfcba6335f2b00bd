/*
 * The checks of an LM-head request before anything runs (linear_request.h):
 * every argument, the outputs against the inputs, and the bounds the
 * inputs' largest magnitudes give the logits and the gradients. The driver
 * (linear_grpo.c) runs them, on host copies of a device backend's token
 * arrays where it must.
 */
#include <math.h>
#include <string.h>

#include "linear_request.h"
#include "shard_stats.h"

int fg_linear_is_sharded(const fg_linear_inputs *in)
{
    return in->vocab_start != 0 || (in->vocab_total > 0 && in->vocab_total != in->weight.rows);
}

fg_grad_bound fg_linear_grad_bound(const input_bounds *ib, const fg_linear_outputs *out,
                                   double temperature, int64_t vocab)
{
    const int gh = ib->scanned && out->grad_hidden.data, gw = ib->scanned && out->grad_weight.data;
    const int gb = ib->scanned && out->grad_bias.data;
    const double sum_scale = gw && ib->hidden_max > 1.0 ? ib->hidden_max : (gw || gb ? 1.0 : 0.0);
    fg_grad_bound b = {1.0 / temperature, log((double)vocab), gh ? ib->weight_max : 0.0,
                       sum_scale, "grad_hidden", gw ? "grad_weight" : "grad_bias", 0.0};
    return b;
}

/* The caller's grad_logp and grad_entropy (backward kinds) bound the whole
 * gradient before anything runs: refused when it could overflow. */
static fg_status bound_external(fg_call *call, const linear_request *req,
                                const fg_linear_outputs *out, int64_t vocab,
                                const input_bounds *ib)
{
    const fg_batch *batch = req->batch;
    fg_grad_bound gb = fg_linear_grad_bound(ib, out, req->cfg->temperature, vocab);
    for (int64_t n = 0; n < batch->batch * batch->seq_len; n++) {
        if (!batch->mask[n])
            continue;
        const fg_status st = fg_grad_bound_add(call->err, &gb, req->dlogp[n],
                                               req->dentropy ? req->dentropy[n] : 0.0, n,
                                               batch->seq_len);
        if (st != FG_OK)
            return st;
    }
    return FG_OK;
}

/* Every logit is bounded by |z| <= (H·max|h|·max|w| + max|b|) / temperature
 * (so is every partial sum of the product); beyond FG_OVERFLOW_LIMIT the row
 * statistics could overflow: FG_ERR_OVERFLOW. */
fg_status fg_linear_check_bounds(fg_call *call, const linear_request *req,
                                 const fg_linear_inputs *in, const fg_linear_outputs *out,
                                 fg_magnitude h, fg_magnitude w, fg_magnitude b, input_bounds *ib)
{
    const double H = (double)in->hidden.cols, temperature = req->cfg->temperature;
    const double bound = H * h.value * w.value + b.value;
    if (bound > FG_OVERFLOW_LIMIT || bound / temperature > FG_OVERFLOW_LIMIT) {
        const int64_t T = req->batch->seq_len;
        return fg_fail(call->err, FG_ERR_OVERFLOW,
                       "hidden row %lld (token [%lld, %lld]) holds |h| = %g: with H = %lld, "
                       "|weight| up to %g (row %lld) and |bias| up to %g, the logits could "
                       "reach %g / temperature %g, beyond float range",
                       (long long)h.index, (long long)(h.index / T), (long long)(h.index % T),
                       h.value, (long long)in->hidden.cols, w.value, (long long)w.index, b.value,
                       bound, temperature);
    }
    ib->scanned = 1;
    ib->hidden_max = h.value;
    ib->weight_max = w.value;
    ib->logit_max = bound / temperature;
    if (req->kind == KIND_LOGPROBS_BACKWARD || req->kind == KIND_SHARD_BACKWARD)
        return bound_external(call, req, out,
                              fg_linear_is_sharded(in) ? in->vocab_total : in->weight.rows, ib);
    return FG_OK;
}

fg_status fg_linear_validate(fg_call *call, const fg_linear_options *o, const linear_request *req,
                             const fg_linear_inputs *in, const fg_linear_outputs *out,
                             int64_t *n_active, input_bounds *ib)
{
    fg_error *err = call->err;
    const fg_loss_config *cfg = req->cfg;
    const fg_batch *batch = req->batch;
    fg_status st;
    if (!in)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "in is NULL");
    if (!out)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "out is NULL");
    if (o->impl != FG_IMPL_FUSED && o->impl != FG_IMPL_MATERIALIZED)
        return fg_fail(err, FG_ERR_UNSUPPORTED, "unknown impl %d", (int)o->impl);
    if ((st = fg_validate_config(err, cfg)) != FG_OK)
        return st;
    if ((st = fg_validate_matrix(err, "hidden", &in->hidden, -1, -1)) != FG_OK ||
        (st = fg_validate_matrix(err, "weight", &in->weight, -1, in->hidden.cols)) != FG_OK)
        return st;
    if (in->weight.dtype != in->hidden.dtype)
        return fg_fail(err, FG_ERR_SHAPE_MISMATCH, "weight dtype differs from hidden dtype");
    const int64_t V = in->weight.rows, H = in->hidden.cols;
    if (in->bias.data) {
        if ((st = fg_validate_vector(err, "bias", &in->bias, V)) != FG_OK)
            return st;
        if (in->bias.dtype != in->weight.dtype)
            return fg_fail(err, FG_ERR_SHAPE_MISMATCH, "bias dtype differs from weight dtype");
    }
    const int sharded = fg_linear_is_sharded(in);
    if (sharded) {
        if (in->vocab_start < 0 || in->vocab_total <= 0 || in->vocab_start > in->vocab_total - V)
            return fg_fail(err, FG_ERR_SHAPE_MISMATCH,
                           "vocab shard of %lld rows at vocab_start = %lld does not lie in "
                           "[0, vocab_total = %lld)",
                           (long long)V, (long long)in->vocab_start, (long long)in->vocab_total);
        if (fg_uses_hook(req->kind) && !call->comm.allreduce)
            return fg_fail(err, FG_ERR_NULL_ARGUMENT,
                           "a vocab-sharded weight needs a communicator (fg_context_options.comm), "
                           "or the phase API (fg_linear_shard_stats)");
    }
    const int64_t vocab = sharded ? in->vocab_total : V;
    if (req->kind == KIND_LOSS && call->device_report) { /* values: on the device */
        st = fg_validate_batch_shape(err, cfg, batch);
        *n_active = st == FG_OK ? batch->batch * batch->seq_len : 0; /* every token row */
    } else if (req->kind == KIND_LOSS) {
        st = fg_validate_batch(err, cfg, batch, vocab, n_active);
    } else {
        const int backward = req->kind == KIND_LOGPROBS_BACKWARD || req->kind == KIND_SHARD_BACKWARD;
        if (backward && !req->dlogp)
            return fg_fail(err, FG_ERR_NULL_ARGUMENT, "grad_logp is NULL");
        if (req->kind == KIND_SHARD_STATS && !req->stats_out)
            return fg_fail(err, FG_ERR_NULL_ARGUMENT, "stats is NULL");
        if (req->kind == KIND_SHARD_BACKWARD &&
            (st = fg_validate_shard_stats(err, req->stats_in, batch->batch * batch->seq_len)) != FG_OK)
            return st;
        const fg_token_input reads[2] = {{"grad_logp", req->dlogp},
                                         {"grad_entropy", req->dentropy}};
        if (call->device_report) {
            st = fg_validate_tokens_shape(err, req->tokens);
            *n_active = st == FG_OK ? req->tokens->batch * req->tokens->seq_len : 0;
        } else {
            st = fg_validate_tokens(err, req->tokens, vocab, reads, 2, n_active);
        }
    }
    if (st != FG_OK)
        return st;
    const int64_t N = batch->batch * batch->seq_len;
    if (in->hidden.rows != N)
        return fg_fail(err, FG_ERR_SHAPE_MISMATCH, "hidden has %lld rows, B*T = %lld",
                       (long long)in->hidden.rows, (long long)N);
    if (out->grad_hidden.data &&
        (st = fg_validate_matrix(err, "grad_hidden", &out->grad_hidden, N, H)) != FG_OK)
        return st;
    if (out->grad_weight.data &&
        (st = fg_validate_matrix(err, "grad_weight", &out->grad_weight, V, H)) != FG_OK)
        return st;
    if (out->grad_bias.data && (st = fg_validate_vector(err, "grad_bias", &out->grad_bias, V)) != FG_OK)
        return st;
    if (in->hidden.dtype != FG_DTYPE_BF16 &&
        ((out->grad_hidden.data && out->grad_hidden.dtype != FG_DTYPE_F32) ||
         (out->grad_weight.data && out->grad_weight.dtype != FG_DTYPE_F32) ||
         (out->grad_bias.data && out->grad_bias.dtype != FG_DTYPE_F32)))
        return fg_fail(err, FG_ERR_UNSUPPORTED,
                       "bfloat16 gradients need bfloat16 inputs; float32 inputs get float32 "
                       "gradients");
    if (req->kind == KIND_LOGPROBS && !out->logp && !out->entropy)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "logp and entropy are both NULL: nothing to compute");
    if ((req->kind == KIND_LOGPROBS_BACKWARD || req->kind == KIND_SHARD_BACKWARD) &&
        !out->grad_hidden.data && !out->grad_weight.data && !out->grad_bias.data)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT,
                       "grad_hidden, grad_weight and grad_bias are all NULL: nothing to compute");
    if (o->round_logits_to_input_dtype && o->impl == FG_IMPL_FUSED)
        return fg_fail(err, FG_ERR_UNSUPPORTED,
                       "round_logits_to_input_dtype is a materialized-baseline option");
    if (!(o->filter_eps == FG_FILTER_EPS_AUTO || (o->filter_eps >= 0 && o->filter_eps <= 1)))
        return fg_fail(err, FG_ERR_BAD_HYPERPARAMETER,
                       "filter_eps = %g: 0 (off), a threshold in (0, 1], or FG_FILTER_EPS_AUTO",
                       o->filter_eps);
    if (o->filter_eps != 0 && o->impl != FG_IMPL_FUSED)
        return fg_fail(err, FG_ERR_UNSUPPORTED,
                       "filter_eps is a fused-path option (the materialized baseline is exact)");
    memset(ib, 0, sizeof *ib);
    return FG_OK;
}

fg_status fg_linear_check_aliasing(const fg_call *call, const linear_request *req,
                                   const fg_linear_inputs *in, const fg_linear_outputs *out)
{
    const fg_batch *b = req->batch; /* the head kinds' view holds their tokens */
    const size_t N = (size_t)(b->batch * b->seq_len), f = sizeof(float);
    const size_t stats = (size_t)FG_SHARD_STATS_FLOATS(N) * f;
    fg_span ins[FG_BATCH_SPANS + 6];
    fg_batch_spans(b, ins);
    ins[FG_BATCH_SPANS + 0] = fg_span_matrix("hidden", &in->hidden);
    ins[FG_BATCH_SPANS + 1] = fg_span_matrix("weight", &in->weight);
    ins[FG_BATCH_SPANS + 2] = fg_span_vector("bias", &in->bias);
    ins[FG_BATCH_SPANS + 3] = fg_span_bytes("grad_logp", req->dlogp, N * f);
    ins[FG_BATCH_SPANS + 4] = fg_span_bytes("grad_entropy", req->dentropy, N * f);
    ins[FG_BATCH_SPANS + 5] = fg_span_bytes("stats", req->stats_in, stats);
    const fg_span outs[] = {fg_span_bytes("logp", out->logp, N * f),
                            fg_span_bytes("entropy", out->entropy, N * f),
                            fg_span_matrix("grad_hidden", &out->grad_hidden),
                            fg_span_matrix("grad_weight", &out->grad_weight),
                            fg_span_vector("grad_bias", &out->grad_bias),
                            fg_span_bytes("stats", req->stats_out, stats),
                            fg_span_bytes("exec->device_report", call->device_report,
                                          sizeof(fg_device_report))};
    return fg_check_aliasing(call->err, outs, (int)(sizeof outs / sizeof outs[0]), ins,
                             (int)(sizeof ins / sizeof ins[0]), call->caller_workspace,
                             call->caller_workspace_bytes);
}
