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
    size_t scratch_bytes;
} linear_plan;

static fg_gemm_shape shape_logits(const linear_plan *p, int64_t m)
{
    fg_gemm_shape s = {m, p->V, p->H, p->cmp_t, p->in_t, p->logit_t, p->H, 1, 1, p->w_ld, p->V, 0,
                       p->has_bias};
    return s;
}

static fg_gemm_shape shape_dhidden(const linear_plan *p, int64_t m)
{
    fg_gemm_shape s = {m, p->H, p->V, p->cmp_t, p->in_t, FG_DTYPE_F32, p->V, 1, p->w_ld, 1, p->H,
                       0, 0};
    return s;
}

static fg_gemm_shape shape_dweight(const linear_plan *p, int64_t m, int accumulate)
{
    fg_gemm_shape s = {p->V, p->H, m, p->cmp_t, p->cmp_t, FG_DTYPE_F32, 1, p->V, p->H, 1, p->gw_ld,
                       accumulate, 0};
    return s;
}

/* Prepares every GEMM a chunk of m rows issues; returns the largest scratchpad. */
static fg_status prepare_gemms(fg_context *ctx, const linear_plan *p, int64_t m, size_t *scratch)
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
        size_t s = 0;
        fg_status st = fg_gemm_prepare(ctx, &shapes[i], &s);
        if (st != FG_OK)
            return st;
        if (s > *scratch)
            *scratch = s;
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

/* Chooses Nc under the budget (fused) and prepares the GEMMs of both chunk
 * sizes, so that backend failures surface before any output is written. */
static fg_status plan_chunks(fg_context *ctx, linear_plan *p, int64_t n_active, size_t fixed,
                             size_t *total)
{
    int64_t nc = n_active;
    if (p->fused) {
        size_t row = chunk_bytes(p, 1), avail = ctx->budget > fixed ? ctx->budget - fixed : 0;
        int64_t fit = (int64_t)(avail / row);
        nc = fit < nc ? fit : nc;
    }
    int agreed = 0;
    for (int attempt = 0; attempt < 16; attempt++) {
        if (nc < 1)
            return fg_fail(ctx, FG_ERR_BUDGET_TOO_SMALL,
                           "a memory budget of %zu bytes cannot hold one token row "
                           "(V = %lld, H = %lld needs about %zu bytes beyond %zu fixed)",
                           ctx->budget, (long long)p->V, (long long)p->H, chunk_bytes(p, 1),
                           fixed);
        /* Equal chunks: the last one is not a sliver. */
        int64_t chunks = (n_active + nc - 1) / nc;
        nc = (n_active + chunks - 1) / chunks;
        const int64_t last = n_active - (chunks - 1) * nc;
        size_t scratch = 0;
        fg_status st = prepare_gemms(ctx, p, nc, &scratch);
        if (st == FG_OK && last != nc)
            st = prepare_gemms(ctx, p, last, &scratch);
        if (st != FG_OK)
            return st;
        /* The arena is mapped in whole pages: count what is really held. */
        size_t need = fg_ws_page_round(fixed + chunk_bytes(p, nc) + fg_ws_round(scratch));
        if (!p->fused || need <= ctx->budget) {
            if (p->sharded && !agreed) {
                /* Every shard must walk the same chunks: take the smallest Nc. */
                float neg = -(float)nc;
                if (ctx->opts.comm.allreduce(ctx->opts.comm.user, &neg, 1, FG_REDUCE_MAX) != 0)
                    return fg_fail(ctx, FG_ERR_BACKEND, "the communicator's allreduce failed");
                agreed = 1;
                if ((int64_t)-neg != nc) {
                    nc = (int64_t)-neg;
                    continue;
                }
            }
            p->Nc = nc;
            p->chunks = chunks;
            p->scratch_bytes = scratch;
            *total = need;
            return FG_OK;
        }
        int64_t cut = (int64_t)((need - ctx->budget + chunk_bytes(p, 1) - 1) / chunk_bytes(p, 1));
        nc -= cut > 1 ? cut : 1;
    }
    return fg_fail(ctx, FG_ERR_BUDGET_TOO_SMALL, "no chunk size fits a budget of %zu bytes",
                   ctx->budget);
}

/* The weight holds a slice of a larger vocabulary. */
static int is_sharded(const fg_linear_inputs *in)
{
    return in->vocab_start != 0 || (in->vocab_total > 0 && in->vocab_total != in->weight.rows);
}

static fg_status validate_linear(fg_context *ctx, const fg_linear_options *o,
                                 const fg_loss_config *cfg, const fg_linear_inputs *in,
                                 const fg_batch *batch, const fg_outputs *out)
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
    if (ctx->opts.check_finite) {
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
            const uint16_t *h = src;
            float *d = dst;
            for (int64_t k = 0; k < p->H; k++)
                d[k] = fg_bf16_to_f32(h[k]);
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
                              L->scratch)) != FG_OK)
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
                              L->scratch)) != FG_OK)
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
                              L->scratch)) != FG_OK)
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

fg_status fg_linear_grpo(fg_context *ctx, const fg_linear_options *opts,
                         const fg_loss_config *cfg, const fg_linear_inputs *in,
                         const fg_batch *batch, fg_outputs *out)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_clear_error(ctx);
    const fg_linear_options fused = {FG_IMPL_FUSED, 0};
    const fg_linear_options *o = opts ? opts : &fused;
    fg_status st = validate_linear(ctx, o, cfg, in, batch, out);
    if (st != FG_OK)
        return st;

    linear_call L;
    memset(&L, 0, sizeof L);
    linear_plan *p = &L.p;
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

    int64_t n_active = 0;
    for (int64_t n = 0; n < N; n++)
        n_active += batch->mask[n] != 0;
    const size_t fixed = fg_common_workspace_bytes(batch->batch, N);
    size_t total = fixed;
    const int saved = fg_threads_enter(ctx);
    if (n_active > 0 && (st = plan_chunks(ctx, p, n_active, fixed, &total)) != FG_OK) {
        fg_threads_leave(saved);
        return st;
    }
    if ((st = fg_ws_reserve(ctx, total)) != FG_OK) {
        fg_threads_leave(saved);
        return fg_fail(ctx, st, "cannot allocate %zu bytes of workspace", total);
    }
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
