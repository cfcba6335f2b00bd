/*
 * The GEMM layer: C[M,N] (+)= A[M,K] · B[K,N] (+ bias[N]) through oneDNN's
 * matmul primitive, with explicit strides so that transposed views (Wᵀ,
 * dlogitsᵀ) cost nothing. Primitives are cached per shape in the context;
 * oneDNN's scratchpad is user-managed so it comes out of the tracked
 * workspace and counts toward the budget.
 */
#ifndef FG_GEMM_ONEDNN_H
#define FG_GEMM_ONEDNN_H

#include "internal.h"

typedef struct fg_gemm_shape {
    int64_t M, N, K;
    fg_dtype ab_type; /* A and B share it: f32·f32 or bf16·bf16, f32 accumulation */
    fg_dtype c_type;
    int64_t a_rs, a_cs; /* A element (m,k) at m*a_rs + k*a_cs */
    int64_t b_rs, b_cs; /* B element (k,n) at k*b_rs + n*b_cs */
    int64_t c_ld;
    int accumulate;     /* C += A·B instead of C = A·B */
    int has_bias;       /* bias[N] in ab_type added to every row */
} fg_gemm_shape;

fg_status fg_gemm_cache_create(fg_context *ctx);
void fg_gemm_cache_destroy(fg_context *ctx);

/* Creates (or finds) the primitive for shape; *scratch_bytes receives the
 * scratchpad it needs. Call before writing any output, so backend failures
 * surface while outputs are untouched. */
fg_status fg_gemm_prepare(fg_context *ctx, const fg_gemm_shape *shape, size_t *scratch_bytes);

/* Runs it. scratch must hold the prepared scratch_bytes. */
fg_status fg_gemm_run(fg_context *ctx, const fg_gemm_shape *shape, const void *A, const void *B,
                      void *C, const void *bias, void *scratch);

#endif
