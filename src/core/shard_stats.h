/*
 * Row statistics of a vocab-sharded LM head, merged exactly.
 *
 * Each shard s holds, per token, the statistics of its own vocab rows
 * (row_kernels.h): m_s = max z, S_s = Σ exp(z − m_s), D_s = Σ exp(z − m_s)(z − m_s),
 * and the token's logit z_tok if the token is one of its rows (−inf if not).
 * Two reductions merge them:
 *   MAX:  M = max_s m_s and z_tok: a max is exact, whatever the order;
 *   SUM:  S = Σ_s e^(m_s − M) S_s,  D = Σ_s e^(m_s − M) (D_s + (m_s − M) S_s).
 * A float sum of the second kind would depend on the reduction's order, which
 * differs between allreduce algorithms, rank counts and even ranks of one
 * reduction. So each shard rounds its two terms to fixed point
 * (FG_SHARD_FRAC_BITS fractional bits, |term| < 2^31) and writes each as
 * FG_SHARD_LIMBS signed 16-bit limbs stored in floats. Any float SUM of up to
 * FG_SHARD_MAX_SHARDS such limbs stays below 2^24 and is exact, so every
 * allreduce (MPI, gloo, lax.psum, a ring or a tree) and every rank get the same
 * integers, and the decode gives the same bits everywhere. The rounding is
 * 2^-33 absolute per shard on S >= 1 (the shard holding M contributes e^0):
 * far below float precision.
 *
 * Layout of the `count` tokens' statistics in one float buffer (one chunk of
 * the one-call hook, or a whole [B, T] batch of the phase API):
 *   [0, 2c + 1)       reduced by MAX: max [c], z_tok [c], a status slot
 *   [2c + 1, 10c + 1) reduced by SUM: 2 sums x FG_SHARD_LIMBS limbs [c] each
 *   [10c + 1, 13c + 1) this shard's own m_s, S_s, D_s [c] (not reduced); after
 *                     the merge, the token's lsum and entropy (phase API)
 */
#ifndef FG_SHARD_STATS_H
#define FG_SHARD_STATS_H

#include <stdint.h>

#include "row_kernels.h"

#define FG_SHARD_LIMBS 4
#define FG_SHARD_LIMB_BITS 16
#define FG_SHARD_FRAC_BITS 32
#define FG_SHARD_MAX_SHARDS 256

static inline int64_t fg_shard_max_count(int64_t c) { return 2 * c + 1; }
static inline int64_t fg_shard_sum_offset(int64_t c) { return 2 * c + 1; }
static inline int64_t fg_shard_sum_count(int64_t c) { return 2 * FG_SHARD_LIMBS * c; }
static inline int64_t fg_shard_local_offset(int64_t c) { return (2 + 2 * FG_SHARD_LIMBS) * c + 1; }
static inline int64_t fg_shard_floats(int64_t c) { return (5 + 2 * FG_SHARD_LIMBS) * c + 1; }

/* Token i's own statistics and chosen logit (−inf: another shard's). */
void fg_shard_put_local(float *buf, int64_t c, int64_t i, fg_row_stats s, float z_tok);

/* A token with nothing to merge (masked): −inf maxima, zero sums. */
void fg_shard_put_empty(float *buf, int64_t c, int64_t i);

/* After the MAX: token i's sums rescaled to the merged max, as limbs. */
void fg_shard_encode(float *buf, int64_t c, int64_t i);

/* After the SUM: token i's merged statistics. Returns 0, -1 when a limb is
 * not an integer a SUM of at most FG_SHARD_MAX_SHARDS limbs can give, -2
 * when a shard's statistics were not finite (NaN/Inf logits). */
int fg_shard_decode(const float *buf, int64_t c, int64_t i, float *zmax, float *lsum,
                    float *logp, float *entropy);

/* The phase API keeps the merged lsum and entropy of token n in the rows of
 * its own statistics, which the merge no longer needs. */
void fg_shard_keep_merged(float *buf, int64_t c, int64_t n, float lsum, float entropy);
void fg_shard_merged_at(const float *buf, int64_t c, int64_t n, float *zmax, float *lsum,
                        float *entropy);

#endif
