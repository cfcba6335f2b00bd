/*
 * The phase API's steps between the caller's reductions (fusedgrpo.h,
 * "phases of a vocab-sharded call"): (b) a shard's sums rescaled to the
 * merged maxima as exact limbs, and the merged log-probs and entropies.
 * The GEMM phases (a) and (d) are requests of linear_grpo.c.
 */
#include <math.h>
#include <stdint.h>

#include "call.h"
#include "shard_stats.h"
#include "validate.h"

/* The checks both steps share: the tokens (sizes, mask) and the stats'
 * status slot (a shard that failed (a)). */
static fg_status check(fg_call *call, const fg_tokens *tokens, const float *stats)
{
    if (!tokens)
        return fg_fail(call->err, FG_ERR_NULL_ARGUMENT, "tokens is NULL");
    int64_t n_active;
    fg_status st = fg_validate_tokens(call->err, tokens, INT64_MAX, NULL, 0, &n_active);
    if (st != FG_OK)
        return st;
    return fg_validate_shard_stats(call->err, stats, tokens->batch * tokens->seq_len);
}

/* The call's start, the checks; on failure the call is ended (its status). */
static fg_status begin(fg_context *ctx, fg_call *call, const fg_tokens *tokens, const float *stats)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_status st = fg_call_begin(ctx, NULL, call);
    if (st != FG_OK)
        return st;
    if ((st = fg_call_host_only(call, "the phase API")) != FG_OK ||
        (st = check(call, tokens, stats)) != FG_OK)
        return fg_call_end(call, st);
    return FG_OK;
}

fg_status fg_shard_stats_rescale(fg_context *ctx, const fg_tokens *tokens, float *stats)
{
    fg_call call;
    const fg_status st = begin(ctx, &call, tokens, stats);
    if (st != FG_OK)
        return st;
    const int64_t N = tokens->batch * tokens->seq_len;
    for (int64_t n = 0; n < N; n++)
        fg_shard_encode(stats, N, n); /* masked tokens: -inf maxima, zero limbs */
    return fg_call_end(&call, FG_OK);
}

fg_status fg_shard_stats_finish(fg_context *ctx, const fg_tokens *tokens, float *stats,
                                float *logp, float *entropy)
{
    fg_call call;
    const fg_status st = begin(ctx, &call, tokens, stats);
    if (st != FG_OK)
        return st;
    const int64_t N = tokens->batch * tokens->seq_len;
    /* Every token is checked before any output is written. */
    for (int64_t n = 0; n < N; n++) {
        if (!tokens->mask[n])
            continue;
        float zmax, lsum, lp, ent;
        const int r = fg_shard_decode(stats, N, n, &zmax, &lsum, &lp, &ent);
        if (r == -1)
            return fg_call_end(&call, fg_fail(call.err, FG_ERR_COMMUNICATOR,
                                              "token %lld: the summed statistics are not sums of "
                                              "shards' limbs (the SUM was skipped, done twice, or "
                                              "over more than %d shards)",
                                              (long long)n, FG_SHARD_MAX_SHARDS));
        if (r == -2 || !isfinite(zmax) || isnan(lp) || !isfinite(ent))
            return fg_call_end(&call, fg_fail(call.err, FG_ERR_NONFINITE_INPUT,
                                              "token %lld: the logits are NaN or Inf on some "
                                              "shard (the finite check was off there)",
                                              (long long)n));
        if (stats[N + n] == -INFINITY) /* the MAX of the token's logit */
            return fg_call_end(&call, fg_fail(call.err, FG_ERR_TOKEN_OUT_OF_RANGE,
                                              "token %lld (id %lld): no shard holds its vocab row "
                                              "(the shards do not cover the vocabulary)",
                                              (long long)n, (long long)tokens->token_ids[n]));
    }
    for (int64_t n = 0; n < N; n++) {
        float zmax = 0, lsum = 0, lp = 0, ent = 0;
        if (tokens->mask[n])
            (void)fg_shard_decode(stats, N, n, &zmax, &lsum, &lp, &ent);
        fg_shard_keep_merged(stats, N, n, lsum, ent);
        if (logp)
            logp[n] = lp;
        if (entropy)
            entropy[n] = ent;
    }
    return fg_call_end(&call, FG_OK);
}
