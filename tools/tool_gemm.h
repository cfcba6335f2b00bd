/*
 * The tool's own GEMMs, outside the library under test: they materialize
 * the logits that the "logits" impl feeds to fg_logits_grpo, run that impl's
 * backward products, and give the synthetic batch its true log-probs.
 * oneDNN's sgemm (row-major) does the work; bfloat16 operands are widened
 * to float32 in blocks of vocabulary rows, because the machines we target
 * lack native bf16 GEMM and a whole widened weight would double the memory.
 * The block scratch lives in a workspace reserved once, so timed steps never
 * allocate or fault pages.
 */
#ifndef FT_TOOL_GEMM_H
#define FT_TOOL_GEMM_H

#include <stddef.h>
#include <stdint.h>

typedef struct ft_gemm_ws {
    float *buf;
    size_t floats;
} ft_gemm_ws;

/* Scratch floats the calls below need for these sizes and dtype. */
size_t ft_gemm_ws_need(int dtype, int out_dtype, int64_t rows, int64_t vocab, int64_t hidden);
int ft_gemm_ws_reserve(ft_gemm_ws *ws, size_t floats);
void ft_gemm_ws_free(ft_gemm_ws *ws);
size_t ft_gemm_ws_bytes(const ft_gemm_ws *ws);

/* out[M, V] (out_dtype, row stride V) = A[M, H] · W[V, H]^T + bias[V] (bias may be NULL). */
int ft_gemm_logits(ft_gemm_ws *ws, int dtype, const void *A, int64_t M, const void *W,
                   const void *bias, int64_t V, int64_t H, void *out, int out_dtype, char *err,
                   size_t errlen);
/* gh[N, H] (f32) = D[N, V] · W[V, H] */
int ft_gemm_grad_hidden(ft_gemm_ws *ws, int dtype, const void *D, const void *W, int64_t N,
                        int64_t V, int64_t H, float *gh, char *err, size_t errlen);
/* gw[V, H] (f32) = D[N, V]^T · A[N, H] */
int ft_gemm_grad_weight(ft_gemm_ws *ws, int dtype, const void *D, const void *A, int64_t N,
                        int64_t V, int64_t H, float *gw, char *err, size_t errlen);
/* gb[V] (f32) = sum over rows of D[N, V] */
void ft_colsum(int dtype, const void *D, int64_t N, int64_t V, float *gb);

#endif
