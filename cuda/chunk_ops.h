/*
 * The small kernels of a chunk besides the row work (row_stats.h) and the
 * products (gemm_cublaslt.h): moving token rows between the caller's
 * [N, H] matrices and a chunk's contiguous buffers, the bias, the rounding of
 * float32 sums into the caller's outputs, zero rows, and the finite scan of
 * an input. What the CUDA backend (backend_cuda.cu) runs for backend.h's ops.
 *
 * Row-major matrices with row strides in elements, as in fusedgrpo.h; dtypes
 * float32 or bfloat16 (raw bits; rounding float32 → bf16 is round to nearest
 * even, once). Every pointer is device memory. Every function checks its
 * arguments, enqueues its kernels on `stream` and returns an fg_status:
 * FG_ERR_NULL_ARGUMENT / FG_ERR_INVALID_SIZE for bad arguments (nothing is
 * launched), FG_ERR_BACKEND when a launch fails, with a message in msg. A
 * row index read from device memory that is out of range never faults: the
 * kernels skip it (or fill NaN where a value must be produced; see below).
 * Gradient filtering (fg_cuda_filter_rows) zeroes the entries of a chunk's
 * dlogits that the spec's rule drops, in place.
 */
#ifndef FG_CUDA_CHUNK_OPS_H
#define FG_CUDA_CHUNK_OPS_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "fusedgrpo.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a scan found; the layout of backend.h's fg_backend_scan (checked
 * there with static_asserts). */
typedef struct fg_cuda_scan {
    uint32_t top_bits; /* largest |x| as float32 bits; >= 0x7f800000: NaN or Inf */
    uint32_t pad;      /* 0                                                      */
    int64_t top_row;   /* its row, the lowest on ties; -1: no row scanned        */
    int64_t bad_row;   /* the lowest row holding a NaN/Inf; -1: none             */
    int64_t bad_col;   /* the lowest such column of bad_row; -1: none            */
} fg_cuda_scan;

/* The scan of x [rows, cols] (row stride ld, dtype xtype): rows with
 * mask[r] != 0 only (mask NULL: every row), into *out (device memory, every
 * field written). At most INT_MAX rows (one block each; the top row's key
 * holds the row in 32 bits). Three small kernels: reset, one block per row,
 * then one block for bad_col and the top row's index. */
fg_status fg_cuda_scan_matrix(const void *x, fg_dtype xtype, int64_t rows, int64_t cols,
                              int64_t ld, const uint8_t *mask, fg_cuda_scan *out,
                              cudaStream_t stream, char *msg, size_t msg_size);

/* dst [m, cols] (row stride ld_dst) = src [rows[i], :] for i < m, src of
 * src_rows rows (stride ld_src), the same dtype (bits copied). A row index
 * outside [0, src_rows) gives a row of NaN: the statistics of that row are
 * then not finite, which the driver's check of the statistics reports,
 * instead of a fault. With mask (NULL: none), a row r with mask[r] == 0
 * gives a zero row (a device-reported walk over masked tokens, whose
 * hidden rows may hold NaN). */
fg_status fg_cuda_gather_rows(const void *src, fg_dtype type, int64_t src_rows, int64_t ld_src,
                              const int64_t *rows, const uint8_t *mask, int64_t m, int64_t cols,
                              void *dst, int64_t ld_dst, cudaStream_t stream, char *msg,
                              size_t msg_size);

/* dst [rows[i], :] (dst_rows rows, stride ld_dst, float32 or bf16) =
 * src [i, :] (float32, stride ld_src) for i < m. Out-of-range indices are
 * skipped. */
fg_status fg_cuda_scatter_rows(const float *src, int64_t ld_src, const int64_t *rows, int64_t m,
                               int64_t cols, void *dst, fg_dtype dst_type, int64_t dst_rows,
                               int64_t ld_dst, cudaStream_t stream, char *msg, size_t msg_size);

/* x [m, V] (stride ld, float32 or bf16) += bias [V] (float32 or bf16),
 * added in float32 and rounded once. */
fg_status fg_cuda_add_bias(void *x, fg_dtype xtype, int64_t m, int64_t V, int64_t ld,
                           const void *bias, fg_dtype bias_type, cudaStream_t stream, char *msg,
                           size_t msg_size);

/* dst [rows, cols] (stride ld_dst, float32 or bf16) = src [rows, cols]
 * (float32, stride ld_src), + dst's old value when `add`: one float32 add,
 * one rounding. grad_weight's float32 sums (rows V) and grad_bias's (rows 1). */
fg_status fg_cuda_store_sums(const float *src, int64_t ld_src, void *dst, fg_dtype dst_type,
                             int64_t ld_dst, int64_t rows, int64_t cols, int add,
                             cudaStream_t stream, char *msg, size_t msg_size);

/* Zeroes row r of x [rows, cols] (stride ld, float32 or bf16) where keep is
 * NULL or keep[r] == 0: grad_hidden at masked tokens, or a whole grad_weight. */
fg_status fg_cuda_zero_rows(void *x, fg_dtype type, int64_t rows, int64_t cols, int64_t ld,
                            const uint8_t *keep, cudaStream_t stream, char *msg, size_t msg_size);

/* One row's scratch of the filter: its threshold and its kept entries
 * (-1: more than cap, the row keeps every entry). */
typedef struct fg_cuda_filter_row {
    float threshold;
    int32_t kept;
} fg_cuda_filter_row;

/* Gradient filtering (docs/LOSS_SPEC.md "Gradient filtering"; the reference
 * backend's ref_filter is the specification) of d [m, V] (stride ld,
 * float32 or bf16, in place), row i's target targets[i] (outside [0, V):
 * none):
 *
 *   thr_i   = (float)(eps · (double) max_v |d[i, v]|)   (NaN entries ignored)
 *   kept    (i, v)  iff  |d[i, v]| > thr_i  or  v == targets[i]
 *   count_i = #kept in row i
 *
 * A row with count_i > cap keeps every entry (count_i := V); in every other
 * row the dropped entries are set to +0. *kept_count += Σ count_i.
 * kept_count (one int64) and rows ([m], the scratch) are device memory.
 * Integer sums and a max only: the same result for any launch order, no
 * host wait. eps > 0 and finite, cap >= 0, at most INT_MAX rows. Two
 * kernels: count (one block per row: a max pass, then a count pass, one
 * integer atomicAdd into kept_count), zero (one block per row). */
fg_status fg_cuda_filter_rows(void *d, fg_dtype type, int64_t m, int64_t V, int64_t ld,
                              const int64_t *targets, double eps, int64_t cap,
                              fg_cuda_filter_row *rows, int64_t *kept_count, cudaStream_t stream,
                              char *msg, size_t msg_size);

#ifdef __cplusplus
}
#endif

#endif
