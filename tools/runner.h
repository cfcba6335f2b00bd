/*
 * Runs one impl on a problem: the part gradcheck and every bench child share.
 *
 *   baseline  fg_linear_grpo(FG_IMPL_MATERIALIZED[, round_logits])
 *   fused     fg_linear_grpo(FG_IMPL_FUSED)
 *   logits    the tool materializes z = hidden·weightᵀ + bias itself (gemm.h,
 *             not part of the kernel), then fg_logits_grpo writes dlogits in
 *             place; for a full step (bench) the tool then does the two
 *             backward GEMMs and the bias column sum, so all three impls do
 *             the same work.
 *
 * Output buffers are allocated once, pre-faulted, and reused by every step.
 */
#ifndef FT_RUNNER_H
#define FT_RUNNER_H

#include "gemm.h"
#include "problem.h"

typedef struct ft_runner {
    int impl, full_step; /* full_step: the logits impl's backward GEMMs too (bench) */
    int min_budget;      /* memory_budget: min */
    const ft_problem *p;
    fg_context *ctx;
    fg_exec exec;
    fg_loss_config loss;
    fg_batch batch;
    fg_linear_inputs lin;
    fg_linear_options lopts;
    float *logp, *entropy, *grad_hidden, *grad_weight, *grad_bias; /* [N], [N], [N, H], [V, H], [V] */
    void *logits;        /* logits impl: [N, V] in the input dtype, then dlogits */
    char *buf;           /* the one mapping all of the above live in */
    size_t buf_bytes;
    ft_gemm gemm;        /* logits impl: the tool's products */
    size_t output_bytes; /* logp..grad_bias */
    size_t logits_bytes;
    double loss_value;
    fg_metrics metrics;
    double kernel_s; /* logits impl: seconds inside fg_logits_grpo, last step */
    char err[1024];
} ft_runner;

/* The library's loss config and per-token inputs for the tool's. */
void ft_loss_config_from(const ft_config *cfg, fg_loss_config *out);
void ft_batch_from(const ft_problem *p, fg_batch *out);

/* These return 0, or -1 with r->err. ft_runner_free applies after a failed init. */
int ft_runner_init(ft_runner *r, const ft_config *cfg, const ft_problem *p, int impl, int full_step);
/* One forward + backward. For the logits impl it is materialize + kernel
 * (+ backward GEMMs when full_step); gradcheck may call the two phases itself. */
int ft_runner_step(ft_runner *r);
int ft_runner_materialize_logits(ft_runner *r);
int ft_runner_logits_kernel(ft_runner *r);
/* Bytes the tool itself holds as working memory (logits impl: logits + GEMM scratch). */
size_t ft_runner_tool_bytes(const ft_runner *r);
/* The fused path's chunk rows for this problem and budget, from the library's
 * planner (whatever r's impl): the first (largest) chunk's, and in *later
 * those of each chunk after it (the last may hold fewer): bench's chunked
 * roofline. <= 0 (and *later 0): failed. */
int64_t ft_runner_fused_chunk_rows(ft_runner *r, int64_t *later);
void ft_runner_free(ft_runner *r);

#endif
