/*
 * The seam's plain reference (backend.h) on host memory: every op as the
 * simplest loops, sums in double, one thread. It is the specification of
 * each op, the backend the seam driver (linear_device.c) is tested with on
 * machines without a GPU, and what the CUDA backend is checked against on
 * one. Slow by design: for tests, never for speed.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend_host.h"
#include "bf16.h"
#include "internal.h"

#include <stdio.h>

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

static size_t ref_call_scratch(void *be, const fg_backend_call *c)
{
    (void)be, (void)c;
    return 0;
}

static size_t ref_chunk_scratch(void *be, const fg_backend_call *c, int64_t m)
{
    (void)be, (void)c, (void)m;
    return 0;
}

static fg_status ref_supports(void *be, const fg_backend_call *c, char *msg, size_t n)
{
    (void)be, (void)msg, (void)n;
    (void)c;
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
        for (int64_t h = 0; h < c->H; h++) /* the gathered rows, as GEMM 3 reads them */
            store(c->hbuf, c->dlogit_t, at(i, c->H, h), load(c->hidden.data, c->in_t, at(row, c->hidden.ld, h)));
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

static void lower(int *slot, int64_t i)
{
    if ((int64_t)*slot > i)
        *slot = (int)i;
}

static fg_status ref_stats(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                           size_t n)
{
    (void)be, (void)msg, (void)n;
    for (int64_t i = 0; i < m; i++) {
        double zmax = -INFINITY;
        for (int64_t v = 0; v < c->V; v++)
            zmax = fmax(zmax, (double)load(c->logits, c->logit_t, at(i, c->V, v)) * c->inv_temp);
        double sum = 0.0, dot = 0.0;
        for (int64_t v = 0; v < c->V; v++) {
            const double d = (double)load(c->logits, c->logit_t, at(i, c->V, v)) * c->inv_temp - zmax;
            sum += exp(d);
            dot += exp(d) * d;
        }
        const int64_t tok = c->targets[r0 + i];
        const double lsum = log(sum);
        const double ztok = tok >= 0 && tok < c->V
                                ? (double)load(c->logits, c->logit_t, at(i, c->V, tok)) * c->inv_temp
                                : NAN;
        c->zmax[i] = (float)zmax;
        c->lsum[i] = (float)lsum;
        c->entropy[i] = (float)(lsum - dot / sum);
        c->logp[i] = (float)((ztok - zmax) - lsum);
        if (!(tok >= 0 && tok < c->V))
            lower(&c->row_check[0], i);
        else if (!isfinite(c->zmax[i]) || !isfinite(c->lsum[i]) || !isfinite(c->entropy[i]) ||
                 !isfinite(c->logp[i]))
            lower(&c->row_check[1], i);
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
            const double z = (double)load(c->logits, c->logit_t, at(i, c->V, v)) * c->inv_temp;
            const double lp = (z - c->zmax[i]) - c->lsum[i], p = exp(lp);
            const double dx = c->inv_temp * (c->g[i] * ((v == tok ? 1.0 : 0.0) - p) -
                                             c->e[i] * p * (lp + c->entropy[i]));
            store(c->dlogits, c->dlogit_t, at(i, c->V, v), (float)dx);
        }
    }
    if (c->gb_sum) /* the stored values, rows in order */
        for (int64_t v = 0; v < c->V; v++) {
            double acc = c->gb_sum[v];
            for (int64_t i = 0; i < m; i++)
                acc += load(c->dlogits, c->dlogit_t, at(i, c->V, v));
            c->gb_sum[v] = (float)acc;
        }
    return FG_OK;
}

static fg_status ref_grads(void *be, const fg_backend_call *c, int64_t r0, int64_t m, int first,
                           char *msg, size_t n)
{
    (void)be, (void)msg, (void)n;
    if (c->grad_hidden.data) /* GEMM 2, one rounding into the caller's row */
        for (int64_t i = 0; i < m; i++)
            for (int64_t h = 0; h < c->H; h++) {
                double acc = 0.0;
                for (int64_t v = 0; v < c->V; v++)
                    acc += (double)load(c->dlogits, c->dlogit_t, at(i, c->V, v)) *
                           load(c->weight.data, c->in_t, at(v, c->weight.ld, h));
                store(c->grad_hidden.data, c->grad_hidden.dtype,
                      at(c->rows[r0 + i], c->grad_hidden.ld, h), (float)acc);
            }
    if (c->grad_weight.data) { /* GEMM 3 */
        void *dst = c->gw_sum ? (void *)c->gw_sum : c->grad_weight.data;
        const fg_dtype dt = c->gw_sum ? FG_DTYPE_F32 : c->grad_weight.dtype;
        const int64_t ld = c->gw_sum ? c->H : c->grad_weight.ld;
        for (int64_t v = 0; v < c->V; v++)
            for (int64_t h = 0; h < c->H; h++) {
                double acc = first ? 0.0 : load(dst, dt, at(v, ld, h));
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
    (void)be, (void)msg, (void)n;
    const fg_matrix *gw = &c->grad_weight;
    if (gw->data && c->gw_sum && c->n_active > 0)
        for (int64_t v = 0; v < c->V; v++)
            for (int64_t h = 0; h < c->H; h++) {
                const float old = c->accumulate ? load(gw->data, gw->dtype, at(v, gw->ld, h)) : 0.0f;
                store(gw->data, gw->dtype, at(v, gw->ld, h), c->gw_sum[at(v, c->H, h)] + old);
            }
    if (gw->data && c->n_active == 0 && !c->accumulate)
        for (int64_t v = 0; v < c->V; v++)
            memset((unsigned char *)gw->data + at(v, gw->ld, 0) * fg_dtype_size(gw->dtype), 0,
                   (size_t)c->H * fg_dtype_size(gw->dtype));
    if (c->grad_bias.data)
        for (int64_t v = 0; v < c->V; v++) {
            const float old = c->accumulate && !c->gb_seeded
                                  ? load(c->grad_bias.data, c->grad_bias.dtype, (size_t)v)
                                  : 0.0f;
            store(c->grad_bias.data, c->grad_bias.dtype, (size_t)v, c->gb_sum[v] + old);
        }
    const fg_matrix *gh = &c->grad_hidden;
    if (gh->data)
        for (int64_t r = 0; r < c->N; r++)
            if (!c->mask[r])
                memset((unsigned char *)gh->data + at(r, gh->ld, 0) * fg_dtype_size(gh->dtype), 0,
                       (size_t)c->H * fg_dtype_size(gh->dtype));
    return FG_OK;
}

static const fg_backend_ops reference_ops = {
    .abi = FG_BACKEND_ABI,
    .name = "reference",
    .destroy = fg_host_destroy,
    .alloc = fg_host_alloc,
    .release = fg_host_release,
    .to_host = fg_host_copy,
    .to_device = fg_host_copy,
    .fill_zero = fg_host_fill_zero,
    .wait = fg_host_wait,
    .call_scratch_bytes = ref_call_scratch,
    .chunk_scratch_bytes = ref_chunk_scratch,
    .supports = ref_supports,
    .scan = ref_scan,
    .logits = ref_logits,
    .stats = ref_stats,
    .backward = ref_backward,
    .grads = ref_grads,
    .finish = ref_finish,
};

fg_status fg_backend_reference_create(void *stream, fg_device *out, char *msg, size_t msg_size)
{
    (void)stream, (void)msg, (void)msg_size;
    out->ops = &reference_ops;
    out->state = NULL;
    return FG_OK;
}
