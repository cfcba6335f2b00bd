/*
 * The LM-head driver, one for every backend (backend.h): fg_linear_grpo,
 * fg_linear_logprobs, fg_linear_logprobs_backward and the phase API's GEMM
 * phases (fg_linear_shard_stats, fg_linear_shard_backward).
 *
 * Fused (FG_IMPL_FUSED): the unmasked tokens are processed in chunks of Nc
 * rows, Nc chosen so that everything the call holds fits the budget
 * (linear_plan.c):
 *
 *   for each chunk of rows R:                       shapes
 *     hbuf   = hidden[R]                            [Nc, H]   gather
 *     logits = hbuf · Wᵀ + bias                     [Nc, V]   GEMM 1
 *     per row: lse, logp, entropy; on the host the loss math's g, e; then
 *     d loss/d logits (in place, or in the compute dtype)
 *     grad_bias   += Σ_rows dlogits                 [V]
 *     grad_hidden[R] = dlogits · W                  [Nc, H]   GEMM 2
 *     grad_weight += dlogitsᵀ · hbuf                [V, H]    GEMM 3
 *
 * Token-level ratios need nothing beyond a token's own row, so the gradient
 * comes out of the same sweep: three GEMM-sized products in all, as many as
 * the baseline. Sequence-level ratios (GSPO), vespo's weight, the off-policy
 * mask and the entropy quantile need every token's log-prob or entropy first
 * (fg_loss_needs_all_tokens): one forward sweep (GEMM 1 only), then the sweep
 * above recomputing the logits, unless everything fits in one chunk.
 *
 * Gradient filtering (filter_eps > 0, grad_filter.h): GEMMs 2 and 3 become
 * sparse products over each row's kept entries of dlogits, when every row of
 * the chunk keeps few enough of them.
 *
 * Materialized (FG_IMPL_MATERIALIZED): the plain baseline, one chunk of all
 * rows with a separate [N, V] dlogits buffer, as a framework holds them.
 *
 * Backends: the host owns what is O(tokens) (validation, the loss math,
 * every token's checks, the loss and metrics), the backend what is O(chunk
 * x vocab) and O(vocab x hidden). On a host backend (the CPU) the driver
 * reads and writes the backend's buffers in place; on another (CUDA, the
 * reference) it stages the token arrays to the host first (staging.h) and
 * keeps every token's statistics in the backend's memory. A deferred call
 * (runs_deferred: most calls) has the backend's derivs op compute g, e from
 * the one loss-math source (loss_token.h), runs the chunks with no host wait
 * between them, and reads and checks every token once, after them (or
 * between a loss's two sweeps); any other copies each chunk's statistics
 * out, checks them and hands g, e back: one wait per chunk. Nothing reaches
 * an output before the checks of the arguments and the scan have passed;
 * each chunk's tokens are checked before its gradient products, but in a
 * deferred call after them (fusedgrpo.h "Conventions" says what a refusal
 * then leaves).
 *
 * A device-reported call (fg_exec.device_report, run_reported) reads no
 * value on the host: nothing is staged, the walk is over every token row
 * (masked rows gather zeros and get g = e = 0), and the backend's report
 * ops check the values, build the plan's per-sequence constants, check
 * every token and evaluate the loss into the caller's record (report.h);
 * the call returns once all of it is queued.
 */
#include <math.h>
#include <string.h>

#include "backend_cpu.h"
#include "bf16.h"
#include "call.h"
#include "collective.h"
#include "finish.h"
#include "linear_plan.h"
#include "report.h"
#include "shard_stats.h"
#include "staging.h"

/* A chunk's per-row arrays as the host reads and writes them: the
 * backend's own on a host backend, copies on another. */
typedef struct host_rows {
    float *zmax, *lsum, *entropy, *logp, *g, *e;
} host_rows;

/* Everything one call carries from chunk to chunk. */
typedef struct linear_call {
    fg_call *call;
    linear_plan p;
    fg_cpu_backend cpu; /* the backend's state when the call runs on the CPU */
    fg_staged staged;   /* a device backend's token arrays on the host         */
    const linear_request *req; /* the request as the host reads it (staged)  */
    const linear_request *dev_req; /* the caller's: its arrays in the backend's memory */
    fg_backend_call cv; /* the chunk's view of p.bc (chunk_view)                   */
    /* A device backend: every token's statistics and a row check slot a
     * chunk (the chunk's first row), in the backend's memory ([n_active]). */
    float *tok_zmax, *tok_lsum, *tok_entropy, *tok_logp;
    int *tok_check;
    double *seq_dev;        /* the loss plan's per-sequence constants there        */
    fg_loss_plan plan_dev;  /* the loss plan over the backend's memory (derivs)    */
    void *report_sums;      /* a device-reported call: report_tokens' scratch      */
    int deferred; /* no host wait between chunks: each chunk's g, e from derivs on
                     the backend, every token read and checked after the chunks
                     (runs_deferred)                                             */
    fg_common c;
    const fg_linear_inputs *in;
    fg_linear_outputs *out;
    host_rows h;
    float *stats;     /* the hook: a chunk's statistics and their reductions
                         (shard_stats.h), host memory                          */
    float *stats_dev; /* the same in the backend's memory (a device backend)  */
    float *gh_host;   /* the hook: grad_hidden's shares, host memory (a device
                         backend; else the backend's ghbuf)                   */
    fg_status failed; /* the hook: this shard failed; it skips its work up to the
                         next reduction, whose flag stops every shard            */
    fg_grad_bound gb;  /* the gradient bound of the tokens checked so far     */
    int64_t checked;   /* tokens whose derivatives are checked (check_tokens) */
    double loss;       /* KIND_LOSS: the loss and metrics, evaluated once every
                          token is checked, committed at the end               */
    fg_metrics metrics;
    int evaluated;
    int certified; /* KIND_LOSS: no token can be refused (cannot_overflow) */
    void *own_mem; /* device memory this call allocated itself (a backend not
                      the context's: tests)                                   */
    char msg[sizeof ((fg_error *)0)->msg];
} linear_call;

enum sweep_mode { SWEEP_FORWARD, SWEEP_BACKWARD, SWEEP_BOTH };

/* A chunk op of the call's backend on the chunk's view, its failure
 * recorded as the call's. */
#define OP(L, op, ...)                                                                            \
    fg_linear_backend_failed((L)->call, &(L)->p.be,                                               \
                             (L)->p.be.ops->op((L)->p.be.state, &(L)->cv, __VA_ARGS__,            \
                                               (L)->msg, sizeof (L)->msg),                        \
                             (L)->msg)
/* A memory op of the call's backend (or a report op: its own arguments). */
#define MEM(L, op, ...)                                                                           \
    fg_linear_backend_failed((L)->call, &(L)->p.be,                                               \
                             (L)->p.be.ops->op((L)->p.be.state, __VA_ARGS__, (L)->msg,            \
                                               sizeof (L)->msg),                                  \
                             (L)->msg)

/* Returned by a step of the hook when a reduction carried some shard's
 * failure flag: every shard stops there, and fg_collective_outcome agrees on
 * the status. Never leaves this file. */
#define STOPPED FG_STATUS_COUNT

/* A local failure: alone, the call ends here; with the hook, the shard skips
 * its work up to its next reduction, which stops every shard. */
static fg_status fail(linear_call *L, fg_status st)
{
    if (!L->p.hook || st == FG_OK)
        return st;
    if (!L->failed)
        L->failed = st;
    return FG_OK;
}

/* ---------------------------------------------------------- host copies */

/* n floats of the call's host arena. */
static float *host_floats(linear_call *L, size_t n)
{
    return fg_call_take(L->call, n * sizeof(float));
}

/* n floats of the backend's memory into host memory and back; nothing to do
 * where the host array is the backend's (a host backend). */
static fg_status pull(linear_call *L, float *host, const float *src, int64_t n)
{
    return host == src ? FG_OK : MEM(L, to_host, host, src, (size_t)n * sizeof(float));
}

static fg_status push(linear_call *L, float *dst, const float *host, int64_t n)
{
    return host == dst ? FG_OK : MEM(L, to_device, dst, host, (size_t)n * sizeof(float));
}

static fg_status wait_backend(linear_call *L)
{
    const fg_device *be = &L->p.be;
    return fg_linear_backend_failed(L->call, be, be->ops->wait(be->state, L->msg, sizeof L->msg),
                                    L->msg);
}

/* ------------------------------------------------------------- the hook */

/* One reduction of the hook's sequence (buf, host memory, holds count + 1
 * floats). */
static fg_status exchange(linear_call *L, float *buf, int64_t count, fg_reduce_op op)
{
    fg_call *call = L->call;
    const int r = fg_collective_reduce(call, buf, count, op, L->failed != FG_OK);
    if (r < 0) {
        L->failed = fg_fail(call->err, FG_ERR_COMMUNICATOR, "the communicator's allreduce failed");
        return STOPPED;
    }
    return r ? STOPPED : FG_OK;
}

/* The hook's merge of a chunk's statistics: this shard's own, MAX, the sums
 * rescaled to exact limbs, SUM, then every row's lse/logp/entropy. */
static fg_status merge_chunk(linear_call *L, int64_t r0, int64_t m)
{
    fg_call *call = L->call;
    const fg_rows rows = {.count = m, .V = L->p.V, .token = L->c.active + r0};
    float *buf = L->stats;
    if (!L->failed) {
        fg_status st = OP(L, shard_stats, r0, m, L->stats_dev, m, 0);
        if (st == FG_OK && (st = pull(L, buf, L->stats_dev, fg_shard_floats(m))) == FG_OK)
            st = wait_backend(L);
        (void)fail(L, st);
    }
    fg_status st = exchange(L, buf, fg_shard_max_count(m) - 1, FG_REDUCE_MAX);
    if (st != FG_OK)
        return st;
    /* No shard failed: nothing can fail between here and the SUM. */
    for (int64_t i = 0; i < m; i++)
        fg_shard_encode(buf, m, i);
    if (call->comm.allreduce(call->comm.user, buf + fg_shard_sum_offset(m), fg_shard_sum_count(m),
                             FG_REDUCE_SUM) != 0) {
        L->failed = fg_fail(call->err, FG_ERR_COMMUNICATOR, "the communicator's allreduce failed");
        return STOPPED;
    }
    if (fg_sweep_shard_merged(&rows, buf, &L->c.ta) != 0) {
        L->failed = fg_fail(call->err, FG_ERR_COMMUNICATOR,
                            "the summed statistics are not sums of shards' limbs (the "
                            "communicator's SUM is not a sum, or more than %d shards)",
                            FG_SHARD_MAX_SHARDS);
        return STOPPED;
    }
    return FG_OK;
}

/* The hook's grad_hidden: each shard holds its vocab rows' share, summed
 * between the product and the rows it writes. */
static fg_status dhidden_shares(linear_call *L, int64_t r0, int64_t m)
{
    const fg_backend_call *bc = &L->cv;
    const int64_t count = m * L->p.H;
    if (!L->failed) { /* a local failure is carried by the SUM's flag */
        fg_status st = OP(L, dhidden, r0, m);
        if (st == FG_OK && (st = pull(L, L->gh_host, bc->ghbuf, count)) == FG_OK)
            st = wait_backend(L);
        (void)fail(L, st);
    }
    fg_status st;
    if ((st = exchange(L, L->gh_host, count, FG_REDUCE_SUM)) != FG_OK)
        return st;
    if (!L->failed && (st = fail(L, push(L, bc->ghbuf, L->gh_host, count))) != FG_OK)
        return st;
    if (!L->failed && (st = fail(L, OP(L, put_grad_hidden, r0, m))) != FG_OK)
        return st;
    return FG_OK;
}

/* ------------------------------------------------------------- tokens */

/* Tokens tok[0..m) once their statistics are known, before anything they
 * feed is written: the statistics, and with `grads` (the loss's derivatives
 * are due) each token's loss term and derivatives and the gradient bound
 * (fg_common_check_tokens). Once every token's derivatives are checked, the
 * loss and metrics (KIND_LOSS). The head-only kinds check statistics alone:
 * the caller's derivatives were bounded with the arguments. */
static fg_status check_tokens(linear_call *L, const int64_t *tok, int64_t m, int grads)
{
    fg_call *call = L->call;
    const int loss = L->req->kind == KIND_LOSS;
    fg_status st = fg_common_check_tokens(&L->c, call->err, tok, m, L->p.bounds.scanned,
                                          grads && loss ? &L->gb : NULL);
    if (st != FG_OK || !grads || !loss)
        return st;
    L->checked += m;
    if (L->checked == L->c.n_active) {
        st = fg_common_evaluate(&L->c, call->err, &L->loss, &L->metrics);
        L->evaluated = 1;
    }
    return st;
}

/* The stats op's row check, reset before each chunk's stats on a host
 * backend (a device backend's slots are reset once, put_rows). */
static void reset_row_check(linear_call *L)
{
    if (L->p.host)
        *L->cv.row_check = FG_BACKEND_ROW_NONE;
}

/* A target the stats op found outside [0, V) at row `check` of the chunk
 * at r0: validation read every id, so the backend is at fault. */
static fg_status bad_target(linear_call *L, int64_t r0, int check)
{
    const int64_t n = L->c.active[r0 + check], T = L->req->batch->seq_len;
    return fg_fail(L->call->err, FG_ERR_TOKEN_OUT_OF_RANGE,
                   "token [%lld, %lld]: id %lld outside [0, %lld) in the %s backend",
                   (long long)(n / T), (long long)(n % T),
                   (long long)L->req->batch->token_ids[n], (long long)L->p.V,
                   L->p.be.ops->name);
}

/* After the chunk's stats: its rows' statistics (and the row check) on the
 * host, into c.ta at its tokens, where the loss math and the checks read
 * them. Validation read every id: a target the stats op finds outside
 * [0, V) is a backend fault. */
static fg_status stats_to_tokens(linear_call *L, int64_t r0, int64_t m)
{
    const fg_backend_call *bc = &L->cv;
    const host_rows *h = &L->h;
    int check = FG_BACKEND_ROW_NONE;
    fg_status st;
    if ((st = pull(L, h->zmax, bc->zmax, m)) != FG_OK || (st = pull(L, h->lsum, bc->lsum, m)) ||
        (st = pull(L, h->entropy, bc->entropy, m)) != FG_OK ||
        (st = pull(L, h->logp, bc->logp, m)) != FG_OK)
        return st;
    if (L->p.host)
        check = *bc->row_check;
    else if ((st = MEM(L, to_host, &check, bc->row_check, sizeof check)) != FG_OK ||
             (st = wait_backend(L)) != FG_OK)
        return st;
    const int64_t *tok = L->c.active + r0;
    if (check != FG_BACKEND_ROW_NONE)
        return bad_target(L, r0, check);
    const fg_token_arrays *ta = &L->c.ta;
    for (int64_t i = 0; i < m; i++) {
        const int64_t n = tok[i];
        ta->zmax[n] = h->zmax[i];
        ta->lsum[n] = h->lsum[i];
        ta->entropy[n] = h->entropy[i];
        ta->logp[n] = h->logp[i];
    }
    return FG_OK;
}

/* The loss math's derivatives of a token for the backend (stats_backward). */
static void token_derivs(const void *user, int64_t k, float logp, float entropy, float *g,
                         float *e)
{
    const fg_common *c = user;
    const int64_t n = c->active[k];
    *g = fg_loss_dlogp(&c->plan, n, logp, entropy);
    *e = fg_loss_dentropy(&c->plan, n, entropy);
}

/* The backward's inputs of the chunk from c.ta: the loss math's g, e and,
 * with `restore`, its rows' statistics (a forward sweep over every chunk
 * ran first, or shards merged them), into the backend. */
static fg_status tokens_to_backward(linear_call *L, int64_t r0, int64_t m, int restore)
{
    const fg_backend_call *bc = &L->cv;
    const fg_token_arrays *ta = &L->c.ta;
    const host_rows *h = &L->h;
    for (int64_t i = 0; i < m; i++) {
        const int64_t n = L->c.active[r0 + i];
        if (restore) {
            h->zmax[i] = ta->zmax[n];
            h->lsum[i] = ta->lsum[n];
            h->entropy[i] = ta->entropy[n];
        }
        token_derivs(&L->c, r0 + i, ta->logp[n], ta->entropy[n], &h->g[i], &h->e[i]);
    }
    fg_status st;
    if ((st = push(L, bc->g, h->g, m)) != FG_OK || (st = push(L, bc->e, h->e, m)) != FG_OK)
        return st;
    if (restore && ((st = push(L, bc->zmax, h->zmax, m)) != FG_OK ||
                    (st = push(L, bc->lsum, h->lsum, m)) != FG_OK ||
                    (st = push(L, bc->entropy, h->entropy, m)) != FG_OK))
        return st;
    return FG_OK;
}

/* ------------------------------------------------------------- chunks */

/* The call as the backend sees chunk r0: the plan's, with a device
 * backend's statistics and row check at the chunk's slice of the per-token
 * arrays. */
static void chunk_view(linear_call *L, int64_t r0)
{
    L->cv = L->p.bc;
    if (L->p.host)
        return;
    L->cv.zmax = L->tok_zmax + r0;
    L->cv.lsum = L->tok_lsum + r0;
    L->cv.entropy = L->tok_entropy + r0;
    L->cv.logp = L->tok_logp + r0;
    L->cv.row_check = L->tok_check + r0;
}

static int forward_first(const linear_call *L);

/* Whether the call runs with no host wait between its chunks: on a device
 * backend, when a later check cannot make it write what the chunked walk
 * would not. A call without gradients writes only at the end. One with
 * gradients needs the backend's derivs, and either a loss call that
 * computes every token's log-prob in a forward sweep first (forward_first:
 * the loss needs them, or an accumulating call sums into the caller's
 * grad_weight), every token then checked between the sweeps, before any
 * gradient; or scanned inputs (their statistics are then finite), where
 * the head's calls and a certified loss cannot be refused, and a loss that
 * is not certified (the KL) can be refused only with FG_ERR_OVERFLOW,
 * whose refusals may leave partial gradients in any walk (fusedgrpo.h
 * "Conventions"). With the finite check off a token-level loss checks each
 * chunk's statistics on the host before its products; the hook's
 * reductions and the phase API stay per chunk too. */
static int runs_deferred(const linear_call *L)
{
    const linear_plan *p = &L->p;
    const enum call_kind kind = L->req->kind;
    if (p->host || p->hook || kind == KIND_SHARD_STATS || kind == KIND_SHARD_BACKWARD)
        return 0;
    if (!p->any_grad)
        return 1;
    if (!p->be.ops->derivs)
        return 0;
    if (kind == KIND_LOSS && forward_first(L))
        return 1;
    if (!p->bounds.scanned)
        return 0;
    /* One chunk: the chunked walk waits once too, and refuses before any
     * product. */
    if (kind == KIND_LOSS && !L->certified && p->chunks == 1)
        return 0;
    return kind == KIND_LOSS || kind == KIND_LOGPROBS_BACKWARD;
}

/* The loss plan over the backend's memory, for derivs: the caller's batch
 * arrays (or derivatives) as they are, the per-sequence constants copied
 * there; the mask and ids, which the per-token math never reads, NULL. */
static fg_status put_plan(linear_call *L)
{
    const fg_batch *b = L->dev_req->batch;
    fg_loss_plan *d = &L->plan_dev;
    *d = L->c.plan;
    d->token_ids = NULL;
    d->mask = NULL;
    if (d->external) {
        d->ext_dlogp = L->dev_req->dlogp;
        d->ext_dentropy = L->dev_req->dentropy;
        return FG_OK;
    }
    d->adv = b->advantages;
    d->old = b->old_logp;
    d->ref = b->ref_logp;
    d->is_ratio = b->is_ratio;
    d->sampling = b->sampling_logp;
    /* The six [B] arrays of fg_loss_plan_init's scratch, in one copy. */
    fg_loss_plan_place(d, L->seq_dev);
    return MEM(L, to_device, L->seq_dev, L->c.plan.seq_weight,
               (size_t)fg_loss_plan_scratch_doubles(d->B) * sizeof(double));
}

/* A deferred call's tokens after its chunks, with one wait: every token's
 * statistics and every chunk's row check to the host, into c.ta, then the
 * checks the chunked walk makes chunk by chunk, in the same order, so that
 * a refusal has the same status and message (with gradients, after they
 * were written: FG_ERR_OVERFLOW of a loss the inputs do not certify, or a
 * backend fault). */
static fg_status collect_tokens(linear_call *L, int grads)
{
    const linear_plan *p = &L->p;
    const int64_t n = p->n_active;
    float *h = host_floats(L, 4 * (size_t)n);
    int *checks = fg_call_take(L->call, (size_t)n * sizeof(int));
    fg_status st;
    if ((st = pull(L, h, L->tok_zmax, n)) != FG_OK ||
        (st = pull(L, h + n, L->tok_lsum, n)) != FG_OK ||
        (st = pull(L, h + 2 * n, L->tok_entropy, n)) != FG_OK ||
        (st = pull(L, h + 3 * n, L->tok_logp, n)) != FG_OK ||
        (st = MEM(L, to_host, checks, L->tok_check, (size_t)n * sizeof(int))) != FG_OK ||
        (st = wait_backend(L)) != FG_OK)
        return st;
    const fg_token_arrays *ta = &L->c.ta;
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = L->c.active[i];
        ta->zmax[t] = h[i];
        ta->lsum[t] = h[n + i];
        ta->entropy[t] = h[2 * n + i];
        ta->logp[t] = h[3 * n + i];
    }
    for (int64_t k = 0; k < p->chunks && st == FG_OK; k++) { /* the chunked walk's order */
        const int64_t r0 = fg_linear_chunk_start(p, k), m = fg_linear_chunk_len(p, k);
        st = checks[r0] != FG_BACKEND_ROW_NONE ? bad_target(L, r0, checks[r0])
                                               : check_tokens(L, L->c.active + r0, m, grads);
    }
    return st;
}

/* One chunk k: GEMM 1 (unless the logits are still there), the row sweep of
 * `mode`, then the bias column sums and GEMMs 2 and 3 when gradients are
 * due. */
static fg_status run_chunk(linear_call *L, int64_t k, enum sweep_mode mode, int logits_ready,
                           int first_backward_chunk)
{
    fg_call *call = L->call;
    const linear_plan *p = &L->p;
    const int64_t r0 = fg_linear_chunk_start(p, k), m = fg_linear_chunk_len(p, k);
    const int64_t *tok = L->c.active ? L->c.active + r0 : NULL; /* NULL: device-reported */
    fg_status st;
    chunk_view(L, r0);
    const fg_backend_call *bc = &L->cv;
    if (!logits_ready && !L->failed && (st = fail(L, OP(L, logits, r0, m))) != FG_OK)
        return st;
    if (L->req->kind == KIND_SHARD_STATS) /* the phase API's (a): this shard's own */
        return OP(L, shard_stats, r0, m, L->req->stats_out, bc->N, 1);
    if (p->hook && mode != SWEEP_BACKWARD) {
        /* Statistics need every shard: merge, check (every shard has the same
         * merged statistics; a gradient bound one shard's own weight rows
         * break stops every shard at the next reduction), then (token level)
         * the backward. */
        if ((st = merge_chunk(L, r0, m)) != FG_OK)
            return st;
        if (!L->failed && (st = fail(L, check_tokens(L, tok, m, mode == SWEEP_BOTH))) != FG_OK)
            return st;
        if (mode == SWEEP_FORWARD)
            return FG_OK;
        mode = SWEEP_BACKWARD;
    }
    if (!L->failed) {
        switch (mode) {
        case SWEEP_FORWARD: /* never with the hook */
            reset_row_check(L);
            if ((st = OP(L, stats, r0, m)) != FG_OK || L->deferred)
                return st;
            if ((st = stats_to_tokens(L, r0, m)) != FG_OK)
                return st;
            return check_tokens(L, tok, m, 0);
        case SWEEP_BACKWARD:
            if (L->deferred) { /* the statistics are still the backend's */
                if ((st = OP(L, derivs, r0, m, &L->plan_dev)) != FG_OK ||
                    (st = OP(L, backward, r0, m)) != FG_OK)
                    return st;
            } else if ((st = fail(L, tokens_to_backward(L, r0, m, 1))) != FG_OK ||
                       (st = fail(L, OP(L, backward, r0, m))) != FG_OK) {
                return st;
            }
            break;
        case SWEEP_BOTH: /* never with the hook; dlogits are the workspace's: checked
                            before the outputs */
            reset_row_check(L);
            if (L->deferred) { /* g, e on the backend: no host wait */
                if ((st = OP(L, stats, r0, m)) != FG_OK ||
                    (st = OP(L, derivs, r0, m, &L->plan_dev)) != FG_OK ||
                    (st = OP(L, backward, r0, m)) != FG_OK)
                    return st;
            } else if (p->host && p->be.ops->stats_backward) { /* one read of each row */
                const fg_backend_derivs d = {token_derivs, &L->c};
                if ((st = OP(L, stats_backward, r0, m, &d)) != FG_OK ||
                    (st = stats_to_tokens(L, r0, m)) != FG_OK ||
                    (st = check_tokens(L, tok, m, 1)) != FG_OK)
                    return st;
            } else if ((st = OP(L, stats, r0, m)) != FG_OK ||
                       (st = stats_to_tokens(L, r0, m)) != FG_OK ||
                       (st = check_tokens(L, tok, m, 1)) != FG_OK ||
                       (st = tokens_to_backward(L, r0, m, 0)) != FG_OK ||
                       (st = OP(L, backward, r0, m)) != FG_OK) {
                return st;
            }
            break;
        }
    }
    /* Gradient filtering: the products below then run sparse where every
     * row keeps few; the entries they use are counted either way. */
    if ((p->want_gh || p->want_gw) && !L->failed) {
        if (bc->filter_eps > 0 && (st = fail(L, OP(L, filter, r0, m))) != FG_OK)
            return st;
        call->dlogits_entries += m * p->V;
        if (bc->filter_eps <= 0)
            call->dlogits_kept += m * p->V;
    }
    /* GEMM 3 overwrites in the first backward chunk, unless it sums straight
     * into the grad_weight of an accumulating call; a bf16 one's float32
     * sums start afresh (finish adds the caller's values). */
    const int sum_in = !first_backward_chunk || (p->accumulate && !p->gw_sum);
    if (!p->hook) /* the seam's grads: GEMM 2 into grad_hidden, GEMM 3 */
        return L->failed ? FG_OK : OP(L, grads, r0, m, !sum_in);
    /* The hook: grad_hidden's shares summed (dhidden_shares), then GEMM 3
     * alone. */
    if (p->want_gh && (st = dhidden_shares(L, r0, m)) != FG_OK)
        return st;
    if (p->want_gw && !L->failed) {
        fg_backend_call gw_only = L->cv;
        gw_only.grad_hidden.data = NULL;
        st = p->be.ops->grads(p->be.state, &gw_only, r0, m, !sum_in, L->msg, sizeof L->msg);
        if ((st = fail(L, fg_linear_backend_failed(call, &p->be, st, L->msg))) != FG_OK)
            return st;
    }
    return FG_OK;
}

/* grad_bias's float32 sums start from the caller's values when accumulating,
 * else from 0: they live in the workspace and reach the caller in finish, so
 * a refused call leaves grad_bias as it was. The sums are the same float
 * additions, in the same order, as summing in place: float32 micro-batches
 * give one call's bits (a bf16 grad_bias is rounded at the end of each
 * call). */
static fg_status start_bias_sums(linear_call *L, float *host)
{
    const linear_plan *p = &L->p;
    float *sums = p->bc.gb_sum;
    if (!p->want_gb)
        return FG_OK;
    if (!p->accumulate)
        return MEM(L, fill_zero, sums, (size_t)p->V * sizeof(float));
    const void *gb = L->out->grad_bias.data;
    const size_t bytes = (size_t)p->V * fg_dtype_size(p->gb_t);
    fg_status st;
    if (!p->host) { /* the caller's values to the host, widened there, and back */
        if ((st = MEM(L, to_host, host, gb, bytes)) != FG_OK || (st = wait_backend(L)) != FG_OK)
            return st;
        gb = host;
    } else {
        host = sums;
    }
    if (p->gb_t == FG_DTYPE_BF16)
        for (int64_t v = p->V - 1; v >= 0; v--) /* in place from the top: host may be gb */
            host[v] = fg_bf16_load(((const uint16_t *)gb)[v]);
    else if (host != gb)
        memcpy(host, gb, bytes);
    return push(L, sums, host, p->V);
}
/* Whether no token of a loss call can be refused once the chunks run: the
 * loss math's bound from the inputs alone (fg_loss_cannot_overflow, given
 * the scanned logits' bound), and the gradients it bounds within the call's
 * fg_grad_bound. Never with the hook: each shard bounds its own weight rows,
 * and the shards must walk the same sweeps. */
static int cannot_overflow(const linear_call *L)
{
    const linear_plan *p = &L->p;
    const fg_grad_bound *gb = &L->gb;
    double gmax, gsum;
    if (L->req->kind != KIND_LOSS || !p->bounds.scanned || p->hook ||
        !fg_loss_cannot_overflow(&L->c.plan, p->bounds.logit_max, gb->log_vocab, &gmax, &gsum))
        return 0;
    const double e = fabs(L->c.plan.entropy_weight) * (gb->log_vocab + 1.0);
    const double smax = 2.0 * (gmax + e) * gb->inv_temp;
    const double ssum = 2.0 * (gsum + (double)L->c.n_active * e) * gb->inv_temp;
    return smax * gb->row_scale <= FG_OVERFLOW_LIMIT && ssum * gb->sum_scale <= FG_OVERFLOW_LIMIT;
}

/* Whether the loss call computes every token's log-prob before any gradient:
 * the loss needs them (fg_loss_needs_all_tokens), or an accumulating call of
 * several chunks sums GEMM 3 straight into the caller's grad_weight, which a
 * token refused in a later chunk (FG_ERR_OVERFLOW) would leave changed,
 * unless no token can be refused (cannot_overflow: token-level losses
 * without the KL, for inputs some 30 orders of magnitude inside the float
 * range). The alternative, float32 sums of grad_weight in the workspace
 * committed at the end, needs V x H floats the budget rarely holds (620 MB
 * at V = 151936, H = 1024); the forward sweep costs one more logits product
 * per token. */
static int forward_first(const linear_call *L)
{
    const linear_plan *p = &L->p;
    return fg_loss_needs_all_tokens(&L->c.plan) ||
           (L->req->kind == KIND_LOSS && p->accumulate && p->want_gw && !p->gw_sum &&
            p->chunks > 1 && !L->certified);
}

static fg_status run_sweeps(linear_call *L)
{
    const linear_plan *p = &L->p;
    fg_status st = FG_OK;
    if (!p->any_grad) {
        for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
            st = run_chunk(L, k, SWEEP_FORWARD, 0, 0);
        return st == FG_OK && L->deferred ? collect_tokens(L, 0) : st;
    }
    if (L->req->kind == KIND_SHARD_BACKWARD) { /* the merged statistics are given */
        for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
            st = run_chunk(L, k, SWEEP_BACKWARD, 0, k == 0);
        return st;
    }
    if (!forward_first(L)) {
        if (L->deferred && (st = put_plan(L)) != FG_OK)
            return st;
        for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
            st = run_chunk(L, k, SWEEP_BOTH, 0, k == 0);
        return st == FG_OK && L->deferred ? collect_tokens(L, 1) : st;
    }
    /* Every log-prob and entropy first (sequence-level ratios, vespo, the
     * off-policy mask, the entropy quantile; every token checked), then the
     * gradient sweep. With one chunk the logits are still in the buffer and
     * need no recomputation. */
    for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
        st = run_chunk(L, k, SWEEP_FORWARD, 0, 0);
    if (st == FG_OK && L->deferred)
        st = collect_tokens(L, 0);
    if (st != FG_OK || L->failed)
        return st;
    fg_common_prepare(&L->c);
    /* With the hook a shard whose own gradient bound fails joins the
     * backward's reductions, whose flag stops every shard (fail). */
    if ((st = fail(L, check_tokens(L, L->c.active, L->c.n_active, 1))) != FG_OK)
        return st;
    /* Deferred: the plan's constants, now prepared, to the backend. */
    if (L->deferred && (st = put_plan(L)) != FG_OK)
        return st;
    for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
        st = run_chunk(L, k, SWEEP_BACKWARD, p->chunks == 1, k == 0);
    return st;
}


/* ------------------------------------------------------ checks and plan */

/* The NaN/Inf scan of hidden (its unmasked rows), weight and bias in the
 * backend, then the bounds their largest magnitudes give
 * (fg_linear_check_bounds). */
static fg_status scan_inputs(linear_call *L, const fg_linear_inputs *in,
                             const fg_linear_outputs *out, const uint8_t *mask)
{
    const fg_backend_ops *ops = L->p.be.ops;
    const fg_matrix bias = {in->bias.data, in->bias.dtype, 1, in->bias.len, in->bias.len};
    const fg_matrix *x[3] = {&in->hidden, &in->weight, &bias};
    const char *name[3] = {"hidden", "weight", "bias"};
    fg_magnitude mag[3] = {{0.0, 0}, {0.0, 0}, {0.0, 0}};
    fg_status st;
    for (int i = 0; i < (in->bias.data ? 3 : 2); i++) {
        fg_backend_scan s;
        if ((st = fg_linear_backend_failed(
                 L->call, &L->p.be,
                 ops->scan(L->p.be.state, x[i], i == 0 ? mask : NULL, &s, L->msg, sizeof L->msg),
                 L->msg)) != FG_OK)
            return st;
        if (s.bad_row >= 0)
            return i == 2 ? fg_fail(L->call->err, FG_ERR_NONFINITE_INPUT,
                                    "%s[%lld] is NaN or Inf", name[i], (long long)s.bad_col)
                          : fg_fail(L->call->err, FG_ERR_NONFINITE_INPUT,
                                    "%s[%lld, %lld] is NaN or Inf", name[i],
                                    (long long)s.bad_row, (long long)s.bad_col);
        float f;
        memcpy(&f, &s.top_bits, sizeof f);
        mag[i] = (fg_magnitude){f, i == 2 || s.top_row < 0 ? 0 : s.top_row};
    }
    return fg_linear_check_bounds(L->call, L->req, in, out, mag[0], mag[1], mag[2],
                                  &L->p.bounds);
}

/* What a device-reported call can be (fusedgrpo.h "Device-reported
 * calls"; its kind was checked before the arguments): the values of its
 * arguments are checked on the device, so each limit here reads shapes and
 * pointers only. */
static fg_status check_reported(linear_call *L, const fg_device *dev,
                                const fg_linear_options *o, const fg_linear_inputs *in,
                                const fg_linear_outputs *out)
{
    fg_error *err = L->call->err;
    const fg_backend_ops *ops = dev->ops;
    const linear_request *req = L->req;
    const int grads = out->grad_hidden.data || out->grad_weight.data || out->grad_bias.data;
    const char *lacks = (ops->caps & FG_BACKEND_HOST_MEMORY)
                            ? "a backend behind the seam (FG_BACKEND_CUDA, FG_BACKEND_REFERENCE); "
                              "the CPU's calls check on the host"
                        : !ops->report_batch || !ops->report_prepare || !ops->report_scan ||
                                  !ops->report_tokens
                            ? "the backend's report ops"
                        : grads && !ops->derivs ? "the backend's derivs op"
                        : NULL;
    if (lacks)
        return fg_fail(err, FG_ERR_UNSUPPORTED, "exec->device_report needs %s (backend \"%s\")",
                       lacks, ops->name);
    if (fg_linear_is_sharded(in) || L->call->comm.allreduce)
        return fg_fail(err, FG_ERR_UNSUPPORTED,
                       "exec->device_report: a vocab-sharded weight or a communicator merges "
                       "on the host");
    if (o->impl != FG_IMPL_FUSED)
        return fg_fail(err, FG_ERR_UNSUPPORTED, "exec->device_report: the fused path only");
    if (out->accumulate && out->grad_bias.data)
        return fg_fail(err, FG_ERR_UNSUPPORTED,
                       "exec->device_report: accumulating into grad_bias (its sums start from "
                       "the caller's values on the host)");
    const int64_t N = req->batch->batch * req->batch->seq_len;
    if (N >= FG_REPORT_SIDE_MAX || in->hidden.cols >= FG_REPORT_SIDE_MAX ||
        in->weight.rows >= FG_REPORT_SIDE_MAX)
        return fg_fail(err, FG_ERR_UNSUPPORTED,
                       "exec->device_report: B*T, H and V must each stay below 2^%d",
                       FG_REPORT_SIDE_BITS);
    return FG_OK;
}

/* The backend of the call: `be`, else the context's, else a CPU backend
 * for this call. */
static void choose_backend(linear_call *L, const fg_device *be, fg_device *out)
{
    if (be)
        *out = *be;
    else if (L->call->device)
        *out = *L->call->device;
    else
        fg_backend_cpu_init(&L->cpu, L->call, out);
}

/* Every argument check, then the plan (opts NULL: fused). On a device
 * backend the token arrays are staged to the host first. `is_call`: for
 * the call itself, which also checks that no output meets an input and
 * scans the inputs for NaN/Inf; the plan query (0) reads shapes and the
 * mask only. */
static fg_status check_and_plan(linear_call *L, const fg_device *be, const fg_linear_options *opts,
                                const linear_request *req, const fg_linear_inputs *in,
                                const fg_linear_outputs *out, int is_call)
{
    fg_call *call = L->call;
    fg_device dev;
    choose_backend(L, be, &dev);
    L->p.be = dev;
    L->req = req;
    fg_status st;
    L->dev_req = req;
    /* A device-reported call reads no value on the host: nothing staged. */
    if (!(dev.ops->caps & FG_BACKEND_HOST_MEMORY) && !call->device_report) {
        if ((st = fg_stage_request(call, &dev, req, &L->staged)) != FG_OK)
            return st;
        L->req = &L->staged.req;
    }
    const fg_linear_options fused = {FG_IMPL_FUSED, 0, 0.0};
    const fg_linear_options *o = opts ? opts : &fused;
    int64_t n_active = 0;
    /* The phase API's kinds read their stats on the host while validating. */
    if (call->device_report && req->kind != KIND_LOSS && req->kind != KIND_LOGPROBS &&
        req->kind != KIND_LOGPROBS_BACKWARD)
        return fg_fail(call->err, FG_ERR_UNSUPPORTED,
                       "exec->device_report: fg_linear_grpo, fg_linear_logprobs and "
                       "fg_linear_logprobs_backward only (not the phase API)");
    if ((st = fg_linear_validate(call, o, L->req, in, out, &n_active, &L->p.bounds)) != FG_OK ||
        (call->device_report && (st = check_reported(L, &dev, o, in, out)) != FG_OK))
        return st;
    /* The call writes its outputs: they must not overlap what it reads (the
     * caller's own pointers; the cheap check first, then the pass over the
     * inputs' values). */
    if (is_call && (st = fg_linear_check_aliasing(call, req, in, out)) != FG_OK)
        return st;
    if (is_call && call->check_finite && !call->device_report &&
        (st = scan_inputs(L, in, out, req->batch->mask)) != FG_OK)
        return st;
    return fg_linear_plan_call(call, &dev, o, L->req, req->batch->mask, in, out, n_active,
                               &L->p);
}

/* What the shards of a collective call must agree on: everything that sets
 * the sequence of reductions or the result, except each shard's own rows. */
static fg_call_hash call_hash(const fg_linear_options *opts, const linear_request *req,
                              const fg_linear_inputs *in, const fg_linear_outputs *out,
                              const linear_plan *p)
{
    fg_call_hash k;
    fg_hash_init(&k);
    const fg_batch *b = req->batch;
    const fg_loss_config *c = req->cfg;
    const int64_t ints[] = {req->kind, opts ? opts->impl : FG_IMPL_FUSED,
                            opts ? opts->round_logits_to_input_dtype : 0, b->batch, b->seq_len,
                            in->hidden.cols, in->vocab_total, in->hidden.dtype, p->sharded,
                            in->bias.data != NULL, p->want_gh, p->want_gw, p->want_gb,
                            out->accumulate, p->gh_t, p->gw_t, p->gb_t, p->n_active, c->loss_type,
                            c->importance_sampling_level, c->max_completion_length,
                            c->use_bias_correction_kl, req->dlogp != NULL, req->dentropy != NULL};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        fg_hash_i64(&k, ints[i]);
    const double reals[] = {opts ? opts->filter_eps : 0.0, c->temperature, c->epsilon_low,
                            c->epsilon_high, c->delta, c->beta, c->num_items_in_batch,
                            c->sapo_temperature_pos, c->sapo_temperature_neg, c->entropy_coef,
                            c->vespo_k_pos, c->vespo_lambda_pos, c->vespo_k_neg,
                            c->vespo_lambda_neg, c->off_policy_mask_threshold,
                            c->top_entropy_quantile};
    for (size_t i = 0; i < sizeof reals / sizeof reals[0]; i++)
        fg_hash_f64(&k, reals[i]);
    const int64_t N = b->batch * b->seq_len;
    for (int64_t n = 0; n < N; n++) /* the mask, and the tokens where it is set */
        fg_hash_i64(&k, b->mask[n] ? b->token_ids[n] : -1);
    return k;
}

/* The call's memory: the host arena (everything, on a host backend; the
 * host's arrays beside a device backend's workspace otherwise) and the
 * device workspace. */
static fg_status reserve(linear_call *L, void **device_mem)
{
    fg_call *call = L->call;
    const linear_plan *p = &L->p;
    *device_mem = NULL;
    if (p->host)
        return fg_call_reserve(call, fg_linear_plan_total(p));
    /* Host side: the per-call arrays, the chunk's row copies, the targets,
     * grad_bias's seed, the per-token outputs, the phase API's stats; the
     * hook's statistics and grad_hidden shares. */
    const fg_batch *b = L->req->batch;
    const size_t N = (size_t)(b->batch * b->seq_len), Nc = (size_t)p->Nc, f = sizeof(float);
    size_t host = fg_common_workspace_bytes(b->batch, (int64_t)N) + fg_ws_round(6 * Nc * f) +
                  fg_ws_round((size_t)p->n_active * sizeof(int64_t)) +
                  fg_ws_round((size_t)p->V * f) +
                  fg_ws_round((size_t)FG_SHARD_STATS_FLOATS((int64_t)N) * f) +
                  2 * fg_ws_round(N * f) +
                  /* the row checks' reset, and a deferred call's token reads */
                  2 * fg_ws_round((size_t)p->n_active * sizeof(int)) +
                  fg_ws_round(4 * (size_t)p->n_active * f);
    if (p->hook)
        host += fg_ws_round((size_t)fg_shard_floats(p->Nc) * f) +
                fg_ws_round((Nc * (size_t)p->H + 1) * f);
    fg_status st = fg_call_reserve(call, fg_ws_page_round(host));
    if (st != FG_OK)
        return st;
    const size_t bytes = fg_linear_plan_total(p);
    if (!call->device || call->device->state != p->be.state) { /* a backend not the context's */
        st = p->be.ops->alloc(p->be.state, bytes ? bytes : 1, &L->own_mem, L->msg, sizeof L->msg);
        *device_mem = L->own_mem;
        return fg_linear_backend_failed(call, &p->be, st, L->msg);
    }
    return fg_call_reserve_device(call, bytes, device_mem);
}

/* A collective call's entry (fg_communicator): the shards agree on the call
 * and its chunk size, plan and reserve for it, and agree that all of them
 * can run it. Every shard makes both reductions whatever its own status. */
static fg_status enter_collective(linear_call *L, const fg_device *be,
                                  const fg_linear_options *opts, const linear_request *req,
                                  const fg_linear_inputs *in, const fg_linear_outputs *out,
                                  void **device_mem)
{
    fg_call *call = L->call;
    linear_plan *p = &L->p;
    fg_status st = check_and_plan(L, be, opts, req, in, out, 1);
    fg_call_hash hash = {0};
    if (st == FG_OK)
        hash = call_hash(opts, L->req, in, out, p);
    int64_t nc = p->Nc;
    st = fg_collective_agree(call, st, hash, &nc);
    if (st == FG_OK && p->n_active > 0 && nc != p->Nc)
        st = fg_linear_plan_rows(call, p, nc);
    if (st == FG_OK)
        st = reserve(L, device_mem);
    return fg_collective_ready(call, st);
}

/* The workspace, piece by piece, as the plan counted it: from the arena on
 * a host backend, from the device workspace otherwise (the host's copies
 * then from the arena). */
typedef struct carver {
    linear_call *L;
    unsigned char *next; /* device workspace; NULL: the arena */
} carver;

static void *take(carver *k, size_t bytes)
{
    if (!k->next)
        return fg_call_take(k->L->call, bytes);
    void *at = k->next;
    k->next += fg_linear_piece(&k->L->p, bytes);
    return at;
}

static void carve(linear_call *L, void *device_mem)
{
    linear_plan *p = &L->p;
    fg_backend_call *bc = &p->bc;
    carver k = {L, device_mem};
    const size_t Nc = (size_t)p->Nc, f = sizeof(float);
    bc->rows = p->host ? L->c.active : take(&k, (size_t)p->n_active * sizeof(int64_t));
    bc->gb_sum = p->want_gb ? take(&k, (size_t)p->V * f) : NULL;
    bc->targets = take(&k, (size_t)p->n_active * sizeof(int64_t));
    if (p->host) {
        bc->row_check = take(&k, sizeof(int));
    } else { /* every token's statistics, a row check a chunk, the plan's constants */
        const size_t n = (size_t)p->n_active;
        L->tok_zmax = take(&k, 4 * n * f);
        L->tok_lsum = L->tok_zmax + n;
        L->tok_entropy = L->tok_zmax + 2 * n;
        L->tok_logp = L->tok_zmax + 3 * n;
        L->tok_check = take(&k, n * sizeof(int));
        L->seq_dev = take(&k, (size_t)fg_loss_plan_scratch_doubles(L->req->batch->batch) *
                                  sizeof(double));
        if (L->call->device_report)
            L->report_sums =
                take(&k, fg_report_sums_bytes(L->req->batch->batch, L->req->batch->seq_len));
    }
    bc->gw_sum = p->gw_sum ? take(&k, (size_t)p->V * (size_t)p->H * f) : NULL;
    bc->kept_count = bc->filter_eps > 0 ? take(&k, sizeof(int64_t)) : NULL;
    if (p->n_active == 0)
        return;
    bc->logits = take(&k, Nc * (size_t)p->V * fg_dtype_size(p->logit_t));
    bc->dlogits = p->any_grad && !p->dl_alias
                      ? take(&k, Nc * (size_t)p->V * fg_dtype_size(p->dlogit_t))
                      : bc->logits;
    bc->hbuf = take(&k, Nc * (size_t)p->H * fg_dtype_size(p->cmp_t));
    if (p->host) {
        float *row_arrays = take(&k, 6 * Nc * f);
        bc->zmax = row_arrays;
        bc->lsum = row_arrays + Nc;
        bc->entropy = row_arrays + 2 * Nc;
        bc->logp = row_arrays + 3 * Nc;
        bc->g = row_arrays + 4 * Nc;
        bc->e = row_arrays + 5 * Nc;
    } else { /* the statistics: chunk_view's slices of the per-token arrays */
        bc->g = take(&k, 2 * Nc * f);
        bc->e = bc->g + Nc;
    }
    if (p->want_gh) /* and the hook's flag slot */
        bc->ghbuf = take(&k, (Nc * (size_t)p->H + (size_t)p->hook) * f);
    if (p->hook)
        L->stats_dev = take(&k, (size_t)fg_shard_floats(p->Nc) * f);
    if (bc->filter_eps > 0 && !(p->be.ops->caps & FG_BACKEND_FILTER_IN_PLACE)) {
        bc->kept_idx = take(&k, Nc * (size_t)bc->kept_cap * sizeof(int32_t));
        bc->kept_nnz = take(&k, Nc * sizeof(int32_t));
        bc->kept_tgt = take(&k, Nc * sizeof(int64_t));
    }
    bc->scratch = p->scratch_bytes ? take(&k, p->scratch_bytes) : NULL;
    /* The host's view of the row arrays and the hook's buffers. */
    if (p->host) {
        L->h = (host_rows){bc->zmax, bc->lsum, bc->entropy, bc->logp, bc->g, bc->e};
        L->stats = L->stats_dev;
        L->gh_host = bc->ghbuf;
    } else {
        float *h = host_floats(L, 6 * Nc);
        L->h = (host_rows){h, h + Nc, h + 2 * Nc, h + 3 * Nc, h + 4 * Nc, h + 5 * Nc};
        if (p->hook) {
            L->stats = host_floats(L, (size_t)fg_shard_floats(p->Nc));
            L->gh_host = host_floats(L, Nc * (size_t)p->H + 1);
        }
    }
}

/* The unmasked rows and their targets (local ids: this shard's rows) in the
 * backend. */
static fg_status put_rows(linear_call *L)
{
    linear_plan *p = &L->p;
    fg_backend_call *bc = &p->bc;
    const fg_batch *batch = L->req->batch;
    int64_t *targets = p->host ? (int64_t *)bc->targets
                               : fg_call_take(L->call, (size_t)p->n_active * sizeof(int64_t));
    for (int64_t i = 0; i < p->n_active; i++)
        targets[i] = batch->token_ids[L->c.active[i]] - p->vocab_start;
    if (p->host || p->n_active == 0)
        return FG_OK;
    const size_t bytes = (size_t)p->n_active * sizeof(int64_t);
    int *none = fg_call_take(L->call, (size_t)p->n_active * sizeof(int));
    for (int64_t i = 0; i < p->n_active; i++)
        none[i] = FG_BACKEND_ROW_NONE;
    fg_status st;
    if ((st = MEM(L, to_device, (void *)bc->rows, L->c.active, bytes)) != FG_OK ||
        (st = MEM(L, to_device, (void *)bc->targets, targets, bytes)) != FG_OK)
        return st;
    return MEM(L, to_device, L->tok_check, none, (size_t)p->n_active * sizeof(int));
}


/* The per-token outputs (0 at masked tokens) and, for the phase API's (a),
 * the stats array's masked tokens and status slot, into the caller's
 * memory. */
static fg_status commit_tokens(linear_call *L)
{
    const fg_batch *batch = L->req->batch;
    const int64_t N = batch->batch * batch->seq_len;
    fg_linear_outputs *out = L->out;
    if (L->req->kind == KIND_SHARD_STATS) {
        float *stats = L->req->stats_out; /* the caller's, in the backend's memory */
        const size_t bytes = (size_t)FG_SHARD_STATS_FLOATS(N) * sizeof(float);
        float *host = L->p.host ? stats : host_floats(L, (size_t)FG_SHARD_STATS_FLOATS(N));
        fg_status st;
        if (!L->p.host && ((st = MEM(L, to_host, host, stats, bytes)) != FG_OK ||
                           (st = wait_backend(L)) != FG_OK))
            return st;
        fg_shard_stats_close(host, batch);
        return L->p.host ? FG_OK : MEM(L, to_device, stats, host, bytes);
    }
    if (L->p.host) {
        fg_common_commit(&L->c, batch, out->logp, out->entropy);
        return FG_OK;
    }
    float *const dst[2] = {out->logp, out->entropy};
    for (int i = 0; i < 2; i++) {
        if (!dst[i])
            continue;
        float *host = host_floats(L, (size_t)N);
        fg_common_commit(&L->c, batch, i == 0 ? host : NULL, i == 1 ? host : NULL);
        const fg_status st = MEM(L, to_device, dst[i], host, (size_t)N * sizeof(float));
        if (st != FG_OK)
            return st;
    }
    return FG_OK;
}

/* The phase API's (a) and (d) helpers (linear_request.h). */
void fg_shard_stats_close(float *stats, const fg_batch *batch)
{
    const int64_t N = batch->batch * batch->seq_len;
    for (int64_t n = 0; n < N; n++)
        if (!batch->mask[n])
            fg_shard_put_empty(stats, N, n);
    stats[FG_SHARD_STATS_STATUS(N)] = 0.0f;
}

void fg_shard_stats_load(const float *stats, const fg_batch *batch, const fg_common *c)
{
    const int64_t N = batch->batch * batch->seq_len;
    for (int64_t k = 0; k < c->n_active; k++) {
        const int64_t n = c->active[k];
        fg_shard_merged_at(stats, N, n, &c->ta.zmax[n], &c->ta.lsum[n], &c->ta.entropy[n]);
    }
}


/* ---------------------------------------------------------------- entry */

static void release(linear_call *L)
{
    fg_staged_free(&L->staged);
    if (L->own_mem)
        L->p.be.ops->release(L->p.be.state, L->own_mem);
    L->own_mem = NULL;
}

fg_status fg_linear_plan_request(fg_call *call, const fg_device *be, const fg_linear_options *opts,
                                 const linear_request *req, const fg_linear_inputs *in,
                                 const fg_linear_outputs *out, fg_linear_plan_info *info)
{
    if (!info)
        return fg_fail(call->err, FG_ERR_NULL_ARGUMENT, "info is NULL");
    linear_call L;
    memset(&L, 0, sizeof L);
    L.call = call;
    const linear_plan *p = &L.p;
    const fg_status plan_st = check_and_plan(&L, be, opts, req, in, out, 0);
    fg_status st = FG_OK;
    fg_linear_plan_info r;
    memset(&r, 0, sizeof r);
    if (plan_st != FG_OK && !(plan_st == FG_ERR_BUDGET_TOO_SMALL && p->n_active > 0)) {
        st = plan_st; /* an argument error: info is not written */
    } else if ((st = fg_linear_min_budget(call, p, &r.min_budget_bytes)) == FG_OK) {
        r.fixed_bytes = p->fixed_bytes;
        r.gemm_dtype = p->cmp_t;
        r.grad_weight_sum_bytes = p->gw_sum_bytes;
        if (plan_st == FG_OK) {
            r.chunk_rows = p->Nc;
            r.later_chunk_rows = p->Nc - p->lead;
            r.chunks = p->chunks;
            r.chunk_bytes = p->n_active > 0 ? fg_linear_chunk_bytes(p, p->Nc) : 0;
            r.gemm_scratch_bytes = p->scratch_bytes;
            r.working_bytes = fg_linear_plan_total(p);
        }
        *info = r;
        st = plan_st; /* FG_ERR_BUDGET_TOO_SMALL keeps its message; info is written */
    }
    release(&L);
    return st;
}

/* A device-reported call (fusedgrpo.h): every op enqueued, none waited
 * for. The batch's checks, rows and per-sequence constants (report_batch),
 * the inputs' scan, the chunks over every token row as a deferred call
 * runs them (derivs on the plan over the backend's memory, which gives a
 * masked row g = e = 0; a loss that needs every token first: a forward
 * sweep, report_prepare, the gradient sweep), finish, each token's checks
 * with the outputs and the loss (report_tokens), then the gradients'
 * scan. */
static fg_status run_reported(linear_call *L, void *device_mem)
{
    fg_call *call = L->call;
    linear_plan *p = &L->p;
    const linear_request *req = L->req; /* the caller's: nothing was staged */
    const fg_batch *batch = req->batch;
    fg_device_report *rep = call->device_report;
    const int loss = req->kind == KIND_LOSS;
    call->chunk_rows = p->Nc;
    call->chunks = p->chunks;
    if (loss)
        fg_loss_plan_init_scalars(&L->c.plan, req->cfg, batch);
    else
        fg_loss_plan_init_external(&L->c.plan, batch, req->dlogp, req->dentropy);
    L->c.n_active = p->n_active;
    carve(L, device_mem);
    fg_backend_call *bc = &p->bc;
    if (bc->kept_count) /* the record counts the kept entries */
        bc->kept_count = &rep->dlogits_kept;
    L->plan_dev = L->c.plan;
    fg_loss_plan_place(&L->plan_dev, L->seq_dev);
    if (loss) /* report_batch computes them there */
        L->plan_dev.batch_scalars = L->seq_dev + 6 * batch->batch;
    const fg_report_batch rb = {p->V, req->dlogp, req->dentropy, loss};
    fg_status st;
    if ((st = MEM(L, fill_zero, rep, sizeof *rep)) != FG_OK ||
        (st = MEM(L, fill_zero, L->tok_check, (size_t)p->n_active * sizeof(int))) != FG_OK ||
        (st = start_bias_sums(L, NULL)) != FG_OK ||
        (st = MEM(L, report_batch, bc, &L->plan_dev, &rb, rep)) != FG_OK)
        return st;
    const fg_matrix bias = {bc->bias.data, p->in_t, 1, p->V, p->V};
    if (call->check_finite &&
        ((st = MEM(L, report_scan, &bc->hidden, batch->mask, FG_REPORT_SCAN_HIDDEN, rep)) ||
         (st = MEM(L, report_scan, &bc->weight, NULL, FG_REPORT_SCAN_WEIGHT, rep)) ||
         (bias.data && (st = MEM(L, report_scan, &bias, NULL, FG_REPORT_SCAN_BIAS, rep)))))
        return st;
    L->deferred = 1;
    const fg_backend_tokens t = {L->tok_zmax, L->tok_lsum, L->tok_entropy, L->tok_logp,
                                 L->out->logp, L->out->entropy, L->report_sums,
                                 call->check_finite};
    if (!(loss && fg_loss_needs_all_tokens(&L->c.plan))) {
        for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
            st = run_chunk(L, k, p->any_grad ? SWEEP_BOTH : SWEEP_FORWARD, 0, k == 0);
    } else { /* every token's log-prob, the sequences' constants, then the gradients */
        for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
            st = run_chunk(L, k, SWEEP_FORWARD, 0, 0);
        if (st == FG_OK)
            st = MEM(L, report_prepare, bc, &L->plan_dev, &t);
        for (int64_t k = 0; k < p->chunks && st == FG_OK && p->any_grad; k++)
            st = run_chunk(L, k, SWEEP_BACKWARD, p->chunks == 1, k == 0);
    }
    if (st != FG_OK || (p->any_grad && (st = MEM(L, finish, bc)) != FG_OK))
        return st;
    if ((st = MEM(L, report_tokens, bc, &L->plan_dev, &rb, &t, rep)) != FG_OK ||
        !call->check_finite)
        return st;
    /* The bounds a host-checked call puts on the products before they run,
     * after the fact here: a non-finite gradient entry. */
    const fg_matrix gb = {bc->grad_bias.data, bc->grad_bias.dtype, 1, p->V, p->V};
    if ((bc->grad_hidden.data &&
         (st = MEM(L, report_scan, &bc->grad_hidden, NULL, FG_REPORT_GRAD_HIDDEN, rep))) ||
        (bc->grad_weight.data &&
         (st = MEM(L, report_scan, &bc->grad_weight, NULL, FG_REPORT_GRAD_WEIGHT, rep))) ||
        (gb.data && (st = MEM(L, report_scan, &gb, NULL, FG_REPORT_GRAD_BIAS, rep))))
        return st;
    return FG_OK;
}

/* Everything after the checks and the plan, with the memory in hand: the
 * sweeps write grad_hidden and grad_weight chunk by chunk (each chunk's
 * tokens checked first, or in a deferred call after the chunks),
 * everything else at the end. */
static fg_status run_call(linear_call *L, int collective, void *device_mem)
{
    fg_call *call = L->call;
    linear_plan *p = &L->p;
    const linear_request *req = L->req;
    const fg_batch *batch = req->batch;
    if (call->device_report)
        return run_reported(L, device_mem);
    call->chunk_rows = p->Nc;
    call->chunks = p->chunks;
    if (req->kind == KIND_LOSS)
        fg_common_init(call->arena, &L->c, req->cfg, batch);
    else
        fg_common_init_external(call->arena, &L->c, batch, req->dlogp, req->dentropy);
    L->gb = fg_linear_grad_bound(&p->bounds, L->out, req->cfg->temperature,
                                 p->sharded ? L->in->vocab_total : p->V);
    L->certified = cannot_overflow(L);
    carve(L, device_mem);
    float *bias_seed = p->host ? NULL : host_floats(L, (size_t)p->V);
    L->deferred = p->n_active > 0 && runs_deferred(L);
    fg_status st = put_rows(L);
    if (st == FG_OK)
        st = start_bias_sums(L, bias_seed);
    if (st == FG_OK && p->bc.kept_count)
        st = MEM(L, fill_zero, p->bc.kept_count, sizeof(int64_t));
    /* A failure here: with the hook the shard still joins every reduction
     * (fail); a collective call always reaches the outcome's agreement. */
    if ((st = fail(L, st)) == FG_OK) {
        if (req->kind == KIND_SHARD_BACKWARD)
            fg_shard_stats_load(req->stats_in, batch, &L->c);
        if (p->n_active > 0)
            st = run_sweeps(L);
    }
    if (collective) {
        /* Every shard leaves with the same status: its own failure, or one a
         * reduction's flag stopped it for. */
        const fg_status local = L->failed ? L->failed : (st == STOPPED ? FG_OK : st);
        if ((st = fg_collective_outcome(call, local)) != FG_OK)
            return st;
    }
    const int loss = req->kind == KIND_LOSS;
    if (st == FG_OK && loss && !L->evaluated) { /* no gradient sweep checked the tokens
        (a loss without gradients, or no unmasked token): their loss terms, then the loss */
        fg_common_prepare(&L->c);
        st = check_tokens(L, L->c.active, L->c.n_active, 1);
    }
    if (st != FG_OK) /* nothing committed: see "Conventions" in fusedgrpo.h */
        return st;
    if (p->any_grad &&
        (st = fg_linear_backend_failed(call, &p->be,
                                       p->be.ops->finish(p->be.state, &p->bc, L->msg,
                                                         sizeof L->msg),
                                       L->msg)) != FG_OK)
        return st;
    int64_t kept = 0; /* the filtered products' entries, read once */
    if (p->bc.kept_count && !p->host &&
        (st = MEM(L, to_host, &kept, p->bc.kept_count, sizeof kept)) != FG_OK)
        return st;
    if ((st = commit_tokens(L)) != FG_OK || (st = wait_backend(L)) != FG_OK)
        return st;
    if (p->bc.kept_count)
        call->dlogits_kept += p->host ? *p->bc.kept_count : kept;
    if (loss) {
        L->out->loss = L->loss;
        L->out->metrics = L->metrics;
    }
    return FG_OK;
}

fg_status fg_linear_run(fg_call *call, const fg_device *be, const fg_linear_options *opts,
                        const linear_request *req, const fg_linear_inputs *in,
                        fg_linear_outputs *out)
{
    linear_call L;
    memset(&L, 0, sizeof L);
    L.call = call;
    L.in = in;
    L.out = out;
    void *device_mem = NULL;
    /* With a communicator the one-call kinds are collective, sharded or not:
     * a shard that fails its checks still joins the entry agreement. */
    const int collective = call->comm.allreduce != NULL && fg_uses_hook(req->kind);
    fg_status st;
    if (collective)
        st = enter_collective(&L, be, opts, req, in, out, &device_mem);
    else if ((st = check_and_plan(&L, be, opts, req, in, out, 1)) == FG_OK)
        st = reserve(&L, &device_mem);
    /* All checks passed and all resources are in hand: the call runs. */
    if (st == FG_OK)
        st = run_call(&L, collective, device_mem);
    release(&L);
    return st;
}

fg_status fg_linear_grpo_plan(fg_context *ctx, const fg_linear_options *opts,
                              const fg_loss_config *cfg, const fg_linear_inputs *in,
                              const fg_batch *batch, const fg_linear_outputs *out,
                              const fg_exec *exec, fg_linear_plan_info *info)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_call call;
    fg_status st = fg_call_begin(ctx, exec, &call);
    if (st != FG_OK)
        return st;
    const linear_request req = {KIND_LOSS, cfg, batch, NULL, NULL, NULL, NULL, NULL};
    return fg_call_end(&call, fg_linear_plan_request(&call, NULL, opts, &req, in, out, info));
}

/* Runs a request on the context's backend. */
static fg_status linear_execute(fg_context *ctx, const fg_linear_options *opts,
                                const linear_request *req, const fg_linear_inputs *in,
                                fg_linear_outputs *out, const fg_exec *exec)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_call call;
    fg_status st = fg_call_begin(ctx, exec, &call);
    if (st != FG_OK)
        return st;
    return fg_call_end(&call, fg_linear_run(&call, NULL, opts, req, in, out));
}

fg_status fg_linear_grpo(fg_context *ctx, const fg_linear_options *opts,
                         const fg_loss_config *cfg, const fg_linear_inputs *in,
                         const fg_batch *batch, fg_linear_outputs *out, const fg_exec *exec)
{
    const linear_request req = {KIND_LOSS, cfg, batch, NULL, NULL, NULL, NULL, NULL};
    return linear_execute(ctx, opts, &req, in, out, exec);
}

/* linear_request.h */
void fg_linear_head_request(linear_request *req, enum call_kind kind, fg_loss_config *cfg,
                            fg_batch *batch, double temperature, const fg_tokens *tokens,
                            const float *dlogp, const float *dentropy)
{
    memset(req, 0, sizeof *req);
    fg_loss_config_init(cfg);
    cfg->temperature = temperature;
    memset(batch, 0, sizeof *batch);
    if (tokens) {
        batch->batch = tokens->batch;
        batch->seq_len = tokens->seq_len;
        batch->token_ids = tokens->token_ids;
        batch->mask = tokens->mask;
    }
    req->kind = kind;
    req->cfg = cfg;
    req->batch = batch;
    req->tokens = tokens;
    req->dlogp = dlogp;
    req->dentropy = dentropy;
}

fg_status fg_linear_logprobs(fg_context *ctx, const fg_linear_options *opts, double temperature,
                             const fg_linear_inputs *in, const fg_tokens *tokens, float *logp,
                             float *entropy, const fg_exec *exec)
{
    fg_loss_config cfg;
    fg_batch batch;
    linear_request req;
    fg_linear_head_request(&req, KIND_LOGPROBS, &cfg, &batch, temperature, tokens, NULL, NULL);
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    out.logp = logp;
    out.entropy = entropy;
    return linear_execute(ctx, opts, &req, in, &out, exec);
}

/* A backward request's gradient views as the outputs the driver writes;
 * grads NULL: NULL, which validation reports as "out is NULL". */
static fg_linear_outputs *grads_as_outputs(const fg_linear_grads *grads, fg_linear_outputs *out)
{
    memset(out, 0, sizeof *out);
    if (!grads)
        return NULL;
    out->grad_hidden = grads->grad_hidden;
    out->grad_weight = grads->grad_weight;
    out->grad_bias = grads->grad_bias;
    out->accumulate = grads->accumulate;
    return out;
}

fg_status fg_linear_logprobs_backward(fg_context *ctx, const fg_linear_options *opts,
                                      double temperature, const fg_linear_inputs *in,
                                      const fg_tokens *tokens, const float *grad_logp,
                                      const float *grad_entropy, fg_linear_grads *grads,
                                      const fg_exec *exec)
{
    fg_loss_config cfg;
    fg_batch batch;
    linear_request req;
    fg_linear_head_request(&req, KIND_LOGPROBS_BACKWARD, &cfg, &batch, temperature, tokens,
                           grad_logp, grad_entropy);
    fg_linear_outputs out;
    return linear_execute(ctx, opts, &req, in, grads_as_outputs(grads, &out), exec);
}

fg_status fg_linear_shard_stats(fg_context *ctx, const fg_linear_options *opts,
                                double temperature, const fg_linear_inputs *in,
                                const fg_tokens *tokens, float *stats, const fg_exec *exec)
{
    fg_loss_config cfg;
    fg_batch batch;
    linear_request req;
    fg_linear_head_request(&req, KIND_SHARD_STATS, &cfg, &batch, temperature, tokens, NULL, NULL);
    req.stats_out = stats;
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    return linear_execute(ctx, opts, &req, in, &out, exec);
}

fg_status fg_linear_shard_backward(fg_context *ctx, const fg_linear_options *opts,
                                   double temperature, const fg_linear_inputs *in,
                                   const fg_tokens *tokens, const float *stats,
                                   const float *grad_logp, const float *grad_entropy,
                                   fg_linear_grads *grads, const fg_exec *exec)
{
    fg_loss_config cfg;
    fg_batch batch;
    linear_request req;
    fg_linear_head_request(&req, KIND_SHARD_BACKWARD, &cfg, &batch, temperature, tokens,
                           grad_logp, grad_entropy);
    req.stats_in = stats;
    fg_linear_outputs out;
    return linear_execute(ctx, opts, &req, in, grads_as_outputs(grads, &out), exec);
}
