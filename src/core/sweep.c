/* Sweeps over blocks of logit rows (see sweep.h). Rows are split across
 * threads in contiguous static blocks; each row is computed by one thread
 * from start to end, so results are the same for any thread count. */
#include <math.h>
#include <omp.h>

#include "bf16.h"
#include "row_kernels.h"
#include "shard_stats.h"
#include "sweep.h"

static const void *row_ptr(const void *base, fg_dtype t, int64_t ld, int64_t r)
{
    return (const unsigned char *)base + (size_t)r * (size_t)ld * fg_dtype_size(t);
}

static int64_t row_index(const fg_rows *rows, int64_t i) { return rows->by_token ? rows->token[i] : i; }

/* Row-local index of token n's chosen id, or -1 when another shard holds it. */
static int64_t local_token(const fg_loss_plan *plan, const fg_rows *rows, int64_t n)
{
    const int64_t tok = plan->token_ids[n] - rows->vocab_start;
    return tok >= 0 && tok < rows->V ? tok : -1;
}

/* Row i's statistics and its chosen logit (-inf when not in this shard). */
static fg_row_stats row_stats(const fg_loss_plan *plan, const fg_rows *rows, int64_t i,
                              float inv_temp, float *z_tok)
{
    const void *x = row_ptr(rows->x, rows->xtype, rows->x_ld, row_index(rows, i));
    const int64_t tok = local_token(plan, rows, rows->token[i]);
    *z_tok = tok < 0 ? -INFINITY
                     : (rows->xtype == FG_DTYPE_BF16 ? fg_bf16_load(((const uint16_t *)x)[tok])
                                                     : ((const float *)x)[tok]) * inv_temp;
    return fg_row_stats_compute(x, rows->xtype, rows->V, inv_temp);
}

/* lse, logp, entropy of token n from its (merged) statistics. */
static void finalize_row(int64_t n, fg_row_stats s, float z_tok, const fg_token_arrays *ta)
{
    fg_row_finalize(s, z_tok, &ta->zmax[n], &ta->lsum[n], &ta->logp[n], &ta->entropy[n]);
}

static void forward_row(const fg_loss_plan *plan, const fg_rows *rows, int64_t i, float inv_temp,
                        const fg_token_arrays *ta)
{
    float z_tok;
    fg_row_stats s = row_stats(plan, rows, i, inv_temp, &z_tok);
    finalize_row(rows->token[i], s, z_tok, ta);
}

static void backward_row(const fg_loss_plan *plan, const fg_rows *rows, int64_t i, float inv_temp,
                         const fg_token_arrays *ta)
{
    const int64_t n = rows->token[i];
    const float g = fg_loss_dlogp(plan, n, ta->logp[n], ta->entropy[n]);
    const int64_t r = row_index(rows, i);
    fg_row_backward(row_ptr(rows->x, rows->xtype, rows->x_ld, r), rows->xtype,
                    (void *)row_ptr(rows->dx, rows->dxtype, rows->dx_ld, r), rows->dxtype, rows->V,
                    inv_temp, ta->zmax[n], ta->lsum[n], ta->entropy[n], g, fg_loss_dentropy(plan, n, ta->entropy[n]),
                    local_token(plan, rows, n));
}

void fg_sweep_forward(int threads, const fg_loss_plan *plan, const fg_rows *rows,
                      float inv_temp, const fg_token_arrays *ta)
{
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < rows->count; i++)
        forward_row(plan, rows, i, inv_temp, ta);
}

int fg_sweep_shard_merged(const fg_rows *rows, const float *buf, const fg_token_arrays *ta)
{
    const int64_t c = rows->count;
    for (int64_t i = 0; i < c; i++) {
        const int64_t n = rows->token[i];
        const int r = fg_shard_decode(buf, c, i, &ta->zmax[n], &ta->lsum[n], &ta->logp[n],
                                      &ta->entropy[n]);
        if (r == -1)
            return -1;
        if (r == -2) /* non-finite statistics: as an unsharded sweep gives them */
            ta->zmax[n] = ta->lsum[n] = ta->logp[n] = ta->entropy[n] = NAN;
    }
    return 0;
}

void fg_sweep_backward(int threads, const fg_loss_plan *plan, const fg_rows *rows,
                       float inv_temp, const fg_token_arrays *ta)
{
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < rows->count; i++)
        backward_row(plan, rows, i, inv_temp, ta);
}

void fg_sweep_column_sums(int threads, const fg_rows *rows, float *acc)
{
    const int nt = threads;
    const int64_t V = rows->V;
#pragma omp parallel num_threads(nt)
    {
        /* ith/nth column split; 16-column granules keep threads off each
         * other's cache lines. */
        const int64_t ith = omp_get_thread_num(), nth = omp_get_num_threads();
        const int64_t granules = (V + 15) / 16;
        const int64_t g0 = granules * ith / nth, g1 = granules * (ith + 1) / nth;
        const int64_t c0 = g0 * 16, c1 = g1 * 16 < V ? g1 * 16 : V;
        if (c0 < c1)
            fg_col_sums_add(rows->dx, rows->dxtype, rows->count, rows->dx_ld, c0, c1, acc);
    }
}

void fg_sweep_round_bf16(int threads, const float *src, int64_t src_ld, uint16_t *dst,
                         int64_t dst_ld, int64_t rows, int64_t cols, int add)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *s = src + (size_t)r * (size_t)src_ld;
        uint16_t *d = dst + (size_t)r * (size_t)dst_ld;
        if (add)
            for (int64_t c = 0; c < cols; c++)
                d[c] = fg_bf16_store(s[c] + fg_bf16_load(d[c]));
        else
            for (int64_t c = 0; c < cols; c++)
                d[c] = fg_bf16_store(s[c]);
    }
}
