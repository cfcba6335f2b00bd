/*
 * The LM-head driver over the per-chunk seam (backend.h): fg_linear_grpo,
 * fg_linear_logprobs and fg_linear_logprobs_backward on a context whose
 * backend keeps the tensors in its own memory (CUDA; the host reference).
 *
 * The host owns what is O(tokens), with the code the CPU path runs:
 * validation (validate.c), the loss plan and its math (loss_math.c, through
 * finish.c), every token's checks, the loss and metrics. The backend owns
 * what is O(chunk x vocab) and O(vocab x hidden). Per call:
 *
 *   stage    the [B, T] token arrays to the host                  wait 1
 *   check    every argument (fg_linear_validate, on the staged copies);
 *            no output over an input (fg_linear_check_aliasing, the caller's)
 *   plan     chunk rows within the budget; the backend's workspace
 *   scan     NaN/Inf and the largest |x| of hidden, weight, bias  wait 2
 *   per chunk of m tokens:
 *     logits, stats                      (backend: GEMM 1, one read of the logits)
 *     the host reads logp/entropy [m]                             wait per chunk
 *     the loss math: checks, g = dL/dlogp, e = dL/dentropy [m] to the backend
 *     backward, grads                    (backend: one read, GEMMs 2 and 3)
 *   finish, logp/entropy out, the loss and metrics               wait at the end
 *
 * The phase API's GEMM phases run here too. (a) fg_linear_shard_stats:
 * logits and stats per chunk, each token's own statistics rebuilt on the
 * host from the stats op's outputs (shard_stats.h), the caller's stats array
 * written once at the end. (d) fg_linear_shard_backward: logits per chunk,
 * then, in place of the stats op, the merged statistics of the staged stats
 * array, g and e from the caller's derivatives, backward and grads. The
 * targets are local ids (token id - vocab_start); one outside [0, V) is
 * another shard's: the stats op's row_check[0] flag for it is ignored, and
 * the backward adds no one-hot term for it (backend.h).
 *
 * Nothing reaches an output before the checks of the arguments and the scan
 * have passed; each chunk's tokens are checked before its gradient products,
 * as on the CPU (fusedgrpo.h "Conventions"). The waits per chunk are where
 * the loss math needs the chunk's log-probs on the host; the next chunk's
 * GEMM 1 is not yet overlapped with them.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "finish.h"
#include "linear_device.h"
#include "shard_stats.h"

/* Backend memory is carved in pieces of whole 256-byte units. */
static size_t unit(size_t bytes) { return (bytes + 255) / 256 * 256; }

/* Everything a device call carries from step to step. */
typedef struct device_call {
    const fg_device *be;
    fg_call *call;
    fg_backend_call bc; /* shapes, the caller's views, the workspace */
    enum call_kind kind;
    int fused;
    int want_gh, want_gw, want_gb, any_grad;
    int64_t chunks;
    size_t call_scratch, fixed_bytes, chunk_bytes;
    fg_backend_scan *scans; /* [3] hidden, weight, bias */
    int64_t vocab_start;    /* the weight's first token id (0: unsharded) */
    /* Host side. */
    void *staging;    /* the staged token arrays (malloc) */
    fg_batch hbatch;  /* the request's batch over the staged copies */
    fg_tokens htokens;
    linear_request hreq;
    fg_common c;
    input_bounds ib;
    fg_grad_bound gb;
    float *hstats; /* [4 * chunk_rows] a chunk's zmax, lsum, entropy, logp */
    float *hge;    /* [2 * chunk_rows] its g, e                            */
    int64_t checked;
    int evaluated;
    double loss;
    fg_metrics metrics;
} device_call;

/* A backend op's failure as the call's error. */
static fg_status op(device_call *D, fg_status st, const char *msg)
{
    if (st == FG_OK)
        return FG_OK;
    return fg_fail(D->call->err, st, "%s backend: %s", D->be->ops->name, msg);
}

#define OP(D, call_expr)                                                                          \
    do {                                                                                          \
        char msg_[sizeof(((fg_error *)0)->msg) - 64];                                             \
        msg_[0] = '\0';                                                                           \
        const fg_status st_ = (call_expr);                                                        \
        if (st_ != FG_OK)                                                                         \
            return op((D), st_, msg_);                                                            \
    } while (0)
#define MSG msg_, sizeof msg_

/* ------------------------------------------------------------- staging */

/* Bytes of one staged array of n elements of `size` (0 when absent). */
static size_t staged(const void *p, int64_t n, size_t size)
{
    return p ? unit((size_t)n * size) : 0;
}

/* Copies the request's token arrays (backend memory) to host memory so that
 * validation and the loss math read them where the CPU path does; for the
 * phase API's (d), the stats array too (its status slot is checked, its
 * merged statistics read on the host). With sizes validation refuses (B or
 * T < 1, B*T*8 bytes overflowing), nothing is staged: validation fails on
 * the sizes before it reads an array. Every other batch is staged, or
 * refused here: validation must never read the backend's memory. */
static fg_status stage_request(device_call *D, const linear_request *req)
{
    const fg_batch *b = req->batch;
    D->hreq = *req;
    if (!b || b->batch < 1 || b->seq_len < 1 || b->batch > INT64_MAX / 8 / b->seq_len)
        return FG_OK;
    if (b->batch > INT64_MAX / 128 / b->seq_len) /* the staged arrays' bytes would overflow */
        return fg_fail(D->call->err, FG_ERR_OUT_OF_MEMORY,
                       "B*T = %lld*%lld tokens: their arrays cannot be staged in host memory",
                       (long long)b->batch, (long long)b->seq_len);
    D->hbatch = *b;
    D->hreq.batch = &D->hbatch;
    const int64_t B = b->batch, N = B * b->seq_len;
    const int64_t ratio_n = b->is_ratio_per_sequence ? B : N;
    const float *stats = req->kind == KIND_SHARD_BACKWARD ? req->stats_in : NULL;
    const size_t bytes = staged(b->token_ids, N, 8) + staged(b->mask, N, 1) +
                         staged(b->advantages, B, 4) + staged(b->old_logp, N, 4) +
                         staged(b->ref_logp, N, 4) + staged(b->is_ratio, ratio_n, 4) +
                         staged(b->sampling_logp, N, 4) + staged(req->dlogp, N, 4) +
                         staged(req->dentropy, N, 4) + staged(stats, FG_SHARD_STATS_FLOATS(N), 4);
    D->staging = malloc(bytes ? bytes : 1);
    if (!D->staging)
        return fg_fail(D->call->err, FG_ERR_OUT_OF_MEMORY,
                       "cannot allocate %zu bytes to stage the token arrays", bytes);
    unsigned char *next = D->staging;
    const void *src[10] = {b->token_ids, b->mask,         b->advantages, b->old_logp, b->ref_logp,
                           b->is_ratio,  b->sampling_logp, req->dlogp,   req->dentropy, stats};
    const int64_t count[10] = {N, N, B, N, N, ratio_n, N, N, N, FG_SHARD_STATS_FLOATS(N)};
    const size_t size[10] = {8, 1, 4, 4, 4, 4, 4, 4, 4, 4};
    void *dst[10];
    for (int i = 0; i < 10; i++) {
        dst[i] = NULL;
        if (!src[i])
            continue;
        dst[i] = next;
        next += staged(src[i], count[i], size[i]);
        OP(D, D->be->ops->to_host(D->be->state, dst[i], src[i], (size_t)count[i] * size[i], MSG));
    }
    OP(D, D->be->ops->wait(D->be->state, MSG));
    D->hbatch.token_ids = dst[0];
    D->hbatch.mask = dst[1];
    D->hbatch.advantages = dst[2];
    D->hbatch.old_logp = dst[3];
    D->hbatch.ref_logp = dst[4];
    D->hbatch.is_ratio = dst[5];
    D->hbatch.sampling_logp = dst[6];
    D->hreq.dlogp = dst[7];
    D->hreq.dentropy = dst[8];
    if (stats)
        D->hreq.stats_in = dst[9];
    if (req->tokens) {
        D->htokens = *req->tokens;
        D->htokens.token_ids = dst[0];
        D->htokens.mask = dst[1];
        D->hreq.tokens = &D->htokens;
    }
    return FG_OK;
}

/* --------------------------------------------------------------- plan */

/* The chunk rows a bf16 grad_weight's float32 sums may not push the chunks
 * below, halving them (plan_device): on an H200 cuBLASLt's three
 * products ran 8% below full speed in chunks of 1024 rows and 25% below in
 * chunks of 512 (bench_cuda, V = 151936, H = 4096). */
#define SUMS_MIN_ROWS 1024

/* Backend bytes of the call besides its chunks. */
static size_t fixed_bytes(const device_call *D, int gw_sum)
{
    const fg_backend_call *c = &D->bc;
    size_t b = 2 * unit((size_t)c->n_active * sizeof(int64_t)) /* rows, targets */
               + unit(3 * sizeof(fg_backend_scan)) + unit(2 * sizeof(int));
    if (gw_sum)
        b += unit((size_t)c->V * (size_t)c->H * sizeof(float));
    if (D->want_gb)
        b += unit((size_t)c->V * sizeof(float));
    return b;
}

/* Backend bytes of a chunk of m rows, the backend's scratch included. */
static size_t chunk_bytes(const device_call *D, int64_t m)
{
    const fg_backend_call *c = &D->bc;
    const size_t mV = (size_t)m * (size_t)c->V, mH = (size_t)m * (size_t)c->H;
    size_t b = unit(mV * fg_dtype_size(c->logit_t)) + unit(mH * fg_dtype_size(c->in_t)) +
               6 * unit((size_t)m * sizeof(float));
    if (D->any_grad && c->dlogit_t != c->logit_t)
        b += unit(mV * fg_dtype_size(c->dlogit_t));
    if (D->want_gh)
        b += unit(mH * sizeof(float));
    return b + unit(D->be->ops->chunk_scratch_bytes(D->be->state, c, m));
}

/* The most rows a chunk may hold within the budget (0: not even one). The
 * budget bounds the call's workspace; the GEMM library's workspace the
 * backend keeps for the context (call_scratch) is outside it, as oneDNN's
 * JIT code is on the CPU. */
static int64_t fit_rows(const device_call *D, size_t budget, int gw_sum)
{
    const size_t fixed = fixed_bytes(D, gw_sum);
    int64_t lo = 0, hi = D->bc.n_active;
    while (lo < hi) { /* the largest m with fixed + chunk_bytes(m) <= budget */
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (fixed + chunk_bytes(D, mid) <= budget)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The rows of each of the equal chunks of at most `rows` rows over n. */
static int64_t equal_rows(int64_t n, int64_t rows)
{
    const int64_t chunks = (n + rows - 1) / rows;
    return (n + chunks - 1) / chunks;
}

/* Equal chunks of at most `rows` rows over the unmasked tokens. */
static void split(device_call *D, int64_t rows)
{
    const int64_t n = D->bc.n_active;
    D->chunks = (n + rows - 1) / rows;
    D->bc.chunk_rows = equal_rows(n, rows);
}

static fg_status plan_device(device_call *D, const fg_linear_options *o,
                             const fg_linear_inputs *in, const fg_linear_outputs *out,
                             int64_t n_active)
{
    fg_backend_call *c = &D->bc;
    const fg_batch *b = D->hreq.batch;
    memset(c, 0, sizeof *c);
    D->fused = o->impl == FG_IMPL_FUSED;
    c->N = b->batch * b->seq_len;
    c->H = in->hidden.cols;
    c->V = in->weight.rows;
    c->n_active = n_active;
    c->in_t = in->hidden.dtype;
    c->logit_t = !D->fused && o->round_logits_to_input_dtype ? c->in_t : FG_DTYPE_F32;
    c->dlogit_t = c->in_t; /* the backward products multiply in the inputs' dtype */
    c->inv_temp = (float)(1.0 / D->hreq.cfg->temperature);
    c->accumulate = out->accumulate != 0;
    c->hidden = in->hidden;
    c->weight = in->weight;
    c->bias = in->bias;
    c->grad_hidden = out->grad_hidden;
    c->grad_weight = out->grad_weight;
    c->grad_bias = out->grad_bias;
    D->want_gh = out->grad_hidden.data != NULL;
    D->want_gw = out->grad_weight.data != NULL;
    D->want_gb = out->grad_bias.data != NULL;
    D->any_grad = D->want_gh || D->want_gw || D->want_gb;
    c->gb_sum = D->want_gb ? (float *)1 : NULL; /* placed by carve(); the backend's
                                                   scratch depends on it */
    fg_error *err = D->call->err;
    const int phase = D->kind == KIND_SHARD_STATS || D->kind == KIND_SHARD_BACKWARD;
    if (fg_linear_is_sharded(in) && !phase)
        return fg_fail(err, FG_ERR_UNSUPPORTED,
                       "a vocab-sharded weight runs on the CPU backend only (for now), or "
                       "through the phase API");
    D->vocab_start = in->vocab_start;
    if (o->filter_eps != 0)
        return fg_fail(err, FG_ERR_UNSUPPORTED,
                       "gradient filtering runs on the CPU backend only (for now)");
    char msg[sizeof err->msg - 64];
    msg[0] = '\0';
    fg_status st = D->be->ops->supports(D->be->state, c, msg, sizeof msg);
    if (st != FG_OK)
        return op(D, st, msg);
    D->call_scratch = D->be->ops->call_scratch_bytes(D->be->state, c);
    if (n_active == 0) {
        D->chunks = 0;
        D->fixed_bytes = fixed_bytes(D, 0);
        return FG_OK;
    }
    /* A bf16 grad_weight walked in several chunks sums in float32 and is
     * rounded once at the end. GEMM 3 adds each chunk into the bf16
     * grad_weight instead (one rounding per chunk; fusedgrpo.h
     * "Conventions") when the budget cannot hold those V x H sums beside a
     * row, or when it holds chunks of SUMS_MIN_ROWS or more without them and
     * beside them the chunks would fall below SUMS_MIN_ROWS and to under half
     * the rows. Chunks that small were slow already; these would be made
     * slow by the sums. On an H200 at
     * V = 151936, H = 4096 the sums (2.3 GiB) at a 3 GiB budget left chunks
     * of 741 rows instead of 2470: 1.27x the bare products instead of 1.08x
     * (docs/BENCHMARKS.md, "The CUDA backend"). */
    const int bf16_gw = D->want_gw && out->grad_weight.dtype == FG_DTYPE_BF16;
    int in_place = 0;
    if (!D->fused) {
        split(D, n_active); /* the baseline: one chunk of every row */
    } else {
        int64_t rows = fit_rows(D, D->call->budget, 0);
        if (rows > 0 && rows < n_active && bf16_gw) {
            const int64_t with_sums = fit_rows(D, D->call->budget, 1);
            const int64_t m = equal_rows(n_active, rows);
            const int64_t m_sums = with_sums < 1 ? 0 : equal_rows(n_active, with_sums);
            in_place = with_sums < 1 || (m >= SUMS_MIN_ROWS && m_sums < SUMS_MIN_ROWS &&
                                         2 * m_sums < m);
            rows = in_place ? rows : with_sums;
        }
        if (rows < 1) {
            const size_t least = fixed_bytes(D, 0) + chunk_bytes(D, 1);
            return fg_fail(err, FG_ERR_BUDGET_TOO_SMALL,
                           "the memory budget of %zu bytes cannot hold one token row on the %s "
                           "backend (%zu bytes)",
                           D->call->budget, D->be->ops->name, least);
        }
        split(D, rows);
    }
    const int gw_sum = bf16_gw && D->chunks > 1 && !in_place;
    D->fixed_bytes = fixed_bytes(D, gw_sum);
    D->chunk_bytes = chunk_bytes(D, c->chunk_rows);
    c->gw_sum = gw_sum ? (float *)1 : NULL; /* placed by carve() */
    return FG_OK;
}

/* The workspace, piece by piece. */
static void *take(unsigned char **next, size_t bytes)
{
    void *p = *next;
    *next += unit(bytes);
    return p;
}

static void carve(device_call *D, void *mem)
{
    fg_backend_call *c = &D->bc;
    unsigned char *next = mem;
    const size_t m = (size_t)c->chunk_rows, V = (size_t)c->V, H = (size_t)c->H;
    c->rows = take(&next, (size_t)c->n_active * sizeof(int64_t));
    c->targets = take(&next, (size_t)c->n_active * sizeof(int64_t));
    D->scans = take(&next, 3 * sizeof(fg_backend_scan));
    c->row_check = take(&next, 2 * sizeof(int));
    c->gw_sum = c->gw_sum ? take(&next, V * H * sizeof(float)) : NULL;
    c->gb_sum = D->want_gb ? take(&next, V * sizeof(float)) : NULL;
    if (c->n_active == 0)
        return;
    c->logits = take(&next, m * V * fg_dtype_size(c->logit_t));
    c->dlogits = D->any_grad && c->dlogit_t != c->logit_t
                     ? take(&next, m * V * fg_dtype_size(c->dlogit_t))
                     : c->logits;
    c->hbuf = take(&next, m * H * fg_dtype_size(c->in_t));
    c->ghbuf = D->want_gh ? take(&next, m * H * sizeof(float)) : NULL;
    c->zmax = take(&next, m * sizeof(float));
    c->lsum = take(&next, m * sizeof(float));
    c->entropy = take(&next, m * sizeof(float));
    c->logp = take(&next, m * sizeof(float));
    c->g = take(&next, m * sizeof(float));
    c->e = take(&next, m * sizeof(float));
    c->scratch = take(&next, D->be->ops->chunk_scratch_bytes(D->be->state, c, c->chunk_rows));
}

/* --------------------------------------------------------------- scan */

static fg_magnitude magnitude(const fg_backend_scan *s)
{
    float f;
    memcpy(&f, &s->top_bits, sizeof f);
    fg_magnitude m = {f, s->top_row < 0 ? 0 : s->top_row};
    return m;
}

/* The finite check of hidden's unmasked rows, weight and bias in the
 * backend, then the bounds (fg_linear_check_bounds); the messages are the
 * CPU scan's. */
static fg_status scan_inputs(device_call *D, const fg_linear_inputs *in,
                             const fg_linear_outputs *out, const uint8_t *mask)
{
    const fg_backend_ops *ops = D->be->ops;
    const fg_matrix bias = {in->bias.data, in->bias.dtype, 1, in->bias.len, in->bias.len};
    const fg_matrix *x[3] = {&in->hidden, &in->weight, &bias};
    const char *name[3] = {"hidden", "weight", "bias"};
    const int n = in->bias.data ? 3 : 2;
    fg_backend_scan s[3];
    for (int i = 0; i < n; i++)
        OP(D, ops->scan(D->be->state, x[i], i == 0 ? mask : NULL, &D->scans[i], MSG));
    OP(D, ops->to_host(D->be->state, s, D->scans, (size_t)n * sizeof *s, MSG));
    OP(D, ops->wait(D->be->state, MSG));
    fg_magnitude mag[3] = {{0.0, 0}, {0.0, 0}, {0.0, 0}};
    for (int i = 0; i < n; i++) {
        if (s[i].bad_row >= 0)
            return i == 2 ? fg_fail(D->call->err, FG_ERR_NONFINITE_INPUT, "%s[%lld] is NaN or Inf",
                                    name[i], (long long)s[i].bad_col)
                          : fg_fail(D->call->err, FG_ERR_NONFINITE_INPUT,
                                    "%s[%lld, %lld] is NaN or Inf", name[i],
                                    (long long)s[i].bad_row, (long long)s[i].bad_col);
        mag[i] = magnitude(&s[i]);
    }
    mag[2].index = 0;
    return fg_linear_check_bounds(D->call, &D->hreq, in, out, mag[0], mag[1], mag[2], &D->ib);
}

/* ------------------------------------------------------------- chunks */

/* The checks of tokens tok[0..m) once their statistics are in c.ta
 * (linear_grpo.c's check_tokens): with `grads`, their loss terms and
 * derivatives too; once every token is checked, the loss and metrics. */
static fg_status check_tokens(device_call *D, const int64_t *tok, int64_t m, int grads)
{
    const int loss = D->kind == KIND_LOSS;
    fg_status st = fg_common_check_tokens(&D->c, D->call->err, tok, m, D->ib.scanned,
                                          grads && loss ? &D->gb : NULL);
    if (st != FG_OK || !grads || !loss)
        return st;
    D->checked += m;
    if (D->checked == D->c.n_active) {
        st = fg_common_evaluate(&D->c, D->call->err, &D->loss, &D->metrics);
        D->evaluated = 1;
    }
    return st;
}

static int64_t chunk_start(const device_call *D, int64_t k) { return k * D->bc.chunk_rows; }
static int64_t chunk_len(const device_call *D, int64_t k)
{
    const int64_t r0 = chunk_start(D, k), left = D->bc.n_active - r0;
    return left < D->bc.chunk_rows ? left : D->bc.chunk_rows;
}

/* GEMM 1 and the stats op of the chunk's rows [r0, r0 + m), their zmax,
 * lsum, entropy and logp queued for the host, m floats each from D->hstats
 * on (there once the caller waits). */
static fg_status chunk_stats_to_host(device_call *D, int64_t r0, int64_t m)
{
    const fg_backend_ops *ops = D->be->ops;
    void *be = D->be->state;
    fg_backend_call *c = &D->bc;
    OP(D, ops->logits(be, c, r0, m, MSG));
    OP(D, ops->stats(be, c, r0, m, MSG));
    float *const src[4] = {c->zmax, c->lsum, c->entropy, c->logp};
    for (int i = 0; i < 4; i++)
        OP(D, ops->to_host(be, D->hstats + i * m, src[i], (size_t)m * sizeof(float), MSG));
    return FG_OK;
}

/* GEMM 1 and the statistics of chunk k, read back into c.ta. */
static fg_status forward_chunk(device_call *D, int64_t k)
{
    const fg_backend_ops *ops = D->be->ops;
    void *be = D->be->state;
    fg_backend_call *c = &D->bc;
    const int64_t r0 = chunk_start(D, k), m = chunk_len(D, k);
    const int none[2] = {FG_BACKEND_ROW_NONE, FG_BACKEND_ROW_NONE};
    int check[2];
    OP(D, ops->to_device(be, c->row_check, none, sizeof none, MSG));
    const fg_status queued = chunk_stats_to_host(D, r0, m);
    if (queued != FG_OK)
        return queued;
    float *const dst[4] = {D->hstats, D->hstats + m, D->hstats + 2 * m, D->hstats + 3 * m};
    OP(D, ops->to_host(be, check, c->row_check, sizeof check, MSG));
    OP(D, ops->wait(be, MSG));
    const int64_t *tok = D->c.active + r0;
    if (check[0] != FG_BACKEND_ROW_NONE) { /* validation read these ids: a backend fault */
        const int64_t n = tok[check[0]], T = D->hbatch.seq_len;
        return fg_fail(D->call->err, FG_ERR_TOKEN_OUT_OF_RANGE,
                       "token [%lld, %lld]: id %lld outside [0, %lld) in the %s backend",
                       (long long)(n / T), (long long)(n % T),
                       (long long)D->hbatch.token_ids[n], (long long)c->V, ops->name);
    }
    for (int64_t i = 0; i < m; i++) {
        const int64_t n = tok[i];
        D->c.ta.zmax[n] = dst[0][i];
        D->c.ta.lsum[n] = dst[1][i];
        D->c.ta.entropy[n] = dst[2][i];
        D->c.ta.logp[n] = dst[3][i];
    }
    return FG_OK;
}

/* The backward of chunk k from its checked statistics: g, e from the loss
 * math, then dlogits and GEMMs 2 and 3. `restore`: the statistics come back
 * from c.ta (a forward sweep over every chunk ran first). */
static fg_status backward_chunk(device_call *D, int64_t k, int restore)
{
    const fg_backend_ops *ops = D->be->ops;
    void *be = D->be->state;
    fg_backend_call *c = &D->bc;
    const int64_t r0 = chunk_start(D, k), m = chunk_len(D, k);
    const int64_t *tok = D->c.active + r0;
    const fg_token_arrays *ta = &D->c.ta;
    float *g = D->hge, *e = D->hge + m;
    for (int64_t i = 0; i < m; i++) {
        const int64_t n = tok[i];
        g[i] = fg_loss_dlogp(&D->c.plan, n, ta->logp[n], ta->entropy[n]);
        e[i] = fg_loss_dentropy(&D->c.plan, n, ta->entropy[n]);
    }
    OP(D, ops->to_device(be, c->g, g, (size_t)m * sizeof(float), MSG));
    OP(D, ops->to_device(be, c->e, e, (size_t)m * sizeof(float), MSG));
    if (restore) {
        float *const dst[3] = {c->zmax, c->lsum, c->entropy};
        const float *const src[3] = {ta->zmax, ta->lsum, ta->entropy};
        for (int j = 0; j < 3; j++) {
            for (int64_t i = 0; i < m; i++)
                D->hstats[i] = src[j][tok[i]];
            OP(D, ops->to_device(be, dst[j], D->hstats, (size_t)m * sizeof(float), MSG));
        }
    }
    OP(D, ops->backward(be, c, r0, m, MSG));
    /* grad_weight's float32 sums start afresh; the caller's values join them
     * in finish when accumulating. */
    OP(D, ops->grads(be, c, r0, m, k == 0 && (!c->accumulate || c->gw_sum), MSG));
    return FG_OK;
}

/* The phase API's (a) for chunk k: GEMM 1 and the stats op, then each
 * token's own statistics (shard_stats.h) into `out`, the host copy of the
 * stats array. The op's outputs give them back: the sum S = exp(lsum), the
 * dot sum S (lsum - entropy) (entropy = lsum - dot / S), the target's logit
 * z = logp + zmax + lsum, rebuilt in double from the float outputs, within
 * an ulp or two of lsum and of the log-prob (the merge's own rounding is
 * of the same order). A target outside the shard's rows is another shard's
 * (-inf); the stats op flags it in row_check[0], which is not read here:
 * validation checked every id against vocab_total. (a) checks no token, as
 * on the CPU: non-finite statistics reach fg_shard_stats_finish, which
 * reports them. */
static fg_status shard_stats_chunk(device_call *D, int64_t k, float *out)
{
    const fg_backend_call *c = &D->bc;
    const int64_t r0 = chunk_start(D, k), m = chunk_len(D, k);
    const fg_status queued = chunk_stats_to_host(D, r0, m);
    if (queued != FG_OK)
        return queued;
    OP(D, D->be->ops->wait(D->be->state, MSG));
    float *const dst[4] = {D->hstats, D->hstats + m, D->hstats + 2 * m, D->hstats + 3 * m};
    const int64_t *tok = D->c.active + r0;
    for (int64_t i = 0; i < m; i++) {
        const int64_t n = tok[i], t = D->hbatch.token_ids[n] - D->vocab_start;
        const double zmax = dst[0][i], lsum = dst[1][i], sum = exp(lsum);
        const fg_row_stats st = {dst[0][i], (float)sum, (float)(sum * (lsum - dst[2][i]))};
        const float z_tok =
            t >= 0 && t < c->V ? (float)((double)dst[3][i] + zmax + lsum) : -INFINITY;
        fg_shard_put_local(out, c->N, n, st, z_tok);
    }
    return FG_OK;
}

/* The phase API's (a): every chunk's statistics, the masked tokens' and the
 * status slot (fg_shard_stats_close, as on the CPU), then the caller's stats
 * array in backend memory: its MAX range and this shard's own statistics,
 * the ranges (a) writes on the CPU (the SUM range is (b)'s). */
static fg_status run_shard_stats(device_call *D)
{
    const int64_t N = D->bc.N;
    float *host = malloc((size_t)FG_SHARD_STATS_FLOATS(N) * sizeof(float));
    if (!host)
        return fg_fail(D->call->err, FG_ERR_OUT_OF_MEMORY, "cannot allocate %lld floats",
                       (long long)FG_SHARD_STATS_FLOATS(N));
    fg_status st = FG_OK;
    for (int64_t k = 0; k < D->chunks && st == FG_OK; k++)
        st = shard_stats_chunk(D, k, host);
    if (st == FG_OK) {
        fg_shard_stats_close(host, &D->hbatch);
        const int64_t local = FG_SHARD_STATS_SUM_OFFSET(N) + FG_SHARD_STATS_SUM_COUNT(N);
        const int64_t first[2] = {0, local};
        const int64_t count[2] = {FG_SHARD_STATS_MAX_COUNT(N), FG_SHARD_STATS_FLOATS(N) - local};
        char msg[sizeof D->call->err->msg - 64];
        msg[0] = '\0';
        for (int i = 0; i < 2 && st == FG_OK; i++)
            st = D->be->ops->to_device(D->be->state, D->hreq.stats_out + first[i],
                                       host + first[i], (size_t)count[i] * sizeof(float), msg,
                                       sizeof msg);
        if (st == FG_OK)
            st = D->be->ops->wait(D->be->state, msg, sizeof msg);
        if (st != FG_OK)
            st = op(D, st, msg);
    }
    free(host);
    return st;
}

/* Whether every token's log-prob comes first: the loss needs them
 * (fg_loss_needs_all_tokens), or an accumulating call of several chunks
 * sums GEMM 3 into the caller's grad_weight, which a token refused in a
 * later chunk would leave changed. (The CPU path skips the second case when
 * the inputs rule a refusal out; here it always runs first.) */
static int forward_first(const device_call *D)
{
    return fg_loss_needs_all_tokens(&D->c.plan) ||
           (D->kind == KIND_LOSS && D->bc.accumulate && D->want_gw && !D->bc.gw_sum &&
            D->chunks > 1);
}

static fg_status run_chunks(device_call *D)
{
    fg_status st = FG_OK;
    const int64_t K = D->chunks;
    if (!D->any_grad) {
        for (int64_t k = 0; k < K && st == FG_OK; k++)
            if ((st = forward_chunk(D, k)) == FG_OK)
                st = check_tokens(D, D->c.active + chunk_start(D, k), chunk_len(D, k), 0);
        return st;
    }
    if (D->kind == KIND_SHARD_BACKWARD) {
        /* The phase API's (d): the merged statistics are in c.ta (loaded
         * from the stats array), the derivatives are the caller's: no stats
         * op, no token checks (as on the CPU). */
        for (int64_t k = 0; k < K && st == FG_OK; k++) {
            OP(D, D->be->ops->logits(D->be->state, &D->bc, chunk_start(D, k), chunk_len(D, k),
                                     MSG));
            st = backward_chunk(D, k, 1);
        }
        return st;
    }
    if (!forward_first(D)) {
        for (int64_t k = 0; k < K && st == FG_OK; k++) {
            if ((st = forward_chunk(D, k)) != FG_OK ||
                (st = check_tokens(D, D->c.active + chunk_start(D, k), chunk_len(D, k), 1)) !=
                    FG_OK)
                return st;
            st = backward_chunk(D, k, 0);
        }
        return st;
    }
    for (int64_t k = 0; k < K && st == FG_OK; k++)
        if ((st = forward_chunk(D, k)) == FG_OK)
            st = check_tokens(D, D->c.active + chunk_start(D, k), chunk_len(D, k), 0);
    if (st != FG_OK)
        return st;
    fg_common_prepare(&D->c);
    if ((st = check_tokens(D, D->c.active, D->c.n_active, 1)) != FG_OK)
        return st;
    for (int64_t k = 0; k < K && st == FG_OK; k++) {
        /* With one chunk the logits are still there. */
        if (K > 1) {
            const fg_backend_ops *ops = D->be->ops;
            OP(D, ops->logits(D->be->state, &D->bc, chunk_start(D, k), chunk_len(D, k), MSG));
        }
        st = backward_chunk(D, k, K > 1);
    }
    return st;
}

/* ------------------------------------------------------------- commit */

/* logp and entropy [N] (0 at masked tokens) to the caller's backend memory. */
static fg_status commit_token_outputs(device_call *D, const fg_linear_outputs *out)
{
    const int64_t N = D->bc.N;
    float *const dst[2] = {out->logp, out->entropy};
    for (int i = 0; i < 2; i++) {
        if (!dst[i])
            continue;
        float *host = malloc((size_t)N * sizeof(float));
        if (!host)
            return fg_fail(D->call->err, FG_ERR_OUT_OF_MEMORY, "cannot allocate %lld floats",
                           (long long)N);
        fg_common_commit(&D->c, &D->hbatch, i == 0 ? host : NULL, i == 1 ? host : NULL);
        char msg[sizeof D->call->err->msg - 64];
        msg[0] = '\0';
        const fg_status st = D->be->ops->to_device(D->be->state, dst[i], host,
                                                   (size_t)N * sizeof(float), msg, sizeof msg);
        free(host);
        if (st != FG_OK)
            return op(D, st, msg);
    }
    return FG_OK;
}

/* Everything after the checks: the rows, the chunks, the finish, then the
 * loss and the per-token outputs; one wait at the end so that a backend
 * failure is this call's status. */
static fg_status run_device_call(device_call *D, fg_linear_outputs *out)
{
    const fg_backend_ops *ops = D->be->ops;
    void *be = D->be->state;
    fg_backend_call *c = &D->bc;
    fg_status st = FG_OK;
    if (c->n_active > 0) {
        /* The unmasked rows and their targets, in the backend. */
        int64_t *targets = malloc((size_t)c->n_active * sizeof(int64_t));
        if (!targets)
            return fg_fail(D->call->err, FG_ERR_OUT_OF_MEMORY, "cannot allocate %lld ids",
                           (long long)c->n_active);
        for (int64_t i = 0; i < c->n_active; i++) /* local ids: this shard's rows */
            targets[i] = D->hbatch.token_ids[D->c.active[i]] - D->vocab_start;
        char msg[sizeof D->call->err->msg - 64];
        msg[0] = '\0';
        st = ops->to_device(be, (void *)c->rows, D->c.active, (size_t)c->n_active * sizeof(int64_t),
                            msg, sizeof msg);
        if (st == FG_OK)
            st = ops->to_device(be, (void *)c->targets, targets,
                                (size_t)c->n_active * sizeof(int64_t), msg, sizeof msg);
        free(targets);
        if (st != FG_OK)
            return op(D, st, msg);
    }
    if (D->kind == KIND_SHARD_STATS)
        return run_shard_stats(D);
    if (c->gb_sum)
        OP(D, ops->fill_zero(be, c->gb_sum, (size_t)c->V * sizeof(float), MSG));
    if (c->n_active > 0 && (st = run_chunks(D)) != FG_OK)
        return st;
    if (D->kind == KIND_LOSS && !D->evaluated) {
        /* No gradient sweep checked the tokens (a loss without gradients,
         * or no unmasked token): their loss terms, then the loss. */
        fg_common_prepare(&D->c);
        if ((st = check_tokens(D, D->c.active, D->c.n_active, 1)) != FG_OK)
            return st;
    }
    if (D->any_grad)
        OP(D, ops->finish(be, c, MSG));
    if ((st = commit_token_outputs(D, out)) != FG_OK)
        return st;
    OP(D, ops->wait(be, MSG));
    if (D->kind == KIND_LOSS) {
        out->loss = D->loss;
        out->metrics = D->metrics;
    }
    return FG_OK;
}

/* ------------------------------------------------------------- entry */

/* Stage, check and plan: what the call and the plan query share. */
static fg_status check_and_plan(device_call *D, fg_call *call, const fg_linear_options *opts,
                                const linear_request *req, const fg_linear_inputs *in,
                                const fg_linear_outputs *out, int64_t *n_active)
{
    memset(D, 0, sizeof *D);
    D->be = call->device;
    D->call = call;
    D->kind = req->kind;
    const fg_linear_options fused = {FG_IMPL_FUSED, 0, 0.0};
    const fg_linear_options *o = opts ? opts : &fused;
    if (call->comm.allreduce)
        return fg_fail(call->err, FG_ERR_UNSUPPORTED,
                       "a communicator runs on the CPU backend only (for now)");
    fg_status st = stage_request(D, req);
    if (st != FG_OK)
        return st;
    input_bounds unscanned;
    if ((st = fg_linear_validate(call, o, &D->hreq, in, out, n_active, &unscanned)) != FG_OK)
        return st;
    return plan_device(D, o, in, out, *n_active);
}

static void release(device_call *D) { free(D->staging); }

fg_status fg_linear_device_execute(fg_call *call, const fg_linear_options *opts,
                                   const linear_request *req, const fg_linear_inputs *in,
                                   fg_linear_outputs *out)
{
    device_call D;
    int64_t n_active = 0;
    fg_status st = check_and_plan(&D, call, opts, req, in, out, &n_active);
    if (st == FG_OK) /* the caller's pointers, in backend memory, not the staged copies */
        st = fg_linear_check_aliasing(call, req, in, out);
    if (st == FG_OK)
        st = fg_call_reserve(call, fg_common_workspace_bytes(D.hbatch.batch, D.bc.N) +
                                       6 * (size_t)D.bc.chunk_rows * sizeof(float) + 256);
    void *mem = NULL;
    if (st == FG_OK)
        st = fg_call_reserve_device(call, D.fixed_bytes + D.chunk_bytes, &mem);
    if (st != FG_OK) {
        release(&D);
        return st;
    }
    call->chunk_rows = D.bc.chunk_rows;
    call->chunks = D.chunks;
    carve(&D, mem);
    D.bc.mask = req->batch->mask; /* the caller's, in backend memory */
    if (call->check_finite && (st = scan_inputs(&D, in, out, req->batch->mask)) != FG_OK) {
        release(&D);
        return st;
    }
    /* Every argument check has passed: from here on the backend writes. */
    if (D.kind == KIND_LOSS)
        fg_common_init(call->arena, &D.c, D.hreq.cfg, &D.hbatch);
    else
        fg_common_init_external(call->arena, &D.c, &D.hbatch, D.hreq.dlogp, D.hreq.dentropy);
    if (D.kind == KIND_SHARD_BACKWARD) /* the merged statistics, staged with the tokens */
        fg_shard_stats_load(D.hreq.stats_in, &D.hbatch, &D.c);
    D.hstats = fg_call_take(call, 4 * (size_t)D.bc.chunk_rows * sizeof(float));
    D.hge = fg_call_take(call, 2 * (size_t)D.bc.chunk_rows * sizeof(float));
    D.gb = fg_linear_grad_bound(&D.ib, out, D.hreq.cfg->temperature, D.bc.V);
    st = run_device_call(&D, out);
    release(&D);
    return st;
}

fg_status fg_linear_device_plan(fg_call *call, const fg_linear_options *opts,
                                const linear_request *req, const fg_linear_inputs *in,
                                const fg_linear_outputs *out, fg_linear_plan_info *info)
{
    device_call D;
    int64_t n_active = 0;
    const fg_status st = check_and_plan(&D, call, opts, req, in, out, &n_active);
    release(&D);
    if (st != FG_OK && !(st == FG_ERR_BUDGET_TOO_SMALL && n_active > 0))
        return st; /* an argument error: info is not written */
    fg_linear_plan_info r;
    memset(&r, 0, sizeof r);
    r.gemm_dtype = D.bc.in_t;
    r.fixed_bytes = D.fixed_bytes;
    r.grad_weight_sum_bytes =
        D.bc.gw_sum ? unit((size_t)D.bc.V * (size_t)D.bc.H * sizeof(float)) : 0;
    r.min_budget_bytes = D.fused ? fixed_bytes(&D, 0) + (n_active > 0 ? chunk_bytes(&D, 1) : 0)
                                 : 0;
    if (st == FG_OK) {
        r.chunk_rows = D.bc.chunk_rows;
        r.later_chunk_rows = D.bc.chunk_rows;
        r.chunks = D.chunks;
        r.chunk_bytes = D.chunk_bytes;
        r.gemm_scratch_bytes = D.call_scratch;
        r.working_bytes = D.fixed_bytes + D.chunk_bytes;
    }
    *info = r;
    return st;
}
