/*
 * Small shared helpers for the fusedgrpo tests: a seeded RNG, a CHECK macro
 * that counts and reports failures, named tolerances that record the worst
 * error they see (TOL_CHECK), random batches with odd sizes and ragged masks,
 * random LM-head problems (tu_problem: stored hidden / weight / bias, their
 * double values for the oracle, a batch), output buffers for fg_linear_grpo,
 * storage of double data as f32 / bf16 matrices (with row padding), and error
 * measures.
 */
#ifndef FG_TEST_UTIL_H
#define FG_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "fusedgrpo.h"

/* ---------------------------------------------------------------- backend */

/* FG_TEST_BACKEND=reference runs a test's contexts on the seam's reference
 * backend (the driver's device path, staging included) where it asks for
 * the CPU: CTest runs chosen tests both ways with the same assertions.
 * Every test's fg_context_create goes through tu_context_create. */
fg_status tu_context_create(const fg_context_options *opts, fg_context **out);
/* Whether FG_TEST_BACKEND selects the reference backend. */
int tu_on_reference(void);
/* A context on the CPU whatever FG_TEST_BACKEND says: the host-only entry
 * points (fg_logits_grpo, fg_grpo_loss_from_logp). */
fg_status tu_host_context_create(fg_context **out);
#ifndef TU_CONTEXT_CREATE_ITSELF
#define fg_context_create tu_context_create
#endif

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

/* Prints the tolerance table (when TOL_CHECK was used), then "N passed, M
 * failed" as the last line; returns the exit code. */
int tu_finish(void);

/* -------------------------------------------------------------- tolerances */

/* TOL_CHECK(name, err, tol, fmt, args...): err <= tol as a CHECK (NaN fails),
 * with the formatted text saying which case it was. Every tolerance of the
 * suite goes through it, under a name: the worst err seen per name (and the
 * case it came from) is kept, and tu_finish prints
 *     tolerance | tol | worst measured | tol / worst | worst case
 * so a tolerance that has drifted far above what the code achieves (no teeth)
 * shows. A name stands for one tolerance: using it with two values fails. */
#define TOL_CHECK(name, err, tol, ...) \
    tu_tol_check((name), (err), (tol), __FILE__, __LINE__, __VA_ARGS__)

#if defined(__GNUC__)
__attribute__((format(printf, 6, 7)))
#endif
void tu_tol_check(const char *name, double err, double tol, const char *file, int line,
                  const char *fmt, ...);
/* The worst error recorded under name so far (0 if none). */
double tu_tol_worst(const char *name);

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
    float *sampling_logp; /* the sampler's log-probs: old_logp + a fixed offset
                             in [-0.25, 0.25], NaN at every 5th token (an
                             unscored token), hostile where masked           */
    int have_old, have_ref, have_sampling;
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
/* ||a - b||_2 / ||b||_2 over n floats (||a - b||_2 when b is 0). */
double tu_rel_l2f(const float *a, const float *b, int64_t n);
/* max over i of |a_i - b_i| / max(|b_i|, floor), only where mask (may be NULL) is set. */
double tu_max_rel(const float *a, const double *b, int64_t n, const uint8_t *mask,
                  double floor);

/* Byte-level sentinels. */
void tu_fill_bytes(void *p, size_t n, unsigned char v);
int tu_bytes_are(const void *p, size_t n, unsigned char v);
/* Fills a float buffer with NaN. */
void tu_fill_nan(float *p, size_t n);

void *tu_xmalloc(size_t n); /* aborts the test on failure */
/* 64-byte aligned, for caller workspaces (fg_exec.workspace); free() it. */
void *tu_xmalloc_aligned(size_t n);

/* 1 when this CPU's GEMMs multiply bf16 natively (the plan's gemm_dtype):
 * the library then rounds dlogits to bf16 for the gradient GEMMs, and bf16
 * gradients carry ~2^-9 relative error; else they are as close as f32 ones. */
int tu_bf16_gemms_native(void);

/* ----------------------------------------------------------------- problems */

/* A random LM-head problem: hidden [N, H], weight [V, H], bias [V] drawn from
 * normals, stored in `dtype` (rows ldh / ldw elements apart, padding columns
 * NaN so that reading them shows), and the stored (rounded) values in double
 * for the oracle; plus a tu_batch (ragged mask, see tu_batch_make) over V.
 * The same seed gives the same values before rounding for every dtype, so
 * f32 and bf16 runs see the same problem. */
typedef struct tu_problem_opts {
    double hidden_scale;  /* <= 0: 1                                            */
    double weight_scale;  /* <= 0: 3 / sqrt(H), logits of a few units           */
    double bias_scale;    /* <= 0: 0.5                                          */
    int64_t hidden_pad;   /* extra (NaN) columns per stored hidden row          */
    int64_t weight_pad;   /* extra (NaN) columns per stored weight row          */
    int mask_pattern;     /* tu_batch_make's pattern                            */
} tu_problem_opts;

typedef struct tu_problem {
    int64_t B, T, N, H, V;
    fg_dtype dtype;
    int64_t ldh, ldw;
    double *hidden, *weight; /* [N, H], [V, H]: the stored values, contiguous   */
    double *bias;            /* [V], or NULL for a problem without a bias       */
    void *hidden_s, *weight_s, *bias_s; /* stored in dtype (bias_s NULL: none)  */
    tu_batch tb;
    tu_rng rng; /* continues the problem's stream (tu_problem_fill_logp)       */
} tu_problem;

/* Aborts the test on allocation failure. opts may be NULL (the defaults). */
void tu_problem_make(tu_problem *p, int64_t B, int64_t T, int64_t H, int64_t V, fg_dtype dtype,
                     int with_bias, uint64_t seed);
void tu_problem_make_opts(tu_problem *p, int64_t B, int64_t T, int64_t H, int64_t V,
                          fg_dtype dtype, int with_bias, uint64_t seed,
                          const tu_problem_opts *opts);
/* Stores the double values again (after a test edited p->hidden, p->weight
 * or p->bias), rounding them to p->dtype in place. */
void tu_problem_restore(tu_problem *p);
/* The stored inputs as fg_linear_inputs (unsharded). */
fg_linear_inputs tu_problem_inputs(const tu_problem *p);
/* Vocab shard [v0, v1)'s view of them: those weight and bias rows, with
 * vocab_start = v0 and vocab_total = V. */
fg_linear_inputs tu_problem_shard_inputs(const tu_problem *p, int64_t v0, int64_t v1);
/* old_logp / ref_logp / is_ratio drawn around the oracle's own log-probs of
 * the problem at this temperature (tu_batch_fill_logp), so that ratios
 * straddle the clip bounds; sets have_old = have_ref = 1 and is_mode = 1.
 * Returns 0, or -1 if the oracle failed. */
int tu_problem_fill_logp(tu_problem *p, double temperature, double s_old, double s_ref);
/* The [N, V] logits hidden · weightᵀ + bias in double (malloc'd). */
double *tu_problem_logits(const tu_problem *p);
void tu_problem_free(tu_problem *p);

/* ------------------------------------------------------- linear outputs */

/* Contiguous fg_linear_grpo outputs: logp, entropy, grad_hidden, grad_weight
 * and (with_grad_bias) grad_bias, with `out` pointing at them. */
typedef struct tu_linear_outs {
    int64_t N, H, V;
    float *logp, *entropy, *grad_hidden, *grad_weight, *grad_bias;
    fg_linear_outputs out;
} tu_linear_outs;

void tu_linear_outs_make(tu_linear_outs *o, int64_t N, int64_t H, int64_t V, int with_grad_bias);
/* Every output byte (loss and metrics included) set to / still equal to v. */
void tu_linear_outs_fill(tu_linear_outs *o, unsigned char v);
int tu_linear_outs_are(const tu_linear_outs *o, unsigned char v);
/* Bitwise equal results. */
int tu_linear_outs_same(const tu_linear_outs *a, const tu_linear_outs *b);
void tu_linear_outs_free(tu_linear_outs *o);

#endif
