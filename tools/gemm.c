/* The tool's products through the library's GEMM layer: see gemm.h. */
#include "gemm.h"

#include "buffer.h"
#include "config.h"

#include <omp.h>
#include <stdio.h>

/* Converted bf16 weight tiles at the library's cap (gemm_onednn.h). */
#define TILE_BYTES FG_TILE_CAP_BYTES

int ft_gemm_init(ft_gemm *g, int threads, int64_t chunk_rows, char *err, size_t errlen)
{
    *g = (ft_gemm){.threads = threads > 0 ? threads : omp_get_max_threads(), .chunk_rows = chunk_rows};
    fg_status st = fg_gemm_cache_create(&g->cache);
    if (st != FG_OK)
        return ft_error(err, errlen, "fg_gemm_cache_create: %s", fg_status_name(st));
    g->native_bf16 = fg_gemm_native_bf16(g->cache);
    return 0;
}

void ft_gemm_free(ft_gemm *g)
{
    fg_gemm_cache_destroy(g->cache);
    ft_big_free(g->scratch, g->scratch_bytes);
    ft_big_free(g->wide, g->wide_bytes);
    *g = (ft_gemm){0};
}

size_t ft_gemm_bytes(const ft_gemm *g) { return g->scratch_bytes + g->wide_bytes; }

/* Makes *buf hold at least `bytes` (page-aligned, so 64-byte aligned too). */
static int grow(ft_gemm *g, void **buf, size_t *have, size_t bytes)
{
    if (bytes <= *have)
        return 0;
    ft_big_free(*buf, *have);
    *buf = ft_big_alloc(bytes);
    *have = *buf ? bytes : 0;
    return *buf ? 0 : ft_error(g->err.msg, sizeof g->err.msg, "out of memory for %zu bytes", bytes);
}

static int product(ft_gemm *g, const fg_gemm_shape *s, const void *A, const void *B, void *C,
                   const void *bias)
{
    fg_gemm_scratch need = {0, 0};
    if (fg_gemm_prepare(g->cache, s, g->threads, &need, &g->err) != FG_OK ||
        grow(g, &g->scratch, &g->scratch_bytes, fg_gemm_scratch_bytes(&need, g->threads)) != 0)
        return -1;
    return g->dry || fg_gemm_run(g->cache, s, A, B, C, bias, g->scratch, g->threads, NULL, &g->err) == FG_OK
               ? 0 : -1;
}

/* Rows [r0, r0 + m) of A (cols wide) as this CPU's GEMMs take them: in
 * place, or widened to f32 (*type becomes f32) where bf16 is not native. */
static const void *a_rows(ft_gemm *g, int *type, const void *A, int64_t r0, int64_t m, int64_t cols)
{
    const size_t count = (size_t)m * (size_t)cols;
    const void *p = (const char *)A + (size_t)r0 * (size_t)cols * ft_dtype_size(*type);
    if (*type != FG_DTYPE_BF16 || g->native_bf16)
        return p;
    *type = FG_DTYPE_F32;
    if (grow(g, (void **)&g->wide, &g->wide_bytes, count * sizeof(float)) != 0)
        return NULL;
    if (!g->dry) {
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < count; i++)
            g->wide[i] = fg_bf16_to_f32(((const uint16_t *)p)[i]);
    }
    return g->wide;
}

int ft_gemm_logits(ft_gemm *g, int a_type, const void *A, int64_t M, int w_type, const void *W,
                   const void *bias, int64_t V, int64_t H, int c_type, void *C)
{
    const int64_t step = g->chunk_rows > 0 ? g->chunk_rows : M;
    for (int64_t r0 = 0; r0 < M; r0 += step) {
        const int64_t m = M - r0 < step ? M - r0 : step;
        int t = a_type;
        const void *a = a_rows(g, &t, A, r0, m, H);
        fg_gemm_shape s = {m, V, H, t, w_type, c_type, H, 1, 1, H, V, 0, bias != NULL,
                           TILE_BYTES, FG_BLOCK_LOGITS_M, FG_BLOCK_LOGITS_N, 1, 0};
        char *c = (char *)C + (size_t)r0 * (size_t)V * ft_dtype_size(c_type);
        if (a == NULL || product(g, &s, a, W, c, bias) != 0)
            return -1;
    }
    return 0;
}

int ft_gemm_backward(ft_gemm *g, int d_type, const void *D, const void *A, int64_t M, int w_type,
                     const void *W, int64_t V, int64_t H, float *gh, float *gw, int accumulate)
{
    const int64_t step = g->chunk_rows > 0 ? g->chunk_rows : M;
    for (int64_t r0 = 0; r0 < M; r0 += step) {
        const int64_t m = M - r0 < step ? M - r0 : step;
        int t = d_type;
        const void *d = a_rows(g, &t, D, r0, m, V);
        if (d == NULL)
            return -1;
        fg_gemm_shape dh = {m, H, V, t, w_type, FG_DTYPE_F32, V, 1, H, 1, H, 0, 0,
                            TILE_BYTES, FG_BLOCK_DHIDDEN_M, FG_BLOCK_DHIDDEN_N, 0,
                            FG_BLOCK_DHIDDEN_SPLIT_K};
        if (gh && product(g, &dh, d, W, gh + (size_t)r0 * (size_t)H, NULL) != 0)
            return -1;
        /* gw = Dᵀ·A: the chunk's tokens are the product's K. */
        fg_gemm_shape dw = {V, H, m, t, d_type, FG_DTYPE_F32, 1, V, H, 1, H, accumulate || r0 > 0, 0,
                            TILE_BYTES, FG_BLOCK_DWEIGHT_M, 0, 0, 0};
        const char *a = (const char *)A + (size_t)r0 * (size_t)H * ft_dtype_size(d_type);
        if (gw && product(g, &dw, d, a, gw, NULL) != 0)
            return -1;
    }
    return 0;
}
