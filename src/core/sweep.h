/*
 * A sweep over a block of logit rows: the glue between the row kernels and
 * the loss math, shared by the logits-level and the LM-head drivers.
 *
 * A block is `count` rows of V logits (f32 or bf16, row stride x_ld); row i
 * belongs to token token[i] (n = b*T + t) of the batch. Per-token results
 * land in [B*T] arrays indexed by n, so blocks can come in any order.
 */
#ifndef FG_SWEEP_H
#define FG_SWEEP_H

#include "error.h"
#include "internal.h"
#include "loss_math.h"

typedef struct fg_rows {
    const void *x;
    fg_dtype xtype;
    int64_t x_ld;
    void *dx; /* d loss / d x rows (may alias x), or NULL for forward only */
    fg_dtype dxtype;
    int64_t dx_ld;
    int64_t count;
    int64_t V;
    const int64_t *token; /* [count] token index of each row */
    int by_token;         /* 1: row i lives at row token[i] of x/dx (the caller's
                             [B*T, V] logits); 0: at row i (a compacted chunk) */
    int64_t vocab_start;  /* this shard's first token id (0 when unsharded) */
} fg_rows;

typedef struct fg_token_arrays {
    /* [B*T], written at the block's tokens. The row's lse is zmax + lsum
     * (max of z, log Σ exp(z − zmax)) kept as two floats: z − lse computed as
     * (z − zmax) − lsum stays exact to float rounding of the small terms even
     * when |z| is ~1e4, where one float lse would be off by ~ulp(1e4) = 1e-3. */
    float *logp, *entropy, *zmax, *lsum;
} fg_token_arrays;

/* Row statistics -> lse, logp, entropy of each row's token (the callers
 * check them for NaN/Inf: fg_common_check_tokens). */
void fg_sweep_forward(int threads, const fg_loss_plan *plan, const fg_rows *rows,
                      float inv_temp, const fg_token_arrays *ta);

/* After both reductions of a chunk's buf (c = rows->count): every row's
 * merged lse, logp and entropy into ta (NaN where a shard's statistics were
 * not finite). -1 when the summed limbs are not what a SUM gives (the
 * communicator misbehaved). */
int fg_sweep_shard_merged(const fg_rows *rows, const float *buf, const fg_token_arrays *ta);

/* d loss / d x for each row from the saved lse/entropy and the loss math's
 * d loss / d logp and d loss / d entropy. */
void fg_sweep_backward(int threads, const fg_loss_plan *plan, const fg_rows *rows,
                       float inv_temp, const fg_token_arrays *ta);

/* acc[c] += Σ_rows dx[r, c] for all c, columns split across threads. */
void fg_sweep_column_sums(int threads, const fg_rows *rows, float *acc);

/* dst[r, c] = bf16(src[r, c] + (add ? dst[r, c] : 0)) for a [rows, cols]
 * block: float32 sums rounded to bfloat16 once (a bf16 grad_weight summed in
 * float32 over the chunks), rows split across threads. */
void fg_sweep_round_bf16(int threads, const float *src, int64_t src_ld, uint16_t *dst,
                         int64_t dst_ld, int64_t rows, int64_t cols, int add);

#endif
