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

/* A matrix view: data, dtype, positive sizes, ld >= cols, no byte overflow,
 * and the expected shape (a negative expectation is not checked). */
fg_status fg_validate_matrix(fg_error *err, const char *name, const fg_matrix *m,
                             int64_t rows, int64_t cols);
fg_status fg_validate_vector(fg_error *err, const char *name, const fg_vector *v, int64_t len);

/* NaN/Inf scan of a matrix (rows with mask[r] == 0 skipped when mask given). */
fg_status fg_check_finite_matrix(fg_error *err, int threads, const char *name,
                                 const fg_matrix *m, const uint8_t *row_mask);
fg_status fg_check_finite_vector(fg_error *err, const char *name, const fg_vector *v);

/* The phase API's statistics buffer (fusedgrpo.h, "phases of a vocab-sharded
 * call") of n tokens: not NULL, and its status slot 0; a slot another shard
 * raised returns that status, so every shard fails the same way. */
fg_status fg_validate_shard_stats(fg_error *err, const float *stats, int64_t n);

#endif
