/*
 * The reference a gradcheck compares the kernel against.
 *
 *   oracle    fg_oracle_linear / fg_oracle_logits in float64 on exactly the
 *             kernel's inputs (bf16 inputs widened exactly; the logits impl's
 *             reference reads the same tool-made logits the kernel read).
 *   baseline  the library's materialized path in float32 (inputs widened to
 *             float32, no logit rounding), for shapes the oracle cannot
 *             afford; for the logits impl, fg_logits_grpo on float32 logits.
 *
 * reference: auto picks the oracle while N*V*H <= oracle_limit and the
 * oracle's [N, V] double arrays stay below ~1.2 GB each.
 */
#ifndef FT_REFERENCE_H
#define FT_REFERENCE_H

#include <stddef.h>

#include "compare.h"
#include "config.h"
#include "fg_oracle.h"
#include "problem.h"
#include "runner.h"

typedef struct ft_reference {
    int kind; /* FT_REF_ORACLE or FT_REF_BASELINE */
    double loss;
    fg_metrics metrics;
    ft_view logp, entropy, grad_logits, grad_hidden, grad_weight, grad_bias;

    /* owned storage */
    fg_oracle_result oracle;
    int has_oracle;
    ft_problem f32p;
    ft_runner base;
    int has_base;
    float *buf; /* logits baseline: logits, dlogits, logp, entropy */
    size_t buf_bytes;
} ft_reference;

int ft_reference_pick(const ft_config *cfg, const ft_problem *p);
/* logits: the logits impl's input (storage dtype of p), else NULL. */
int ft_reference_run(ft_reference *ref, int kind, const ft_config *cfg, const ft_problem *p,
                     int impl, const void *logits, char *err, size_t errlen);
void ft_reference_free(ft_reference *ref);

#endif
