/*
 * The CPU backend: the seam's chunk ops (backend.h) on host memory, the
 * products through oneDNN in fixed blocks (gemm_onednn.h), the row work
 * with OpenMP over rows (row_kernels.h). The driver (linear_grpo.c) makes
 * one for each call that runs on the CPU.
 *
 * Its memory is the host's (FG_BACKEND_HOST_MEMORY), so it has every
 * optional op: statistics, the loss's derivatives and dlogits in one read
 * of each row (stats_backward), a vocab shard's own row statistics for the
 * communicator hook and the phase API (shard_stats), GEMM 2 apart from
 * writing its rows (dhidden, put_grad_hidden), so that the hook sums
 * grad_hidden's shares between the two, and gradient filtering (filter:
 * GEMMs 2 and 3 then as sparse products). Its planner facts: the products'
 * compute dtype (bf16 only where measured faster), their scratch for a
 * chunk size, the logits product's block, where grad_hidden's blocks run
 * slow.
 */
#ifndef FG_BACKEND_CPU_H
#define FG_BACKEND_CPU_H

#include "backend.h"
#include "call.h"
#include "gemm_onednn.h"
#include "grad_filter.h"

/* One call's CPU backend. */
typedef struct fg_cpu_backend {
    fg_call *call; /* threads, the GEMM cache and its statistics, the error sink */
    /* The chunk's kept entries after filter: the products run sparse while
     * kept_total >= 0 (from filter up to the next chunk's backward). */
    fg_kept kept;
    int64_t kept_total;
} fg_cpu_backend;

/* The backend of `call` into *out (its state is *s, which must outlive it). */
void fg_backend_cpu_init(fg_cpu_backend *s, fg_call *call, fg_device *out);

#endif
