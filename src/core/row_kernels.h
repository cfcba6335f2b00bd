/*
 * Per-row work over the vocabulary, shared by every path: the streaming
 * statistics of one row of logits (one pass: online max, Σ exp, Σ exp·z) and
 * the row of d loss / d logits. A row is a contiguous run of V values in
 * float32 or bfloat16; z = x · inv_temp.
 */
#ifndef FG_ROW_KERNELS_H
#define FG_ROW_KERNELS_H

#include <math.h>

#include "fusedgrpo.h"

/* Mergeable row statistics: sum = Σ exp(z − max), dot = Σ exp(z − max)·(z − max).
 * Keeping dot relative to max avoids the cancellation of lse − Σ p z when the
 * logits are large. Vocab shards of one row merge exactly in shard_stats.c. */
typedef struct fg_row_stats {
    float max, sum, dot;
} fg_row_stats;

fg_row_stats fg_row_stats_compute(const void *x, fg_dtype dtype, int64_t n, float inv_temp);

static inline float fg_row_lse(fg_row_stats s) { return s.max + logf(s.sum); }
static inline float fg_row_entropy(fg_row_stats s) { return logf(s.sum) - s.dot / s.sum; }

/* A row's lse as zmax + lsum, its target's log-prob from the target's
 * logit z_tok (-inf: another shard's) and its entropy: every path's. */
static inline void fg_row_finalize(fg_row_stats s, float z_tok, float *zmax, float *lsum,
                                   float *logp, float *entropy)
{
    const float l = logf(s.sum);
    *zmax = s.max;
    *lsum = l;
    *logp = (z_tok - s.max) - l;
    *entropy = fg_row_entropy(s);
}

/* out_v = ∂loss/∂x_v = inv_temp · [ g (δ_v,tok − p_v) − e p_v (log p_v + entropy) ],
 * p_v = exp((z_v − zmax) − lsum), lse = zmax + lsum (see fg_token_arrays).
 * tok is the row-local index of the chosen token, or −1 when it lies outside
 * this row (another vocab shard). out may alias x when the dtypes match (in
 * place). */
void fg_row_backward(const void *x, fg_dtype xtype, void *out, fg_dtype otype, int64_t n,
                     float inv_temp, float zmax, float lsum, float entropy, float g, float e,
                     int64_t tok);

/* acc[c] += Σ_r d[r, c] for c in [c0, c1): the bias gradient's column sums,
 * rows summed in order (deterministic whatever the column partition). */
void fg_col_sums_add(const void *d, fg_dtype dtype, int64_t rows, int64_t ld, int64_t c0,
                     int64_t c1, float *acc);

/* dst[i] = bf16 src[i * stride] widened to f32, i in [0, n): the weight tiles
 * and gathered hidden rows of bf16 inputs on CPUs without native bf16 GEMMs. */
void fg_bf16_to_f32_strided(float *dst, const uint16_t *src, int64_t n, int64_t stride);

#endif
