/* Gradient filtering's sparse products: see sparse_products.h. Every sum
 * steps by one fused multiply-add (__fmaf_rn), as the CPU's vectorized
 * grad_filter.c loops do (y += a·x contracted to an FMA). */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <stdint.h>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "fail.h"
#include "sparse_products.h"
#include "storage.cuh"

namespace {

constexpr int DECIDE_THREADS = 256;
constexpr int ROW_THREADS = 256;  /* compact: a block per row                    */
constexpr int H_THREADS = 256;    /* dhidden, dweight: a thread per hidden entry  */
constexpr int COLS_PER_BLOCK = 8; /* dweight: vocabulary columns a block walks    */

size_t up256(size_t n) { return (n + 255) / 256 * 256; }

/* The radix sort's key bits: columns in [0, V], V the padding's key. */
int key_bits(int64_t V)
{
    int b = 1;
    while (b < 32 && (int64_t{1} << b) <= V)
        b++;
    return b;
}

/* Each row's kept count (a row past the cap counts as over), their exclusive
 * prefix sums into row_off, and whether the chunk runs sparse. */
__global__ void __launch_bounds__(DECIDE_THREADS)
    decide_kernel(const fg_cuda_filter_row *rows, int m, int cap, long long entries,
                  int32_t *row_off, int32_t *flag, cudaGraphConditionalHandle handle,
                  int set_handle)
{
    typedef cub::BlockScan<long long, DECIDE_THREADS> Scan;
    __shared__ typename Scan::TempStorage tmp;
    long long carry = 0; /* every thread holds the same running total */
    int over = 0;
    for (int base = 0; base < m; base += DECIDE_THREADS) {
        const int i = base + (int)threadIdx.x;
        long long k = 0;
        int bad = 0;
        if (i < m) {
            const int kept = rows[i].kept;
            bad = kept < 0 || kept > cap;
            k = kept < 0 ? 0 : kept;
        }
        over |= __syncthreads_or(bad);
        long long excl, all;
        Scan(tmp).ExclusiveSum(k, excl, all);
        if (i < m) /* clamped: past `entries` the chunk runs dense and nothing reads them */
            row_off[i] = (int32_t)(carry + excl < entries ? carry + excl : entries);
        carry += all;
        __syncthreads(); /* tmp is reused */
    }
    if (threadIdx.x == 0) {
        const int sparse = !over && carry <= entries;
        row_off[m] = (int32_t)(carry < entries ? carry : entries);
        *flag = sparse;
        if (set_handle)
            cudaGraphSetConditional(handle, sparse ? 1u : 0u);
    }
}

/* Row i's kept entries, columns ascending: the filter's rule again, from its
 * threshold (a dropped entry is 0 now, which the rule drops again). */
template <typename T>
__global__ void __launch_bounds__(ROW_THREADS) compact_kernel(const T *d, int64_t ld, int V, const int64_t *targets,
                               const fg_cuda_filter_row *rows, const int32_t *flag,
                               const int32_t *row_off, int32_t *col, int32_t *row, float *val)
{
    if (!*flag)
        return;
    typedef cub::BlockScan<int, ROW_THREADS> Scan;
    __shared__ typename Scan::TempStorage tmp;
    const int i = blockIdx.x;
    const T *x = d + (int64_t)i * ld;
    const float thr = rows[i].threshold;
    const int64_t target = targets[i];
    int out = row_off[i];
    for (int v0 = 0; v0 < V; v0 += ROW_THREADS) {
        const int v = v0 + (int)threadIdx.x;
        float a = 0.0f;
        int keep = 0;
        if (v < V) {
            a = to_float(x[v]);
            keep = fabsf(a) > thr || (int64_t)v == target;
        }
        int at, all;
        Scan(tmp).ExclusiveSum(keep, at, all);
        if (keep) {
            col[out + at] = v;
            row[out + at] = i;
            val[out + at] = a;
        }
        out += all;
        __syncthreads();
    }
}

/* gh[i, h] = Σ_p val[p] · w[col[p], h] over row i's entries in order. */
template <typename W>
__global__ void __launch_bounds__(H_THREADS) dhidden_kernel(const int32_t *flag, const int32_t *row_off, const int32_t *col,
                               const float *val, const W *w, int64_t w_ld, int H, float *gh,
                               int64_t gh_ld)
{
    if (!*flag)
        return;
    const int i = blockIdx.x, h = blockIdx.y * H_THREADS + (int)threadIdx.x;
    if (h >= H)
        return;
    float acc = 0.0f;
    const int end = row_off[i + 1];
#pragma unroll 8
    for (int p = row_off[i]; p < end; p++) /* loads run ahead; the adds stay in order */
        acc = __fmaf_rn(val[p], to_float(w[(int64_t)col[p] * w_ld + h]), acc);
    gh[(int64_t)i * gh_ld + h] = acc;
}

/* The radix sort's input: each CSR position's column (V past the chunk's
 * kept entries, so that they sort last) and the position itself. */
__global__ void __launch_bounds__(256) sort_input_kernel(const int32_t *flag, const int32_t *row_off, int m,
                                  const int32_t *col, int64_t entries, uint32_t V, uint32_t *key,
                                  int32_t *pos)
{
    if (!*flag)
        return;
    const int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= entries)
        return;
    key[p] = p < row_off[m] ? (uint32_t)col[p] : V;
    pos[p] = (int32_t)p;
}

/* Each column's range [col_begin, col_end) of the sorted positions (both 0
 * for a column no row keeps: set before). */
__global__ void __launch_bounds__(256) ranges_kernel(const int32_t *flag, const uint32_t *key, int64_t entries,
                              uint32_t V, int32_t *begin, int32_t *end)
{
    if (!*flag)
        return;
    const int64_t p = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= entries || key[p] >= V)
        return;
    const uint32_t k = key[p];
    if (p == 0 || key[p - 1] != k)
        begin[k] = (int32_t)p;
    if (p + 1 == entries || key[p + 1] != k)
        end[k] = (int32_t)(p + 1);
}

/* gw[v, h] = (first ? 0 : gw[v, h]) + Σ val · hbuf[row, h], the rows keeping
 * v ascending; a column no row keeps is zeroed when `first`, else left. */
template <typename T>
__global__ void __launch_bounds__(H_THREADS) dweight_kernel(const int32_t *flag, const int32_t *begin, const int32_t *end,
                               const int32_t *pos, const int32_t *row, const float *val,
                               const T *hb, int64_t h_ld, int V, int H, float *gw, int64_t gw_ld,
                               int first)
{
    if (!*flag)
        return;
    const int h = blockIdx.y * H_THREADS + (int)threadIdx.x;
    if (h >= H)
        return;
    const int v0 = blockIdx.x * COLS_PER_BLOCK;
    for (int v = v0; v < V && v < v0 + COLS_PER_BLOCK; v++) {
        const int b = begin[v], e = end[v];
        if (b == e && !first)
            continue;
        float *y = gw + (int64_t)v * gw_ld + h;
        float acc = first ? 0.0f : *y;
#pragma unroll 8
        for (int p = b; p < e; p++) {
            const int q = pos[p];
            acc = __fmaf_rn(val[q], to_float(hb[(int64_t)row[q] * h_ld + h]), acc);
        }
        *y = acc;
    }
}

fg_status check_dtype(const char *what, const char *name, fg_dtype t, char *msg, size_t msg_size)
{
    if (t != FG_DTYPE_F32 && t != FG_DTYPE_BF16)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size, "%s: %s of unknown dtype %d", what, name, (int)t);
    return FG_OK;
}

fg_status check_rows(const char *what, const fg_cuda_sparse *s, int64_t m, char *msg,
                     size_t msg_size)
{
    if (!s || !s->flag)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "%s: the sparse scratch is required",
                    what);
    if (m < 1 || m > s->rows)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size, "%s: %lld rows (the scratch holds %lld)",
                    what, (long long)m, (long long)s->rows);
    return FG_OK;
}

/* A product's arguments: the chunk's rows, the operand x [., H] (stride
 * x_ld) of dtype x_t and the float32 output (stride out_ld). */
fg_status check_product(const char *what, const fg_cuda_sparse *s, int64_t m, const char *x_name,
                        const void *x, fg_dtype x_t, int64_t x_ld, const char *out_name,
                        const float *out, int64_t out_ld, int64_t H, char *msg, size_t msg_size)
{
    fg_status st = check_rows(what, s, m, msg, msg_size);
    if (st == FG_OK)
        st = check_dtype(what, x_name, x_t, msg, msg_size);
    if (st != FG_OK)
        return st;
    if (!x || !out || H < 1 || H > (int64_t)65535 * H_THREADS || x_ld < H || out_ld < H)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "%s: %s (stride %lld) and %s (stride %lld) of H = %lld", what, x_name,
                    (long long)x_ld, out_name, (long long)out_ld, (long long)H);
    return FG_OK;
}

int64_t blocks_of(int64_t n, int64_t per) { return (n + per - 1) / per; }

} // namespace

extern "C" int64_t fg_cuda_sparse_entries(int64_t rows, int64_t V)
{
    const int64_t per_row = V / 256 > 1 ? V / 256 : 1;
    const int64_t limit = int64_t{1} << 30;
    return rows > limit / per_row ? limit : rows * per_row;
}

/* CUB's radix sort scratch for `entries` slots of keys below 2^key_bits(V). */
static fg_status sort_bytes_of(int64_t entries, int64_t V, size_t *bytes, char *msg,
                               size_t msg_size)
{
    *bytes = 0;
    const cudaError_t err = cub::DeviceRadixSort::SortPairs(
        nullptr, *bytes, (const uint32_t *)nullptr, (uint32_t *)nullptr,
        (const int32_t *)nullptr, (int32_t *)nullptr, (int)entries, 0, key_bits(V));
    if (err != cudaSuccess)
        return fail(FG_ERR_BACKEND, msg, msg_size, "CUDA: the radix sort's scratch: %s (%s)",
                    cudaGetErrorName(err), cudaGetErrorString(err));
    return FG_OK;
}

/* The pieces, in carve's order. */
static size_t layout(int64_t rows, int64_t V, int64_t entries, size_t sort_bytes)
{
    const size_t e = (size_t)entries;
    return up256(sizeof(int32_t)) + up256((size_t)(rows + 1) * sizeof(int32_t)) +
           2 * up256(e * sizeof(int32_t)) + up256(e * sizeof(float)) +
           2 * up256(e * sizeof(uint32_t)) + 2 * up256(e * sizeof(int32_t)) +
           2 * up256((size_t)V * sizeof(int32_t)) + up256(sort_bytes);
}

extern "C" fg_status fg_cuda_sparse_bytes(int64_t rows, int64_t V, size_t *bytes, char *msg,
                                          size_t msg_size)
{
    if (!bytes)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "sparse products: bytes is NULL");
    *bytes = 0;
    if (rows < 1 || V < 1 || rows >= INT_MAX || V >= INT_MAX)
        return fail(FG_ERR_UNSUPPORTED, msg, msg_size,
                    "sparse products: %lld rows of %lld entries (int32 indices)",
                    (long long)rows, (long long)V);
    const int64_t entries = fg_cuda_sparse_entries(rows, V);
    size_t sort_bytes = 0;
    const fg_status st = sort_bytes_of(entries, V, &sort_bytes, msg, msg_size);
    if (st == FG_OK)
        *bytes = layout(rows, V, entries, sort_bytes);
    return st;
}

extern "C" fg_status fg_cuda_sparse_carve(fg_cuda_sparse *s, void *base, int64_t rows, int64_t V,
                                          char *msg, size_t msg_size)
{
    const int64_t entries = fg_cuda_sparse_entries(rows, V);
    const size_t e = (size_t)entries;
    unsigned char *p = static_cast<unsigned char *>(base);
    auto take = [&p](size_t n) {
        void *q = p;
        p += up256(n);
        return q;
    };
    s->rows = rows;
    s->V = V;
    s->entries = entries;
    s->flag = static_cast<int32_t *>(take(sizeof(int32_t)));
    s->row_off = static_cast<int32_t *>(take((size_t)(rows + 1) * sizeof(int32_t)));
    s->col = static_cast<int32_t *>(take(e * sizeof(int32_t)));
    s->row = static_cast<int32_t *>(take(e * sizeof(int32_t)));
    s->val = static_cast<float *>(take(e * sizeof(float)));
    s->key_in = static_cast<uint32_t *>(take(e * sizeof(uint32_t)));
    s->key_out = static_cast<uint32_t *>(take(e * sizeof(uint32_t)));
    s->pos_in = static_cast<int32_t *>(take(e * sizeof(int32_t)));
    s->pos_out = static_cast<int32_t *>(take(e * sizeof(int32_t)));
    s->col_begin = static_cast<int32_t *>(take((size_t)V * sizeof(int32_t)));
    s->col_end = static_cast<int32_t *>(take((size_t)V * sizeof(int32_t)));
    s->sort_temp = p; /* the rest: layout's sort_bytes */
    return sort_bytes_of(entries, V, &s->sort_bytes, msg, msg_size);
}

extern "C" fg_status fg_cuda_sparse_decide(const fg_cuda_filter_row *rows, int64_t m, int64_t cap,
                                           const fg_cuda_sparse *s, int set_handle,
                                           unsigned long long handle, cudaStream_t stream,
                                           char *msg, size_t msg_size)
{
    const char *what = "sparse decide";
    fg_status st = check_rows(what, s, m, msg, msg_size);
    if (st != FG_OK)
        return st;
    if (!rows || cap < 0)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size, "%s: the filter's rows, cap %lld", what,
                    (long long)cap);
    /* this chunk's own budget of V/256 a row (m <= s->rows: within the scratch's) */
    decide_kernel<<<1, DECIDE_THREADS, 0, stream>>>(
        rows, (int)m, cap > INT_MAX ? INT_MAX : (int)cap,
        (long long)fg_cuda_sparse_entries(m, s->V), s->row_off, s->flag,
        (cudaGraphConditionalHandle)handle, set_handle);
    return launched(what, msg, msg_size);
}

extern "C" fg_status fg_cuda_sparse_compact(const void *d, fg_dtype type, int64_t m, int64_t ld,
                                            const int64_t *targets,
                                            const fg_cuda_filter_row *rows,
                                            const fg_cuda_sparse *s, cudaStream_t stream,
                                            char *msg, size_t msg_size)
{
    const char *what = "sparse compact";
    fg_status st = check_rows(what, s, m, msg, msg_size);
    if (st == FG_OK)
        st = check_dtype(what, "dlogits", type, msg, msg_size);
    if (st != FG_OK)
        return st;
    if (!d || !targets || !rows || ld < s->V)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "%s: dlogits (stride %lld for %lld entries), targets and the filter's rows "
                    "are required", what, (long long)ld, (long long)s->V);
    if (type == FG_DTYPE_BF16)
        compact_kernel<<<(unsigned)m, ROW_THREADS, 0, stream>>>(
            static_cast<const __nv_bfloat16 *>(d), ld, (int)s->V, targets, rows, s->flag,
            s->row_off, s->col, s->row, s->val);
    else
        compact_kernel<<<(unsigned)m, ROW_THREADS, 0, stream>>>(
            static_cast<const float *>(d), ld, (int)s->V, targets, rows, s->flag, s->row_off,
            s->col, s->row, s->val);
    return launched(what, msg, msg_size);
}

extern "C" fg_status fg_cuda_sparse_dhidden(const fg_cuda_sparse *s, int64_t m, const void *w,
                                            fg_dtype w_t, int64_t w_ld, int64_t H, float *gh,
                                            int64_t gh_ld, cudaStream_t stream, char *msg,
                                            size_t msg_size)
{
    const char *what = "sparse dhidden";
    const fg_status st = check_product(what, s, m, "the weight", w, w_t, w_ld, "grad_hidden", gh,
                                       gh_ld, H, msg, msg_size);
    if (st != FG_OK)
        return st;
    const dim3 grid((unsigned)m, (unsigned)blocks_of(H, H_THREADS));
    if (w_t == FG_DTYPE_BF16)
        dhidden_kernel<<<grid, H_THREADS, 0, stream>>>(s->flag, s->row_off, s->col, s->val,
                                                        static_cast<const __nv_bfloat16 *>(w),
                                                        w_ld, (int)H, gh, gh_ld);
    else
        dhidden_kernel<<<grid, H_THREADS, 0, stream>>>(s->flag, s->row_off, s->col, s->val,
                                                        static_cast<const float *>(w), w_ld,
                                                        (int)H, gh, gh_ld);
    return launched(what, msg, msg_size);
}

extern "C" fg_status fg_cuda_sparse_dweight(const fg_cuda_sparse *s, int64_t m, const void *hbuf,
                                            fg_dtype h_t, int64_t h_ld, int64_t H, float *gw,
                                            int64_t gw_ld, int first, cudaStream_t stream,
                                            char *msg, size_t msg_size)
{
    const char *what = "sparse dweight";
    fg_status st = check_product(what, s, m, "hbuf", hbuf, h_t, h_ld, "grad_weight", gw, gw_ld, H,
                                 msg, msg_size);
    if (st != FG_OK)
        return st;
    const int64_t entries = s->entries;
    const uint32_t V = (uint32_t)s->V;
    const unsigned eb = (unsigned)blocks_of(entries, 256);
    sort_input_kernel<<<eb, 256, 0, stream>>>(s->flag, s->row_off, (int)m, s->col, entries, V,
                                              s->key_in, s->pos_in);
    if ((st = launched(what, msg, msg_size)) != FG_OK)
        return st;
    /* The sort runs over every slot (its length is the host's), whether or
     * not the chunk is sparse: the backend runs this in the sparse branch. */
    size_t sort_bytes = s->sort_bytes;
    cudaError_t err = cub::DeviceRadixSort::SortPairs(
        s->sort_temp, sort_bytes, s->key_in, s->key_out, s->pos_in, s->pos_out, (int)entries, 0,
        key_bits(s->V), stream);
    if (err == cudaSuccess)
        err = cudaMemsetAsync(s->col_begin, 0, (size_t)V * sizeof(int32_t), stream);
    if (err == cudaSuccess)
        err = cudaMemsetAsync(s->col_end, 0, (size_t)V * sizeof(int32_t), stream);
    if (err != cudaSuccess)
        return fail(FG_ERR_BACKEND, msg, msg_size, "CUDA: %s's column order: %s (%s)", what,
                    cudaGetErrorName(err), cudaGetErrorString(err));
    ranges_kernel<<<eb, 256, 0, stream>>>(s->flag, s->key_out, entries, V, s->col_begin,
                                          s->col_end);
    if ((st = launched(what, msg, msg_size)) != FG_OK)
        return st;
    const dim3 grid((unsigned)blocks_of(s->V, COLS_PER_BLOCK), (unsigned)blocks_of(H, H_THREADS));
    if (h_t == FG_DTYPE_BF16)
        dweight_kernel<<<grid, H_THREADS, 0, stream>>>(
            s->flag, s->col_begin, s->col_end, s->pos_out, s->row, s->val,
            static_cast<const __nv_bfloat16 *>(hbuf), h_ld, (int)s->V, (int)H, gw, gw_ld, first);
    else
        dweight_kernel<<<grid, H_THREADS, 0, stream>>>(
            s->flag, s->col_begin, s->col_end, s->pos_out, s->row, s->val,
            static_cast<const float *>(hbuf), h_ld, (int)s->V, (int)H, gw, gw_ld, first);
    return launched(what, msg, msg_size);
}
