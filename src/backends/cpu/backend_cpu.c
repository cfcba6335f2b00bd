/*
 * The CPU backend (backend_cpu.h): the seam's ops on host memory.
 *
 * Products: oneDNN through gemm_onednn.h, each in fixed blocks of C run by
 * one thread with the whole K, so that their bits do not depend on the
 * thread count; every primitive call of the logits product is one whole
 * FG_BLOCK_LOGITS_M x FG_BLOCK_LOGITS_N block (a row's bits depend neither
 * on the chunk size nor on where the row lies). Row work: one thread per
 * row, start to end (row_kernels.h), so any thread count gives the same
 * bits. Its ops also leave their messages in the call's error sink.
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cpu.h"
#include "backend_host.h"
#include "bf16.h"
#include "row_kernels.h"
#include "shard_stats.h"
#include "sweep.h"
#include "validate.h"

static fg_cpu_backend *state(void *be) { return be; }

/* A failure the GEMM layer left in the call's error sink, as the op's. */
static fg_status failed(const fg_cpu_backend *s, fg_status st, char *msg, size_t n)
{
    if (st != FG_OK)
        snprintf(msg, n, "%s", s->call->err->msg);
    return st;
}

static void *row_at(const fg_matrix *m, int64_t r)
{
    return (unsigned char *)m->data + (size_t)r * (size_t)m->ld * fg_dtype_size(m->dtype);
}

static const void *chunk_row(const void *base, fg_dtype t, int64_t V, int64_t i)
{
    return (const unsigned char *)base + (size_t)i * (size_t)V * fg_dtype_size(t);
}

/* -------------------------------------------------------------- shapes */

/* The products multiply bf16 only where oneDNN multiplies bf16 natively on
 * this CPU and measured faster (gemm_onednn.c), else float32 (the gathered
 * rows and weight tiles widened). */
static fg_dtype cpu_compute_dtype(void *be, fg_dtype in_t)
{
    return in_t == FG_DTYPE_BF16 && fg_gemm_native_bf16(state(be)->call->gemm) ? FG_DTYPE_BF16
                                                                               : FG_DTYPE_F32;
}

/* Converted weight tiles (bf16 on CPUs without native bf16 GEMMs; f32 for
 * short grad_hidden products whose weight rows lie 4 KiB multiples apart,
 * where half a chunk's logits hold two K pieces: gemm_onednn.c,
 * restride_f32) scale with the chunk: half its logits, at most
 * FG_TILE_CAP_BYTES. Everything a call holds is then a function of the
 * chunk rows alone, so the smallest budget is the need of a one-row chunk.
 * None for float32 inputs where shards merge per chunk (c->hook): they
 * replan at the agreed, smaller chunk without refitting, and a chunk short
 * enough for the tiles would need more memory than its own plan. */
static size_t tile_cap(const fg_cpu_backend *s, const fg_backend_call *c, int64_t m)
{
    (void)s;
    if (c->hook && c->in_t == FG_DTYPE_F32)
        return 0;
    const size_t half_logits = (size_t)m * (size_t)c->V * sizeof(float) / 2;
    return half_logits < FG_TILE_CAP_BYTES ? half_logits : FG_TILE_CAP_BYTES;
}

/* GEMM 1, logits[m, V] = hbuf · Wᵀ (+ bias): every primitive call one whole
 * block (fixed_blocks), the rows past the last whole block zero-padded. */
static fg_gemm_shape shape_logits(const fg_cpu_backend *s, const fg_backend_call *c, int64_t m)
{
    return (fg_gemm_shape){.M = m, .N = c->V, .K = c->H,
                           .a_type = c->dlogit_t, .b_type = c->in_t, .c_type = c->logit_t,
                           .a_rs = c->H, .a_cs = 1, .b_rs = 1, .b_cs = c->weight.ld,
                           .c_ld = c->V, .accumulate = 0, .has_bias = c->bias.data != NULL,
                           .tile_bytes = tile_cap(s, c, m),
                           .block_m = FG_BLOCK_LOGITS_M, .block_n = FG_BLOCK_LOGITS_N,
                           .fixed_blocks = 1, .split_k = 0};
}

/* GEMM 2, ghbuf[m, H] = dlogits · W. */
static fg_gemm_shape shape_dhidden(const fg_cpu_backend *s, const fg_backend_call *c, int64_t m)
{
    return (fg_gemm_shape){.M = m, .N = c->H, .K = c->V,
                           .a_type = c->dlogit_t, .b_type = c->in_t, .c_type = FG_DTYPE_F32,
                           .a_rs = c->V, .a_cs = 1, .b_rs = c->weight.ld, .b_cs = 1,
                           .c_ld = c->H, .accumulate = 0, .has_bias = 0,
                           .tile_bytes = tile_cap(s, c, m),
                           .block_m = FG_BLOCK_DHIDDEN_M, .block_n = FG_BLOCK_DHIDDEN_N,
                           .fixed_blocks = 0, .split_k = FG_BLOCK_DHIDDEN_SPLIT_K};
}

/* GEMM 3, grad_weight[V, H] (+)= dlogitsᵀ · hbuf: into the caller's
 * grad_weight, or the float32 sums of a bf16 one (c->gw_sum). */
static fg_gemm_shape shape_dweight(const fg_cpu_backend *s, const fg_backend_call *c, int64_t m,
                                   int accumulate)
{
    const int sums = c->gw_sum != NULL;
    return (fg_gemm_shape){.M = c->V, .N = c->H, .K = m,
                           .a_type = c->dlogit_t, .b_type = c->dlogit_t,
                           .c_type = sums ? FG_DTYPE_F32 : c->grad_weight.dtype,
                           .a_rs = 1, .a_cs = c->V, .b_rs = c->H, .b_cs = 1,
                           .c_ld = sums ? c->H : c->grad_weight.ld, .accumulate = accumulate,
                           .has_bias = 0, .tile_bytes = tile_cap(s, c, m),
                           .block_m = FG_BLOCK_DWEIGHT_M, .block_n = 0, .fixed_blocks = 0,
                           .split_k = 0};
}

/* Prepares every product a chunk of m rows issues, raising *need to cover
 * them (oneDNN's primitives: a failure surfaces before any output). */
static fg_status prepare_chunk(const fg_cpu_backend *s, const fg_backend_call *c, int64_t m,
                               fg_gemm_scratch *need)
{
    fg_gemm_shape shapes[4];
    int k = 0;
    shapes[k++] = shape_logits(s, c, m);
    if (c->grad_hidden.data)
        shapes[k++] = shape_dhidden(s, c, m);
    if (c->grad_weight.data) {
        shapes[k++] = shape_dweight(s, c, m, 0);
        shapes[k++] = shape_dweight(s, c, m, 1);
    }
    for (int i = 0; i < k; i++) {
        const fg_status st =
            fg_gemm_prepare(s->call->gemm, &shapes[i], s->call->threads, need, s->call->err);
        if (st != FG_OK)
            return st;
    }
    return FG_OK;
}

/* Blocks that short run oneDNN's no-copy kernels (fg_gemm_fast_rows), which
 * read the weight in place, and rows H floats apart (a power of two at H =
 * 1024, 2048, 4096) fall on one cache set: measured on AVX2, m = 188, H =
 * 1024: 38.7 GFLOP/s a core against 70.4 at a stride of 1040
 * (bench/block_probe.c). Products on weight tiles (fg_gemm_tiled) are
 * stored at such a stride and run fast at any m. */
static int cpu_chunk_slow(void *be, const fg_backend_call *c, int64_t m)
{
    const fg_cpu_backend *s = state(be);
    if (!c->grad_hidden.data)
        return 0;
    const fg_gemm_shape g = shape_dhidden(s, c, m);
    if (fg_gemm_tiled(s->call->gemm, &g))
        return 0;
    return m < fg_gemm_fast_rows(c->H < FG_BLOCK_DHIDDEN_N ? c->H : FG_BLOCK_DHIDDEN_N);
}

/* ------------------------------------------------------------ planning */

static size_t cpu_call_scratch(void *be, const fg_backend_call *c)
{
    (void)be, (void)c;
    return 0; /* oneDNN's JIT code and packing buffers: outside any budget */
}

/* The products' scratch (and converted weight tiles) for chunks of m rows
 * and a last one of `last` rows on c->workers threads. */
static fg_status cpu_chunk_scratch(void *be, const fg_backend_call *c, int64_t m, int64_t last,
                                   size_t *bytes, char *msg, size_t n)
{
    fg_cpu_backend *s = state(be);
    fg_gemm_scratch need = {0, 0};
    fg_status st = prepare_chunk(s, c, m, &need);
    if (st == FG_OK && last != m)
        st = prepare_chunk(s, c, last, &need);
    *bytes = fg_gemm_scratch_bytes(&need, c->workers);
    return failed(s, st, msg, n);
}

/* The products multiply the gathered rows and dlogits in this CPU's compute
 * dtype (cpu_compute_dtype): bf16 dlogits only where oneDNN has bf16
 * kernels, float32 ones only for float32 or widened bf16 inputs. */
static fg_status cpu_supports(void *be, const fg_backend_call *c, char *msg, size_t n)
{
    const fg_dtype want = cpu_compute_dtype(be, c->in_t);
    if (c->dlogit_t == want)
        return FG_OK;
    snprintf(msg, n, "the CPU backend multiplies %s inputs with %s dlogits on this CPU, not %s",
             c->in_t == FG_DTYPE_BF16 ? "bf16" : "f32", want == FG_DTYPE_BF16 ? "bf16" : "f32",
             c->dlogit_t == FG_DTYPE_BF16 ? "bf16" : "f32");
    return FG_ERR_UNSUPPORTED;
}

/* The finite check with its largest magnitude (validate.c's scan), then, on
 * a NaN or Inf, where the first one is. */
static fg_status cpu_scan(void *be, const fg_matrix *x, const uint8_t *mask, fg_backend_scan *out,
                          char *msg, size_t n)
{
    fg_cpu_backend *s = state(be);
    (void)msg, (void)n;
    fg_error err;
    fg_magnitude mag = {0.0, 0};
    fg_backend_scan r = {0, 0, -1, -1, -1};
    if (fg_scan_matrix(&err, s->call->threads, "x", x, mask, &mag) == FG_OK) {
        const float top = (float)mag.value;
        memcpy(&r.top_bits, &top, sizeof top);
        int scanned = 0; /* some row was: mag.index is its largest's */
        for (int64_t row = 0; row < x->rows && !scanned; row++)
            scanned = !mask || mask[row];
        r.top_row = scanned ? mag.index : -1;
        *out = r;
        return FG_OK;
    }
    r.top_bits = 0x7fc00000u;
    for (int64_t row = 0; row < x->rows && r.bad_row < 0; row++) {
        if (mask && !mask[row])
            continue;
        for (int64_t col = 0; col < x->cols && r.bad_row < 0; col++) {
            const size_t i = (size_t)row * (size_t)x->ld + (size_t)col;
            const float v = x->dtype == FG_DTYPE_BF16 ? fg_bf16_load(((const uint16_t *)x->data)[i])
                                                      : ((const float *)x->data)[i];
            if (!isfinite(v)) {
                r.bad_row = r.top_row = row;
                r.bad_col = col;
            }
        }
    }
    *out = r;
    return FG_OK;
}

/* --------------------------------------------------------- chunk work */

/* hbuf[i] = hidden[rows[r0 + i]] in the products' dtype, then GEMM 1. */
static fg_status cpu_logits(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                            size_t n)
{
    fg_cpu_backend *s = state(be);
    const size_t hrow = (size_t)c->H * fg_dtype_size(c->dlogit_t);
    for (int64_t i = 0; i < m; i++) {
        const void *src = row_at(&c->hidden, c->rows[r0 + i]);
        void *dst = (unsigned char *)c->hbuf + (size_t)i * hrow;
        if (c->dlogit_t == c->in_t)
            memcpy(dst, src, hrow);
        else /* bf16 storage, f32 products */
            fg_bf16_to_f32_strided(dst, src, c->H, 1);
    }
    const fg_gemm_shape g = shape_logits(s, c, m);
    return failed(s,
                  fg_gemm_run(s->call->gemm, &g, c->hbuf, c->weight.data, c->logits, c->bias.data,
                              c->scratch, c->workers, &s->call->gemm_stats, s->call->err),
                  msg, n);
}

/* Row i's statistics and its target's logit (-inf: another shard's). */
static fg_row_stats row_stats(const fg_backend_call *c, int64_t r0, int64_t i, float *z_tok)
{
    const void *x = chunk_row(c->logits, c->logit_t, c->V, i);
    const int64_t t = c->targets[r0 + i];
    *z_tok = t < 0 || t >= c->V
                 ? -INFINITY
                 : (c->logit_t == FG_DTYPE_BF16 ? fg_bf16_load(((const uint16_t *)x)[t])
                                                : ((const float *)x)[t]) *
                       c->inv_temp;
    return fg_row_stats_compute(x, c->logit_t, c->V, c->inv_temp);
}

static void stats_row(const fg_backend_call *c, int64_t r0, int64_t i)
{
    float z_tok;
    const fg_row_stats st = row_stats(c, r0, i, &z_tok);
    fg_row_finalize(st, z_tok, &c->zmax[i], &c->lsum[i], &c->logp[i], &c->entropy[i]);
    const int64_t t = c->targets[r0 + i];
    if (t < 0 || t >= c->V)
        c->logp[i] = NAN;
}

static void backward_row(const fg_backend_call *c, int64_t r0, int64_t i)
{
    const int64_t t = c->targets[r0 + i];
    fg_row_backward(chunk_row(c->logits, c->logit_t, c->V, i), c->logit_t,
                    (void *)chunk_row(c->dlogits, c->dlogit_t, c->V, i), c->dlogit_t, c->V,
                    c->inv_temp, c->zmax[i], c->lsum[i], c->entropy[i], c->g[i], c->e[i],
                    t >= 0 && t < c->V ? t : -1);
}

/* The first row with a target outside [0, V) (row_check), after the rows'
 * parallel loop. */
static void check_rows(const fg_backend_call *c, int64_t r0, int64_t m)
{
    for (int64_t i = 0; i < m && *c->row_check > i; i++) {
        const int64_t t = c->targets[r0 + i];
        if (t < 0 || t >= c->V)
            *c->row_check = (int)i;
    }
}

static fg_status cpu_stats(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                           size_t n)
{
    (void)msg, (void)n;
#pragma omp parallel for schedule(static) num_threads(state(be)->call->threads)
    for (int64_t i = 0; i < m; i++)
        stats_row(c, r0, i);
    check_rows(c, r0, m);
    return FG_OK;
}

/* grad_bias's float32 sums: the chunk's dlogits columns, rows in order. */
static void bias_sums(const fg_cpu_backend *s, const fg_backend_call *c, int64_t m)
{
    if (!c->gb_sum)
        return;
    const fg_rows rows = {.x = c->dlogits, .xtype = c->dlogit_t, .x_ld = c->V,
                          .dx = c->dlogits, .dxtype = c->dlogit_t, .dx_ld = c->V,
                          .count = m, .V = c->V};
    fg_sweep_column_sums(s->call->threads, &rows, c->gb_sum);
}

static fg_status cpu_backward(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                              char *msg, size_t n)
{
    (void)msg, (void)n;
    fg_cpu_backend *s = state(be);
    s->kept_total = -1; /* new dlogits: dense until filtered */
#pragma omp parallel for schedule(static) num_threads(s->call->threads)
    for (int64_t i = 0; i < m; i++)
        backward_row(c, r0, i);
    bias_sums(s, c, m);
    return FG_OK;
}

static fg_status cpu_stats_backward(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                                    const fg_backend_derivs *d, char *msg, size_t n)
{
    (void)msg, (void)n;
    fg_cpu_backend *s = state(be);
    s->kept_total = -1; /* new dlogits: dense until filtered */
#pragma omp parallel for schedule(static) num_threads(s->call->threads)
    for (int64_t i = 0; i < m; i++) {
        stats_row(c, r0, i);
        d->at(d->user, r0 + i, c->logp[i], c->entropy[i], &c->g[i], &c->e[i]);
        backward_row(c, r0, i);
    }
    check_rows(c, r0, m);
    bias_sums(s, c, m);
    return FG_OK;
}

static fg_status cpu_shard_stats(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                                 float *out, int64_t count, int by_token, char *msg, size_t n)
{
    (void)msg, (void)n;
#pragma omp parallel for schedule(static) num_threads(state(be)->call->threads)
    for (int64_t i = 0; i < m; i++) {
        float z_tok;
        const fg_row_stats st = row_stats(c, r0, i, &z_tok);
        fg_shard_put_local(out, count, by_token ? c->rows[r0 + i] : i, st, z_tok);
    }
    return FG_OK;
}

/* Gradient filtering of the chunk's dlogits: the kept entries, compacted in
 * place for the sparse products; or, where some row keeps more than
 * kept_cap (it keeps every entry), the other rows' dropped entries zeroed in
 * place and kept_total -1 (the chunk's products run dense). Counts the
 * entries the rule keeps either way. */
static fg_status cpu_filter(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                            size_t n)
{
    (void)msg, (void)n;
    fg_cpu_backend *s = state(be);
    fg_call *call = s->call;
    s->kept_total = -1;
    for (int64_t i = 0; i < m; i++) {
        const int64_t t = c->targets[r0 + i];
        c->kept_tgt[i] = t >= 0 && t < c->V ? t : -1;
    }
    s->kept = (fg_kept){.d = c->dlogits, .d_t = c->dlogit_t, .d_ld = c->V, .count = m,
                        .V = c->V, .target = c->kept_tgt, .idx = c->kept_idx,
                        .cap = c->kept_cap, .nnz = c->kept_nnz};
    const double t0 = omp_get_wtime();
    int64_t dense_rows = 0;
    const int64_t kept = fg_filter_select(call->threads, &s->kept, c->filter_eps, &dense_rows);
    if (dense_rows == 0) {
        fg_filter_compact(call->threads, &s->kept);
        s->kept_total = kept;
    } else {
        fg_filter_zero_dropped(call->threads, &s->kept);
    }
    call->gemm_stats.seconds += omp_get_wtime() - t0;
    *c->kept_count += kept;
    return FG_OK;
}

/* A sparse product's time and work, with the GEMMs'. */
static void count_sparse(fg_call *call, double t0, int64_t kept, int64_t H)
{
    call->gemm_stats.seconds += omp_get_wtime() - t0;
    call->gemm_stats.flops += 2 * kept * H;
}

static fg_status cpu_dhidden(void *be, const fg_backend_call *c, int64_t r0, int64_t m, char *msg,
                             size_t n)
{
    (void)r0;
    fg_cpu_backend *s = state(be);
    if (s->kept_total >= 0) { /* filtered: the kept entries' rows of the weight */
        const double t0 = omp_get_wtime();
        fg_kept_dhidden(s->call->threads, &s->kept, c->weight.data, c->in_t, c->weight.ld, c->H,
                        c->ghbuf, c->H);
        count_sparse(s->call, t0, s->kept_total, c->H);
        return FG_OK;
    }
    const fg_gemm_shape g = shape_dhidden(s, c, m);
    return failed(s,
                  fg_gemm_run(s->call->gemm, &g, c->dlogits, c->weight.data, c->ghbuf, NULL,
                              c->scratch, c->workers, &s->call->gemm_stats, s->call->err),
                  msg, n);
}

/* ghbuf's float32 rows into grad_hidden, rounded once to a bf16 one. */
static fg_status cpu_put_grad_hidden(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                                     char *msg, size_t n)
{
    (void)be, (void)msg, (void)n;
    for (int64_t i = 0; i < m; i++) {
        const float *src = c->ghbuf + (size_t)i * (size_t)c->H;
        void *dst = row_at(&c->grad_hidden, c->rows[r0 + i]);
        if (c->grad_hidden.dtype == FG_DTYPE_BF16)
            for (int64_t h = 0; h < c->H; h++)
                ((uint16_t *)dst)[h] = fg_bf16_store(src[h]);
        else
            memcpy(dst, src, (size_t)c->H * sizeof(float));
    }
    return FG_OK;
}

static fg_status cpu_grads(void *be, const fg_backend_call *c, int64_t r0, int64_t m, int first,
                           char *msg, size_t n)
{
    fg_cpu_backend *s = state(be);
    fg_status st;
    if (c->grad_hidden.data && ((st = cpu_dhidden(be, c, r0, m, msg, n)) != FG_OK ||
                                (st = cpu_put_grad_hidden(be, c, r0, m, msg, n)) != FG_OK))
        return st;
    if (!c->grad_weight.data)
        return FG_OK;
    void *dst = c->gw_sum ? (void *)c->gw_sum : c->grad_weight.data;
    if (s->kept_total >= 0) { /* filtered: a float32 destination (the plan's) */
        const double t0 = omp_get_wtime();
        fg_kept_dweight(s->call->threads, &s->kept, c->hbuf, c->dlogit_t, c->H, c->H, dst,
                        c->gw_sum ? c->H : c->grad_weight.ld, !first);
        count_sparse(s->call, t0, s->kept_total, c->H);
        return FG_OK;
    }
    const fg_gemm_shape g = shape_dweight(s, c, m, !first);
    return failed(s,
                  fg_gemm_run(s->call->gemm, &g, c->dlogits, c->hbuf, dst, NULL, c->scratch,
                              c->workers, &s->call->gemm_stats, s->call->err),
                  msg, n);
}

static fg_status cpu_finish(void *be, const fg_backend_call *c, char *msg, size_t n)
{
    (void)msg, (void)n;
    const int threads = state(be)->call->threads;
    const fg_matrix *gw = &c->grad_weight;
    if (gw->data && c->gw_sum && c->n_active > 0)
        fg_sweep_round_bf16(threads, c->gw_sum, c->H, gw->data, gw->ld, c->V, c->H,
                            c->accumulate);
    if (gw->data && c->n_active == 0 && !c->accumulate)
        for (int64_t v = 0; v < c->V; v++)
            memset(row_at(gw, v), 0, (size_t)c->H * fg_dtype_size(gw->dtype));
    const fg_vector *gb = &c->grad_bias; /* the sums started from the caller's values */
    if (gb->data && gb->dtype == FG_DTYPE_BF16)
        for (int64_t v = 0; v < c->V; v++)
            ((uint16_t *)gb->data)[v] = fg_bf16_store(c->gb_sum[v]);
    else if (gb->data)
        memcpy(gb->data, c->gb_sum, (size_t)c->V * sizeof(float));
    const fg_matrix *gh = &c->grad_hidden;
    if (gh->data)
        for (int64_t r = 0; r < c->N; r++)
            if (!c->mask[r])
                memset(row_at(gh, r), 0, (size_t)c->H * fg_dtype_size(gh->dtype));
    return FG_OK;
}

static const fg_backend_ops cpu_ops = {
    .abi = FG_BACKEND_ABI,
    .name = "cpu",
    .caps = FG_BACKEND_HOST_MEMORY | FG_BACKEND_FIXED_ROW_BITS | FG_BACKEND_THREAD_INVARIANT,
    .align = FG_ALIGN,
    .logits_block_rows = FG_BLOCK_LOGITS_M,
    .fast_chunk_rows = 0,
    .destroy = fg_host_destroy,
    .alloc = fg_host_alloc,
    .release = fg_host_release,
    .to_host = fg_host_copy,
    .to_device = fg_host_copy,
    .fill_zero = fg_host_fill_zero,
    .wait = fg_host_wait,
    .compute_dtype = cpu_compute_dtype,
    .call_scratch_bytes = cpu_call_scratch,
    .chunk_scratch = cpu_chunk_scratch,
    .chunk_slow = cpu_chunk_slow,
    .supports = cpu_supports,
    .scan = cpu_scan,
    .logits = cpu_logits,
    .stats = cpu_stats,
    .backward = cpu_backward,
    .grads = cpu_grads,
    .finish = cpu_finish,
    .stats_backward = cpu_stats_backward,
    .shard_stats = cpu_shard_stats,
    .dhidden = cpu_dhidden,
    .put_grad_hidden = cpu_put_grad_hidden,
    .filter = cpu_filter,
};

void fg_backend_cpu_init(fg_cpu_backend *s, fg_call *call, fg_device *out)
{
    memset(s, 0, sizeof *s);
    s->call = call;
    s->kept_total = -1;
    out->ops = &cpu_ops;
    out->state = s;
}
