/* Gradient filtering: see grad_filter.h. Rows are split across threads for
 * select, compact and dhidden; vocab blocks for dweight. Every output row is
 * summed by one thread in a fixed order. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "bf16.h"
#include "cpu_dispatch.h"
#include "grad_filter.h"

/* A row of a sampled distribution keeps far fewer (SmolLM2's completions at
 * eps 1e-5: 586 of 49,152 on average, 3,831 at most); a row near uniform
 * keeps nearly all, and then the GEMMs are faster. The kept ids take V/2
 * bytes per chunk row, an eighth of its f32 logits. */
int64_t fg_kept_cap(int64_t V) { return V / 8 > 1 ? V / 8 : 1; }

/* FG_FILTER_EPS_AUTO, chosen by measurement on SmolLM2's own completions
 * (docs/BENCHMARKS.md "Gradient filtering"): for bf16 storage, 1e-5 drops
 * ~99% of the entries, with grad_hidden within 6.7e-3 and grad_weight within
 * 3e-4 of the exact gradient (relative L2), a few times the bf16 rounding of
 * the gradient itself. float32 storage asks for float32 accuracy, which no
 * threshold that pays gives: off. */
double fg_filter_eps_auto(fg_dtype dtype) { return dtype == FG_DTYPE_BF16 ? 1e-5 : 0.0; }

#define ALWAYS_INLINE inline __attribute__((always_inline))

static ALWAYS_INLINE float load(const void *x, int bf, int64_t i)
{
    return bf ? fg_bf16_load(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static void *row_of(const fg_kept *k, int64_t i)
{
    return (unsigned char *)k->d + (size_t)i * (size_t)k->d_ld * fg_dtype_size(k->d_t);
}

static ALWAYS_INLINE float row_absmax_impl(const void *x, int bf, int64_t n)
{
    enum { L = 16 };
    float m[L] = {0};
    int64_t i = 0;
    for (; i + L <= n; i += L)
        for (int l = 0; l < L; l++) {
            const float a = fabsf(load(x, bf, i + l));
            m[l] = a > m[l] ? a : m[l];
        }
    for (; i < n; i++) {
        const float a = fabsf(load(x, bf, i));
        m[0] = a > m[0] ? a : m[0];
    }
    float r = m[0];
    for (int l = 1; l < L; l++)
        r = m[l] > r ? m[l] : r;
    return r;
}

/* Row i's kept ids into idx (at most cap of them); returns how many it
 * keeps, which may exceed cap. */
FG_CPU_CLONES
static int64_t select_row_isa(const void *x, fg_dtype t, int64_t n, int64_t target, double eps,
                              int32_t *idx, int64_t cap)
{
    const int bf = t == FG_DTYPE_BF16;
    const float thr = (float)(eps * (double)(bf ? row_absmax_impl(x, 1, n) : row_absmax_impl(x, 0, n)));
    int64_t c = 0;
    for (int64_t v = 0; v < n; v++) {
        if (fabsf(load(x, bf, v)) > thr || v == target) {
            if (c < cap)
                idx[c] = (int32_t)v;
            c++;
        }
    }
    return c;
}

int64_t fg_filter_select(int threads, fg_kept *k, double eps, int64_t *dense_rows)
{
    int64_t total = 0, over = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total, over)
    for (int64_t i = 0; i < k->count; i++) {
        const int64_t c = select_row_isa(row_of(k, i), k->d_t, k->V, k->target[i], eps,
                                         k->idx + (size_t)i * (size_t)k->cap, k->cap);
        k->nnz[i] = c <= k->cap ? (int32_t)c : -1;
        total += c <= k->cap ? c : k->V;
        over += c > k->cap;
    }
    *dense_rows = over;
    return total;
}

void fg_filter_zero_dropped(int threads, fg_kept *k)
{
    const size_t es = fg_dtype_size(k->d_t);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < k->count; i++) {
        if (k->nnz[i] < 0) /* the row keeps every entry */
            continue;
        unsigned char *d = row_of(k, i);
        const int32_t *idx = k->idx + (size_t)i * (size_t)k->cap;
        int64_t v = 0;
        for (int32_t j = 0; j <= k->nnz[i]; j++) { /* the gap before idx[j], then idx[j] kept */
            const int64_t end = j < k->nnz[i] ? idx[j] : k->V;
            memset(d + (size_t)v * es, 0, (size_t)(end - v) * es);
            v = end + 1;
        }
    }
}

void fg_filter_compact(int threads, fg_kept *k)
{
    const size_t es = fg_dtype_size(k->d_t);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < k->count; i++) {
        unsigned char *d = row_of(k, i);
        const int32_t *idx = k->idx + (size_t)i * (size_t)k->cap;
        for (int32_t j = 0; j < k->nnz[i]; j++) /* j <= idx[j]: never overwrites one unread */
            memmove(d + (size_t)j * es, d + (size_t)idx[j] * es, es);
    }
}

/* y[0..n) += a · x[0..n), x float32 or bfloat16. */
static ALWAYS_INLINE void axpy(float a, const void *x, int bf, float *restrict y, int64_t n)
{
    if (bf) {
        const uint16_t *restrict xb = x;
        for (int64_t h = 0; h < n; h++)
            y[h] += a * fg_bf16_load(xb[h]);
    } else {
        const float *restrict xf = x;
        for (int64_t h = 0; h < n; h++)
            y[h] += a * xf[h];
    }
}

FG_CPU_CLONES
static void dhidden_row_isa(const void *d, fg_dtype d_t, const int32_t *idx, int64_t nnz,
                            const void *w, fg_dtype w_t, int64_t w_ld, int64_t H, float *gh)
{
    const int dbf = d_t == FG_DTYPE_BF16, wbf = w_t == FG_DTYPE_BF16;
    const size_t wrow = (size_t)w_ld * fg_dtype_size(w_t);
    memset(gh, 0, (size_t)H * sizeof *gh);
    for (int64_t j = 0; j < nnz; j++) {
        const void *wr = (const unsigned char *)w + (size_t)idx[j] * wrow;
        if (wbf)
            axpy(load(d, dbf, j), wr, 1, gh, H);
        else
            axpy(load(d, dbf, j), wr, 0, gh, H);
    }
}

void fg_kept_dhidden(int threads, const fg_kept *k, const void *w, fg_dtype w_t, int64_t w_ld,
                     int64_t H, float *gh, int64_t gh_ld)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < k->count; i++)
        dhidden_row_isa(row_of(k, i), k->d_t, k->idx + (size_t)i * (size_t)k->cap, k->nnz[i], w,
                        w_t, w_ld, H, gh + (size_t)i * (size_t)gh_ld);
}

/* First j with idx[j] >= v. */
static int64_t lower_bound(const int32_t *idx, int64_t n, int64_t v)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (idx[mid] < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* grad_weight rows [v0, v1): every row's entries in that range, rows in order. */
FG_CPU_CLONES
static void dweight_block_isa(const fg_kept *k, int64_t v0, int64_t v1, const void *h,
                              fg_dtype h_t, int64_t h_ld, int64_t H, float *gw, int64_t gw_ld,
                              int add)
{
    const int dbf = k->d_t == FG_DTYPE_BF16, hbf = h_t == FG_DTYPE_BF16;
    const size_t hrow = (size_t)h_ld * fg_dtype_size(h_t);
    if (!add)
        for (int64_t v = v0; v < v1; v++)
            memset(gw + (size_t)v * (size_t)gw_ld, 0, (size_t)H * sizeof *gw);
    for (int64_t i = 0; i < k->count; i++) {
        const int32_t *idx = k->idx + (size_t)i * (size_t)k->cap;
        const void *d = row_of(k, i);
        const void *hr = (const unsigned char *)h + (size_t)i * hrow;
        for (int64_t j = lower_bound(idx, k->nnz[i], v0); j < k->nnz[i] && idx[j] < v1; j++) {
            float *y = gw + (size_t)idx[j] * (size_t)gw_ld;
            if (hbf)
                axpy(load(d, dbf, j), hr, 1, y, H);
            else
                axpy(load(d, dbf, j), hr, 0, y, H);
        }
    }
}

/* grad_weight rows per block: about 256 KiB of them, so that a block's rows
 * stay in L2 while every chunk row adds to them. */
static int64_t dweight_block_rows(int64_t H)
{
    const int64_t r = (256 * 1024) / (H * (int64_t)sizeof(float));
    return r < 8 ? 8 : r;
}

void fg_kept_dweight(int threads, const fg_kept *k, const void *h, fg_dtype h_t, int64_t h_ld,
                     int64_t H, float *gw, int64_t gw_ld, int add)
{
    const int64_t rows = dweight_block_rows(H), blocks = (k->V + rows - 1) / rows;
    /* Kept entries crowd into the frequent tokens' rows: dynamic blocks even
     * the load out. */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t v0 = b * rows, v1 = v0 + rows < k->V ? v0 + rows : k->V;
        dweight_block_isa(k, v0, v1, h, h_t, h_ld, H, gw, gw_ld, add);
    }
}
