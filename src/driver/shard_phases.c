/*
 * The phase API's steps between the caller's reductions (fusedgrpo.h,
 * "phases of a vocab-sharded call"): (b) a shard's sums rescaled to the
 * merged maxima as exact limbs, and the merged log-probs and entropies.
 * The GEMM phases (a) and (d) are requests of the one driver, linear_grpo.c.
 *
 * Both steps are O(N) host work. On a backend behind the seam every array is
 * the backend's memory: the tokens and the stats array are staged to the
 * host, the same code runs on the copies, and what it wrote goes back (the
 * stats array's rows it changed; logp and entropy), once every check has
 * passed.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "call.h"
#include "shard_stats.h"
#include "validate.h"

/* The arrays a step works on: the caller's, or host copies of a backend's. */
typedef struct phase_arrays {
    fg_tokens tok;
    const fg_tokens *tokens; /* &tok, or NULL when the caller's is NULL */
    float *stats;
    void *staging; /* the host copies (malloc), or NULL */
} phase_arrays;

/* A backend op's failure as the call's error. */
static fg_status backend_fail(fg_call *call, fg_status st, const char *msg)
{
    return fg_fail(call->err, st, "%s backend: %s", call->device->ops->name, msg);
}

/* The caller's arrays; on a backend, host copies of token_ids, mask and
 * stats. With sizes the checks refuse (B or T < 1, B*T*8 bytes overflowing),
 * or a NULL array, that array is not copied: the checks fail before they
 * read it. */
static fg_status stage(fg_call *call, const fg_tokens *tokens, float *stats, phase_arrays *a)
{
    memset(a, 0, sizeof *a);
    a->stats = stats;
    if (tokens) {
        a->tok = *tokens;
        a->tokens = &a->tok;
    }
    if (!call->device || !tokens || tokens->batch < 1 || tokens->seq_len < 1 ||
        tokens->batch > INT64_MAX / 8 / tokens->seq_len)
        return FG_OK;
    if (tokens->batch > INT64_MAX / 128 / tokens->seq_len) /* the copies' bytes would overflow */
        return fg_fail(call->err, FG_ERR_OUT_OF_MEMORY,
                       "B*T = %lld*%lld tokens: their arrays cannot be staged in host memory",
                       (long long)tokens->batch, (long long)tokens->seq_len);
    const int64_t N = tokens->batch * tokens->seq_len;
    const size_t ids = (size_t)N * sizeof(int64_t), mask = (size_t)N,
                 sbytes = (size_t)FG_SHARD_STATS_FLOATS(N) * sizeof(float);
    unsigned char *p = malloc(ids + sbytes + mask);
    if (!p)
        return fg_fail(call->err, FG_ERR_OUT_OF_MEMORY,
                       "cannot allocate %zu bytes to stage the tokens and stats",
                       ids + sbytes + mask);
    a->staging = p;
    const fg_backend_ops *ops = call->device->ops;
    void *be = call->device->state;
    char msg[sizeof call->err->msg - 64];
    msg[0] = '\0';
    fg_status st = FG_OK;
    if (tokens->token_ids) {
        a->tok.token_ids = (const int64_t *)p;
        st = ops->to_host(be, p, tokens->token_ids, ids, msg, sizeof msg);
    }
    if (st == FG_OK && stats) {
        a->stats = (float *)(p + ids);
        st = ops->to_host(be, a->stats, stats, sbytes, msg, sizeof msg);
    }
    if (st == FG_OK && tokens->mask) {
        a->tok.mask = p + ids + sbytes;
        st = ops->to_host(be, p + ids + sbytes, tokens->mask, mask, msg, sizeof msg);
    }
    if (st == FG_OK)
        st = ops->wait(be, msg, sizeof msg);
    return st == FG_OK ? FG_OK : backend_fail(call, st, msg);
}

/* On a backend: n floats of host memory into the backend's dst. */
static fg_status put(fg_call *call, float *dst, const float *host, int64_t n)
{
    char msg[sizeof call->err->msg - 64];
    msg[0] = '\0';
    const fg_status st = call->device->ops->to_device(call->device->state, dst, host,
                                                      (size_t)n * sizeof(float), msg, sizeof msg);
    return st == FG_OK ? FG_OK : backend_fail(call, st, msg);
}

/* On a backend: waits for the copies, so that their failure is the call's. */
static fg_status settle(fg_call *call)
{
    char msg[sizeof call->err->msg - 64];
    msg[0] = '\0';
    const fg_status st = call->device->ops->wait(call->device->state, msg, sizeof msg);
    return st == FG_OK ? FG_OK : backend_fail(call, st, msg);
}

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

/* The caller's own arrays (on a backend, its memory): what a step writes,
 * the stats and (finish) logp and entropy, must not overlap the tokens or
 * one another. The stats, read and written through one argument, are no
 * alias. After check: the sizes are valid. */
static fg_status check_aliasing(fg_call *call, const fg_tokens *tokens, const float *stats,
                                const float *logp, const float *entropy)
{
    const int64_t N = tokens->batch * tokens->seq_len;
    const size_t bytes = (size_t)N * sizeof(float);
    const fg_span ins[2] = {
        fg_span_bytes("token_ids", tokens->token_ids, (size_t)N * sizeof(int64_t)),
        fg_span_bytes("mask", tokens->mask, (size_t)N)};
    const fg_span outs[3] = {
        fg_span_bytes("stats", stats, (size_t)FG_SHARD_STATS_FLOATS(N) * sizeof(float)),
        fg_span_bytes("logp", logp, bytes), fg_span_bytes("entropy", entropy, bytes)};
    return fg_check_aliasing(call->err, outs, 3, ins, 2, call->caller_workspace,
                             call->caller_workspace_bytes);
}

/* The call's start, the staging and the checks; on failure the call is
 * ended (its status) and nothing is left to release. logp and entropy: the
 * step's other outputs (NULL: none). */
static fg_status begin(fg_context *ctx, fg_call *call, const fg_tokens *tokens, float *stats,
                       const float *logp, const float *entropy, phase_arrays *a)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_status st = fg_call_begin(ctx, NULL, call);
    if (st != FG_OK)
        return st;
    if ((st = stage(call, tokens, stats, a)) != FG_OK ||
        (st = check(call, a->tokens, a->stats)) != FG_OK ||
        (st = check_aliasing(call, tokens, stats, logp, entropy)) != FG_OK) {
        free(a->staging);
        return fg_call_end(call, st);
    }
    return FG_OK;
}

/* The call's end: the host copies released. */
static fg_status end(fg_call *call, phase_arrays *a, fg_status st)
{
    free(a->staging);
    return fg_call_end(call, st);
}

fg_status fg_shard_stats_rescale(fg_context *ctx, const fg_tokens *tokens, float *stats)
{
    fg_call call;
    phase_arrays a;
    fg_status st = begin(ctx, &call, tokens, stats, NULL, NULL, &a);
    if (st != FG_OK)
        return st;
    const int64_t N = tokens->batch * tokens->seq_len;
    for (int64_t n = 0; n < N; n++)
        fg_shard_encode(a.stats, N, n); /* masked tokens: -inf maxima, zero limbs */
    if (call.device) { /* the SUM range, the one this step writes */
        const int64_t o = FG_SHARD_STATS_SUM_OFFSET(N);
        if ((st = put(&call, stats + o, a.stats + o, FG_SHARD_STATS_SUM_COUNT(N))) == FG_OK)
            st = settle(&call);
    }
    return end(&call, &a, st);
}

fg_status fg_shard_stats_finish(fg_context *ctx, const fg_tokens *tokens, float *stats,
                                float *logp, float *entropy)
{
    fg_call call;
    phase_arrays a;
    fg_status st = begin(ctx, &call, tokens, stats, logp, entropy, &a);
    if (st != FG_OK)
        return st;
    const fg_tokens *tk = a.tokens;
    float *sb = a.stats;
    const int64_t N = tokens->batch * tokens->seq_len;
    /* Every token is checked before any output is written. */
    for (int64_t n = 0; n < N; n++) {
        if (!tk->mask[n])
            continue;
        float zmax, lsum, lp, ent;
        const int r = fg_shard_decode(sb, N, n, &zmax, &lsum, &lp, &ent);
        if (r == -1)
            return end(&call, &a, fg_fail(call.err, FG_ERR_COMMUNICATOR,
                                          "token %lld: the summed statistics are not sums of "
                                          "shards' limbs (the SUM was skipped, done twice, or "
                                          "over more than %d shards)",
                                          (long long)n, FG_SHARD_MAX_SHARDS));
        if (r == -2 || !isfinite(zmax) || isnan(lp) || !isfinite(ent))
            return end(&call, &a, fg_fail(call.err, FG_ERR_NONFINITE_INPUT,
                                          "token %lld: the logits are NaN or Inf on some "
                                          "shard (the finite check was off there)",
                                          (long long)n));
        if (sb[N + n] == -INFINITY) /* the MAX of the token's logit */
            return end(&call, &a, fg_fail(call.err, FG_ERR_TOKEN_OUT_OF_RANGE,
                                          "token %lld (id %lld): no shard holds its vocab row "
                                          "(the shards do not cover the vocabulary)",
                                          (long long)n, (long long)tk->token_ids[n]));
    }
    /* On a backend, logp and entropy are written on the host first. */
    float *const out[2] = {logp, entropy};
    float *hout[2] = {logp, entropy};
    float *host = NULL;
    if (call.device && (logp || entropy)) {
        host = malloc(2 * (size_t)N * sizeof(float));
        if (!host)
            return end(&call, &a, fg_fail(call.err, FG_ERR_OUT_OF_MEMORY,
                                          "cannot allocate %lld floats", (long long)(2 * N)));
        hout[0] = logp ? host : NULL;
        hout[1] = entropy ? host + N : NULL;
    }
    for (int64_t n = 0; n < N; n++) {
        float zmax = 0, lsum = 0, lp = 0, ent = 0;
        if (tk->mask[n])
            (void)fg_shard_decode(sb, N, n, &zmax, &lsum, &lp, &ent);
        fg_shard_keep_merged(sb, N, n, lsum, ent);
        if (hout[0])
            hout[0][n] = lp;
        if (hout[1])
            hout[1][n] = ent;
    }
    if (call.device) {
        /* logp and entropy first: an output the backend refuses (host
         * memory handed to CUDA) leaves the stats as they were, and the call
         * can be made again. Then this shard's own rows of the stats, which
         * keep the merged statistics. */
        for (int i = 0; i < 2 && st == FG_OK; i++)
            if (out[i])
                st = put(&call, out[i], hout[i], N);
        const int64_t o = FG_SHARD_STATS_SUM_OFFSET(N) + FG_SHARD_STATS_SUM_COUNT(N);
        if (st == FG_OK)
            st = put(&call, stats + o, sb + o, FG_SHARD_STATS_FLOATS(N) - o);
        if (st == FG_OK)
            st = settle(&call);
    }
    free(host);
    return end(&call, &a, st);
}
