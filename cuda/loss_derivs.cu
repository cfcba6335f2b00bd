/* The loss's per-token derivatives on the GPU: see loss_derivs.h.
 *
 * One thread per chunk row: the work is a few dozen double operations per
 * token on m floats (a chunk of thousands of rows next to its [m, V] row
 * work), so the kernel only has to avoid a host round trip, not to be fast.
 * The plan travels by value in the kernel's parameters (a few hundred
 * bytes): its scalars come from constant memory and its array pointers are
 * the driver's device copies.
 *
 * Compiled with --fmad=false (cuda/CMakeLists.txt, this file only): nvcc
 * otherwise contracts loss_token.h's a·b + c into FMAs, which round once
 * where the host's C rounds twice, and g would differ from the host's in
 * its last bits for no reason. */
#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include "fail.h"
#include "loss_derivs.h"
#include "loss_token.h"

#define THREADS 128

/* g, e [m] from logp, entropy [m] of the tokens rows [m]; grid: ceil(m / THREADS). */
__global__ void __launch_bounds__(THREADS)
    loss_derivs_kernel(const fg_loss_plan plan, const int64_t *rows, int64_t m,
                       const float *logp, const float *entropy, float *g, float *e)
{
    const int64_t i = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    if (i >= m)
        return;
    const int64_t n = rows[i];
    if (n < 0 || n >= plan.B * plan.T) { /* not a token of the batch: never read past it */
        g[i] = NAN;
        e[i] = NAN;
        return;
    }
    const fg_loss_plan p = fg_loss_plan_resolved(&plan); /* a device-reported call's scalars */
    fg_token_derivs(&p, n, logp[i], entropy[i], &g[i], &e[i]);
}

fg_status fg_cuda_loss_derivs(const struct fg_loss_plan *plan, const int64_t *rows, int64_t m,
                              const float *logp, const float *entropy, float *g, float *e,
                              cudaStream_t stream, char *msg, size_t msg_size)
{
    if (!plan || !rows || !logp || !entropy || !g || !e)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size,
                    "loss derivs: plan, rows, logp, entropy, g and e are required");
    if (m < 0 || m > INT_MAX)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size, "loss derivs: %lld rows (at most %d)",
                    (long long)m, INT_MAX);
    if (m == 0)
        return FG_OK;
    const unsigned blocks = (unsigned)((m + THREADS - 1) / THREADS);
    loss_derivs_kernel<<<blocks, THREADS, 0, stream>>>(*plan, rows, m, logp, entropy, g, e);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return fail(FG_ERR_BACKEND, msg, msg_size, "CUDA: launching the loss derivs: %s (%s)",
                    cudaGetErrorName(err), cudaGetErrorString(err));
    return FG_OK;
}
