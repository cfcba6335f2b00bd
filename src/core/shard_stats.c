/* Exact merge of vocab shards' row statistics (see shard_stats.h). */
#include <math.h>

#include "shard_stats.h"

static float *max_row(float *buf, int64_t c)
{
    (void)c;
    return buf;
}
static float *tok_row(float *buf, int64_t c) { return buf + c; }
static float *limb_row(float *buf, int64_t c, int k) { return buf + fg_shard_sum_offset(c) + k * c; }
static float *local_row(float *buf, int64_t c, int k) { return buf + fg_shard_local_offset(c) + k * c; }

void fg_shard_put_local(float *buf, int64_t c, int64_t i, fg_row_stats s, float z_tok)
{
    max_row(buf, c)[i] = local_row(buf, c, 0)[i] = s.max;
    tok_row(buf, c)[i] = z_tok;
    local_row(buf, c, 1)[i] = s.sum;
    local_row(buf, c, 2)[i] = s.dot;
}

void fg_shard_put_empty(float *buf, int64_t c, int64_t i)
{
    fg_row_stats none = {-INFINITY, 0.0f, 0.0f};
    fg_shard_put_local(buf, c, i, none, -INFINITY);
}

/* x rounded to a fixed-point integer, written as FG_SHARD_LIMBS signed limbs
 * (sign and magnitude: every limb carries the sign). |x| < 2^31 here: a sum
 * over at most V exp(≤ 0) terms. */
static void put_limbs(double x, float *first, int64_t stride)
{
    if (!(fabs(x) < 0x1p31)) {
        for (int k = 0; k < FG_SHARD_LIMBS; k++)
            first[k * stride] = NAN;
        return;
    }
    const double q = nearbyint(ldexp(x, FG_SHARD_FRAC_BITS));
    const float sign = q < 0 ? -1.0f : 1.0f;
    uint64_t a = (uint64_t)fabs(q);
    for (int k = 0; k < FG_SHARD_LIMBS; k++, a >>= FG_SHARD_LIMB_BITS)
        first[k * stride] = sign * (float)(a & ((1u << FG_SHARD_LIMB_BITS) - 1));
}

/* The integer a column of summed limbs stands for, as a double; -1 in *bad
 * when a limb cannot be a sum of FG_SHARD_MAX_SHARDS limbs. The limbs are
 * added in 64-bit two's complement: partial sums may wrap, the total (below
 * 2^63 for any vocabulary under 2^31 rows) does not. */
static double get_limbs(const float *first, int64_t stride, int *bad)
{
    const float lim = (float)FG_SHARD_MAX_SHARDS * (float)((1u << FG_SHARD_LIMB_BITS) - 1);
    uint64_t q = 0;
    for (int k = 0; k < FG_SHARD_LIMBS; k++) {
        const float l = first[k * stride];
        if (isnan(l)) {
            *bad = *bad ? *bad : 2;
            return 0;
        }
        if (!(fabsf(l) <= lim) || l != nearbyintf(l)) {
            *bad = 1;
            return 0;
        }
        q += (uint64_t)(int64_t)l << (k * FG_SHARD_LIMB_BITS);
    }
    return ldexp((double)(int64_t)q, -FG_SHARD_FRAC_BITS);
}

void fg_shard_encode(float *buf, int64_t c, int64_t i)
{
    const float M = max_row(buf, c)[i], m = local_row(buf, c, 0)[i];
    double s = 0, d = 0;
    if (!isfinite(M) && M != -INFINITY) {
        s = d = NAN; /* NaN/Inf logits on some shard: decode reports them */
    } else if (m != -INFINITY) { /* a shard without rows, or a masked token, adds 0 */
        const double shift = (double)m - (double)M, f = exp(shift);
        s = (double)local_row(buf, c, 1)[i] * f;
        d = ((double)local_row(buf, c, 2)[i] + shift * (double)local_row(buf, c, 1)[i]) * f;
    }
    put_limbs(s, limb_row(buf, c, 0) + i, c);
    put_limbs(d, limb_row(buf, c, FG_SHARD_LIMBS) + i, c);
}

int fg_shard_decode(const float *buf, int64_t c, int64_t i, float *zmax, float *lsum,
                    float *logp, float *entropy)
{
    float *b = (float *)buf; /* the row helpers do not write */
    int bad = 0;
    const double S = get_limbs(limb_row(b, c, 0) + i, c, &bad);
    const double D = get_limbs(limb_row(b, c, FG_SHARD_LIMBS) + i, c, &bad);
    if (bad)
        return bad == 2 ? -2 : -1;
    const float M = max_row(b, c)[i];
    const double ls = log(S);
    *zmax = M;
    *lsum = (float)ls;
    *logp = (tok_row(b, c)[i] - M) - *lsum;
    *entropy = (float)(ls - D / S);
    return 0;
}

void fg_shard_keep_merged(float *buf, int64_t c, int64_t n, float lsum, float entropy)
{
    local_row(buf, c, 0)[n] = lsum;
    local_row(buf, c, 1)[n] = entropy;
}

void fg_shard_merged_at(const float *buf, int64_t c, int64_t n, float *zmax, float *lsum,
                        float *entropy)
{
    float *b = (float *)buf;
    *zmax = max_row(b, c)[n];
    *lsum = local_row(b, c, 0)[n];
    *entropy = local_row(b, c, 1)[n];
}
