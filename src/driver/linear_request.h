/*
 * A request to the LM-head driver (linear_grpo.c, one for every backend)
 * and its checks (linear_checks.c): every argument, then the bounds the
 * inputs' largest magnitudes give the logits and gradients.
 */
#ifndef FG_LINEAR_REQUEST_H
#define FG_LINEAR_REQUEST_H

#include "call.h"
#include "finish.h"
#include "validate.h"

/* What a call computes: the configured loss (fg_linear_grpo), or the head's
 * log-probs alone: forward only (fg_linear_logprobs), or the backward of the
 * caller's own loss through them (fg_linear_logprobs_backward); or a phase of
 * a vocab-sharded call whose reductions are the caller's: a shard's row
 * statistics (fg_linear_shard_stats), its backward from merged statistics
 * (fg_linear_shard_backward). The head-only kinds carry a default loss
 * config holding their temperature and a batch view of their tokens without
 * advantages. */
enum call_kind {
    KIND_LOSS,
    KIND_LOGPROBS,
    KIND_LOGPROBS_BACKWARD,
    KIND_SHARD_STATS,
    KIND_SHARD_BACKWARD
};

typedef struct linear_request {
    enum call_kind kind;
    const fg_loss_config *cfg;
    const fg_batch *batch;
    const fg_tokens *tokens;          /* head-only kinds                           */
    const float *dlogp, *dentropy;    /* KIND_LOGPROBS_BACKWARD, KIND_SHARD_BACKWARD */
    float *stats_out;                 /* KIND_SHARD_STATS: [FG_SHARD_STATS_FLOATS(N)] */
    const float *stats_in;            /* KIND_SHARD_BACKWARD: the merged statistics  */
} linear_request;

/* A head-only request as the public entry points build it: a default config
 * with the temperature, a batch view of the tokens (an empty one when tokens
 * is NULL: validation reports it), the caller's derivatives (or NULL). */
void fg_linear_head_request(linear_request *req, enum call_kind kind, fg_loss_config *cfg,
                            fg_batch *batch, double temperature, const fg_tokens *tokens,
                            const float *dlogp, const float *dentropy);

/* The kinds whose shards reduce through the context's communicator. */
static inline int fg_uses_hook(enum call_kind k)
{
    return k != KIND_SHARD_STATS && k != KIND_SHARD_BACKWARD;
}

/* Runs a request on backend `be` (NULL: the call's own, the context's
 * backend or a CPU backend for the call): every check, the plan, the
 * memory, the chunks. Tests hand the CPU backend with its capabilities
 * changed (without FG_BACKEND_HOST_MEMORY: the staged path over it). */
fg_status fg_linear_run(fg_call *call, const fg_device *be, const fg_linear_options *opts,
                        const linear_request *req, const fg_linear_inputs *in,
                        fg_linear_outputs *out);

/* fg_linear_grpo_plan's query for a request on backend `be` (as above). */
fg_status fg_linear_plan_request(fg_call *call, const fg_device *be,
                                 const fg_linear_options *opts, const linear_request *req,
                                 const fg_linear_inputs *in, const fg_linear_outputs *out,
                                 fg_linear_plan_info *info);

/* The up-front scan's findings: the inputs were scanned (the finite check
 * on), and their largest |element|s, which bound every logit and, with the
 * per-token derivatives, every gradient entry (fg_grad_bound). */
typedef struct input_bounds {
    int scanned;
    double hidden_max, weight_max;
    double logit_max; /* every |z| is at most this */
} input_bounds;

/* Every check of a request's arguments: config, views, batch or tokens
 * (host memory), outputs, options. *n_active: the unmasked tokens; *ib
 * zeroed (unscanned). Neither the aliasing check nor the scan of the
 * inputs' values: the plan query makes neither, a call both (on a backend,
 * the scan in the backend's memory). */
fg_status fg_linear_validate(fg_call *call, const fg_linear_options *o, const linear_request *req,
                             const fg_linear_inputs *in, const fg_linear_outputs *out,
                             int64_t *n_active, input_bounds *ib);

/* A call's outputs against its inputs and one another (fusedgrpo.h
 * "Conventions"): FG_ERR_ALIASED_OUTPUT, before anything is written. The
 * caller's own request (on a backend: its pointers, not the staged host
 * copies), after fg_linear_validate. */
fg_status fg_linear_check_aliasing(const fg_call *call, const linear_request *req,
                                   const fg_linear_inputs *in, const fg_linear_outputs *out);

/* From the inputs' largest magnitudes (bias: {0, 0} when none): the
 * logits' bound, FG_ERR_OVERFLOW beyond float range; then, for the backward
 * kinds, the bound of the caller's derivatives (host memory). Fills *ib. */
fg_status fg_linear_check_bounds(fg_call *call, const linear_request *req,
                                 const fg_linear_inputs *in, const fg_linear_outputs *out,
                                 fg_magnitude h, fg_magnitude w, fg_magnitude b, input_bounds *ib);

/* The gradient bound of a call (fg_grad_bound) from its scanned inputs and
 * the outputs it writes; all scales 0 when the inputs were not scanned. */
fg_grad_bound fg_linear_grad_bound(const input_bounds *ib, const fg_linear_outputs *out,
                                   double temperature, int64_t vocab);

/* The weight holds a slice of a larger vocabulary. */
int fg_linear_is_sharded(const fg_linear_inputs *in);

/* The phase API's (a), after the chunks wrote each unmasked token's own
 * statistics into stats (host memory, [FG_SHARD_STATS_FLOATS(N)]): the
 * masked tokens' (none: shard_stats.h) and the status slot cleared. */
void fg_shard_stats_close(float *stats, const fg_batch *batch);

/* The phase API's (d): the merged zmax, lsum and entropy that
 * fg_shard_stats_finish left in stats (host memory), into c->ta at the
 * unmasked tokens: what the backward reads. */
void fg_shard_stats_load(const float *stats, const fg_batch *batch, const fg_common *c);

#endif
