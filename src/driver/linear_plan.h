/*
 * The chunk planner of an LM-head call, one for every backend: which
 * products run in which dtype, the chunks of unmasked tokens and what the
 * call holds for them within the budget. The backend answers the facts
 * (backend.h: its compute dtype, its products' scratch, its chunk shaping);
 * the rules are here once.
 */
#ifndef FG_LINEAR_PLAN_H
#define FG_LINEAR_PLAN_H

#include "linear_request.h"

typedef struct linear_plan {
    fg_device be;     /* the call's backend: its ops and state                    */
    int host;         /* FG_BACKEND_HOST_MEMORY: one arena holds the call's host
                         arrays and its buffers, used in place, in whole pages  */
    int fused;
    fg_dtype in_t;    /* storage of hidden, weight, bias                          */
    fg_dtype cmp_t;   /* the products' operands (the gathered rows, dlogits): the
                         backend's compute_dtype(in_t)                            */
    fg_dtype logit_t, dlogit_t;
    int dl_alias; /* dlogits overwrite the f32 logits in place */
    int64_t H, V, Nc, chunks;
    int64_t lead; /* chunk 0 holds Nc rows, every later one Nc - lead (the last
                     maybe fewer): the rows past whole logits blocks, in one chunk
                     (lead_rows); 0: every chunk Nc rows */
    int want_gh, want_gw, want_gb, any_grad;
    fg_dtype gh_t, gw_t, gb_t; /* the gradient outputs' dtypes (bf16 for bf16 inputs) */
    int accumulate; /* grad_weight and grad_bias += this call's gradient */
    int gw_sum;     /* a bf16 grad_weight summed over the chunks in a float32 [V, H]
                       buffer of the workspace (in fixed_bytes), rounded once      */
    size_t gw_sum_bytes;
    int sharded; /* weight holds vocab rows [vocab_start, vocab_start + V) */
    int hook;    /* sharded, merged through the context's communicator per chunk */
    int64_t vocab_start;
    int64_t n_active;     /* unmasked tokens: the rows the chunks cover (a
                             device-reported call: every token row)            */
    size_t fixed_bytes;   /* the backend memory the call holds besides its chunks:
                             the targets, the sums; on a host backend also the
                             per-call [B, T] arrays (fg_common_workspace_bytes) */
    size_t scratch_bytes; /* the backend's chunk scratch on bc.workers threads     */
    input_bounds bounds;  /* what the up-front scan found                          */
    fg_backend_call bc;   /* the call as the backend sees it: shapes, dtypes,
                             views, workers, filtering; its workspace pointers
                             placed by the call (planning reads bc.gw_sum and
                             bc.gb_sum as flags)                                  */
} linear_plan;

/* A backend op's failure as the call's error (its message in msg): the CPU
 * backend's as it is, another's prefixed with the backend's name. */
fg_status fg_linear_backend_failed(fg_call *call, const fg_device *be, fg_status st,
                                   const char *msg);

/* The plan of a validated call on backend `be` (req: as the host reads it;
 * mask: the caller's, in the backend's memory; p->bounds left as they
 * are): dtypes, which products run, the chunks; FG_ERR_UNSUPPORTED naming
 * an optional op the call needs and the backend lacks;
 * FG_ERR_BUDGET_TOO_SMALL when not one row fits (p still describes the
 * call: n_active, fixed_bytes). */
fg_status fg_linear_plan_call(fg_call *call, const fg_device *be, const fg_linear_options *o,
                              const linear_request *req, const uint8_t *mask,
                              const fg_linear_inputs *in, const fg_linear_outputs *out,
                              int64_t n_active, linear_plan *p);

/* Re-plans the chunks at exactly `rows` rows a chunk (a collective call:
 * the shards' smallest). */
fg_status fg_linear_plan_rows(fg_call *call, linear_plan *p, int64_t rows);

/* The backend memory one chunk of m rows holds (scratch apart). */
size_t fg_linear_chunk_bytes(const linear_plan *p, int64_t m);

/* What the planned call holds in the backend's memory: fixed, one chunk,
 * the scratch (in whole pages on a host backend). */
size_t fg_linear_plan_total(const linear_plan *p);

/* The smallest budget the fused call runs with: one token row a chunk, on
 * one thread (a bf16 grad_weight then summed chunk by chunk where the
 * backend's products can). */
fg_status fg_linear_min_budget(fg_call *call, const linear_plan *p, size_t *bytes);

/* A piece of the workspace: `bytes` rounded up to the backend's alignment. */
static inline size_t fg_linear_piece(const linear_plan *p, size_t bytes)
{
    const size_t a = p->be.ops->align;
    return (bytes + a - 1) / a * a;
}

/* Chunk k's first row and rows. */
static inline int64_t fg_linear_chunk_start(const linear_plan *p, int64_t k)
{
    return k == 0 ? 0 : p->lead + k * (p->Nc - p->lead);
}

static inline int64_t fg_linear_chunk_len(const linear_plan *p, int64_t k)
{
    const int64_t r0 = fg_linear_chunk_start(p, k), m = k == 0 ? p->Nc : p->Nc - p->lead;
    return p->n_active - r0 < m ? p->n_active - r0 : m;
}

#endif
