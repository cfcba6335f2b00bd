/*
 * Argument checks shared by the entry points. Each failure has its own status
 * and a message naming the argument; they run before anything is written.
 */
#ifndef FG_VALIDATE_H
#define FG_VALIDATE_H

#include "error.h"
#include "internal.h"

fg_status fg_validate_config(fg_error *err, const fg_loss_config *cfg);

/* Batch sizes, pointers, beta/ref, unmasked token ids in [0, vocab), and
 * NaN/Inf in advantages, old/ref log-probs and is_ratio where they are read.
 * One pass over the mask; *n_active: the unmasked tokens. */
fg_status fg_validate_batch(fg_error *err, const fg_loss_config *cfg, const fg_batch *batch,
                            int64_t vocab, int64_t *n_active);

/* The part of fg_validate_batch that reads no array (a device-reported
 * call: its values are checked on the device, report.h). */
fg_status fg_validate_batch_shape(fg_error *err, const fg_loss_config *cfg, const fg_batch *batch);

/* A per-token [B, T] input read at unmasked positions (x NULL: not read). */
typedef struct fg_token_input {
    const char *name;
    const float *x;
} fg_token_input;

/* The token side of a log-prob pass: sizes, pointers, unmasked ids in
 * [0, vocab), and NaN/Inf in `reads` at unmasked positions; one pass over
 * the mask. *n_active: the unmasked tokens. */
fg_status fg_validate_tokens(fg_error *err, const fg_tokens *tokens, int64_t vocab,
                             const fg_token_input *reads, int n_reads, int64_t *n_active);
fg_status fg_validate_tokens_shape(fg_error *err, const fg_tokens *tokens);

/* A matrix view: data, dtype, positive sizes, ld >= cols, no byte overflow,
 * and the expected shape (a negative expectation is not checked). */
fg_status fg_validate_matrix(fg_error *err, const char *name, const fg_matrix *m,
                             int64_t rows, int64_t cols);
fg_status fg_validate_vector(fg_error *err, const char *name, const fg_vector *v, int64_t len);

/* The bytes an argument spans, [lo, hi) (lo == hi: absent or empty), for
 * the aliasing check. One range per array, from its first element to the end
 * of its last: a matrix's row padding counts as its own, so two views
 * interleaved in one buffer are refused too (the check stays a comparison of
 * two ranges, and no caller needs that layout). */
typedef struct fg_span {
    const char *name;
    uintptr_t lo, hi;
} fg_span;

/* A span from a pointer and a byte count (p NULL: absent). */
fg_span fg_span_bytes(const char *name, const void *p, size_t bytes);
/* A validated view (fg_validate_matrix / fg_validate_vector), or data NULL. */
fg_span fg_span_matrix(const char *name, const fg_matrix *m);
fg_span fg_span_vector(const char *name, const fg_vector *v);

/* The spans of a validated batch's arrays (absent ones empty): token_ids,
 * mask, advantages, old_logp, ref_logp, is_ratio, sampling_logp. */
#define FG_BATCH_SPANS 7
void fg_batch_spans(const fg_batch *b, fg_span spans[FG_BATCH_SPANS]);

/* FG_ERR_ALIASED_OUTPUT, naming both, when an output's span meets an input's
 * or another output's (fusedgrpo.h "Conventions"). Inputs may overlap one
 * another. The caller's workspace (fg_exec.workspace, NULL: none), which the
 * call writes, is checked as one more output. Spans of validated sizes only:
 * their byte counts do not overflow. */
fg_status fg_check_aliasing(fg_error *err, const fg_span *outs, int n_outs, const fg_span *ins,
                            int n_ins, const void *workspace, size_t workspace_bytes);

/* The largest |element| an input holds, and its row (0 for a vector). */
typedef struct fg_magnitude {
    double value;
    int64_t index;
} fg_magnitude;

/* NaN/Inf scan of a matrix (rows with mask[r] == 0 skipped when mask given)
 * that also finds its largest |element|, in the same pass over the bits. */
fg_status fg_scan_matrix(fg_error *err, int threads, const char *name, const fg_matrix *m,
                         const uint8_t *row_mask, fg_magnitude *out);
fg_status fg_scan_vector(fg_error *err, const char *name, const fg_vector *v,
                         fg_magnitude *out);

/* The largest magnitude a bound on the logits or on a gradient's entries may
 * reach: an eighth of the float range, so that the difference of two logits,
 * the rounding of the products' partial sums and the bound's own arithmetic
 * stay finite. Real models sit some 30 orders of magnitude below. */
#define FG_OVERFLOW_LIMIT (3.4028234663852886e38 / 8)

/* What a call's gradient outputs can reach, from each token's d loss/d logp
 * (g) and d loss/d entropy (e): its d loss/d logits row has an L1 norm of at
 * most s = 2(|g| + |e|(log V + 1)) / temperature; a gradient row written per
 * token (grad_hidden: s times the largest |weight|; grad_logits: s) must stay
 * below FG_OVERFLOW_LIMIT, and so must the sums over tokens (grad_weight: Σ s
 * times the largest |hidden|; grad_bias: Σ s). A scale of 0: not written. */
typedef struct fg_grad_bound {
    double inv_temp, log_vocab;
    double row_scale, sum_scale;
    const char *row_name, *sum_name;
    double sum; /* Σ s over the tokens added so far */
} fg_grad_bound;

/* Adds token n (of rows of T) to the bound: FG_ERR_OVERFLOW naming the token
 * and the output when a bound passes FG_OVERFLOW_LIMIT. */
fg_status fg_grad_bound_add(fg_error *err, fg_grad_bound *gb, double dlogp, double dentropy,
                            int64_t n, int64_t T);

/* The phase API's statistics buffer (fusedgrpo.h, "phases of a vocab-sharded
 * call") of n tokens: not NULL, and its status slot 0; a slot another shard
 * raised returns that status, so every shard fails the same way. */
fg_status fg_validate_shard_stats(fg_error *err, const float *stats, int64_t n);

#endif
