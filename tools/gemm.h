/*
 * The tool's own GEMMs, outside the library under test but through the
 * library's GEMM layer (src/backends/cpu/gemm_onednn.h: the same oneDNN blocks and bf16
 * tile path): the logits the `logits` impl feeds to fg_logits_grpo and that
 * impl's two backward products, the synthetic batch's true log-probs, and
 * bench's bare-GEMM roofline.
 *
 * Products run chunk_rows token rows at a time; where bf16 is not native
 * (fg_gemm_native_bf16) a bf16 A operand is widened to f32 a chunk at a
 * time, as the library's driver does. Scratch grows on first use and stays.
 */
#ifndef FT_GEMM_H
#define FT_GEMM_H

#include "gemm_onednn.h"

typedef struct ft_gemm {
    fg_gemm_cache *cache;
    int threads, native_bf16;
    int64_t chunk_rows;  /* token rows per product; <= 0: all at once */
    int dry;             /* prepare and size everything, run nothing (before a timed run) */
    void *scratch;       /* oneDNN scratchpads and converted bf16 tiles */
    float *wide;         /* one chunk of A widened to f32 */
    size_t scratch_bytes, wide_bytes;
    fg_error err;        /* why the last call failed */
} ft_gemm;

/* threads <= 0: the OpenMP default. 0, or -1 with a message in err. */
int ft_gemm_init(ft_gemm *g, int threads, int64_t chunk_rows, char *err, size_t errlen);
void ft_gemm_free(ft_gemm *g);
size_t ft_gemm_bytes(const ft_gemm *g); /* scratch + widened chunk held now */

/* These return 0, or -1 with the reason in g->err.msg. Types are fg_dtype. */
/* C[M, V] (c_type) = A[M, H] · W[V, H]ᵀ + bias[V] (bias in W's type; NULL: none). */
int ft_gemm_logits(ft_gemm *g, int a_type, const void *A, int64_t M, int w_type, const void *W,
                   const void *bias, int64_t V, int64_t H, int c_type, void *C);
/* gh[M, H] = D[M, V] · W and gw[V, H] = Dᵀ · A[M, H] (+ gw when accumulate);
 * D and A in d_type, gh and gw float32; a NULL output is skipped. */
int ft_gemm_backward(ft_gemm *g, int d_type, const void *D, const void *A, int64_t M, int w_type,
                     const void *W, int64_t V, int64_t H, float *gh, float *gw, int accumulate);

#endif
