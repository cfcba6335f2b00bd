/*
 * The seam's plain reference (backend.h): every op as the simplest loops,
 * sums in double, one thread. It is the specification of each op and the
 * backend the CUDA one is checked against. Its memory is the host's, but the
 * driver (linear_grpo.c) treats it as a device's (no FG_BACKEND_HOST_MEMORY:
 * every byte through to_host / to_device), so that the driver's staging path
 * is tested on machines without a GPU. Slow by design: for tests, never for
 * speed.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_host.h"
#include "bf16.h"
#include "internal.h"
#include "loss_token.h"
#include "report.h"
#include "shard_stats.h"

/* The driver's host synchronisations, for tests (fg_backend_reference_syncs):
 * waits, and copies (each a wait on an asynchronous backend whose host side
 * is pageable). A call that needs no host wait between its chunks makes as
 * many whatever its chunk count. */
static _Atomic long ref_syncs;

long fg_backend_reference_syncs(void) { return ref_syncs; }

static fg_status ref_copy(void *be, void *dst, const void *src, size_t bytes, char *msg,
                          size_t n)
{
    ref_syncs++;
    return fg_host_copy(be, dst, src, bytes, msg, n);
}

static fg_status ref_wait(void *be, char *msg, size_t n)
{
    ref_syncs++;
    return fg_host_wait(be, msg, n);
}

static float load(const void *base, fg_dtype t, size_t i)
{
    return t == FG_DTYPE_BF16 ? fg_bf16_load(((const uint16_t *)base)[i])
                              : ((const float *)base)[i];
}

/* Stores a float in dtype t: bf16 rounded to nearest even, once. */
static void store(void *base, fg_dtype t, size_t i, float x)
{
    if (t == FG_DTYPE_BF16)
        ((uint16_t *)base)[i] = fg_bf16_store(x);
    else
        ((float *)base)[i] = x;
}

static size_t at(int64_t r, int64_t ld, int64_t c) { return (size_t)r * (size_t)ld + (size_t)c; }

/* The reference multiplies in double whatever the dtype: hbuf and dlogits
 * keep the inputs' own. */
static fg_dtype ref_compute_dtype(void *be, fg_dtype in_t)
{
    (void)be;
    return in_t;
}

static size_t ref_call_scratch(void *be, const fg_backend_call *c)
{
    (void)be, (void)c;
    return 0;
}

/* A row of the filter's scratch (ref_filter). */
typedef struct ref_filter_row {
    float threshold;
    int32_t kept;
} ref_filter_row;

/* The filter's rows for the larger chunk, with filtering; the loops need no
 * other scratch and nothing prepared. */
static fg_status ref_chunk_scratch(void *be, const fg_backend_call *c, int64_t m, int64_t last,
                                   size_t *bytes, char *msg, size_t n)
{
    (void)be, (void)msg, (void)n;
    *bytes = c->filter_eps > 0 ? (size_t)(m > last ? m : last) * sizeof(ref_filter_row) : 0;
    return FG_OK;
}

static fg_status ref_supports(void *be, const fg_backend_call *c, char *msg, size_t n)
{
    (void)be, (void)c, (void)msg, (void)n;
    return FG_OK;
}

/* |x| as float32 bits: ordered like the magnitudes, NaN above Inf. */
static uint32_t magnitude_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u & 0x7fffffffu;
}

static fg_status ref_scan(void *be, const fg_matrix *x, const uint8_t *mask, fg_backend_scan *out,
                          char *msg, size_t n)
{
    (void)be, (void)msg, (void)n;
    fg_backend_scan s = {0, 0, -1, -1, -1};
    for (int64_t r = 0; r < x->rows; r++) {
        if (mask && !mask[r])
            continue;
        for (int64_t c = 0; c < x->cols; c++) {
            const uint32_t b = magnitude_bits(load(x->data, x->dtype, at(r, x->ld, c)));
            if (s.top_row < 0 || b > s.top_bits) {
                s.top_bits = b;
                s.top_row = r;
            }
            if (b >= 0x7f800000u && s.bad_row < 0) {
                s.bad_row = r;
                s.bad_col = c;
            }
        }
    }
    *out = s;
    return FG_OK;
}

/* GEMM 1: logits[i] = hidden[rows[r0 + i]] · Wᵀ + b, in double. */
static fg_status ref_logits(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                            size_t n)
{
    (void)be, (void)msg, (void)n;
    for (int64_t i = 0; i < m; i++) {
        const int64_t row = c->rows[r0 + i];
        const int masked = c->mask && !c->mask[row]; /* a zero row: never read */
        for (int64_t h = 0; h < c->H; h++) /* the gathered rows, as GEMM 3 reads them */
            store(c->hbuf, c->dlogit_t, at(i, c->H, h),
                  masked ? 0.0f : load(c->hidden.data, c->in_t, at(row, c->hidden.ld, h)));
        for (int64_t v = 0; v < c->V; v++) {
            double acc = c->bias.data ? load(c->bias.data, c->in_t, (size_t)v) : 0.0;
            for (int64_t h = 0; h < c->H; h++)
                acc += (double)load(c->hbuf, c->dlogit_t, at(i, c->H, h)) *
                       load(c->weight.data, c->in_t, at(v, c->weight.ld, h));
            store(c->logits, c->logit_t, at(i, c->V, v), (float)acc);
        }
    }
    return FG_OK;
}

/* Row i's scaled logit z = x · inv_temp at column v. */
static double z_at(const fg_backend_call *c, int64_t i, int64_t v)
{
    return (double)load(c->logits, c->logit_t, at(i, c->V, v)) * c->inv_temp;
}

/* Row i's statistics (row_kernels.h's fg_row_stats), in double: max z,
 * sum = Σ exp(z − max), dot = Σ exp(z − max)·(z − max). */
typedef struct ref_row {
    double max, sum, dot;
} ref_row;

static ref_row row_stats(const fg_backend_call *c, int64_t i)
{
    ref_row s = {-INFINITY, 0.0, 0.0};
    for (int64_t v = 0; v < c->V; v++)
        s.max = fmax(s.max, z_at(c, i, v));
    for (int64_t v = 0; v < c->V; v++) {
        const double d = z_at(c, i, v) - s.max;
        s.sum += exp(d);
        s.dot += exp(d) * d;
    }
    return s;
}

static int in_vocab(const fg_backend_call *c, int64_t tok) { return tok >= 0 && tok < c->V; }

static fg_status ref_stats(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                           size_t n)
{
    (void)be, (void)msg, (void)n;
    for (int64_t i = 0; i < m; i++) {
        const ref_row s = row_stats(c, i);
        const int64_t tok = c->targets[r0 + i];
        const double lsum = log(s.sum);
        /* another shard's target: logp NaN, the row's statistics all the same */
        const double ztok = in_vocab(c, tok) ? z_at(c, i, tok) : NAN;
        c->zmax[i] = (float)s.max;
        c->lsum[i] = (float)lsum;
        c->entropy[i] = (float)(lsum - s.dot / s.sum);
        c->logp[i] = (float)((ztok - s.max) - lsum);
        if (!in_vocab(c, tok) && (int64_t)*c->row_check > i)
            *c->row_check = (int)i;
    }
    return FG_OK;
}

/* This shard's own statistics of each row, unmerged (shard_stats.h): its
 * max, sums and target's logit (−inf: another shard's), each float32 once. */
static fg_status ref_shard_stats(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                                 float *out, int64_t count, int by_token, char *msg, size_t n)
{
    (void)be, (void)msg, (void)n;
    for (int64_t i = 0; i < m; i++) {
        const ref_row s = row_stats(c, i);
        const int64_t tok = c->targets[r0 + i];
        const fg_row_stats st = {(float)s.max, (float)s.sum, (float)s.dot};
        const float ztok = in_vocab(c, tok) ? (float)z_at(c, i, tok) : -INFINITY;
        fg_shard_put_local(out, count, by_token ? c->rows[r0 + i] : i, st, ztok);
    }
    return FG_OK;
}

/* dx_v = inv_temp · [g·(δ_v,tok − p_v) − e·p_v·(lp_v + entropy)] (row_kernels.h);
 * a target outside [0, V) (another shard's) matches no v: no one-hot term. */
static fg_status ref_backward(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                              char *msg, size_t n)
{
    (void)be, (void)msg, (void)n;
    for (int64_t i = 0; i < m; i++) {
        const int64_t tok = c->targets[r0 + i];
        for (int64_t v = 0; v < c->V; v++) {
            const double lp = (z_at(c, i, v) - c->zmax[i]) - c->lsum[i], p = exp(lp);
            const double dx = c->inv_temp * (c->g[i] * ((v == tok ? 1.0 : 0.0) - p) -
                                             c->e[i] * p * (lp + c->entropy[i]));
            store(c->dlogits, c->dlogit_t, at(i, c->V, v), (float)dx);
        }
    }
    if (c->gb_sum) /* the stored values, one float32 addition a row, rows in order */
        for (int64_t v = 0; v < c->V; v++)
            for (int64_t i = 0; i < m; i++)
                c->gb_sum[v] += load(c->dlogits, c->dlogit_t, at(i, c->V, v));
    return FG_OK;
}

/* GEMM 2 alone: ghbuf[i, :] = Σ_v dlogits[i, v] · W[v, :] ([m, H] float32),
 * in double, stored once. */
static fg_status ref_dhidden(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                             size_t n)
{
    (void)be, (void)r0;
    if (!c->ghbuf) {
        snprintf(msg, n, "dhidden: ghbuf is required");
        return FG_ERR_NULL_ARGUMENT;
    }
    for (int64_t i = 0; i < m; i++)
        for (int64_t h = 0; h < c->H; h++) {
            double acc = 0.0;
            for (int64_t v = 0; v < c->V; v++)
                acc += (double)load(c->dlogits, c->dlogit_t, at(i, c->V, v)) *
                       load(c->weight.data, c->in_t, at(v, c->weight.ld, h));
            c->ghbuf[at(i, c->H, h)] = (float)acc;
        }
    return FG_OK;
}

/* ghbuf's rows into grad_hidden's rows of the chunk's tokens, rounded once
 * to a bf16 grad_hidden. */
static fg_status ref_put_grad_hidden(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                                     char *msg, size_t n)
{
    (void)be, (void)msg, (void)n;
    const fg_matrix *gh = &c->grad_hidden;
    if (!gh->data) /* not wanted: nothing to put */
        return FG_OK;
    for (int64_t i = 0; i < m; i++)
        for (int64_t h = 0; h < c->H; h++)
            store(gh->data, gh->dtype, at(c->rows[r0 + i], gh->ld, h), c->ghbuf[at(i, c->H, h)]);
    return FG_OK;
}

/* Gradient filtering (docs/LOSS_SPEC.md), in place (FG_BACKEND_FILTER_IN_PLACE:
 * the CUDA backend's algorithm; its products then run dense here):
 *   count   each row's threshold (float)(eps · max |d|) and its kept entries
 *           (|d| > threshold, or its target) into the scratch; a row keeping
 *           more than kept_cap keeps every entry (V);
 *   sum     *kept_count += the rows' kept entries;
 *   zero    in every row keeping at most kept_cap, the dropped entries of
 *           dlogits set to 0 (the products then sum the kept ones).
 * No kept_* workspace; the same comparisons in float as the CPU's select. */

static int ref_keeps(const fg_backend_call *c, int64_t i, int64_t v, float thr, int64_t t)
{
    return fabsf(load(c->dlogits, c->dlogit_t, at(i, c->V, v))) > thr || v == t;
}

static fg_status ref_filter(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                            size_t n)
{
    (void)be;
    ref_filter_row *rows = c->scratch;
    if (!rows || !c->kept_count) {
        snprintf(msg, n, "filter: the scratch chunk_scratch asked for and kept_count are required");
        return FG_ERR_NULL_ARGUMENT;
    }
    int64_t total = 0;
    for (int64_t i = 0; i < m; i++) { /* count */
        float top = 0.0f;
        for (int64_t v = 0; v < c->V; v++) {
            const float a = fabsf(load(c->dlogits, c->dlogit_t, at(i, c->V, v)));
            top = a > top ? a : top;
        }
        const float thr = (float)(c->filter_eps * (double)top);
        const int64_t t = c->targets[r0 + i];
        int32_t kept = 0;
        for (int64_t v = 0; v < c->V; v++)
            kept += ref_keeps(c, i, v, thr, t);
        if (kept > c->kept_cap)
            kept = (int32_t)c->V;
        rows[i] = (ref_filter_row){thr, kept};
        total += kept;
    }
    *c->kept_count += total; /* sum */
    for (int64_t i = 0; i < m; i++) /* zero */
        for (int64_t v = 0; v < c->V && rows[i].kept <= c->kept_cap; v++)
            if (!ref_keeps(c, i, v, rows[i].threshold, c->targets[r0 + i]))
                store(c->dlogits, c->dlogit_t, at(i, c->V, v), 0.0f);
    return FG_OK;
}

/* The loss's derivatives of the chunk's rows through loss_token.h, the
 * math every path shares, on a plan over the backend's memory. */
static fg_status ref_derivs(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                            const struct fg_loss_plan *plan, char *msg, size_t n)
{
    (void)be, (void)msg, (void)n;
    const fg_loss_plan p = fg_loss_plan_resolved(plan);
    for (int64_t i = 0; i < m; i++)
        fg_token_derivs(&p, c->rows[r0 + i], c->logp[i], c->entropy[i], &c->g[i], &c->e[i]);
    return FG_OK;
}

/* ------------------------------------------------ device-reported calls */

/* A failure's key into the record: the smallest key is kept (report.h). */
static void report(fg_device_report *rep, uint64_t key)
{
    if (key && ~key > rep->failed)
        rep->failed = ~key;
}

static fg_status ref_report_batch(void *be, const fg_backend_call *c,
                                  const struct fg_loss_plan *plan, const fg_report_batch *r,
                                  fg_device_report *rep, char *msg, size_t n)
{
    (void)be, (void)msg, (void)n;
    fg_loss_plan p = *plan;
    for (int64_t b = 0; b < p.B; b++)
        report(rep, fg_report_sequence(&p, r, b));
    for (int64_t t = 0; t < c->N; t++) {
        report(rep, fg_report_token_input(&p, r, t));
        const int64_t id = p.token_ids[t];
        ((int64_t *)c->rows)[t] = t;
        ((int64_t *)c->targets)[t] = p.mask[t] && id >= 0 && id < r->vocab ? id : -1;
    }
    rep->seq_len = p.T;
    rep->vocab = r->vocab;
    if (!r->loss || p.external)
        return FG_OK;
    double total = 0; /* the host's order: counts, their sum, then each sequence */
    for (int64_t b = 0; b < p.B; b++)
        total += p.seq_count[b] = fg_loss_seq_count(&p, b);
    for (int64_t b = 0; b < p.B; b++) { /* fg_loss_plan_init's, and fg_loss_prepare's
                                             where no token is needed (else report_prepare) */
        fg_loss_seq_init(&p, b, p.seq_count[b], total);
        if (!fg_loss_tokens_first(&p))
            fg_loss_seq_prepare(&p, b, NULL);
    }
    double *scalars = (double *)p.batch_scalars;
    scalars[0] = total;
    scalars[1] = fg_loss_entropy_weight(&p, total);
    scalars[2] = p.entropy_threshold; /* every token; report_prepare's quantile */
    return FG_OK;
}

/* The entropy quantile's threshold and the entropy bonus's weight
 * (loss_math.c's, on the host's sort), into the plan and its batch
 * scalars. */
static fg_status ref_entropy_quantile(fg_loss_plan *p, const float *entropy, char *msg, size_t n)
{
    const int64_t N = p->B * p->T;
    float *x = malloc((size_t)(N > 0 ? N : 1) * sizeof *x);
    if (!x) {
        snprintf(msg, n, "report prepare: %lld entropies to sort", (long long)N);
        return FG_ERR_OUT_OF_MEMORY;
    }
    fg_loss_entropy_quantile(p, entropy, x);
    free(x);
    double *scalars = (double *)p->batch_scalars;
    scalars[1] = p->entropy_weight;
    scalars[2] = p->entropy_threshold;
    return FG_OK;
}

static fg_status ref_report_prepare(void *be, const fg_backend_call *c,
                                    const struct fg_loss_plan *plan, const fg_backend_tokens *t,
                                    char *msg, size_t n)
{
    (void)be, (void)c;
    fg_loss_plan p = fg_loss_plan_resolved(plan);
    for (int64_t b = 0; b < p.B; b++) /* fg_loss_prepare's order */
        fg_loss_seq_prepare(&p, b, t->logp);
    fg_status st;
    if (p.top_entropy_quantile < 1.0 && !p.external &&
        (st = ref_entropy_quantile(&p, t->entropy, msg, n)) != FG_OK)
        return st;
    if (p.level == FG_LEVEL_SEQUENCE)
        for (int64_t b = 0; b < p.B; b++)
            fg_loss_seq_dratio(&p, b, t->logp, t->entropy);
    return FG_OK;
}

static fg_status ref_report_scan(void *be, const fg_matrix *x, const uint8_t *mask, int stage,
                                 fg_device_report *rep, char *msg, size_t n)
{
    (void)be, (void)msg, (void)n;
    for (int64_t r = 0; r < x->rows; r++)
        for (int64_t c = 0; c < x->cols && (!mask || mask[r]); c++)
            if (!isfinite(load(x->data, x->dtype, at(r, x->ld, c)))) {
                report(rep, fg_report_entry_key(stage, r, c));
                return FG_OK;
            }
    return FG_OK;
}

static fg_status ref_report_tokens(void *be, const fg_backend_call *c,
                                   const struct fg_loss_plan *plan, const fg_report_batch *r,
                                   const fg_backend_tokens *t, fg_device_report *rep, char *msg,
                                   size_t n)
{
    (void)be, (void)msg, (void)n;
    const fg_loss_plan p = fg_loss_plan_resolved(plan);
    for (int64_t k = 0; k < c->N; k++) {
        report(rep, fg_report_token(&p, r, k, t->zmax[k], t->lsum[k], t->logp[k], t->entropy[k],
                                    t->scanned));
        if (t->logp_out)
            t->logp_out[k] = p.mask[k] ? t->logp[k] : 0.0f;
        if (t->entropy_out)
            t->entropy_out[k] = p.mask[k] ? t->entropy[k] : 0.0f;
    }
    if (r->loss) { /* loss_sequence.h's pieces in their order */
        const int64_t segments = (p.T + FG_EVAL_SEGMENT - 1) / FG_EVAL_SEGMENT;
        fg_seq_sums *sums = t->sums;
        for (int64_t b = 0; b < p.B; b++)
            for (int64_t k = 0; k < segments; k++)
                sums[b * segments + k] = fg_seg_eval(&p, b, k, t->logp, t->entropy);
        fg_loss_from_segments(&p, sums, segments, &rep->loss, &rep->metrics);
        double value = 0;
        const uint64_t key = fg_report_sums(rep->loss, &rep->metrics, &value);
        report(rep, key);
        if (key && ~key == rep->failed)
            rep->value[0] = value;
    }
    if (rep->failed && fg_report_stage_of(~rep->failed) != FG_REPORT_SUM)
        fg_report_values(&p, r, t->logp, t->entropy, ~rep->failed, rep->value);
    return FG_OK;
}

/* GEMM 2 as dhidden then put_grad_hidden (one definition of grad_hidden),
 * GEMM 3 overwriting its destination on the first chunk, adding after. */
static fg_status ref_grads(void *be, const fg_backend_call *c, int64_t r0, int64_t m, int first,
                           char *msg, size_t n)
{
    fg_status st;
    if (c->grad_hidden.data && ((st = ref_dhidden(be, c, r0, m, msg, n)) != FG_OK ||
                                (st = ref_put_grad_hidden(be, c, r0, m, msg, n)) != FG_OK))
        return st;
    if (c->grad_weight.data) { /* [V, H] (+)= dlogitsᵀ [V, m] · hbuf [m, H] */
        void *dst = c->gw_sum ? (void *)c->gw_sum : c->grad_weight.data;
        const fg_dtype dt = c->gw_sum ? FG_DTYPE_F32 : c->grad_weight.dtype;
        const int64_t ld = c->gw_sum ? c->H : c->grad_weight.ld;
        for (int64_t v = 0; v < c->V; v++)
            for (int64_t h = 0; h < c->H; h++) {
                double acc = first ? 0.0 : load(dst, dt, at(v, ld, h)); /* first: not read */
                for (int64_t i = 0; i < m; i++)
                    acc += (double)load(c->dlogits, c->dlogit_t, at(i, c->V, v)) *
                           load(c->hbuf, c->dlogit_t, at(i, c->H, h));
                store(dst, dt, at(v, ld, h), (float)acc);
            }
    }
    return FG_OK;
}

static fg_status ref_finish(void *be, const fg_backend_call *c, char *msg, size_t n)
{
    (void)be;
    const fg_matrix *gw = &c->grad_weight;
    if (gw->data && c->gw_sum && c->n_active > 0) /* one float32 sum, rounded once */
        for (int64_t v = 0; v < c->V; v++)
            for (int64_t h = 0; h < c->H; h++) {
                const float old =
                    c->accumulate ? load(gw->data, gw->dtype, at(v, gw->ld, h)) : 0.0f;
                store(gw->data, gw->dtype, at(v, gw->ld, h), c->gw_sum[at(v, c->H, h)] + old);
            }
    if (gw->data && c->n_active == 0 && !c->accumulate)
        for (int64_t v = 0; v < c->V; v++)
            memset((unsigned char *)gw->data + at(v, gw->ld, 0) * fg_dtype_size(gw->dtype), 0,
                   (size_t)c->H * fg_dtype_size(gw->dtype));
    if (c->grad_bias.data) { /* the driver seeded the sums: the caller's values are in */
        if (!c->gb_sum) {
            snprintf(msg, n, "finish: gb_sum is required with grad_bias");
            return FG_ERR_NULL_ARGUMENT;
        }
        for (int64_t v = 0; v < c->V; v++)
            store(c->grad_bias.data, c->grad_bias.dtype, (size_t)v, c->gb_sum[v]);
    }
    const fg_matrix *gh = &c->grad_hidden;
    if (gh->data)
        for (int64_t r = 0; r < c->N; r++)
            if (!c->mask[r])
                memset((unsigned char *)gh->data + at(r, gh->ld, 0) * fg_dtype_size(gh->dtype), 0,
                       (size_t)c->H * fg_dtype_size(gh->dtype));
    return FG_OK;
}

/* Not FG_BACKEND_HOST_MEMORY on purpose (the header); no fusion. */
static const fg_backend_ops reference_ops = {
    .abi = FG_BACKEND_ABI,
    .name = "reference",
    .caps = FG_BACKEND_FIXED_ROW_BITS | FG_BACKEND_THREAD_INVARIANT | FG_BACKEND_FILTER_IN_PLACE,
    .align = 256,
    .logits_block_rows = 0,
    .fast_chunk_rows = 1024, /* the CUDA backend's, so that tests run the planner's rule */
    .destroy = fg_host_destroy,
    .alloc = fg_host_alloc,
    .release = fg_host_release,
    .to_host = ref_copy,
    .to_device = ref_copy,
    .fill_zero = fg_host_fill_zero,
    .wait = ref_wait,
    .compute_dtype = ref_compute_dtype,
    .call_scratch_bytes = ref_call_scratch,
    .chunk_scratch = ref_chunk_scratch,
    .chunk_slow = NULL,
    .supports = ref_supports,
    .scan = ref_scan,
    .logits = ref_logits,
    .stats = ref_stats,
    .backward = ref_backward,
    .grads = ref_grads,
    .finish = ref_finish,
    .stats_backward = NULL,
    .shard_stats = ref_shard_stats,
    .dhidden = ref_dhidden,
    .put_grad_hidden = ref_put_grad_hidden,
    .filter = ref_filter,
    .derivs = ref_derivs,
    .report_batch = ref_report_batch,
    .report_prepare = ref_report_prepare,
    .report_scan = ref_report_scan,
    .report_tokens = ref_report_tokens,
};

fg_status fg_backend_reference_create(void *stream, fg_device *out, char *msg, size_t msg_size)
{
    (void)stream, (void)msg, (void)msg_size;
    out->ops = &reference_ops;
    out->state = NULL;
    return FG_OK;
}
