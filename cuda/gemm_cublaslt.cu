/* The chunk's three products through cuBLASLt: see gemm_cublaslt.h.
 *
 * cuBLASLt is column-major; a row-major X [r, c] with stride ld is the
 * column-major Xᵀ [c, r] with the same ld, so each row-major product is
 * written as its transpose:
 *
 *   GEMM 1  logitsᵀ [V, M] = op_T(W as [H, V]) · (h as [H, M])          m V, n M, k H
 *   GEMM 2  ghᵀ     [H, M] = (W as [H, V]) · (dlogits as [V, M])         m H, n M, k V
 *   GEMM 3  gwᵀ     [H, V] = (h as [H, M]) · op_T(dlogits as [V, M])     m H, n V, k M
 *
 * The descriptors are made per call (a few microseconds of host time, once
 * per chunk and product). cuBLASLt assumes 256-byte aligned pointers unless
 * told otherwise, so each call states the alignment its pointers really have:
 * a chunk that starts inside a matrix still gets a valid algorithm. */
#include <stdint.h>
#include <stdio.h>

#include "fail.h"
#include "gemm_cublaslt.h"


size_t fg_cuda_gemm_workspace_hint(void) { return (size_t)32 << 20; }

static cudaDataType_t cuda_type(fg_dtype t)
{
    return t == FG_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

/* The largest power of two up to 256 that divides p's address. */
static uint32_t alignment_of(const void *p)
{
    uint32_t a = 256;
    while (a > 1 && (uintptr_t)p % a != 0)
        a >>= 1;
    return a;
}

/* One stored column-major operand: rows × cols with leading dimension ld. */
typedef struct operand {
    const void *p;
    cublasOperation_t op;
    uint64_t rows, cols;
    int64_t ld;
} operand;

/* The cuBLASLt objects of one call, destroyed together. */
typedef struct lt_call {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulPreference_t pref;
} lt_call;

static void lt_call_destroy(lt_call *k)
{
    if (k->pref)
        cublasLtMatmulPreferenceDestroy(k->pref);
    if (k->c)
        cublasLtMatrixLayoutDestroy(k->c);
    if (k->b)
        cublasLtMatrixLayoutDestroy(k->b);
    if (k->a)
        cublasLtMatrixLayoutDestroy(k->a);
    if (k->desc)
        cublasLtMatmulDescDestroy(k->desc);
}

static cublasStatus_t set_alignment(cublasLtMatmulPreference_t pref,
                                    cublasLtMatmulPreferenceAttributes_t attr, const void *p)
{
    const uint32_t a = alignment_of(p);
    return cublasLtMatmulPreferenceSetAttribute(pref, attr, &a, sizeof a);
}

/* The descriptors, layouts and preference of C [m, n] = op(A) · op(B) + beta C. */
static cublasStatus_t lt_call_make(lt_call *k, const fg_cuda_gemm *g, fg_dtype in_type,
                                   const operand *A, const operand *B, void *C, fg_dtype c_type,
                                   uint64_t m, uint64_t n, int64_t ldc)
{
    cublasStatus_t s = cublasLtMatmulDescCreate(&k->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescSetAttribute(k->desc, CUBLASLT_MATMUL_DESC_TRANSA, &A->op,
                                           sizeof A->op);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulDescSetAttribute(k->desc, CUBLASLT_MATMUL_DESC_TRANSB, &B->op,
                                           sizeof B->op);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&k->a, cuda_type(in_type), A->rows, A->cols, A->ld);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&k->b, cuda_type(in_type), B->rows, B->cols, B->ld);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatrixLayoutCreate(&k->c, cuda_type(c_type), m, n, ldc);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceCreate(&k->pref);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(k->pref,
                                                 CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                 &g->workspace_bytes, sizeof g->workspace_bytes);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = set_alignment(k->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, A->p);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = set_alignment(k->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, B->p);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = set_alignment(k->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, C);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = set_alignment(k->pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, C);
    return s;
}

/* C [m, n] (column-major, ldc) = op(A) · op(B) + beta · C, on g's stream. */
static fg_status lt_matmul(const fg_cuda_gemm *g, const char *what, fg_dtype in_type,
                           const operand *A, const operand *B, void *C, fg_dtype c_type,
                           uint64_t m, uint64_t n, int64_t ldc, float beta, char *msg,
                           size_t msg_size)
{
    lt_call k = {};
    cublasStatus_t s = lt_call_make(&k, g, in_type, A, B, C, c_type, m, n, ldc);
    if (s != CUBLAS_STATUS_SUCCESS) {
        lt_call_destroy(&k);
        return fail(FG_ERR_BACKEND, msg, msg_size, "cuBLASLt: describing %s: %s", what,
                    cublasLtGetStatusName(s));
    }
    cublasLtMatmulHeuristicResult_t algo;
    int found = 0;
    s = cublasLtMatmulAlgoGetHeuristic(g->lt, k.desc, k.a, k.b, k.c, k.c, k.pref, 1, &algo,
                                       &found);
    if (s == CUBLAS_STATUS_SUCCESS && found == 0)
        s = CUBLAS_STATUS_NOT_SUPPORTED;
    if (s != CUBLAS_STATUS_SUCCESS) {
        lt_call_destroy(&k);
        return fail(FG_ERR_BACKEND, msg, msg_size,
                    "cuBLASLt: no algorithm for %s (m %llu, n %llu, ldc %lld, %zu bytes of "
                    "workspace): %s",
                    what, (unsigned long long)m, (unsigned long long)n, (long long)ldc,
                    g->workspace_bytes, cublasLtGetStatusName(s));
    }
    const float alpha = 1.0f;
    s = cublasLtMatmul(g->lt, k.desc, &alpha, A->p, k.a, B->p, k.b, &beta, C, k.c, C, k.c,
                       &algo.algo, g->workspace, g->workspace_bytes, g->stream);
    lt_call_destroy(&k);
    if (s != CUBLAS_STATUS_SUCCESS)
        return fail(FG_ERR_BACKEND, msg, msg_size, "cuBLASLt: running %s: %s", what,
                    cublasLtGetStatusName(s));
    return FG_OK;
}

/* The checks all three products share. */
static fg_status check_gemm(const fg_cuda_gemm *g, const char *what, fg_dtype in_type,
                            fg_dtype out_type, int64_t M, int64_t V, int64_t H, const void *a,
                            const void *b, const void *c, char *msg, size_t msg_size)
{
    if (!g || !g->lt || !a || !b || !c || (g->workspace_bytes && !g->workspace))
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size,
                    "%s: the handle, the operands, the output and a workspace of "
                    "workspace_bytes are required",
                    what);
    if (M <= 0 || V <= 0 || H <= 0)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "%s: M = %lld, V = %lld, H = %lld (all must be > 0)", what, (long long)M,
                    (long long)V, (long long)H);
    if ((in_type != FG_DTYPE_F32 && in_type != FG_DTYPE_BF16) ||
        (out_type != FG_DTYPE_F32 && out_type != FG_DTYPE_BF16))
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size, "%s: unknown dtype (in %d, out %d)",
                    what, (int)in_type, (int)out_type);
    /* cuBLASLt's float32 products write float32 only; bf16 outputs are for bf16 inputs. */
    if (in_type == FG_DTYPE_F32 && out_type == FG_DTYPE_BF16)
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "%s: float32 operands with a bfloat16 output", what);
    return FG_OK;
}

static fg_status check_ld(const char *what, const char *name, int64_t ld, int64_t cols, char *msg,
                          size_t msg_size)
{
    if (ld < cols)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size, "%s: %s = %lld < %lld columns", what,
                    name, (long long)ld, (long long)cols);
    return FG_OK;
}

fg_status fg_cuda_gemm_logits(const fg_cuda_gemm *g, fg_dtype in_type, int64_t M, int64_t V,
                              int64_t H, const void *h, int64_t ld_h, const void *w, int64_t ld_w,
                              void *logits, fg_dtype logits_type, int64_t ld_logits, char *msg,
                              size_t msg_size)
{
    const char *what = "GEMM 1 (logits = h W^T)";
    fg_status st = check_gemm(g, what, in_type, logits_type, M, V, H, h, w, logits, msg, msg_size);
    if (st == FG_OK)
        st = check_ld(what, "ld_h", ld_h, H, msg, msg_size);
    if (st == FG_OK)
        st = check_ld(what, "ld_w", ld_w, H, msg, msg_size);
    if (st == FG_OK)
        st = check_ld(what, "ld_logits", ld_logits, V, msg, msg_size);
    if (st != FG_OK)
        return st;
    const operand A = {w, CUBLAS_OP_T, (uint64_t)H, (uint64_t)V, ld_w};
    const operand B = {h, CUBLAS_OP_N, (uint64_t)H, (uint64_t)M, ld_h};
    return lt_matmul(g, what, in_type, &A, &B, logits, logits_type, (uint64_t)V, (uint64_t)M,
                     ld_logits, 0.0f, msg, msg_size);
}

fg_status fg_cuda_gemm_grad_hidden(const fg_cuda_gemm *g, fg_dtype in_type, int64_t M, int64_t V,
                                   int64_t H, const void *dlogits, int64_t ld_d, const void *w,
                                   int64_t ld_w, void *grad_hidden, fg_dtype gh_type,
                                   int64_t ld_gh, float beta, char *msg, size_t msg_size)
{
    const char *what = "GEMM 2 (grad_hidden = dlogits W)";
    fg_status st =
        check_gemm(g, what, in_type, gh_type, M, V, H, dlogits, w, grad_hidden, msg, msg_size);
    if (st == FG_OK)
        st = check_ld(what, "ld_d", ld_d, V, msg, msg_size);
    if (st == FG_OK)
        st = check_ld(what, "ld_w", ld_w, H, msg, msg_size);
    if (st == FG_OK)
        st = check_ld(what, "ld_gh", ld_gh, H, msg, msg_size);
    if (st != FG_OK)
        return st;
    const operand A = {w, CUBLAS_OP_N, (uint64_t)H, (uint64_t)V, ld_w};
    const operand B = {dlogits, CUBLAS_OP_N, (uint64_t)V, (uint64_t)M, ld_d};
    return lt_matmul(g, what, in_type, &A, &B, grad_hidden, gh_type, (uint64_t)H, (uint64_t)M,
                     ld_gh, beta, msg, msg_size);
}

fg_status fg_cuda_gemm_grad_weight(const fg_cuda_gemm *g, fg_dtype in_type, int64_t M, int64_t V,
                                   int64_t H, const void *dlogits, int64_t ld_d, const void *h,
                                   int64_t ld_h, void *grad_weight, fg_dtype gw_type,
                                   int64_t ld_gw, float beta, char *msg, size_t msg_size)
{
    const char *what = "GEMM 3 (grad_weight = dlogits^T h)";
    fg_status st =
        check_gemm(g, what, in_type, gw_type, M, V, H, dlogits, h, grad_weight, msg, msg_size);
    if (st == FG_OK)
        st = check_ld(what, "ld_d", ld_d, V, msg, msg_size);
    if (st == FG_OK)
        st = check_ld(what, "ld_h", ld_h, H, msg, msg_size);
    if (st == FG_OK)
        st = check_ld(what, "ld_gw", ld_gw, H, msg, msg_size);
    if (st != FG_OK)
        return st;
    const operand A = {h, CUBLAS_OP_N, (uint64_t)H, (uint64_t)M, ld_h};
    const operand B = {dlogits, CUBLAS_OP_T, (uint64_t)V, (uint64_t)M, ld_d};
    return lt_matmul(g, what, in_type, &A, &B, grad_weight, gw_type, (uint64_t)H, (uint64_t)V,
                     ld_gw, beta, msg, msg_size);
}
