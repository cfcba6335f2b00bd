/*
 * Small shared helpers for the fusedgrpo tests: a seeded RNG, a CHECK macro
 * that counts and reports failures, random batches with odd sizes and ragged
 * masks, storage of double data as f32 / bf16 matrices (with row padding), and
 * error measures.
 */
#ifndef FG_TEST_UTIL_H
#define FG_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "fusedgrpo.h"

/* ------------------------------------------------------------------ checks */

extern long tu_passed;
extern long tu_failed;

/* CHECK(cond, fmt, args...): counts a pass, or counts a failure and prints
 * the condition, the place and the formatted numbers. */
#define CHECK(cond, ...)                                                         \
    do {                                                                         \
        if (cond) {                                                              \
            tu_passed++;                                                         \
        } else {                                                                 \
            tu_failed++;                                                         \
            fprintf(stderr, "FAIL %s:%d: (%s): ", __FILE__, __LINE__, #cond);    \
            fprintf(stderr, __VA_ARGS__);                                        \
            fputc('\n', stderr);                                                 \
            fflush(stderr);                                                      \
        }                                                                        \
    } while (0)

/* Prints "N passed, M failed" as the last line; returns the exit code. */
int tu_finish(void);

/* --------------------------------------------------------------------- rng */

typedef struct tu_rng {
    uint64_t s;
} tu_rng;

void tu_rng_seed(tu_rng *r, uint64_t seed);
uint64_t tu_next(tu_rng *r);
double tu_uniform(tu_rng *r);            /* [0, 1)            */
double tu_normal(tu_rng *r);             /* N(0, 1)           */
int64_t tu_randint(tu_rng *r, int64_t n); /* [0, n)            */

/* ------------------------------------------------------------------ config */

/* LOSS_SPEC.md defaults, written here independently of the library. */
void tu_config_defaults(fg_loss_config *cfg);
const char *tu_loss_name(int loss_type);
const char *tu_level_name(int level);

/* ------------------------------------------------------------------- batch */

typedef struct tu_batch {
    int64_t B, T;
    int64_t *token_ids;
    uint8_t *mask;
    float *advantages;
    float *old_logp;
    float *ref_logp;
    float *is_ratio;  /* [B*T] storage; used as [B] when per-sequence */
    int have_old, have_ref;
    int is_mode;      /* 0: none, 1: [B, T], 2: [B] */
    fg_batch view;    /* refreshed by tu_batch_view */
} tu_batch;

/* Allocates a B x T batch: random tokens in [0, V), a ragged mask (when
 * B >= 3 one sequence is all masked, chosen by `pattern`; a hole in another),
 * masked token ids set out of range on purpose, random +- advantages. */
int tu_batch_make(tu_batch *tb, int64_t B, int64_t T, int64_t V, int pattern, tu_rng *rng);
/* old = logp_true + N(0, s_old), ref = logp_true + N(0, s_ref), is_ratio in
 * [0.5, 1.5]; masked positions get hostile garbage (huge values). */
void tu_batch_fill_logp(tu_batch *tb, const double *logp_true, double s_old, double s_ref,
                        tu_rng *rng);
const fg_batch *tu_batch_view(tu_batch *tb);
int64_t tu_batch_unmasked(const tu_batch *tb);
void tu_batch_free(tu_batch *tb);

/* ----------------------------------------------------------------- storage */

size_t tu_dtype_size(fg_dtype dt);
/* The value x has once stored as dt (f32 or bf16, round to nearest even). */
double tu_round_to(fg_dtype dt, double x);
/* Stores vals [rows, cols] into a new rows x ld buffer of dtype dt; padding
 * columns hold NaN (never to be read). vals is overwritten with the stored
 * (rounded) values. Returns NULL on allocation failure. */
void *tu_store_matrix(double *vals, int64_t rows, int64_t cols, int64_t ld, fg_dtype dt);
/* Element (r, c) of a stored matrix as double. */
double tu_load(const void *data, fg_dtype dt, int64_t idx);

/* ------------------------------------------------------------------ errors */

/* |a - b| / max(|b|, floor) */
double tu_rel_err(double a, double b, double floor);
/* ||a - b||_2 / ||b||_2 over a [rows, cols] matrix a (dtype dt, stride lda)
 * against a contiguous double b. When ||b|| == 0, returns ||a||. */
double tu_rel_l2(const void *a, fg_dtype dt, int64_t rows, int64_t cols, int64_t lda,
                 const double *b);
/* max over i of |a_i - b_i| / max(|b_i|, floor), only where mask (may be NULL) is set. */
double tu_max_rel(const float *a, const double *b, int64_t n, const uint8_t *mask,
                  double floor);

/* Byte-level sentinels. */
void tu_fill_bytes(void *p, size_t n, unsigned char v);
int tu_bytes_are(const void *p, size_t n, unsigned char v);
/* Fills a float buffer with NaN. */
void tu_fill_nan(float *p, size_t n);

void *tu_xmalloc(size_t n); /* aborts the test on failure */

#endif
