/* Tool-side GEMMs through oneDNN sgemm: see tool_gemm.h. */
#include "tool_gemm.h"

#include "bigbuf.h"
#include "config.h"
#include "problem.h"

#include <oneapi/dnnl/dnnl.h>
#include <stdio.h>
#include <stdlib.h>

#define VBLOCK 1024 /* vocabulary rows widened at a time for bf16 operands */

size_t ft_gemm_ws_need(int dtype, int out_dtype, int64_t rows, int64_t vocab, int64_t hidden)
{
    if (dtype != FT_DTYPE_BF16 && out_dtype != FT_DTYPE_BF16)
        return 0;
    size_t vb = (size_t)(vocab < VBLOCK ? vocab : VBLOCK);
    size_t n = (size_t)rows, h = (size_t)hidden;
    size_t logits = n * h + vb * h + n * vb;
    size_t ghid = n * vb + vb * h;
    size_t gwt = n * h + n * vb;
    size_t m = logits > ghid ? logits : ghid;
    return m > gwt ? m : gwt;
}

int ft_gemm_ws_reserve(ft_gemm_ws *ws, size_t floats)
{
    if (floats <= ws->floats)
        return 0;
    ft_gemm_ws_free(ws);
    ws->buf = ft_big_alloc(floats * sizeof(float));
    if (ws->buf == NULL)
        return -1;
    ws->floats = floats;
    return 0;
}

void ft_gemm_ws_free(ft_gemm_ws *ws)
{
    ft_big_free(ws->buf, ws->floats * sizeof(float));
    ws->buf = NULL;
    ws->floats = 0;
}

size_t ft_gemm_ws_bytes(const ft_gemm_ws *ws) { return ws->floats * sizeof(float); }

/* dst[r, c] = src[r, c0 + c] as float for r < rows, c < cols (src row stride ld). */
static void widen(int dtype, const void *src, int64_t ld, int64_t c0, int64_t rows, int64_t cols,
                  float *dst)
{
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            dst[r * cols + c] = ft_load(src, dtype, r * ld + c0 + c);
}

static int sgemm(char ta, char tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                 const float *B, int64_t ldb, float beta, float *C, int64_t ldc, char *err,
                 size_t errlen)
{
    dnnl_status_t st = dnnl_sgemm(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
    if (st != dnnl_success) {
        snprintf(err, errlen, "dnnl_sgemm(%c%c, %lld x %lld x %lld) failed with status %d", ta, tb,
                 (long long)M, (long long)N, (long long)K, (int)st);
        return -1;
    }
    return 0;
}

static int need_ws(ft_gemm_ws *ws, size_t floats, char *err, size_t errlen)
{
    if (ft_gemm_ws_reserve(ws, floats) != 0) {
        snprintf(err, errlen, "out of memory for %zu bytes of GEMM scratch", floats * sizeof(float));
        return -1;
    }
    return 0;
}

int ft_gemm_logits(ft_gemm_ws *ws, int dtype, const void *A, int64_t M, const void *W,
                   const void *bias, int64_t V, int64_t H, void *out, int out_dtype, char *err,
                   size_t errlen)
{
    if (dtype == FT_DTYPE_F32 && out_dtype == FT_DTYPE_F32) {
        if (sgemm('N', 'T', M, V, H, A, H, W, H, 0.0f, out, V, err, errlen) != 0)
            return -1;
        if (bias) {
#pragma omp parallel for schedule(static)
            for (int64_t r = 0; r < M; r++)
                for (int64_t v = 0; v < V; v++)
                    ((float *)out)[r * V + v] += ((const float *)bias)[v];
        }
        return 0;
    }
    int64_t vb_max = V < VBLOCK ? V : VBLOCK;
    size_t need = (size_t)(M * H + vb_max * H + M * vb_max);
    if (need_ws(ws, need, err, errlen) != 0)
        return -1;
    float *a32 = ws->buf, *w32 = a32 + M * H, *c32 = w32 + vb_max * H;
    const float *a = A;
    if (dtype == FT_DTYPE_BF16) {
        widen(dtype, A, H, 0, M, H, a32);
        a = a32;
    }
    for (int64_t v0 = 0; v0 < V; v0 += vb_max) {
        int64_t vb = V - v0 < vb_max ? V - v0 : vb_max;
        const float *w = (const float *)W + v0 * H;
        if (dtype == FT_DTYPE_BF16) {
            widen(dtype, (const uint16_t *)W + v0 * H, H, 0, vb, H, w32);
            w = w32;
        }
        if (sgemm('N', 'T', M, vb, H, a, H, w, H, 0.0f, c32, vb, err, errlen) != 0)
            return -1;
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < M; r++)
            for (int64_t c = 0; c < vb; c++) {
                float z = c32[r * vb + c] + (bias ? ft_load(bias, dtype, v0 + c) : 0.0f);
                ft_store(out, out_dtype, r * V + v0 + c, z);
            }
    }
    return 0;
}

int ft_gemm_grad_hidden(ft_gemm_ws *ws, int dtype, const void *D, const void *W, int64_t N,
                        int64_t V, int64_t H, float *gh, char *err, size_t errlen)
{
    if (dtype == FT_DTYPE_F32)
        return sgemm('N', 'N', N, H, V, D, V, W, H, 0.0f, gh, H, err, errlen);
    int64_t vb_max = V < VBLOCK ? V : VBLOCK;
    if (need_ws(ws, (size_t)(N * vb_max + vb_max * H), err, errlen) != 0)
        return -1;
    float *d32 = ws->buf, *w32 = d32 + N * vb_max;
    for (int64_t v0 = 0; v0 < V; v0 += vb_max) {
        int64_t vb = V - v0 < vb_max ? V - v0 : vb_max;
        widen(dtype, D, V, v0, N, vb, d32);
        widen(dtype, (const uint16_t *)W + v0 * H, H, 0, vb, H, w32);
        if (sgemm('N', 'N', N, H, vb, d32, vb, w32, H, v0 == 0 ? 0.0f : 1.0f, gh, H, err, errlen) != 0)
            return -1;
    }
    return 0;
}

int ft_gemm_grad_weight(ft_gemm_ws *ws, int dtype, const void *D, const void *A, int64_t N,
                        int64_t V, int64_t H, float *gw, char *err, size_t errlen)
{
    if (dtype == FT_DTYPE_F32)
        return sgemm('T', 'N', V, H, N, D, V, A, H, 0.0f, gw, H, err, errlen);
    int64_t vb_max = V < VBLOCK ? V : VBLOCK;
    if (need_ws(ws, (size_t)(N * H + N * vb_max), err, errlen) != 0)
        return -1;
    float *a32 = ws->buf, *d32 = a32 + N * H;
    widen(dtype, A, H, 0, N, H, a32);
    for (int64_t v0 = 0; v0 < V; v0 += vb_max) {
        int64_t vb = V - v0 < vb_max ? V - v0 : vb_max;
        widen(dtype, D, V, v0, N, vb, d32);
        if (sgemm('T', 'N', vb, H, N, d32, vb, a32, H, 0.0f, gw + v0 * H, H, err, errlen) != 0)
            return -1;
    }
    return 0;
}

void ft_colsum(int dtype, const void *D, int64_t N, int64_t V, float *gb)
{
    enum { CB = 512 }; /* columns per task: rows are read contiguously, not strided by V */
#pragma omp parallel for schedule(static)
    for (int64_t v0 = 0; v0 < V; v0 += CB) {
        int64_t vb = V - v0 < CB ? V - v0 : CB;
        double acc[CB] = {0};
        for (int64_t r = 0; r < N; r++)
            for (int64_t c = 0; c < vb; c++)
                acc[c] += ft_load(D, dtype, r * V + v0 + c);
        for (int64_t c = 0; c < vb; c++)
            gb[v0 + c] = (float)acc[c];
    }
}
