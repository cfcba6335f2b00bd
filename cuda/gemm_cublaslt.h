/*
 * The three products of a chunk through cuBLASLt, on device memory.
 *
 * Row-major matrices with row strides in elements, as in fusedgrpo.h. A chunk
 * is M token rows; H the hidden size, V the vocabulary:
 *
 *   logits      [M, V]  = h [M, H] · W [V, H]ᵀ                   (GEMM 1)
 *   grad_hidden [M, H]  = dlogits [M, V] · W [V, H]   (+ beta·itself) (GEMM 2)
 *   grad_weight [V, H]  = dlogits [M, V]ᵀ · h [M, H]  (+ beta·itself) (GEMM 3)
 *
 * The operands of one product share a storage dtype (in_type): bfloat16 runs
 * on tensor cores with float32 accumulation; float32 runs in true float32
 * (CUBLAS_COMPUTE_32F: TF32 is never used). Outputs are float32, or bfloat16
 * for bfloat16 operands (FG_ERR_UNSUPPORTED otherwise);
 * with beta = 1 the output is read and added to (grad_weight summed over the
 * chunks in a float32 buffer).
 *
 * Every call runs asynchronously on g->stream with g->workspace (the
 * caller's device memory, g->workspace_bytes of it; fg_cuda_gemm_workspace_hint
 * suggests a size) and returns an fg_status: FG_ERR_NULL_ARGUMENT or
 * FG_ERR_INVALID_SIZE for bad arguments, FG_ERR_BACKEND when cuBLASLt fails or
 * has no algorithm for the layout, with a message in msg naming the product
 * and the cuBLASLt status. Nothing is written before the checks pass.
 */
#ifndef FG_CUDA_GEMM_CUBLASLT_H
#define FG_CUDA_GEMM_CUBLASLT_H

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "fusedgrpo.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fg_cuda_gemm {
    cublasLtHandle_t lt;
    cudaStream_t stream;
    void *workspace; /* device memory, 256-byte aligned */
    size_t workspace_bytes;
} fg_cuda_gemm;

/* A workspace size that lets cuBLASLt pick its fast Hopper kernels. */
size_t fg_cuda_gemm_workspace_hint(void);

/* GEMM 1: logits = h · Wᵀ. */
fg_status fg_cuda_gemm_logits(const fg_cuda_gemm *g, fg_dtype in_type, int64_t M, int64_t V,
                              int64_t H, const void *h, int64_t ld_h, const void *w, int64_t ld_w,
                              void *logits, fg_dtype logits_type, int64_t ld_logits, char *msg,
                              size_t msg_size);

/* GEMM 2: grad_hidden = dlogits · W + beta · grad_hidden. */
fg_status fg_cuda_gemm_grad_hidden(const fg_cuda_gemm *g, fg_dtype in_type, int64_t M, int64_t V,
                                   int64_t H, const void *dlogits, int64_t ld_d, const void *w,
                                   int64_t ld_w, void *grad_hidden, fg_dtype gh_type,
                                   int64_t ld_gh, float beta, char *msg, size_t msg_size);

/* GEMM 3: grad_weight = dlogitsᵀ · h + beta · grad_weight. */
fg_status fg_cuda_gemm_grad_weight(const fg_cuda_gemm *g, fg_dtype in_type, int64_t M, int64_t V,
                                   int64_t H, const void *dlogits, int64_t ld_d, const void *h,
                                   int64_t ld_h, void *grad_weight, fg_dtype gw_type,
                                   int64_t ld_gw, float beta, char *msg, size_t msg_size);

#ifdef __cplusplus
}
#endif

#endif
