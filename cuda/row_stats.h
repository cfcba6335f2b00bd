/*
 * The row work of a chunk on an NVIDIA GPU: the definitions of
 * src/core/row_kernels.c (see row_kernels.h there), computed on device memory.
 *
 * A chunk is M rows of logits x [M, V], float32 or bfloat16, row stride ld
 * (elements); z = x · inv_temp. Row r's target is tokens[r], an index into
 * [0, V). Per row, with zmax = max_v z_v:
 *
 *   sum     = Σ exp(z_v − zmax)                 dot = Σ exp(z_v − zmax)·(z_v − zmax)
 *   lsum    = log(sum)                          lse = zmax + lsum
 *   entropy = lsum − dot / sum                  logp = (z_tok − zmax) − lsum
 *
 * and d loss / d x_v with g = dL/dlogp, e = dL/dentropy of the row:
 *
 *   lp_v = (z_v − zmax) − lsum,  p_v = exp(lp_v)
 *   dx_v = inv_temp · [ g·(δ_v,tok − p_v) − e·p_v·(lp_v + entropy) ]
 *
 * Each fast kernel reads x once: the forward for the statistics, the backward
 * for dx. A plain reference kernel (one thread per row, or per column for the
 * column sums) sits beside each; the tests check one against the other.
 *
 * Every function runs asynchronously on the caller's stream and returns an
 * fg_status: argument errors and launch failures, with a message in msg.
 * Token ids outside [0, V) are found on the device and recorded in an
 * fg_cuda_row_check that the caller reads when it chooses to synchronize
 * (fg_cuda_row_check_status), never a device fault. Non-finite statistics
 * (NaN/Inf logits) come out as they are: the caller reads the statistics.
 */
#ifndef FG_CUDA_ROW_STATS_H
#define FG_CUDA_ROW_STATS_H

#include <cuda_runtime_api.h>
#include <limits.h>

#include "fusedgrpo.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The lowest chunk row whose token id is outside [0, V) (its logp is then
 * NaN), FG_CUDA_ROW_NONE when none: one int, backend.h's row_check. */
typedef struct fg_cuda_row_check {
    int bad_token_row;
} fg_cuda_row_check;

/* The byte pattern 0x7f in every byte: the largest value a memset can give. */
#define FG_CUDA_ROW_NONE 0x7f7f7f7f

/* The per-row statistics of a chunk, device arrays of M floats each. */
typedef struct fg_cuda_row_stats {
    float *zmax, *lsum, *entropy, *logp;
} fg_cuda_row_stats;

/* Sets *check (device memory) to "no bad row" on the stream. */
fg_status fg_cuda_row_check_reset(fg_cuda_row_check *check, cudaStream_t stream, char *msg,
                                  size_t msg_size);

/* Synchronizes the stream and reads *check: FG_OK or FG_ERR_TOKEN_OUT_OF_RANGE
 * naming the chunk row. row0 is the chunk's first row in the caller's
 * numbering, added to the row in the message. */
fg_status fg_cuda_row_check_status(const fg_cuda_row_check *check, int64_t row0,
                                   cudaStream_t stream, char *msg, size_t msg_size);

/* Forward: stats of rows [0, M). check (device) collects bad rows. */
fg_status fg_cuda_row_stats_forward(const void *x, fg_dtype xtype, int64_t M, int64_t V,
                                    int64_t ld, float inv_temp, const int64_t *tokens,
                                    fg_cuda_row_stats stats, fg_cuda_row_check *check,
                                    cudaStream_t stream, char *msg, size_t msg_size);

/* Each row's own mergeable statistics, the forward's very values (max, sum,
 * dot of fg_row_stats, src/core/row_kernels.h), and its target's scaled logit
 * z_tok = x[r, tokens[r]] · inv_temp (−inf when tokens[r] is outside [0, V):
 * another vocab shard's token), for the exact merge of vocab shards
 * (src/core/shard_stats.h). Row r goes to slot index[r] (index NULL: slot r) of
 * five device arrays of `count` floats; a slot outside [0, count) is
 * skipped (never a fault). */
typedef struct fg_cuda_shard_slots {
    float *max, *z_tok;                 /* the range the shards reduce by MAX */
    float *own_max, *own_sum, *own_dot; /* this shard's own m, S, D           */
    const int64_t *index;               /* [M] device, or NULL                */
    int64_t count;
} fg_cuda_shard_slots;

fg_status fg_cuda_row_stats_shard(const void *x, fg_dtype xtype, int64_t M, int64_t V,
                                  int64_t ld, float inv_temp, const int64_t *tokens,
                                  fg_cuda_shard_slots out, cudaStream_t stream, char *msg,
                                  size_t msg_size);

/* Backward: dx [M, V] (row stride ld_dx, float32 or bfloat16) from x, the
 * forward's stats and per-row g, e (device arrays of M floats). With
 * bias_sum (device, V floats) non-NULL, bias_sum[v] += dx[r, v] of the
 * stored (rounded) dx for r = 0, 1, ..., M − 1: one float32 add per row, in
 * row order, so that sums carried over chunks have the bits of one sum over
 * every row in order, whatever the chunking (fg_col_sums_add of
 * src/core/row_kernels.c, the CPU backend's and the reference's order). dx may be
 * x itself (in place) when the dtypes and row strides are equal. */
fg_status fg_cuda_row_backward(const void *x, fg_dtype xtype, int64_t ld_x, void *dx,
                               fg_dtype dxtype, int64_t ld_dx, int64_t M, int64_t V,
                               float inv_temp, const int64_t *tokens, fg_cuda_row_stats stats,
                               const float *g, const float *e, float *bias_sum,
                               cudaStream_t stream, char *msg, size_t msg_size);

/* The most rows one launch of the row kernels takes: rows are numbered in
 * int (the row check) and the forward runs one block per row. */
#define FG_CUDA_ROW_LIMIT ((int64_t)INT_MAX)

/* The plain references: the same contracts, one thread per row (and per
 * column for bias_sum). */
fg_status fg_cuda_row_stats_forward_ref(const void *x, fg_dtype xtype, int64_t M, int64_t V,
                                        int64_t ld, float inv_temp, const int64_t *tokens,
                                        fg_cuda_row_stats stats, fg_cuda_row_check *check,
                                        cudaStream_t stream, char *msg, size_t msg_size);
fg_status fg_cuda_row_backward_ref(const void *x, fg_dtype xtype, int64_t ld_x, void *dx,
                                   fg_dtype dxtype, int64_t ld_dx, int64_t M, int64_t V,
                                   float inv_temp, const int64_t *tokens, fg_cuda_row_stats stats,
                                   const float *g, const float *e, float *bias_sum,
                                   cudaStream_t stream, char *msg, size_t msg_size);

#ifdef __cplusplus
}
#endif

#endif
