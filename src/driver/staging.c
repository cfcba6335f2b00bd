/* Staging a request's token arrays to the host (staging.h). */
#include <stdlib.h>
#include <string.h>

#include "linear_plan.h"
#include "staging.h"

/* Bytes of one staged array of n elements of `size` (0 when absent). */
static size_t staged(const void *p, int64_t n, size_t size)
{
    return p ? ((size_t)n * size + 63) / 64 * 64 : 0;
}

fg_status fg_stage_request(fg_call *call, const fg_device *be, const linear_request *req,
                           fg_staged *out)
{
    memset(out, 0, sizeof *out);
    out->req = *req;
    const fg_batch *b = req->batch;
    if (!b || b->batch < 1 || b->seq_len < 1 || b->batch > INT64_MAX / 8 / b->seq_len)
        return FG_OK;
    if (b->batch > INT64_MAX / 128 / b->seq_len) /* the staged arrays' bytes would overflow */
        return fg_fail(call->err, FG_ERR_OUT_OF_MEMORY,
                       "B*T = %lld*%lld tokens: their arrays cannot be staged in host memory",
                       (long long)b->batch, (long long)b->seq_len);
    out->batch = *b;
    out->req.batch = &out->batch;
    const int64_t B = b->batch, N = B * b->seq_len;
    const int64_t ratio_n = b->is_ratio_per_sequence ? B : N;
    const float *stats = req->kind == KIND_SHARD_BACKWARD ? req->stats_in : NULL;
    enum { ARRAYS = 10 };
    const void *src[ARRAYS] = {b->token_ids, b->mask,          b->advantages, b->old_logp,
                               b->ref_logp,  b->is_ratio,      b->sampling_logp, req->dlogp,
                               req->dentropy, stats};
    const int64_t count[ARRAYS] = {N, N, B, N, N, ratio_n, N, N, N, FG_SHARD_STATS_FLOATS(N)};
    const size_t size[ARRAYS] = {8, 1, 4, 4, 4, 4, 4, 4, 4, 4};
    size_t bytes = 0;
    for (int i = 0; i < ARRAYS; i++)
        bytes += staged(src[i], count[i], size[i]);
    out->mem = malloc(bytes ? bytes : 1);
    if (!out->mem)
        return fg_fail(call->err, FG_ERR_OUT_OF_MEMORY,
                       "cannot allocate %zu bytes to stage the token arrays", bytes);
    unsigned char *next = out->mem;
    void *dst[ARRAYS];
    char msg[sizeof call->err->msg];
    msg[0] = '\0';
    fg_status st = FG_OK;
    for (int i = 0; i < ARRAYS && st == FG_OK; i++) {
        dst[i] = NULL;
        if (!src[i])
            continue;
        dst[i] = next;
        next += staged(src[i], count[i], size[i]);
        st = be->ops->to_host(be->state, dst[i], src[i], (size_t)count[i] * size[i], msg,
                              sizeof msg);
    }
    if (st == FG_OK)
        st = be->ops->wait(be->state, msg, sizeof msg);
    if (st != FG_OK)
        return fg_linear_backend_failed(call, be, st, msg);
    out->batch.token_ids = dst[0];
    out->batch.mask = dst[1];
    out->batch.advantages = dst[2];
    out->batch.old_logp = dst[3];
    out->batch.ref_logp = dst[4];
    out->batch.is_ratio = dst[5];
    out->batch.sampling_logp = dst[6];
    out->req.dlogp = dst[7];
    out->req.dentropy = dst[8];
    if (stats)
        out->req.stats_in = dst[9];
    if (req->tokens) {
        out->tokens = *req->tokens;
        out->tokens.token_ids = dst[0];
        out->tokens.mask = dst[1];
        out->req.tokens = &out->tokens;
    }
    return FG_OK;
}

void fg_staged_free(fg_staged *s)
{
    free(s->mem);
    s->mem = NULL;
}
