/*
 * fg_linear_grpo: the loss from hidden states and the LM-head weight.
 *
 * Fused (FG_IMPL_FUSED): the unmasked tokens are processed in chunks of Nc
 * rows, Nc chosen so that everything the call holds fits the budget:
 *
 *   for each chunk of rows R:                       shapes
 *     hbuf   = hidden[R]                            [Nc, H]   gather
 *     logits = hbuf · Wᵀ + bias                     [Nc, V]   GEMM 1
 *     per row: lse, logp, entropy, then d loss/d logits (in place, or bf16)
 *     grad_bias   += Σ_rows dlogits                 [V]
 *     grad_hidden[R] = dlogits · W                  [Nc, H]   GEMM 2
 *     grad_weight += dlogitsᵀ · hbuf                [V, H]    GEMM 3
 *
 * Token-level ratios need nothing beyond a token's own row, so the gradient
 * comes out of the same sweep: three GEMM-sized products in all, as many as
 * the baseline. Sequence-level ratios (GSPO) need every log-prob of a sequence
 * first: one forward sweep (GEMM 1 only), then the sweep above recomputing
 * the logits, unless everything fits in one chunk.
 *
 * Materialized (FG_IMPL_MATERIALIZED): the plain baseline, one chunk of all
 * rows with a separate [N, V] dlogits buffer, as a framework holds them.
 */
#include <string.h>

#include "finish.h"
#include "gemm_onednn.h"
#include "row_kernels.h"
#include "validate.h"

typedef struct linear_plan {
    int fused;
    fg_dtype in_t;    /* storage of hidden, weight, bias                          */
    fg_dtype cmp_t;   /* the gathered hidden rows and dlogits: bf16 only where the
                         CPU multiplies bf16 natively, else f32 (gemm_onednn.h)   */
    fg_dtype logit_t, dlogit_t;
    int dl_alias; /* dlogits overwrite the f32 logits in place */
    int64_t H, V, Nc, chunks;
    int want_gh, want_gw, want_gb, any_grad, two_sweeps;
    int has_bias;
    int sharded; /* weight holds vocab rows [vocab_start, vocab_start + V) */
    int64_t vocab_start;
    int64_t w_ld, gw_ld;
    int64_t n_active;     /* unmasked tokens: the rows the chunks cover            */
    size_t fixed_bytes;   /* per-call [B, T] arrays (fg_common_workspace_bytes)    */
    size_t tile_bytes;    /* bf16 tile path: one converted weight tile (tile_cap)  */
    fg_gemm_scratch gemm; /* GEMM scratch of the chosen chunk sizes               */
    int gemm_workers;     /* threads the GEMMs run on: the scratchpads held        */
    size_t scratch_bytes; /* fg_gemm_scratch_bytes(gemm, gemm_workers)             */
} linear_plan;

/* The chunk size is planned with room for this many GEMM scratchpads (or one,
 * when the budget holds no more), never with the thread count: the chunks,
 * and so the order of grad_weight's sums, are the same for any thread count.
 * The call then runs its GEMMs on as many of its threads as the budget holds
 * scratchpads for. */
#define PLAN_GEMM_WORKERS 8

/* Converted weight tiles (CPUs without native bf16 GEMMs) scale with the
 * chunk: half its logits, at most 32 MiB (>= 1024 weight rows at H = 4096,
 * enough for the per-tile GEMMs to run at full speed). Everything the call
 * holds is then a function of the chunk rows alone, so the smallest budget is
 * the need of a one-row chunk. */
static size_t tile_cap(const linear_plan *p, int64_t m)
{
    const size_t half_logits = (size_t)m * (size_t)p->V * sizeof(float) / 2, cap = (size_t)32 << 20;
    return half_logits < cap ? half_logits : cap;
}

static fg_gemm_shape shape_logits(const linear_plan *p, int64_t m)
{
    fg_gemm_shape s = {m, p->V, p->H, p->cmp_t, p->in_t, p->logit_t, p->H, 1, 1, p->w_ld, p->V, 0,
                       p->has_bias, tile_cap(p, m), FG_BLOCK_LOGITS_M, FG_BLOCK_LOGITS_N};
    return s;
}

static fg_gemm_shape shape_dhidden(const linear_plan *p, int64_t m)
{
    fg_gemm_shape s = {m, p->H, p->V, p->cmp_t, p->in_t, FG_DTYPE_F32, p->V, 1, p->w_ld, 1, p->H,
                       0, 0, tile_cap(p, m), FG_BLOCK_DHIDDEN_M, FG_BLOCK_DHIDDEN_N};
    return s;
}

static fg_gemm_shape shape_dweight(const linear_plan *p, int64_t m, int accumulate)
{
    fg_gemm_shape s = {p->V, p->H, m, p->cmp_t, p->cmp_t, FG_DTYPE_F32, 1, p->V, p->H, 1, p->gw_ld,
                       accumulate, 0, tile_cap(p, m), FG_BLOCK_DWEIGHT_M, 0};
    return s;
}

/* Prepares every GEMM a chunk of m rows issues; raises *need to cover them. */
static fg_status prepare_gemms(fg_context *ctx, const linear_plan *p, int64_t m,
                               fg_gemm_scratch *need)
{
    fg_gemm_shape shapes[4];
    int k = 0;
    shapes[k++] = shape_logits(p, m);
    if (p->want_gh)
        shapes[k++] = shape_dhidden(p, m);
    if (p->want_gw) {
        shapes[k++] = shape_dweight(p, m, 0);
        shapes[k++] = shape_dweight(p, m, 1);
    }
    for (int i = 0; i < k; i++) {
        fg_status st = fg_gemm_prepare(ctx, &shapes[i], need);
        if (st != FG_OK)
            return st;
    }
    return FG_OK;
}

static size_t chunk_bytes(const linear_plan *p, int64_t m)
{
    size_t b = fg_ws_round((size_t)m * (size_t)p->V * fg_dtype_size(p->logit_t));
    if (p->any_grad && !p->dl_alias)
        b += fg_ws_round((size_t)m * (size_t)p->V * fg_dtype_size(p->dlogit_t));
    b += fg_ws_round((size_t)m * (size_t)p->H * fg_dtype_size(p->cmp_t));
    if (p->want_gh)
        b += fg_ws_round((size_t)m * (size_t)p->H * sizeof(float));
    if (p->sharded)
        b += fg_ws_round((size_t)m * 5 * sizeof(float));
    return b;
}

/* What a call with chunks of m rows (the last one `last` rows) and `workers`
 * GEMM threads holds: the fixed arrays, one chunk's buffers and the GEMM
 * scratch, in whole pages since the arena is mapped in pages. Prepares the
 * GEMMs of both sizes, so backend failures surface before any output is
 * written. */
static fg_status need_bytes(fg_context *ctx, const linear_plan *p, int64_t m, int64_t last,
                            int workers, size_t *need, fg_gemm_scratch *gs)
{
    memset(gs, 0, sizeof *gs);
    fg_status st = prepare_gemms(ctx, p, m, gs);
    if (st == FG_OK && last != m)
        st = prepare_gemms(ctx, p, last, gs);
    *need = fg_ws_page_round(p->fixed_bytes + chunk_bytes(p, m) +
                             fg_gemm_scratch_bytes(gs, workers));
    return st;
}

/* The largest equal-chunk size whose need with `workers` GEMM scratchpads
 * fits the budget, or 0. */
static fg_status fit_chunks(fg_context *ctx, const linear_plan *p, int workers, int64_t *out)
{
    const int64_t n = p->n_active;
    const size_t row = chunk_bytes(p, 1);
    const size_t avail = ctx->budget > p->fixed_bytes ? ctx->budget - p->fixed_bytes : 0;
    int64_t nc = (int64_t)(avail / row) < n ? (int64_t)(avail / row) : n;
    *out = 0;
    while (nc >= 1) {
        /* Equal chunks: the last one is not a sliver. */
        const int64_t chunks = (n + nc - 1) / nc;
        nc = (n + chunks - 1) / chunks;
        size_t need;
        fg_gemm_scratch gs;
        fg_status st = need_bytes(ctx, p, nc, n - (chunks - 1) * nc, workers, &need, &gs);
        if (st != FG_OK)
            return st;
        if (need <= ctx->budget) {
            *out = nc;
            return FG_OK;
        }
        /* Over by need - budget: drop that many rows' worth (at least one),
         * trying one row before giving up (GEMM scratch is not linear in m). */
        const int64_t cut = (int64_t)((need - ctx->budget + row - 1) / row);
        nc = nc == 1 ? 0 : (nc - cut > 1 ? nc - cut : 1);
    }
    return FG_OK;
}

/* Chooses Nc: all active rows (materialized), or the largest equal-chunk size
 * that fits the budget (fused, see PLAN_GEMM_WORKERS), then the GEMM worker
 * count. `agree`: sharded callers take the smallest Nc of all shards so that
 * every shard walks the same chunks. */
static fg_status plan_chunks(fg_context *ctx, linear_plan *p, int agree)
{
    const int64_t n = p->n_active;
    const int threads = fg_threads(ctx);
    int64_t nc = n;
    fg_status st;
    if (p->fused) {
        if ((st = fit_chunks(ctx, p, PLAN_GEMM_WORKERS, &nc)) != FG_OK)
            return st;
        if (nc < 1 && (st = fit_chunks(ctx, p, 1, &nc)) != FG_OK)
            return st;
        if (nc < 1) {
            size_t need1;
            fg_gemm_scratch gs1;
            if ((st = need_bytes(ctx, p, 1, 1, 1, &need1, &gs1)) != FG_OK)
                return st;
            return fg_fail(ctx, FG_ERR_BUDGET_TOO_SMALL,
                           "a memory budget of %zu bytes is too small: one token row a chunk "
                           "needs %zu bytes (per-call arrays %zu + one row's logits, dlogits "
                           "and hidden rows %zu + GEMM scratch %zu for one thread, in whole "
                           "pages; V = %lld, H = %lld)",
                           ctx->budget, need1, p->fixed_bytes, chunk_bytes(p, 1),
                           fg_gemm_scratch_bytes(&gs1, 1), (long long)p->V, (long long)p->H);
        }
    }
    if (agree) {
        float neg = -(float)nc;
        if (ctx->opts.comm.allreduce(ctx->opts.comm.user, &neg, 1, FG_REDUCE_MAX) != 0)
            return fg_fail(ctx, FG_ERR_BACKEND, "the communicator's allreduce failed");
        nc = (int64_t)-neg;
    }
    const int64_t chunks = (n + nc - 1) / nc;
    nc = (n + chunks - 1) / chunks;
    size_t need;
    if ((st = need_bytes(ctx, p, nc, n - (chunks - 1) * nc, 1, &need, &p->gemm)) != FG_OK)
        return st;
    /* As many GEMM threads as the budget holds scratchpads for. */
    int workers = 1;
    while (workers < threads &&
           (!p->fused || fg_ws_page_round(p->fixed_bytes + chunk_bytes(p, nc) +
                                          fg_gemm_scratch_bytes(&p->gemm, workers + 1)) <=
                             ctx->budget))
        workers++;
    p->Nc = nc;
    p->chunks = chunks;
    p->gemm_workers = workers;
    p->scratch_bytes = fg_gemm_scratch_bytes(&p->gemm, workers);
    return FG_OK;
}

/* The weight holds a slice of a larger vocabulary. */
static int is_sharded(const fg_linear_inputs *in)
{
    return in->vocab_start != 0 || (in->vocab_total > 0 && in->vocab_total != in->weight.rows);
}

/* Every check of the call; the NaN/Inf scan of the inputs only when `scan`
 * (the plan query reads shapes, not values). */
static fg_status validate_linear(fg_context *ctx, const fg_linear_options *o,
                                 const fg_loss_config *cfg, const fg_linear_inputs *in,
                                 const fg_batch *batch, const fg_outputs *out, int scan)
{
    fg_status st;
    if (!in)
        return fg_fail(ctx, FG_ERR_NULL_ARGUMENT, "in is NULL");
    if (!out)
        return fg_fail(ctx, FG_ERR_NULL_ARGUMENT, "out is NULL");
    if (o->impl != FG_IMPL_FUSED && o->impl != FG_IMPL_MATERIALIZED)
        return fg_fail(ctx, FG_ERR_UNSUPPORTED, "unknown impl %d", (int)o->impl);
    if ((st = fg_validate_config(ctx, cfg)) != FG_OK)
        return st;
    if ((st = fg_validate_matrix(ctx, "hidden", &in->hidden, -1, -1)) != FG_OK ||
        (st = fg_validate_matrix(ctx, "weight", &in->weight, -1, in->hidden.cols)) != FG_OK)
        return st;
    if (in->weight.dtype != in->hidden.dtype)
        return fg_fail(ctx, FG_ERR_SHAPE_MISMATCH, "weight dtype differs from hidden dtype");
    const int64_t V = in->weight.rows, H = in->hidden.cols;
    if (in->bias.data) {
        if ((st = fg_validate_vector(ctx, "bias", &in->bias, V)) != FG_OK)
            return st;
        if (in->bias.dtype != in->weight.dtype)
            return fg_fail(ctx, FG_ERR_SHAPE_MISMATCH, "bias dtype differs from weight dtype");
    }
    const int sharded = is_sharded(in);
    if (sharded) {
        if (in->vocab_start < 0 || in->vocab_total <= 0 || in->vocab_start > in->vocab_total - V)
            return fg_fail(ctx, FG_ERR_SHAPE_MISMATCH,
                           "vocab shard of %lld rows at vocab_start = %lld does not lie in "
                           "[0, vocab_total = %lld)",
                           (long long)V, (long long)in->vocab_start, (long long)in->vocab_total);
        if (!ctx->opts.comm.allreduce)
            return fg_fail(ctx, FG_ERR_NULL_ARGUMENT,
                           "a vocab-sharded weight needs a communicator (fg_context_options.comm)");
    }
    if ((st = fg_validate_batch(ctx, cfg, batch, sharded ? in->vocab_total : V)) != FG_OK)
        return st;
    const int64_t N = batch->batch * batch->seq_len;
    if (in->hidden.rows != N)
        return fg_fail(ctx, FG_ERR_SHAPE_MISMATCH, "hidden has %lld rows, B*T = %lld",
                       (long long)in->hidden.rows, (long long)N);
    if (out->grad_logits.data)
        return fg_fail(ctx, FG_ERR_UNSUPPORTED,
                       "fg_linear_grpo writes no grad_logits (use fg_logits_grpo)");
    if (out->grad_hidden.data &&
        (st = fg_validate_matrix(ctx, "grad_hidden", &out->grad_hidden, N, H)) != FG_OK)
        return st;
    if (out->grad_weight.data &&
        (st = fg_validate_matrix(ctx, "grad_weight", &out->grad_weight, V, H)) != FG_OK)
        return st;
    if (out->grad_bias.data && (st = fg_validate_vector(ctx, "grad_bias", &out->grad_bias, V)) != FG_OK)
        return st;
    if ((out->grad_hidden.data && out->grad_hidden.dtype != FG_DTYPE_F32) ||
        (out->grad_weight.data && out->grad_weight.dtype != FG_DTYPE_F32) ||
        (out->grad_bias.data && out->grad_bias.dtype != FG_DTYPE_F32))
        return fg_fail(ctx, FG_ERR_UNSUPPORTED, "gradients are written in float32 only");
    if (o->round_logits_to_input_dtype && o->impl == FG_IMPL_FUSED)
        return fg_fail(ctx, FG_ERR_UNSUPPORTED,
                       "round_logits_to_input_dtype is a materialized-baseline option");
    if (scan && ctx->opts.check_finite) {
        if ((st = fg_check_finite_matrix(ctx, "hidden", &in->hidden, batch->mask)) != FG_OK ||
            (st = fg_check_finite_matrix(ctx, "weight", &in->weight, NULL)) != FG_OK)
            return st;
        if (in->bias.data && (st = fg_check_finite_vector(ctx, "bias", &in->bias)) != FG_OK)
            return st;
    }
    return FG_OK;
}

static void *row_at(const fg_matrix *m, int64_t r)
{
    return (unsigned char *)m->data + (size_t)r * (size_t)m->ld * fg_dtype_size(m->dtype);
}

/* hbuf[i] = hidden[tok[i]], converted to the compute dtype. */
static void gather_rows(const linear_plan *p, const fg_matrix *hidden, const int64_t *tok,
                        int64_t m, void *hbuf)
{
    const size_t hrow = (size_t)p->H * fg_dtype_size(p->cmp_t);
    for (int64_t i = 0; i < m; i++) {
        const void *src = row_at(hidden, tok[i]);
        void *dst = (unsigned char *)hbuf + (size_t)i * hrow;
        if (p->cmp_t == p->in_t) {
            memcpy(dst, src, hrow);
        } else { /* bf16 storage, f32 compute */
            fg_bf16_to_f32_strided(dst, src, p->H, 1);
        }
    }
}

/* Everything one call carries from chunk to chunk. */
typedef struct linear_call {
    linear_plan p;
    fg_common c;
    const fg_linear_inputs *in;
    fg_outputs *out;
    float inv_temp;
    void *logits, *dlogits, *hbuf, *scratch;
    float *ghbuf;
    float *stats; /* sharded: 5 floats per chunk row for the statistics merge */
    int bad; /* non-finite statistics seen (only possible with the finite check off) */
} linear_call;

enum sweep_mode { SWEEP_FORWARD, SWEEP_BACKWARD, SWEEP_BOTH };

/* One chunk k: GEMM 1 (unless the logits are still there), the row sweep of
 * `mode`, then the bias column sums and GEMMs 2 and 3 when gradients are due. */
static fg_status run_chunk(fg_context *ctx, linear_call *L, int64_t k, enum sweep_mode mode,
                           int logits_ready, int first_backward_chunk)
{
    const linear_plan *p = &L->p;
    const int64_t r0 = k * p->Nc;
    const int64_t m = L->c.n_active - r0 < p->Nc ? L->c.n_active - r0 : p->Nc;
    const int64_t *tok = L->c.active + r0;
    fg_status st;
    if (!logits_ready) {
        gather_rows(p, &L->in->hidden, tok, m, L->hbuf);
        fg_gemm_shape s1 = shape_logits(p, m);
        if ((st = fg_gemm_run(ctx, &s1, L->hbuf, L->in->weight.data, L->logits, L->in->bias.data,
                              L->scratch, p->gemm_workers)) != FG_OK)
            return st;
    }
    fg_rows rows = {L->logits, p->logit_t, p->V, L->dlogits, p->dlogit_t, p->V, m, p->V, tok, 0,
                    p->vocab_start};
    const fg_loss_plan *plan = &L->c.plan;
    if (p->sharded && mode != SWEEP_BACKWARD) {
        /* Statistics need every shard: merge, then (token level) the backward. */
        if ((st = fg_sweep_forward_sharded(ctx, plan, &rows, L->inv_temp, &L->c.ta, L->stats,
                                           &L->bad)) != FG_OK)
            return st;
        if (mode == SWEEP_FORWARD)
            return FG_OK;
        mode = SWEEP_BACKWARD;
    }
    switch (mode) {
    case SWEEP_FORWARD: L->bad |= fg_sweep_forward(ctx, plan, &rows, L->inv_temp, &L->c.ta); return FG_OK;
    case SWEEP_BACKWARD: fg_sweep_backward(ctx, plan, &rows, L->inv_temp, &L->c.ta); break;
    case SWEEP_BOTH: L->bad |= fg_sweep_forward_backward(ctx, plan, &rows, L->inv_temp, &L->c.ta); break;
    }
    if (p->want_gb)
        fg_sweep_column_sums(ctx, &rows, (float *)L->out->grad_bias.data);
    if (p->want_gh) {
        fg_gemm_shape s2 = shape_dhidden(p, m);
        if ((st = fg_gemm_run(ctx, &s2, L->dlogits, L->in->weight.data, L->ghbuf, NULL,
                              L->scratch, p->gemm_workers)) != FG_OK)
            return st;
        /* Each shard holds its vocab rows' share of grad_hidden: sum them. */
        if (p->sharded && ctx->opts.comm.allreduce(ctx->opts.comm.user, L->ghbuf, m * p->H,
                                                    FG_REDUCE_SUM) != 0)
            return fg_fail(ctx, FG_ERR_BACKEND, "the communicator's allreduce failed");
        for (int64_t i = 0; i < m; i++)
            memcpy(row_at(&L->out->grad_hidden, tok[i]), L->ghbuf + (size_t)i * (size_t)p->H,
                   (size_t)p->H * sizeof(float));
    }
    if (p->want_gw) {
        fg_gemm_shape s3 = shape_dweight(p, m, !first_backward_chunk);
        if ((st = fg_gemm_run(ctx, &s3, L->dlogits, L->hbuf, L->out->grad_weight.data, NULL,
                              L->scratch, p->gemm_workers)) != FG_OK)
            return st;
    }
    return FG_OK;
}

/* Zeroes what no chunk writes: masked rows of grad_hidden, the bias
 * accumulator, and grad_weight when no token is unmasked. */
static void zero_unwritten(const linear_call *L, const fg_batch *batch)
{
    const linear_plan *p = &L->p;
    const fg_outputs *out = L->out;
    if (p->want_gh)
        for (int64_t n = 0; n < batch->batch * batch->seq_len; n++)
            if (!batch->mask[n])
                memset(row_at(&out->grad_hidden, n), 0, (size_t)p->H * sizeof(float));
    if (p->want_gb)
        memset(out->grad_bias.data, 0, (size_t)p->V * sizeof(float));
    if (p->want_gw && L->c.n_active == 0)
        for (int64_t v = 0; v < p->V; v++)
            memset(row_at(&out->grad_weight, v), 0, (size_t)p->H * sizeof(float));
}

static fg_status run_sweeps(fg_context *ctx, linear_call *L)
{
    const linear_plan *p = &L->p;
    fg_status st = FG_OK;
    if (!p->any_grad) {
        for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
            st = run_chunk(ctx, L, k, SWEEP_FORWARD, 0, 0);
        return st;
    }
    if (L->c.plan.level == FG_LEVEL_TOKEN) {
        for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
            st = run_chunk(ctx, L, k, SWEEP_BOTH, 0, k == 0);
        return st;
    }
    /* Sequence level: every log-prob first, then the gradient sweep. With one
     * chunk the logits are still in the buffer and need no recomputation. */
    for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
        st = run_chunk(ctx, L, k, SWEEP_FORWARD, 0, 0);
    if (st != FG_OK)
        return st;
    fg_loss_prepare_sequences(&L->c.plan, L->c.ta.logp);
    for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
        st = run_chunk(ctx, L, k, SWEEP_BACKWARD, p->chunks == 1, k == 0);
    return st;
}

/* The plan of a validated call: dtypes, which products run, and the chunks.
 * Runs inside fg_threads_enter (GEMM primitives are made for the call's
 * thread count). `agree`: sharded calls agree on the chunk size. */
static fg_status plan_call(fg_context *ctx, const fg_linear_options *o, const fg_linear_inputs *in,
                           const fg_batch *batch, const fg_outputs *out, int agree, linear_plan *p)
{
    memset(p, 0, sizeof *p);
    p->fused = o->impl == FG_IMPL_FUSED;
    p->in_t = in->hidden.dtype;
    p->cmp_t = (p->in_t == FG_DTYPE_BF16 && fg_gemm_native_bf16(ctx)) ? FG_DTYPE_BF16 : FG_DTYPE_F32;
    p->logit_t = (!p->fused && o->round_logits_to_input_dtype) ? p->in_t : FG_DTYPE_F32;
    p->dlogit_t = p->cmp_t; /* the gradient GEMMs take dlogits in the compute dtype */
    p->dl_alias = p->fused && p->dlogit_t == p->logit_t;
    p->H = in->hidden.cols;
    p->V = in->weight.rows;
    p->w_ld = in->weight.ld;
    p->gw_ld = out->grad_weight.data ? out->grad_weight.ld : p->H;
    p->has_bias = in->bias.data != NULL;
    p->sharded = is_sharded(in);
    p->vocab_start = in->vocab_start;
    p->want_gh = out->grad_hidden.data != NULL;
    p->want_gw = out->grad_weight.data != NULL;
    p->want_gb = out->grad_bias.data != NULL;
    p->any_grad = p->want_gh || p->want_gw || p->want_gb;
    const int64_t N = batch->batch * batch->seq_len;
    for (int64_t n = 0; n < N; n++)
        p->n_active += batch->mask[n] != 0;
    p->fixed_bytes = fg_common_workspace_bytes(batch->batch, N);
    return p->n_active > 0 ? plan_chunks(ctx, p, agree && p->sharded) : FG_OK;
}

/* The arena a planned call reserves. */
static size_t plan_total(const linear_plan *p)
{
    if (p->n_active == 0)
        return fg_ws_page_round(p->fixed_bytes);
    return fg_ws_page_round(p->fixed_bytes + chunk_bytes(p, p->Nc) + p->scratch_bytes);
}

/* The call's options (NULL: fused) after every argument check; `scan`: the
 * NaN/Inf scan of the inputs too. */
static fg_status start_call(fg_context *ctx, const fg_linear_options *opts,
                            const fg_loss_config *cfg, const fg_linear_inputs *in,
                            const fg_batch *batch, const fg_outputs *out, int scan,
                            fg_linear_options *o)
{
    const fg_linear_options fused = {FG_IMPL_FUSED, 0};
    *o = opts ? *opts : fused;
    return validate_linear(ctx, o, cfg, in, batch, out, scan);
}

fg_status fg_linear_grpo_plan(fg_context *ctx, const fg_linear_options *opts,
                              const fg_loss_config *cfg, const fg_linear_inputs *in,
                              const fg_batch *batch, const fg_outputs *out,
                              fg_linear_plan_info *info)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_clear_error(ctx);
    if (!info)
        return fg_fail(ctx, FG_ERR_NULL_ARGUMENT, "info is NULL");
    fg_linear_options o;
    fg_status st = start_call(ctx, opts, cfg, in, batch, out, 0, &o);
    if (st != FG_OK)
        return st;
    linear_plan p;
    const int saved = fg_threads_enter(ctx);
    const fg_status plan_st = plan_call(ctx, &o, in, batch, out, 0, &p);
    fg_linear_plan_info r;
    memset(&r, 0, sizeof r);
    st = plan_st;
    if ((st == FG_OK || st == FG_ERR_BUDGET_TOO_SMALL) && p.fused && p.n_active > 0) {
        fg_gemm_scratch gs1;
        st = need_bytes(ctx, &p, 1, 1, 1, &r.min_budget_bytes, &gs1);
    }
    fg_threads_leave(saved);
    if (st != FG_OK)
        return st;
    r.fixed_bytes = p.fixed_bytes;
    if (plan_st == FG_OK) {
        r.chunk_rows = p.Nc;
        r.chunks = p.chunks;
        r.chunk_bytes = p.n_active > 0 ? chunk_bytes(&p, p.Nc) : 0;
        r.gemm_scratch_bytes = p.scratch_bytes;
        r.working_bytes = plan_total(&p);
    }
    if (p.fused && p.n_active == 0)
        r.min_budget_bytes = fg_ws_page_round(p.fixed_bytes);
    *info = r;
    return plan_st; /* FG_ERR_BUDGET_TOO_SMALL keeps its message; info is written */
}

fg_status fg_linear_grpo(fg_context *ctx, const fg_linear_options *opts,
                         const fg_loss_config *cfg, const fg_linear_inputs *in,
                         const fg_batch *batch, fg_outputs *out)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_clear_error(ctx);
    fg_linear_options o;
    fg_status st = start_call(ctx, opts, cfg, in, batch, out, 1, &o);
    if (st != FG_OK)
        return st;

    linear_call L;
    memset(&L, 0, sizeof L);
    linear_plan *p = &L.p;
    const int saved = fg_threads_enter(ctx);
    if ((st = plan_call(ctx, &o, in, batch, out, 1, p)) != FG_OK) {
        fg_threads_leave(saved);
        return st;
    }
    const size_t total = plan_total(p);
    if ((st = fg_ws_reserve(ctx, total)) != FG_OK) {
        fg_threads_leave(saved);
        return fg_fail(ctx, st, "cannot allocate %zu bytes of workspace", total);
    }
    const int64_t n_active = p->n_active;
    /* All checks passed and all resources are in hand: outputs are written
     * from here on. */
    ctx->last_gemm_flops = 0;
    ctx->last_gemm_seconds = 0;
    const double call_t0 = fg_now();
    ctx->last_chunk_rows = p->Nc;
    ctx->last_chunks = p->chunks;
    fg_common_init(ctx, &L.c, cfg, batch);
    L.in = in;
    L.out = out;
    L.inv_temp = (float)(1.0 / cfg->temperature);
    if (n_active > 0) {
        L.logits = fg_ws_take(ctx, (size_t)p->Nc * (size_t)p->V * fg_dtype_size(p->logit_t));
        L.dlogits = L.logits;
        if (p->any_grad && !p->dl_alias)
            L.dlogits = fg_ws_take(ctx, (size_t)p->Nc * (size_t)p->V * fg_dtype_size(p->dlogit_t));
        L.hbuf = fg_ws_take(ctx, (size_t)p->Nc * (size_t)p->H * fg_dtype_size(p->cmp_t));
        if (p->want_gh)
            L.ghbuf = fg_ws_take(ctx, (size_t)p->Nc * (size_t)p->H * sizeof(float));
        L.scratch = p->scratch_bytes ? fg_ws_take(ctx, p->scratch_bytes) : NULL;
        if (p->sharded)
            L.stats = fg_ws_take(ctx, (size_t)p->Nc * 5 * sizeof(float));
    }
    zero_unwritten(&L, batch);
    if (n_active > 0)
        st = run_sweeps(ctx, &L);
    fg_common_finish(&L.c, batch, out);
    fg_threads_leave(saved);
    ctx->last_call_seconds = fg_now() - call_t0;
    if (st != FG_OK)
        return st;
    if (L.bad)
        return fg_fail(ctx, FG_ERR_NONFINITE_INPUT,
                       "the logits came out NaN or Inf (hidden, weight or bias hold NaN/Inf and "
                       "the finite check was off); results are invalid");
    return FG_OK;
}
