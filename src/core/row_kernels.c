/* Row kernels: see row_kernels.h. The loops are written as 16 independent
 * lanes so that GCC vectorizes them without reassociation flags; the lane
 * partial sums are combined in a fixed order, so results do not depend on the
 * thread count or on how rows are partitioned. */
#include <string.h>

#include "bf16.h"
#include "cpu_dispatch.h"
#include "fast_exp.h"
#include "row_kernels.h"

#define LANES 16
#define BLOCK 512 /* elements per max-then-exp block: stays in L1 */

#define ALWAYS_INLINE inline __attribute__((always_inline))

static ALWAYS_INLINE float load(const void *x, int bf, int64_t i)
{
    return bf ? fg_bf16_load(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static ALWAYS_INLINE void store(void *x, int bf, int64_t i, float v)
{
    if (bf)
        ((uint16_t *)x)[i] = fg_bf16_store(v);
    else
        ((float *)x)[i] = v;
}

static ALWAYS_INLINE float block_max(const void *x, int bf, int64_t i0, int64_t len)
{
    float mx[LANES];
    for (int l = 0; l < LANES; l++)
        mx[l] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= len; i += LANES)
        for (int l = 0; l < LANES; l++) {
            float v = load(x, bf, i0 + i + l);
            mx[l] = v > mx[l] ? v : mx[l];
        }
    for (; i < len; i++) {
        float v = load(x, bf, i0 + i);
        mx[0] = v > mx[0] ? v : mx[0];
    }
    float m = mx[0];
    for (int l = 1; l < LANES; l++)
        m = mx[l] > m ? mx[l] : m;
    return m;
}

static ALWAYS_INLINE fg_row_stats stats_impl(const void *x, int bf, int64_t n, float s)
{
    float m = -INFINITY;
    float acc_s[LANES], acc_t[LANES];
    for (int l = 0; l < LANES; l++)
        acc_s[l] = acc_t[l] = 0;
    for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
        const int64_t len = n - i0 < BLOCK ? n - i0 : BLOCK;
        /* inv_temp > 0, so max(x)·s is max(x·s) exactly. */
        const float bm = block_max(x, bf, i0, len) * s;
        if (bm > m) {
            if (m != -INFINITY) {
                const float shift = m - bm, a = expf(shift);
                for (int l = 0; l < LANES; l++) {
                    acc_t[l] = (acc_t[l] + acc_s[l] * shift) * a;
                    acc_s[l] *= a;
                }
            }
            m = bm;
        }
        int64_t i = 0;
        for (; i + LANES <= len; i += LANES)
            for (int l = 0; l < LANES; l++) {
                const float u = load(x, bf, i0 + i + l) * s - m;
                const float e = fg_expf(u);
                acc_s[l] += e;
                acc_t[l] += e * u;
            }
        for (; i < len; i++) {
            const float u = load(x, bf, i0 + i) * s - m;
            const float e = fg_expf(u);
            acc_s[i % LANES] += e;
            acc_t[i % LANES] += e * u;
        }
    }
    fg_row_stats r = {m, 0, 0};
    for (int l = 0; l < LANES; l++) {
        r.sum += acc_s[l];
        r.dot += acc_t[l];
    }
    return r;
}

/* The cloned functions are static: GCC exports the ifunc of an extern clone
 * whatever its visibility, and the library exports only its public API. */
FG_CPU_CLONES
static fg_row_stats row_stats_isa(const void *x, fg_dtype dtype, int64_t n, float inv_temp)
{
    return dtype == FG_DTYPE_BF16 ? stats_impl(x, 1, n, inv_temp) : stats_impl(x, 0, n, inv_temp);
}

static ALWAYS_INLINE void backward_impl(const void *x, int xbf, void *out, int obf, int64_t n,
                                        float s, float zmax, float lsum, float ent, float g,
                                        float e, int64_t tok)
{
    /* Read the chosen logit before an in-place pass overwrites it. */
    const float z_tok = tok >= 0 ? load(x, xbf, tok) * s : 0.0f;
    if (e == 0.0f) {
        const float c = -g * s;
        for (int64_t i = 0; i < n; i++) {
            const float p = fg_expf((load(x, xbf, i) * s - zmax) - lsum);
            store(out, obf, i, c * p);
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            const float lp = (load(x, xbf, i) * s - zmax) - lsum;
            const float p = fg_expf(lp);
            store(out, obf, i, (-g * p - e * p * (lp + ent)) * s);
        }
    }
    if (tok >= 0) {
        const float lp = (z_tok - zmax) - lsum, p = fg_expf(lp);
        store(out, obf, tok, (g * (1.0f - p) - e * p * (lp + ent)) * s);
    }
}

FG_CPU_CLONES
static void row_backward_isa(const void *x, fg_dtype xtype, void *out, fg_dtype otype, int64_t n,
                             float inv_temp, float zmax, float lsum, float entropy, float g,
                             float e, int64_t tok)
{
    const int xb = xtype == FG_DTYPE_BF16, ob = otype == FG_DTYPE_BF16;
    if (xb && ob)
        backward_impl(x, 1, out, 1, n, inv_temp, zmax, lsum, entropy, g, e, tok);
    else if (xb)
        backward_impl(x, 1, out, 0, n, inv_temp, zmax, lsum, entropy, g, e, tok);
    else if (ob)
        backward_impl(x, 0, out, 1, n, inv_temp, zmax, lsum, entropy, g, e, tok);
    else
        backward_impl(x, 0, out, 0, n, inv_temp, zmax, lsum, entropy, g, e, tok);
}

FG_CPU_CLONES
static void col_sums_add_isa(const void *d, fg_dtype dtype, int64_t rows, int64_t ld, int64_t c0,
                             int64_t c1, float *acc)
{
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == FG_DTYPE_BF16) {
            const uint16_t *row = (const uint16_t *)d + r * ld;
            for (int64_t c = c0; c < c1; c++)
                acc[c] += fg_bf16_load(row[c]);
        } else {
            const float *row = (const float *)d + r * ld;
            for (int64_t c = c0; c < c1; c++)
                acc[c] += row[c];
        }
    }
}

FG_CPU_CLONES
static void bf16_to_f32_isa(float *dst, const uint16_t *src, int64_t n, int64_t stride)
{
    if (stride == 1) {
        for (int64_t i = 0; i < n; i++)
            dst[i] = fg_bf16_load(src[i]);
    } else {
        for (int64_t i = 0; i < n; i++)
            dst[i] = fg_bf16_load(src[i * stride]);
    }
}

fg_row_stats fg_row_stats_compute(const void *x, fg_dtype dtype, int64_t n, float inv_temp)
{
    return row_stats_isa(x, dtype, n, inv_temp);
}

void fg_row_backward(const void *x, fg_dtype xtype, void *out, fg_dtype otype, int64_t n,
                     float inv_temp, float zmax, float lsum, float entropy, float g, float e,
                     int64_t tok)
{
    row_backward_isa(x, xtype, out, otype, n, inv_temp, zmax, lsum, entropy, g, e, tok);
}

void fg_col_sums_add(const void *d, fg_dtype dtype, int64_t rows, int64_t ld, int64_t c0,
                     int64_t c1, float *acc)
{
    col_sums_add_isa(d, dtype, rows, ld, c0, c1, acc);
}

void fg_bf16_to_f32_strided(float *dst, const uint16_t *src, int64_t n, int64_t stride)
{
    bf16_to_f32_isa(dst, src, n, stride);
}
