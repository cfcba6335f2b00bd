/*
 * The GEMM layer: C[M,N] (+)= A[M,K] · B[K,N] (+ bias[N]) through oneDNN's
 * matmul primitive, with explicit strides so that transposed views (Wᵀ,
 * dlogitsᵀ) cost nothing. Primitives are cached per shape in the context;
 * oneDNN's scratchpad is user-managed so it comes out of the tracked
 * workspace and counts toward the budget.
 *
 * bf16: where oneDNN has bf16 kernels for this CPU (AVX-512 BF16 / AMX) the
 * product runs natively. Elsewhere (oneDNN 2.x needs AVX-512 for bf16) a bf16
 * B operand (the weight) is converted to f32 one cache-sized tile of weight
 * rows at a time, and a bf16 C is written through an f32 tile: the weight is
 * never copied whole, and the extra traffic is one read of it per product.
 * A must then be f32: fg_gemm_native_bf16() tells the caller which to pass.
 */
#ifndef FG_GEMM_ONEDNN_H
#define FG_GEMM_ONEDNN_H

#include "internal.h"

typedef struct fg_gemm_shape {
    int64_t M, N, K;
    fg_dtype a_type, b_type; /* f32 accumulation always */
    fg_dtype c_type;
    int64_t a_rs, a_cs; /* A element (m,k) at m*a_rs + k*a_cs */
    int64_t b_rs, b_cs; /* B element (k,n) at k*b_rs + n*b_cs */
    int64_t c_ld;
    int accumulate;     /* C += A·B instead of C = A·B */
    int has_bias;       /* bias[N], in b_type, added to every row */
    size_t tile_bytes;  /* bf16 tile path: cap of one converted weight tile (the
                           caller's plan decides it; not part of a primitive's key) */
} fg_gemm_shape;

/* 1 when bf16·bf16 products run natively on this CPU. */
int fg_gemm_native_bf16(const fg_context *ctx);

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
