/*
 * The CPU backend: the seam's chunk ops (backend.h) on host memory, the
 * products through oneDNN in fixed blocks (gemm_onednn.h), the row work
 * with OpenMP over rows (row_kernels.h). The CPU driver (linear_grpo.c)
 * reaches the hardware through it, one instance per call, and asks it the
 * facts of its chunk planner: the products' scratch for a chunk size, the
 * logits product's block, where grad_hidden's blocks run slow.
 *
 * Beside the seam's ops it fills the optional ones only a host backend can
 * run (backend.h, "capabilities"): statistics, the loss's derivatives and
 * dlogits in one read of each row (stats_backward), a vocab shard's own row
 * statistics for the communicator hook and the phase API (shard_stats),
 * GEMM 2 apart from writing its rows (dhidden, put_grad_hidden), so that
 * the hook sums grad_hidden's shares between the two, and gradient
 * filtering (filter: GEMMs 2 and 3 then as sparse products).
 */
#ifndef FG_BACKEND_CPU_H
#define FG_BACKEND_CPU_H

#include "backend.h"
#include "call.h"
#include "gemm_onednn.h"
#include "grad_filter.h"

/* One call's CPU backend. */
typedef struct fg_cpu_backend {
    fg_call *call;    /* threads, the GEMM cache and its statistics, the error sink */
    int gemm_workers; /* threads the products run on: the scratchpads the plan holds */
    int tiles;        /* converted weight tiles allowed: 0 for float32 inputs where
                         shards merge per chunk (the plan's tile_cap explains) */
    /* Gradient filtering (grad_filter.h): the threshold (0: off) and the
     * workspace the driver carved for it, [chunk_rows, kept_cap] ids,
     * [chunk_rows] counts and targets; then the chunk's kept entries: the
     * products run sparse while kept_total >= 0 (from filter up to the next
     * chunk's backward). */
    double filter_eps;
    int64_t kept_cap;
    int32_t *kept_idx, *kept_nnz;
    int64_t *kept_tgt;
    fg_kept kept;
    int64_t kept_total;
} fg_cpu_backend;

/* The backend of `call` into *out (its state is *s, which must outlive it). */
void fg_backend_cpu_init(fg_cpu_backend *s, fg_call *call, int tiles, fg_device *out);

/* The products' operand dtype for inputs of in_t: bf16 only where oneDNN
 * multiplies bf16 natively on this CPU, else float32 (gathered rows and
 * weight tiles widened). hbuf and dlogits hold it (fg_backend_call). */
fg_dtype fg_cpu_gemm_dtype(const fg_call *call, fg_dtype in_t);

/* Planning, before the workspace is carved: c's shapes, dtypes and views;
 * c->gw_sum non-NULL exactly when GEMM 3 sums into float32 sums. */

/* Prepares every product a chunk of m rows issues, raising *need to cover
 * them (oneDNN's primitives: a failure surfaces before any output). */
fg_status fg_cpu_prepare_chunk(const fg_cpu_backend *s, const fg_backend_call *c, int64_t m,
                               fg_gemm_scratch *need);

/* The rows of one block of the logits product: a chunk's rows past its
 * last whole block run zero-padded (gemm_onednn.h). */
int64_t fg_cpu_logits_block_rows(void);

/* Whether grad_hidden's product for a chunk of m rows may run at half
 * speed (short blocks read the weight in place at a cache-set stride). */
int fg_cpu_dhidden_slow(const fg_cpu_backend *s, const fg_backend_call *c, int64_t m);

#endif
