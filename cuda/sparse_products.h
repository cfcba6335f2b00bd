/*
 * Gradient filtering's sparse products on the device: GEMMs 2 and 3 of a
 * chunk over the entries of dlogits the filter kept (fg_cuda_filter_rows,
 * chunk_ops.h), in the CPU's summation order (src/core/grad_filter.h), so
 * that the same kept entries give the CPU's bits.
 *
 *   decide:   sparse = every row keeps at most cap entries and the chunk at
 *             most fg_cuda_sparse_entries(m, V); row_off = the rows' exclusive
 *             prefix sums of their kept counts                    [m + 1]
 *   compact:  row i's kept (column, value) pairs, columns ascending, at
 *             row_off[i]                                          CSR [kept]
 *   dhidden:  gh[i, :] = Σ_p val[p] · W[col[p], :], p in row i's order  [m, H]
 *   order:    the CSR positions sorted by column, stably (rows stay
 *             ascending within a column; CUB's radix sort), and each
 *             column's range                                      [entries], [V]
 *   dweight:  gw[v, :] = (first ? 0 : gw[v, :]) + Σ val · hbuf[row, :], the
 *             rows keeping v in ascending order                   [V, H]
 *
 * Each output element is one thread's float32 sum in that order, a fused
 * multiply-add a term (as the CPU's vectorized loops contract y += a·x): no
 * atomics, the same bits run to run, and the CPU's for the same kept entries
 * where its loops run with FMA (AVX2 and AVX-512). Every kernel after decide returns at once when the chunk is
 * not sparse, so the pieces may be launched unconditionally; the backend
 * instead runs them as the sparse branch of a CUDA graph conditional node
 * that decide sets, with the dense cuBLASLt products as the other branch
 * (backend_cuda.cu): the choice costs no host wait.
 *
 * Why per entry and not per tile: on SmolLM2's own completions at filter_eps
 * 1e-5 every 128 x 128 tile of dlogits holds a kept entry
 * (bench/kept_blocks.py), so a tensor-core product skipping empty tiles skips
 * nothing; per entry, the products read one weight (or hbuf) row per kept
 * entry, a bandwidth-bound cost that beats the dense products only while few
 * entries are kept (about V/256 a row on an H200, an estimate to measure:
 * sparse_entries).
 */
#ifndef FG_CUDA_SPARSE_PRODUCTS_H
#define FG_CUDA_SPARSE_PRODUCTS_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "chunk_ops.h"
#include "fusedgrpo.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The sparse products' scratch for chunks of at most `rows` rows over V
 * vocabulary entries, carved from one allocation (fg_cuda_sparse_carve). */
typedef struct fg_cuda_sparse {
    int64_t rows, V, entries; /* capacities: rows, vocabulary, kept entries    */
    int32_t *flag;            /* [1] decide's answer: 1 sparse, 0 dense        */
    int32_t *row_off;         /* [rows + 1] CSR row offsets                    */
    int32_t *col, *row;       /* [entries] kept entries' column and row, CSR   */
    float *val;               /* [entries] their dlogits, as float32            */
    uint32_t *key_in, *key_out; /* [entries] columns to sort, sorted           */
    int32_t *pos_in, *pos_out;  /* [entries] CSR positions, in column order    */
    int32_t *col_begin, *col_end; /* [V] each column's range of pos_out        */
    void *sort_temp;          /* CUB's radix sort scratch                       */
    size_t sort_bytes;
} fg_cuda_sparse;

/* The kept entries a chunk of `rows` rows may hold to run sparse: rows ·
 * max(V / 256, 1), at most 2^30 (int32 offsets). */
int64_t fg_cuda_sparse_entries(int64_t rows, int64_t V);

/* Bytes of the scratch for chunks of at most `rows` rows (CUB's sort scratch
 * is queried from the current device). FG_ERR_UNSUPPORTED for V or H past
 * int32. */
fg_status fg_cuda_sparse_bytes(int64_t rows, int64_t V, size_t *bytes, char *msg,
                               size_t msg_size);

/* The scratch's pieces from `base` (fg_cuda_sparse_bytes of it, 256-byte
 * aligned); fails only where the sort's scratch size cannot be had. */
fg_status fg_cuda_sparse_carve(fg_cuda_sparse *s, void *base, int64_t rows, int64_t V,
                               char *msg, size_t msg_size);

/* decide for the chunk's m rows from the filter's row scratch (their kept
 * counts, -1 past the cap) against fg_cuda_sparse_entries(m, V); sets
 * *s->flag and, with set_handle, the graph conditional `handle` (a
 * cudaGraphConditionalHandle) to the same value. One block; no host wait. */
fg_status fg_cuda_sparse_decide(const fg_cuda_filter_row *rows, int64_t m, int64_t cap,
                                const fg_cuda_sparse *s, int set_handle,
                                unsigned long long handle, cudaStream_t stream, char *msg,
                                size_t msg_size);

/* compact: the kept entries of the filtered d [m, V] (stride ld; row i's
 * threshold and target as the filter had them). */
fg_status fg_cuda_sparse_compact(const void *d, fg_dtype type, int64_t m, int64_t ld,
                                 const int64_t *targets, const fg_cuda_filter_row *rows,
                                 const fg_cuda_sparse *s, cudaStream_t stream, char *msg,
                                 size_t msg_size);

/* dhidden: gh [m, H] (stride gh_ld) from w [V, H] (stride w_ld, float32 or
 * bf16). */
fg_status fg_cuda_sparse_dhidden(const fg_cuda_sparse *s, int64_t m, const void *w,
                                 fg_dtype w_t, int64_t w_ld, int64_t H, float *gh, int64_t gh_ld,
                                 cudaStream_t stream, char *msg, size_t msg_size);

/* order, then dweight: gw [V, H] (stride gw_ld, float32), overwritten when
 * `first`, else added to; hbuf [m, H] (stride h_ld, float32 or bf16). */
fg_status fg_cuda_sparse_dweight(const fg_cuda_sparse *s, int64_t m, const void *hbuf,
                                 fg_dtype h_t, int64_t h_ld, int64_t H, float *gw, int64_t gw_ld,
                                 int first, cudaStream_t stream, char *msg, size_t msg_size);

#ifdef __cplusplus
}
#endif

#endif
