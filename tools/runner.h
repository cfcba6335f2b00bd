/*
 * Runs one impl on a problem: the part gradcheck and every bench child share.
 *
 *   baseline  fg_linear_grpo(FG_IMPL_MATERIALIZED[, round_logits])
 *   fused     fg_linear_grpo(FG_IMPL_FUSED)
 *   logits    the tool materializes z = hidden·weightᵀ + bias itself (not part
 *             of the kernel), then fg_logits_grpo writes dlogits in place; for
 *             a full step (bench) the tool then does the two backward GEMMs
 *             and the bias column sum, so all three impls do the same work.
 *
 * Output buffers are allocated once, pre-faulted, and reused by every step.
 */
#ifndef FT_RUNNER_H
#define FT_RUNNER_H

#include <stddef.h>

#include "config.h"
#include "fusedgrpo.h"
#include "problem.h"
#include "tool_gemm.h"

typedef struct ft_runner {
    int impl;
    int full_step; /* logits impl: also the backward GEMMs (bench); gradcheck stops at dlogits */
    const ft_problem *p;
    fg_context *ctx;
    fg_loss_config loss;
    fg_batch batch;
    fg_linear_inputs lin;
    fg_linear_options lopts;

    float *logp, *entropy;                 /* [N]                      */
    float *grad_hidden, *grad_weight;      /* [N, H], [V, H]           */
    float *grad_bias;                      /* [V] when the problem has a bias */
    void *logits;                          /* logits impl: [N, V] dtype, then dlogits */
    ft_gemm_ws ws;                         /* logits impl: tool GEMM scratch */
    size_t output_bytes;                   /* logp..grad_bias          */
    size_t logits_bytes;

    double loss_value;
    fg_metrics metrics;
    double kernel_s; /* logits impl: seconds inside fg_logits_grpo, last step */
    char err[1024];
} ft_runner;

/* The library's loss config for the tool's config. 0, or -1 with err. */
int ft_loss_config_from(const ft_config *cfg, fg_loss_config *out, char *err, size_t errlen);
/* The library's view of the problem's per-token inputs. */
void ft_batch_from(const ft_problem *p, fg_batch *out);
/* "FG_ERR_X: message" for a failed call, without repeating the status name
 * when the library's message already starts with it. */
void ft_describe_status(const fg_context *ctx, fg_status st, char *buf, size_t n);
/* A context with the config's threads, budget and check_finite. */
int ft_context_from(const ft_config *cfg, fg_context **out, char *err, size_t errlen);

int ft_runner_init(ft_runner *r, const ft_config *cfg, const ft_problem *p, int impl, int full_step);
/* One forward + backward. For the logits impl it is materialize + kernel
 * (+ backward GEMMs when full_step); gradcheck may call the two phases itself. */
int ft_runner_step(ft_runner *r);
int ft_runner_materialize_logits(ft_runner *r);
int ft_runner_logits_kernel(ft_runner *r);
/* Bytes the tool itself holds as working memory (logits + GEMM scratch). */
size_t ft_runner_tool_bytes(const ft_runner *r);
/* Frees every buffer and the library's cached workspace but keeps the
 * context, so bench can time the roofline without two steps' worth of
 * memory still resident. No step may follow. */
void ft_runner_release_buffers(ft_runner *r);
void ft_runner_free(ft_runner *r);

#endif
