/* The small kernels of a chunk: see chunk_ops.h for the contracts.
 *
 * Each kernel is one block per matrix row, its threads striding along the
 * row (coalesced, no division, int64 offsets r·ld + c); the rows are few
 * (a chunk's tokens, N, or V) and long. The scan is a reduction: a
 * block's max |x| in a fixed shuffle order, then one 64-bit atomicMax per
 * row whose key orders (magnitude, lower row), so the result is the same
 * whatever order the blocks run in. The filter's reductions are a max and
 * integer sums, exact in any order; no float is ever summed by atomics. */
#include <cuda_bf16.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include "chunk_ops.h"
#include "fail.h"
#include "storage.cuh"

#define THREADS 256


/* A quiet NaN in the bits of a stored element (gather's "no such row"). */
template <typename T> __device__ __forceinline__ T nan_bits();
template <> __device__ __forceinline__ float nan_bits<float>()
{
    return __int_as_float(0x7fc00000);
}
template <> __device__ __forceinline__ uint16_t nan_bits<uint16_t>() { return 0x7fc0; }

template <typename T> __device__ __forceinline__ T zero_bits();
template <> __device__ __forceinline__ float zero_bits<float>() { return 0.0f; }
template <> __device__ __forceinline__ uint16_t zero_bits<uint16_t>() { return 0; }

/* |x| as float32 bits: ordered as the magnitudes are, Inf at 0x7f800000 and
 * every NaN above it; a bf16 is the top half of its float32. */
__device__ __forceinline__ uint32_t magnitude_bits(float v)
{
    return __float_as_uint(v) & 0x7fffffffu;
}
__device__ __forceinline__ uint32_t magnitude_bits(uint16_t h)
{
    return ((uint32_t)h << 16) & 0x7fffffffu;
}

/* ---- the scan ------------------------------------------------------------- */

/* The scan's output as four 64-bit slots (fg_cuda_scan's layout on a
 * little-endian device; every device access goes through this type):
 *   [0] while scanning: the top key (bits << 32 | (0xffffffff − row)), 0: no
 *       row yet; finally top_bits in the low half, pad 0 in the high half
 *   [1] top_row   [2] bad_row   [3] bad_col   (-1, all bits set: none, which
 *       is also the largest value atomicMin can lower) */
typedef unsigned long long slot_t;
#define SLOT_NONE (~0ull)
#define NONFINITE_BITS 0x7f800000u

__global__ void scan_reset_kernel(slot_t *slots)
{
    if (threadIdx.x == 0) {
        slots[0] = 0;
        slots[1] = SLOT_NONE;
        slots[2] = SLOT_NONE;
        slots[3] = SLOT_NONE;
    }
}

/* The block's max of v, valid in thread 0; blockDim.x == THREADS. */
__device__ uint32_t block_max(uint32_t v)
{
    __shared__ uint32_t per_warp[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1)
        v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0)
        per_warp[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < THREADS / 32 ? per_warp[lane] : 0u;
        for (int o = 16; o > 0; o >>= 1)
            v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

/* x [rows, cols] stride ld; grid: one block per row. A masked row returns
 * before any barrier (the whole block takes the same branch). */
template <typename T>
__global__ void __launch_bounds__(THREADS)
    scan_rows_kernel(const T *x, int64_t cols, int64_t ld, const uint8_t *mask, slot_t *slots)
{
    const int64_t r = blockIdx.x;
    if (mask && mask[r] == 0)
        return;
    const T *row = x + r * ld;
    uint32_t top = 0;
    for (int64_t c = threadIdx.x; c < cols; c += THREADS)
        top = max(top, magnitude_bits(row[c]));
    top = block_max(top);
    if (threadIdx.x == 0) {
        atomicMax(&slots[0], ((slot_t)top << 32) | (slot_t)(0xffffffffu - (uint32_t)r));
        if (top >= NONFINITE_BITS)
            atomicMin(&slots[2], (slot_t)r);
    }
}

/* One block: the first non-finite column of bad_row (if any), then the top
 * key unpacked into top_bits and top_row. */
template <typename T>
__global__ void __launch_bounds__(THREADS)
    scan_finish_kernel(const T *x, int64_t cols, int64_t ld, slot_t *slots)
{
    const slot_t bad = slots[2];
    if (bad != SLOT_NONE) {
        const T *row = x + (int64_t)bad * ld;
        for (int64_t c = threadIdx.x; c < cols; c += THREADS)
            if (magnitude_bits(row[c]) >= NONFINITE_BITS)
                atomicMin(&slots[3], (slot_t)c);
    }
    if (threadIdx.x == 0) {
        const slot_t key = slots[0];
        slots[0] = key >> 32; /* top_bits, and pad = 0 */
        slots[1] = key == 0 ? SLOT_NONE : (slot_t)(0xffffffffu - (uint32_t)(key & 0xffffffffu));
    }
}

/* ---- row moves -------------------------------------------------------------- */

/* dst [m, cols] = src [rows[i], :], a zero row where mask[rows[i]] == 0;
 * grid: one block per i. */
template <typename T>
__global__ void __launch_bounds__(THREADS)
    gather_rows_kernel(const T *src, int64_t src_rows, int64_t ld_src, const int64_t *rows,
                       const uint8_t *mask, int64_t cols, T *dst, int64_t ld_dst)
{
    const int64_t i = blockIdx.x, r = rows[i];
    T *out = dst + i * ld_dst;
    if (r < 0 || r >= src_rows) {
        for (int64_t c = threadIdx.x; c < cols; c += THREADS)
            out[c] = nan_bits<T>();
        return;
    }
    if (mask && !mask[r]) { /* a masked token's row is never read: it may hold NaN */
        for (int64_t c = threadIdx.x; c < cols; c += THREADS)
            out[c] = zero_bits<T>();
        return;
    }
    const T *in = src + r * ld_src;
    for (int64_t c = threadIdx.x; c < cols; c += THREADS)
        out[c] = in[c];
}

/* dst [rows[i], :] = src [i, :] (float32 → T, one rounding); grid: one block per i. */
template <typename T>
__global__ void __launch_bounds__(THREADS)
    scatter_rows_kernel(const float *src, int64_t ld_src, const int64_t *rows, int64_t cols,
                        T *dst, int64_t dst_rows, int64_t ld_dst)
{
    const int64_t i = blockIdx.x, r = rows[i];
    if (r < 0 || r >= dst_rows)
        return;
    const float *in = src + i * ld_src;
    T *out = dst + r * ld_dst;
    for (int64_t c = threadIdx.x; c < cols; c += THREADS)
        out[c] = from_float<T>(in[c]);
}

/* ---- elementwise ------------------------------------------------------------ */

/* x [m, V] += bias [V]; grid: one block per row. */
template <typename Tx, typename Tb>
__global__ void __launch_bounds__(THREADS)
    add_bias_kernel(Tx *x, int64_t V, int64_t ld, const Tb *bias)
{
    Tx *row = x + (int64_t)blockIdx.x * ld;
    for (int64_t v = threadIdx.x; v < V; v += THREADS)
        row[v] = from_float<Tx>(to_float(row[v]) + to_float(bias[v]));
}

/* dst [rows, cols] = src (+ dst when add); grid: one block per row. */
template <typename T>
__global__ void __launch_bounds__(THREADS)
    store_sums_kernel(const float *src, int64_t ld_src, T *dst, int64_t ld_dst, int64_t cols,
                      int add)
{
    const int64_t r = blockIdx.x;
    const float *in = src + r * ld_src;
    T *out = dst + r * ld_dst;
    for (int64_t c = threadIdx.x; c < cols; c += THREADS)
        out[c] = from_float<T>(add ? in[c] + to_float(out[c]) : in[c]);
}

/* Row r of x zeroed where keep is NULL or keep[r] == 0; grid: one block per row. */
template <typename T>
__global__ void __launch_bounds__(THREADS)
    zero_rows_kernel(T *x, int64_t cols, int64_t ld, const uint8_t *keep)
{
    const int64_t r = blockIdx.x;
    if (keep && keep[r] != 0)
        return;
    T *row = x + r * ld;
    for (int64_t c = threadIdx.x; c < cols; c += THREADS)
        row[c] = zero_bits<T>();
}

/* ---- gradient filtering ------------------------------------------------------ */

/* The spec's rule (chunk_ops.h; ref_filter of the reference backend) in two
 * launches:
 *
 *   count   grid m, one block per row i of d [m, V]:
 *             top = max_v |d[i, v]|      (fmaxf: NaN ignored, as ref_filter's
 *                                         a > top ? a : top; 0 for a zero row)
 *             thr = (float)(eps · (double)top)
 *             kept = #{v : |d[i, v]| > thr or v == target_i}
 *           into rows[i] = {thr, kept}, kept = -1 where it exceeds cap (the
 *           row keeps every entry); *kept_count += kept (V for such a row),
 *           one integer atomicAdd a row
 *   zero    grid m, one block per row: unless rows[i].kept < 0, the entries
 *           that fail the test above set to +0 (d is read again, not the
 *           kept ids: the same comparisons in float, in place)
 *
 * The max of magnitudes and integer sums do not depend on the order the
 * threads or blocks run in, so the kept set and the count are those of
 * ref_filter exactly, bit for bit, and run to run. The count pass reads
 * the row twice (its max first); a row of V = 151936 bf16 (300 KB) does
 * not stay in L2 across 100+ resident blocks, so that is two reads, and
 * zero a third and the writes: ~4 passes of the chunk's dlogits, next to
 * the products' two reads of it. */

/* The block's max of v (fmaxf: a NaN loses to any number), returned to
 * every thread; blockDim.x == THREADS. */
__device__ float block_max_all(float v)
{
    __shared__ float per_warp[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0)
        per_warp[threadIdx.x / 32] = v;
    __syncthreads();
    v = per_warp[0];
    for (int w = 1; w < THREADS / 32; w++)
        v = fmaxf(v, per_warp[w]);
    __syncthreads(); /* per_warp read by all before any later reuse */
    return v;
}

/* The block's sum of v (integers: exact in any order), returned to every
 * thread; blockDim.x == THREADS. */
__device__ long long block_sum_all(long long v)
{
    __shared__ long long per_warp[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0)
        per_warp[threadIdx.x / 32] = v;
    __syncthreads();
    v = 0;
    for (int w = 0; w < THREADS / 32; w++)
        v += per_warp[w];
    __syncthreads();
    return v;
}

/* Whether entry (v, x) of a row with threshold thr and target tok is kept. */
__device__ __forceinline__ bool filter_keeps(float x, int64_t v, float thr, int64_t tok)
{
    return fabsf(x) > thr || v == tok;
}

/* d [m, V] stride ld; grid: one block per row. */
template <typename T>
__global__ void __launch_bounds__(THREADS)
    filter_count_kernel(const T *d, int64_t V, int64_t ld, const int64_t *targets, double eps,
                        int64_t cap, fg_cuda_filter_row *rows, int64_t *kept_count)
{
    const int64_t i = blockIdx.x;
    const T *row = d + i * ld;
    float top = 0.0f;
    for (int64_t v = threadIdx.x; v < V; v += THREADS)
        top = fmaxf(top, fabsf(to_float(row[v])));
    top = block_max_all(top);
    /* In double, rounded once to float: ref_filter's threshold, bit for bit. */
    const float thr = (float)(eps * (double)top);
    const int64_t tok = targets[i];
    long long kept = 0;
    for (int64_t v = threadIdx.x; v < V; v += THREADS)
        kept += filter_keeps(to_float(row[v]), v, thr, tok);
    kept = block_sum_all(kept);
    if (threadIdx.x == 0) {
        const bool whole = kept > cap; /* a flat row: every entry kept */
        rows[i].threshold = thr;
        rows[i].kept = whole ? -1 : (int32_t)kept; /* <= V <= INT_MAX */
        atomicAdd(reinterpret_cast<unsigned long long *>(kept_count),
                  (unsigned long long)(whole ? V : kept));
    }
}

/* d [m, V] stride ld, in place; grid: one block per row. A row that keeps
 * every entry returns at once (the whole block takes the same branch). */
template <typename T>
__global__ void __launch_bounds__(THREADS)
    filter_zero_kernel(T *d, int64_t V, int64_t ld, const int64_t *targets,
                       const fg_cuda_filter_row *rows)
{
    const int64_t i = blockIdx.x;
    if (rows[i].kept < 0)
        return;
    const float thr = rows[i].threshold;
    const int64_t tok = targets[i];
    T *row = d + i * ld;
    for (int64_t v = threadIdx.x; v < V; v += THREADS)
        if (!filter_keeps(to_float(row[v]), v, thr, tok))
            row[v] = from_float<T>(0.0f);
}

/* ---- host side -------------------------------------------------------------- */

static fg_status check_dtype(const char *what, fg_dtype t, char *msg, size_t msg_size)
{
    if (t != FG_DTYPE_F32 && t != FG_DTYPE_BF16)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size, "%s: unknown dtype %d", what, (int)t);
    return FG_OK;
}

/* A matrix of `rows` rows (one block each: at most INT_MAX), cols >= 1 and
 * ld >= cols, whose last offset rows·ld fits in int64. rows may be 0 only
 * where the caller says so (allow_empty). */
static fg_status check_matrix(const char *what, const char *name, int64_t rows, int64_t cols,
                              int64_t ld, int allow_empty, char *msg, size_t msg_size)
{
    if (rows < (allow_empty ? 0 : 1) || rows > INT_MAX || cols < 1 || ld < cols ||
        rows > INT64_MAX / ld)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "%s: %s has %lld rows, %lld columns, stride %lld (need 1 <= rows <= %d, "
                    "cols >= 1, ld >= cols)",
                    what, name, (long long)rows, (long long)cols, (long long)ld, INT_MAX);
    return FG_OK;
}

fg_status fg_cuda_scan_matrix(const void *x, fg_dtype xtype, int64_t rows, int64_t cols,
                              int64_t ld, const uint8_t *mask, fg_cuda_scan *out,
                              cudaStream_t stream, char *msg, size_t msg_size)
{
    const char *what = "scan";
    if (!out || (rows > 0 && !x))
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "scan: x and out are required");
    fg_status st = check_dtype(what, xtype, msg, msg_size);
    if (st == FG_OK)
        st = check_matrix(what, "x", rows, cols, ld, 1, msg, msg_size);
    if (st != FG_OK)
        return st;
    /* rows <= INT_MAX (one block each) also keeps the key's row field
     * 0xffffffff − row above 0, so key 0 means "no row". */
    slot_t *slots = reinterpret_cast<slot_t *>(out);
    scan_reset_kernel<<<1, 32, 0, stream>>>(slots);
    if ((st = launched("the scan's reset", msg, msg_size)) != FG_OK)
        return st;
    if (rows > 0) {
        if (xtype == FG_DTYPE_BF16)
            scan_rows_kernel<<<(unsigned)rows, THREADS, 0, stream>>>(
                static_cast<const uint16_t *>(x), cols, ld, mask, slots);
        else
            scan_rows_kernel<<<(unsigned)rows, THREADS, 0, stream>>>(
                static_cast<const float *>(x), cols, ld, mask, slots);
        if ((st = launched("the scan", msg, msg_size)) != FG_OK)
            return st;
    }
    /* With no row the finish reads no x (bad_row is none). */
    if (xtype == FG_DTYPE_BF16)
        scan_finish_kernel<<<1, THREADS, 0, stream>>>(static_cast<const uint16_t *>(x), cols, ld,
                                                      slots);
    else
        scan_finish_kernel<<<1, THREADS, 0, stream>>>(static_cast<const float *>(x), cols, ld,
                                                      slots);
    return launched("the scan's finish", msg, msg_size);
}

fg_status fg_cuda_gather_rows(const void *src, fg_dtype type, int64_t src_rows, int64_t ld_src,
                              const int64_t *rows, const uint8_t *mask, int64_t m, int64_t cols,
                              void *dst, int64_t ld_dst, cudaStream_t stream, char *msg,
                              size_t msg_size)
{
    const char *what = "gather rows";
    if (!src || !rows || !dst)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "%s: src, rows and dst are required",
                    what);
    fg_status st = check_dtype(what, type, msg, msg_size);
    if (st == FG_OK)
        st = check_matrix(what, "src", src_rows, cols, ld_src, 0, msg, msg_size);
    if (st == FG_OK)
        st = check_matrix(what, "dst", m, cols, ld_dst, 0, msg, msg_size);
    if (st != FG_OK)
        return st;
    if (type == FG_DTYPE_BF16)
        gather_rows_kernel<<<(unsigned)m, THREADS, 0, stream>>>(
            static_cast<const uint16_t *>(src), src_rows, ld_src, rows, mask, cols,
            static_cast<uint16_t *>(dst), ld_dst);
    else
        gather_rows_kernel<<<(unsigned)m, THREADS, 0, stream>>>(
            static_cast<const float *>(src), src_rows, ld_src, rows, mask, cols,
            static_cast<float *>(dst), ld_dst);
    return launched(what, msg, msg_size);
}

fg_status fg_cuda_scatter_rows(const float *src, int64_t ld_src, const int64_t *rows, int64_t m,
                               int64_t cols, void *dst, fg_dtype dst_type, int64_t dst_rows,
                               int64_t ld_dst, cudaStream_t stream, char *msg, size_t msg_size)
{
    const char *what = "scatter rows";
    if (!src || !rows || !dst)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "%s: src, rows and dst are required",
                    what);
    fg_status st = check_dtype(what, dst_type, msg, msg_size);
    if (st == FG_OK)
        st = check_matrix(what, "src", m, cols, ld_src, 0, msg, msg_size);
    if (st == FG_OK)
        st = check_matrix(what, "dst", dst_rows, cols, ld_dst, 0, msg, msg_size);
    if (st != FG_OK)
        return st;
    if (dst_type == FG_DTYPE_BF16)
        scatter_rows_kernel<<<(unsigned)m, THREADS, 0, stream>>>(
            src, ld_src, rows, cols, static_cast<__nv_bfloat16 *>(dst), dst_rows, ld_dst);
    else
        scatter_rows_kernel<<<(unsigned)m, THREADS, 0, stream>>>(
            src, ld_src, rows, cols, static_cast<float *>(dst), dst_rows, ld_dst);
    return launched(what, msg, msg_size);
}

template <typename Tx>
static void launch_add_bias(void *x, int64_t m, int64_t V, int64_t ld, const void *bias,
                            fg_dtype bias_type, cudaStream_t stream)
{
    Tx *xt = static_cast<Tx *>(x);
    if (bias_type == FG_DTYPE_BF16)
        add_bias_kernel<<<(unsigned)m, THREADS, 0, stream>>>(
            xt, V, ld, static_cast<const __nv_bfloat16 *>(bias));
    else
        add_bias_kernel<<<(unsigned)m, THREADS, 0, stream>>>(xt, V, ld,
                                                             static_cast<const float *>(bias));
}

fg_status fg_cuda_add_bias(void *x, fg_dtype xtype, int64_t m, int64_t V, int64_t ld,
                           const void *bias, fg_dtype bias_type, cudaStream_t stream, char *msg,
                           size_t msg_size)
{
    const char *what = "bias add";
    if (!x || !bias)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "%s: x and bias are required", what);
    fg_status st = check_dtype(what, xtype, msg, msg_size);
    if (st == FG_OK)
        st = check_dtype(what, bias_type, msg, msg_size);
    if (st == FG_OK)
        st = check_matrix(what, "x", m, V, ld, 0, msg, msg_size);
    if (st != FG_OK)
        return st;
    if (xtype == FG_DTYPE_BF16)
        launch_add_bias<__nv_bfloat16>(x, m, V, ld, bias, bias_type, stream);
    else
        launch_add_bias<float>(x, m, V, ld, bias, bias_type, stream);
    return launched(what, msg, msg_size);
}

fg_status fg_cuda_store_sums(const float *src, int64_t ld_src, void *dst, fg_dtype dst_type,
                             int64_t ld_dst, int64_t rows, int64_t cols, int add,
                             cudaStream_t stream, char *msg, size_t msg_size)
{
    const char *what = "store sums";
    if (!src || !dst)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "%s: src and dst are required", what);
    fg_status st = check_dtype(what, dst_type, msg, msg_size);
    if (st == FG_OK)
        st = check_matrix(what, "src", rows, cols, ld_src, 0, msg, msg_size);
    if (st == FG_OK)
        st = check_matrix(what, "dst", rows, cols, ld_dst, 0, msg, msg_size);
    if (st != FG_OK)
        return st;
    const int a = add != 0;
    if (dst_type == FG_DTYPE_BF16)
        store_sums_kernel<<<(unsigned)rows, THREADS, 0, stream>>>(
            src, ld_src, static_cast<__nv_bfloat16 *>(dst), ld_dst, cols, a);
    else
        store_sums_kernel<<<(unsigned)rows, THREADS, 0, stream>>>(
            src, ld_src, static_cast<float *>(dst), ld_dst, cols, a);
    return launched(what, msg, msg_size);
}

fg_status fg_cuda_zero_rows(void *x, fg_dtype type, int64_t rows, int64_t cols, int64_t ld,
                            const uint8_t *keep, cudaStream_t stream, char *msg, size_t msg_size)
{
    const char *what = "zero rows";
    if (!x)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "%s: x is required", what);
    fg_status st = check_dtype(what, type, msg, msg_size);
    if (st == FG_OK)
        st = check_matrix(what, "x", rows, cols, ld, 0, msg, msg_size);
    if (st != FG_OK)
        return st;
    if (type == FG_DTYPE_BF16)
        zero_rows_kernel<<<(unsigned)rows, THREADS, 0, stream>>>(static_cast<uint16_t *>(x), cols,
                                                                 ld, keep);
    else
        zero_rows_kernel<<<(unsigned)rows, THREADS, 0, stream>>>(static_cast<float *>(x), cols, ld,
                                                                 keep);
    return launched(what, msg, msg_size);
}

template <typename T>
static void launch_filter(void *d, int64_t m, int64_t V, int64_t ld, const int64_t *targets,
                          double eps, int64_t cap, fg_cuda_filter_row *rows, int64_t *kept_count,
                          cudaStream_t stream)
{
    T *dt = static_cast<T *>(d);
    filter_count_kernel<<<(unsigned)m, THREADS, 0, stream>>>(dt, V, ld, targets, eps, cap, rows,
                                                            kept_count);
    filter_zero_kernel<<<(unsigned)m, THREADS, 0, stream>>>(dt, V, ld, targets, rows);
}

fg_status fg_cuda_filter_rows(void *d, fg_dtype type, int64_t m, int64_t V, int64_t ld,
                              const int64_t *targets, double eps, int64_t cap,
                              fg_cuda_filter_row *rows, int64_t *kept_count, cudaStream_t stream,
                              char *msg, size_t msg_size)
{
    const char *what = "filter";
    if (!d || !targets || !rows || !kept_count)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size,
                    "%s: dlogits, targets, the row scratch and kept_count are required", what);
    fg_status st = check_dtype(what, type, msg, msg_size);
    if (st == FG_OK)
        st = check_matrix(what, "dlogits", m, V, ld, 0, msg, msg_size);
    if (st != FG_OK)
        return st;
    if (!(eps > 0) || !isfinite(eps) || cap < 0)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "%s: eps = %g (need > 0 and finite), cap = %lld (need >= 0)", what, eps,
                    (long long)cap);
    if (type == FG_DTYPE_BF16)
        launch_filter<__nv_bfloat16>(d, m, V, ld, targets, eps, cap, rows, kept_count, stream);
    else
        launch_filter<float>(d, m, V, ld, targets, eps, cap, rows, kept_count, stream);
    return launched(what, msg, msg_size);
}
