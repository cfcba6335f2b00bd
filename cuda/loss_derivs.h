/*
 * The loss's per-token derivatives on the GPU: the seam's derivs op
 * (src/backends/backend.h). For the chunk's rows i = 0..m-1, token
 * n = rows[i]:
 *
 *   g[i] = d loss/d logp_n    = fg_token_dlogp(plan, n, logp[i], entropy[i])
 *   e[i] = d loss/d entropy_n = fg_token_dentropy(plan, n, entropy[i])
 *
 * (fg_token_derivs: 0 at a token the plan's mask drops, when the plan has
 * its mask; a device-reported call's batch scalars read from the device)
 *
 * through src/core/loss_token.h, the host's own formulas compiled for the
 * device, so that a call needs no host round trip per chunk for g and e.
 * The file is compiled with --fmad=false (cuda/CMakeLists.txt): the device
 * then evaluates the same double expressions without contracting a·b + c
 * into an FMA, as the host C code does (loss_math.c). What may still differ
 * is the last bit of the device's double exp() against glibc's, which the
 * float results almost always round away (test_cuda_api.cu measures it in
 * ulps).
 */
#ifndef FG_CUDA_LOSS_DERIVS_H
#define FG_CUDA_LOSS_DERIVS_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "fusedgrpo.h"

struct fg_loss_plan; /* src/core/loss_math.h */

#ifdef __cplusplus
extern "C" {
#endif

/* g, e [m] from logp, entropy [m] of the tokens rows [m] (device arrays),
 * on `stream`, no host wait. `plan` is host memory and is passed to the
 * kernel by value; its arrays (the batch's advantages, old / reference
 * log-probs and ratios, the per-sequence constants, or a caller's own
 * derivatives) must be device memory, prepared (fg_loss_prepare) where the
 * loss needs every token first. A token index outside [0, B*T) gives NaN
 * g and e (never a fault). At most INT_MAX rows. */
fg_status fg_cuda_loss_derivs(const struct fg_loss_plan *plan, const int64_t *rows, int64_t m,
                              const float *logp, const float *entropy, float *g, float *e,
                              cudaStream_t stream, char *msg, size_t msg_size);

#ifdef __cplusplus
}
#endif

#endif
