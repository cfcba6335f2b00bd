/* The row work of a chunk on the GPU: see row_stats.h for the definitions.
 *
 * Forward: one block per row. Each thread streams its share of the row in
 * 16-byte packs, keeping the mergeable statistics (max, sum, dot) of
 * src/core/row_kernels.c; a pack's max is found first so that the running sums
 * are rescaled at most once per pack. The block merges its threads' partial
 * statistics in a fixed order, so a row's result does not depend on timing.
 *
 * The same kernel writes a vocab shard's own statistics (row_stats_shard):
 * one definition of a row's max, sum and dot.
 *
 * Backward: a block owns GROUP_ROWS rows × (THREADS · pack) columns. Each
 * thread walks down its columns row by row, so every load and store is
 * coalesced and the per-row coefficients come from shared memory. The bias
 * column sums are a second kernel over the stored dx, one thread per column
 * (coalesced over columns), adding the rows one by one in order: the bits of
 * summing every row in order, whatever the chunking (fg_col_sums_add of
 * src/core/row_kernels.c). It reads dx once more (M·V elements: for bf16 dlogits
 * at H = 4096 about 1.5% of the time of a chunk's three products on an H200,
 * by bandwidth and peak rates), which bits independent of the chunk size are
 * worth.
 *
 * expf and logf are the accurate library functions (no --use_fast_math). */
#include <cuda_bf16.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>

#include <algorithm>

#include "fail.h"
#include "row_stats.h"
#include "storage.cuh"

#define THREADS 256
#define GROUP_ROWS 64   /* rows per backward block (and pass) */
#define MAX_GRID_Y 65535 /* the most blocks in grid.y: larger chunks loop */
#define SUM_UNROLL 8     /* rows a column-sum thread loads before adding them in order */


/* N consecutive values, loaded and stored as one vector access. */
template <typename T, int N> struct alignas(sizeof(T) * N) Pack {
    T v[N];
};

/* Values per 16-byte load of T: the pack width of the fast kernels. */
template <typename T> constexpr int pack_width() { return (int)(16 / sizeof(T)); }

/* ---- mergeable row statistics (fg_row_stats of src/core/row_kernels.h) --------- */

struct Stats {
    float max, sum, dot; /* sum = Σ exp(z − max), dot = Σ exp(z − max)·(z − max) */
};

__device__ __forceinline__ Stats merge(Stats a, Stats b)
{
    if (a.max < b.max) {
        const Stats t = a;
        a = b;
        b = t;
    }
    if (b.max == -INFINITY) /* b holds no value yet */
        return a;
    const float shift = b.max - a.max, f = expf(shift);
    a.sum += b.sum * f;
    a.dot += (b.dot + b.sum * shift) * f;
    return a;
}

/* Adds N values of z to s. A NaN never wins the max (fmaxf), so it reaches
 * the sums through u and makes them NaN, as on the CPU. */
template <int N> __device__ __forceinline__ void add_values(Stats &s, const float (&z)[N])
{
    float m = z[0];
#pragma unroll
    for (int j = 1; j < N; j++)
        m = fmaxf(m, z[j]);
    if (m > s.max) {
        if (s.max != -INFINITY) {
            const float shift = s.max - m, a = expf(shift);
            s.dot = (s.dot + s.sum * shift) * a;
            s.sum *= a;
        }
        s.max = m;
    }
#pragma unroll
    for (int j = 0; j < N; j++) {
        const float u = z[j] - s.max, p = expf(u);
        s.sum += p;
        s.dot += p * u;
    }
}

/* The block's merged statistics, valid in thread 0. */
__device__ Stats block_merge(Stats s)
{
    __shared__ Stats per_warp[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) {
        const Stats t = {__shfl_xor_sync(0xffffffffu, s.max, o),
                         __shfl_xor_sync(0xffffffffu, s.sum, o),
                         __shfl_xor_sync(0xffffffffu, s.dot, o)};
        s = merge(s, t);
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0)
        per_warp[warp] = s;
    __syncthreads();
    if (warp == 0) {
        const Stats empty = {-INFINITY, 0.0f, 0.0f};
        s = lane < THREADS / 32 ? per_warp[lane] : empty;
        for (int o = THREADS / 64; o > 0; o >>= 1) {
            const Stats t = {__shfl_xor_sync(0xffffffffu, s.max, o),
                             __shfl_xor_sync(0xffffffffu, s.sum, o),
                             __shfl_xor_sync(0xffffffffu, s.dot, o)};
            s = merge(s, t);
        }
    }
    return s;
}

/* Row r's outputs from its statistics (fg_row_finalize of src/core/row_kernels.h);
 * a token outside [0, V) gives a NaN logp and goes to check. */
struct StatsSink {
    fg_cuda_row_stats out;
    fg_cuda_row_check *check;

    template <typename T>
    __device__ void put(int64_t r, Stats s, const T *row, int64_t V, float inv_temp,
                        const int64_t *tokens) const
    {
        const float lsum = logf(s.sum);
        const int64_t tok = tokens[r];
        const bool tok_ok = tok >= 0 && tok < V;
        const float z_tok = tok_ok ? to_float(row[tok]) * inv_temp : NAN;
        out.zmax[r] = s.max;
        out.lsum[r] = lsum;
        out.entropy[r] = lsum - s.dot / s.sum;
        out.logp[r] = (z_tok - s.max) - lsum;
        if (!tok_ok)
            atomicMin(&check->bad_token_row, (int)r);
    }
};

/* Row r's own statistics and its target's logit (−inf: another shard's) at
 * its slot of a vocab shard's layout (row_stats.h). */
struct ShardSink {
    fg_cuda_shard_slots out;

    template <typename T>
    __device__ void put(int64_t r, Stats s, const T *row, int64_t V, float inv_temp,
                        const int64_t *tokens) const
    {
        const int64_t slot = out.index ? out.index[r] : r;
        if (slot < 0 || slot >= out.count)
            return;
        const int64_t tok = tokens[r];
        out.max[slot] = s.max;
        out.z_tok[slot] = tok >= 0 && tok < V ? to_float(row[tok]) * inv_temp : -INFINITY;
        out.own_max[slot] = s.max;
        out.own_sum[slot] = s.sum;
        out.own_dot[slot] = s.dot;
    }
};

/* ---- forward ---------------------------------------------------------------- */

/* x [M, V] row stride ld; grid M blocks of THREADS; N = 1 or the pack width
 * (then every row start is 16-byte aligned). Sink: StatsSink or ShardSink. */
template <typename T, int N, typename Sink>
__global__ void __launch_bounds__(THREADS)
    row_stats_forward_kernel(const T *x, int64_t V, int64_t ld, float inv_temp,
                             const int64_t *tokens, Sink sink)
{
    const int64_t r = blockIdx.x;
    const T *row = x + r * ld;
    Stats s = {-INFINITY, 0.0f, 0.0f};
    const int64_t packs = V / N;
    for (int64_t i = threadIdx.x; i < packs; i += THREADS) {
        const Pack<T, N> p = reinterpret_cast<const Pack<T, N> *>(row)[i];
        float z[N];
#pragma unroll
        for (int j = 0; j < N; j++)
            z[j] = to_float(p.v[j]) * inv_temp;
        add_values<N>(s, z);
    }
    for (int64_t i = packs * N + threadIdx.x; i < V; i += THREADS) {
        const float z[1] = {to_float(row[i]) * inv_temp};
        add_values<1>(s, z);
    }
    s = block_merge(s);
    if (threadIdx.x == 0)
        sink.put(r, s, row, V, inv_temp, tokens);
}

/* The plain reference: one thread per row, a max pass then a sum pass. z and
 * exp are rounded as in the fast kernel; the sums are kept in double, so that
 * comparing with it measures the fast kernel's summation error alone. */
template <typename T>
__global__ void row_stats_forward_ref_kernel(const T *x, int64_t M, int64_t V, int64_t ld,
                                             float inv_temp, const int64_t *tokens,
                                             fg_cuda_row_stats out, fg_cuda_row_check *check)
{
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= M)
        return;
    const T *row = x + r * ld;
    float zmax = -INFINITY;
    for (int64_t v = 0; v < V; v++)
        zmax = fmaxf(zmax, to_float(row[v]) * inv_temp);
    double sum = 0.0, dot = 0.0;
    for (int64_t v = 0; v < V; v++) {
        const float u = to_float(row[v]) * inv_temp - zmax, p = expf(u);
        sum += p;
        dot += (double)p * u;
    }
    const Stats s = {zmax, (float)sum, (float)dot};
    const StatsSink sink = {out, check};
    sink.put(r, s, row, V, inv_temp, tokens);
}

/* ---- backward --------------------------------------------------------------- */

/* Everything dx of one row needs besides x. */
struct RowCoef {
    float zmax, lsum, entropy, g, e;
    int64_t tok;
};

__device__ __forceinline__ RowCoef row_coef(int64_t r, const int64_t *tokens,
                                            fg_cuda_row_stats st, const float *g, const float *e)
{
    const RowCoef k = {st.zmax[r], st.lsum[r], st.entropy[r], g[r], e[r], tokens[r]};
    return k;
}

/* dx_v of one row from z_v = x_v · inv_temp (row_stats.h). */
__device__ __forceinline__ float dlogit(float x, int64_t v, const RowCoef &k, float inv_temp)
{
    const float lp = (x * inv_temp - k.zmax) - k.lsum, p = expf(lp);
    const float onehot = v == k.tok ? 1.0f : 0.0f;
    return (k.g * (onehot - p) - k.e * p * (lp + k.entropy)) * inv_temp;
}

/* dx of rows [r0, r0 + rows) at columns [c, c + N) (c < V), walking down the
 * rows: every load and store coalesced across the block's threads. */
template <typename Tin, typename Tout, int N>
__device__ __forceinline__ void backward_group(const Tin *x, int64_t ld_x, Tout *dx,
                                               int64_t ld_dx, int64_t V, float inv_temp,
                                               const RowCoef *coef, int64_t r0, int rows,
                                               int64_t c, bool whole)
{
#pragma unroll 4
    for (int i = 0; i < rows; i++) {
        const RowCoef k = coef[i];
        const Tin *xr = x + (r0 + i) * ld_x + c;
        Tout *dr = dx + (r0 + i) * ld_dx + c;
        if (whole) {
            const Pack<Tin, N> in = *reinterpret_cast<const Pack<Tin, N> *>(xr);
            Pack<Tout, N> o;
#pragma unroll
            for (int j = 0; j < N; j++)
                o.v[j] = from_float<Tout>(dlogit(to_float(in.v[j]), c + j, k, inv_temp));
            *reinterpret_cast<Pack<Tout, N> *>(dr) = o;
        } else {
#pragma unroll
            for (int j = 0; j < N; j++)
                if (c + j < V)
                    dr[j] = from_float<Tout>(dlogit(to_float(xr[j]), c + j, k, inv_temp));
        }
    }
}

/* grid (ceil(V / (THREADS · N)), min(ceil(M / GROUP_ROWS), MAX_GRID_Y)) blocks
 * of THREADS; block y takes row groups y, y + gridDim.y, ... (one group each
 * unless a chunk has over MAX_GRID_Y · GROUP_ROWS rows). */
template <typename Tin, typename Tout, int N>
__global__ void __launch_bounds__(THREADS)
    row_backward_kernel(const Tin *x, int64_t ld_x, Tout *dx, int64_t ld_dx, int64_t M, int64_t V,
                        float inv_temp, const int64_t *tokens, fg_cuda_row_stats st,
                        const float *g, const float *e)
{
    __shared__ RowCoef coef[GROUP_ROWS];
    const int64_t c = ((int64_t)blockIdx.x * THREADS + threadIdx.x) * N;
    const bool whole = c + N <= V; /* a whole pack; else the row's last, narrower one */
    for (int64_t r0 = (int64_t)blockIdx.y * GROUP_ROWS; r0 < M;
         r0 += (int64_t)gridDim.y * GROUP_ROWS) {
        const int rows = (int)min((int64_t)GROUP_ROWS, M - r0);
        __syncthreads(); /* the previous group's coefficients are read */
        for (int i = threadIdx.x; i < rows; i += THREADS)
            coef[i] = row_coef(r0 + i, tokens, st, g, e);
        __syncthreads();
        if (c < V)
            backward_group<Tin, Tout, N>(x, ld_x, dx, ld_dx, V, inv_temp, coef, r0, rows, c,
                                         whole);
    }
}

/* bias_sum[v] += dx[r, v] for r = 0, 1, ..., M − 1, one float add per row in
 * row order; one thread per column, a warp's loads coalesced over columns.
 * SUM_UNROLL rows are loaded before they are added (in order), so that a
 * thread keeps several loads in flight. grid ceil(V / THREADS). */
template <typename T>
__global__ void __launch_bounds__(THREADS)
    column_sums_kernel(const T *dx, int64_t ld_dx, int64_t M, int64_t V, float *bias_sum)
{
    const int64_t v = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    if (v >= V)
        return;
    const T *col = dx + v;
    float s = bias_sum[v];
    int64_t r = 0;
    for (; r + SUM_UNROLL <= M; r += SUM_UNROLL) {
        float x[SUM_UNROLL];
#pragma unroll
        for (int j = 0; j < SUM_UNROLL; j++)
            x[j] = to_float(col[(r + j) * ld_dx]);
#pragma unroll
        for (int j = 0; j < SUM_UNROLL; j++)
            s += x[j];
    }
    for (; r < M; r++)
        s += to_float(col[r * ld_dx]);
    bias_sum[v] = s;
}

/* The plain reference: one thread per row. */
template <typename Tin, typename Tout>
__global__ void row_backward_ref_kernel(const Tin *x, int64_t ld_x, Tout *dx, int64_t ld_dx,
                                        int64_t M, int64_t V, float inv_temp,
                                        const int64_t *tokens, fg_cuda_row_stats st,
                                        const float *g, const float *e)
{
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= M)
        return;
    const RowCoef k = row_coef(r, tokens, st, g, e);
    for (int64_t v = 0; v < V; v++)
        dx[r * ld_dx + v] = from_float<Tout>(dlogit(to_float(x[r * ld_x + v]), v, k, inv_temp));
}

/* The plain reference of the bias sums: one thread per column, rows in order
 * (fg_col_sums_add of src/core/row_kernels.c). */
template <typename T>
__global__ void column_sums_ref_kernel(const T *dx, int64_t ld_dx, int64_t M, int64_t V,
                                       float *bias_sum)
{
    const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= V)
        return;
    float s = bias_sum[v];
    for (int64_t r = 0; r < M; r++)
        s += to_float(dx[r * ld_dx + v]);
    bias_sum[v] = s;
}

/* ---- host side ---------------------------------------------------------------- */

static bool aligned(const void *p, size_t bytes) { return (uintptr_t)p % bytes == 0; }

static unsigned blocks_for(int64_t n, int per_block)
{
    return (unsigned)((n + per_block - 1) / per_block);
}

static fg_status check_dtype(fg_dtype t, const char *name, char *msg, size_t msg_size)
{
    if (t != FG_DTYPE_F32 && t != FG_DTYPE_BF16)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size, "%s: unknown dtype %d", name, (int)t);
    return FG_OK;
}

/* The checks of the logits every row entry point reads. */
static fg_status check_x(const void *x, fg_dtype xtype, int64_t M, int64_t V, int64_t ld,
                         float inv_temp, const int64_t *tokens, char *msg, size_t msg_size)
{
    if (!x || !tokens)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "row stats: x and tokens are required");
    if (M <= 0 || V <= 0 || ld < V)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "row stats: M = %lld, V = %lld, ld = %lld (need M, V > 0, ld >= V)",
                    (long long)M, (long long)V, (long long)ld);
    /* Rows are numbered in int (atomicMin) and the forward's fill grid.x. */
    if (M > FG_CUDA_ROW_LIMIT)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "row stats: a chunk of %lld rows is over the %lld rows one launch takes",
                    (long long)M, (long long)FG_CUDA_ROW_LIMIT);
    if (!(inv_temp > 0.0f) || !isfinite(inv_temp))
        return fail(FG_ERR_BAD_TEMPERATURE, msg, msg_size,
                    "row stats: 1/temperature = %g is not a finite positive number",
                    (double)inv_temp);
    return check_dtype(xtype, "row stats: x", msg, msg_size);
}

/* check_x and the four statistics arrays. */
static fg_status check_rows(const void *x, fg_dtype xtype, int64_t M, int64_t V, int64_t ld,
                            float inv_temp, const int64_t *tokens, fg_cuda_row_stats st,
                            char *msg, size_t msg_size)
{
    if (!st.zmax || !st.lsum || !st.entropy || !st.logp)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size,
                    "row stats: the four stats arrays are required");
    return check_x(x, xtype, M, V, ld, inv_temp, tokens, msg, msg_size);
}

fg_status fg_cuda_row_check_reset(fg_cuda_row_check *check, cudaStream_t stream, char *msg,
                                  size_t msg_size)
{
    if (!check)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "row check: check is NULL");
    const cudaError_t err = cudaMemsetAsync(check, 0x7f, sizeof *check, stream);
    if (err != cudaSuccess)
        return fail(FG_ERR_BACKEND, msg, msg_size, "CUDA: resetting the row check: %s (%s)",
                    cudaGetErrorName(err), cudaGetErrorString(err));
    return FG_OK;
}

fg_status fg_cuda_row_check_status(const fg_cuda_row_check *check, int64_t row0,
                                   cudaStream_t stream, char *msg, size_t msg_size)
{
    if (!check)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "row check: check is NULL");
    fg_cuda_row_check h;
    cudaError_t err = cudaMemcpyAsync(&h, check, sizeof h, cudaMemcpyDeviceToHost, stream);
    if (err == cudaSuccess)
        err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess)
        return fail(FG_ERR_BACKEND, msg, msg_size, "CUDA: reading the row check: %s (%s)",
                    cudaGetErrorName(err), cudaGetErrorString(err));
    if (h.bad_token_row != FG_CUDA_ROW_NONE)
        return fail(FG_ERR_TOKEN_OUT_OF_RANGE, msg, msg_size,
                    "row %lld: the token id is outside [0, V)",
                    (long long)(row0 + h.bad_token_row));
    return FG_OK;
}

/* The fast forward with either sink: packs where every row start is 16-byte
 * aligned, else one value at a time. */
template <typename T, typename Sink>
static void launch_forward(const void *x, int64_t M, int64_t V, int64_t ld, float inv_temp,
                           const int64_t *tokens, Sink sink, cudaStream_t stream)
{
    constexpr int N = pack_width<T>();
    const T *xt = static_cast<const T *>(x);
    if (aligned(x, 16) && ld % N == 0)
        row_stats_forward_kernel<T, N, Sink>
            <<<(unsigned)M, THREADS, 0, stream>>>(xt, V, ld, inv_temp, tokens, sink);
    else
        row_stats_forward_kernel<T, 1, Sink>
            <<<(unsigned)M, THREADS, 0, stream>>>(xt, V, ld, inv_temp, tokens, sink);
}

template <typename Sink>
static void launch_forward_any(const void *x, fg_dtype xtype, int64_t M, int64_t V, int64_t ld,
                               float inv_temp, const int64_t *tokens, Sink sink,
                               cudaStream_t stream)
{
    if (xtype == FG_DTYPE_BF16)
        launch_forward<__nv_bfloat16>(x, M, V, ld, inv_temp, tokens, sink, stream);
    else
        launch_forward<float>(x, M, V, ld, inv_temp, tokens, sink, stream);
}

fg_status fg_cuda_row_stats_forward(const void *x, fg_dtype xtype, int64_t M, int64_t V,
                                    int64_t ld, float inv_temp, const int64_t *tokens,
                                    fg_cuda_row_stats stats, fg_cuda_row_check *check,
                                    cudaStream_t stream, char *msg, size_t msg_size)
{
    fg_status st = check_rows(x, xtype, M, V, ld, inv_temp, tokens, stats, msg, msg_size);
    if (st != FG_OK)
        return st;
    if (!check)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "row stats: check is NULL");
    const StatsSink sink = {stats, check};
    launch_forward_any(x, xtype, M, V, ld, inv_temp, tokens, sink, stream);
    return launched("the row stats forward", msg, msg_size);
}

fg_status fg_cuda_row_stats_shard(const void *x, fg_dtype xtype, int64_t M, int64_t V,
                                  int64_t ld, float inv_temp, const int64_t *tokens,
                                  fg_cuda_shard_slots out, cudaStream_t stream, char *msg,
                                  size_t msg_size)
{
    fg_status st = check_x(x, xtype, M, V, ld, inv_temp, tokens, msg, msg_size);
    if (st != FG_OK)
        return st;
    if (!out.max || !out.z_tok || !out.own_max || !out.own_sum || !out.own_dot)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size,
                    "shard stats: the five output arrays are required");
    if (out.count < (out.index ? 1 : M))
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size,
                    "shard stats: %lld slots for %lld rows%s", (long long)out.count,
                    (long long)M, out.index ? " by index" : "");
    const ShardSink sink = {out};
    launch_forward_any(x, xtype, M, V, ld, inv_temp, tokens, sink, stream);
    return launched("the shard stats forward", msg, msg_size);
}

fg_status fg_cuda_row_stats_forward_ref(const void *x, fg_dtype xtype, int64_t M, int64_t V,
                                        int64_t ld, float inv_temp, const int64_t *tokens,
                                        fg_cuda_row_stats stats, fg_cuda_row_check *check,
                                        cudaStream_t stream, char *msg, size_t msg_size)
{
    fg_status st = check_rows(x, xtype, M, V, ld, inv_temp, tokens, stats, msg, msg_size);
    if (st != FG_OK)
        return st;
    if (!check)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "row stats: check is NULL");
    const unsigned grid = blocks_for(M, 128);
    if (xtype == FG_DTYPE_BF16)
        row_stats_forward_ref_kernel<<<grid, 128, 0, stream>>>(
            static_cast<const __nv_bfloat16 *>(x), M, V, ld, inv_temp, tokens, stats, check);
    else
        row_stats_forward_ref_kernel<<<grid, 128, 0, stream>>>(static_cast<const float *>(x), M, V,
                                                               ld, inv_temp, tokens, stats, check);
    return launched("the reference row stats forward", msg, msg_size);
}

template <typename Tin, typename Tout>
static void launch_backward(const void *x, int64_t ld_x, void *dx, int64_t ld_dx, int64_t M,
                            int64_t V, float inv_temp, const int64_t *tokens,
                            fg_cuda_row_stats st, const float *g, const float *e,
                            cudaStream_t stream)
{
    constexpr int N = pack_width<Tin>();
    const Tin *xt = static_cast<const Tin *>(x);
    Tout *dt = static_cast<Tout *>(dx);
    const unsigned groups = std::min(blocks_for(M, GROUP_ROWS), (unsigned)MAX_GRID_Y);
    if (aligned(x, 16) && ld_x % N == 0 && aligned(dx, sizeof(Pack<Tout, N>)) && ld_dx % N == 0)
        row_backward_kernel<Tin, Tout, N>
            <<<dim3(blocks_for(V, THREADS * N), groups), THREADS, 0, stream>>>(
                xt, ld_x, dt, ld_dx, M, V, inv_temp, tokens, st, g, e);
    else
        row_backward_kernel<Tin, Tout, 1><<<dim3(blocks_for(V, THREADS), groups), THREADS, 0,
                                            stream>>>(xt, ld_x, dt, ld_dx, M, V, inv_temp, tokens,
                                                      st, g, e);
}

/* The checks of both backward entry points beyond check_rows. */
static fg_status check_backward(const void *dx, fg_dtype dxtype, int64_t ld_dx, int64_t V,
                                const float *g, const float *e, char *msg, size_t msg_size)
{
    if (!dx || !g || !e)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "row backward: dx, g and e are required");
    if (ld_dx < V)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size, "row backward: ld_dx = %lld < V = %lld",
                    (long long)ld_dx, (long long)V);
    return check_dtype(dxtype, "row backward: dx", msg, msg_size);
}

fg_status fg_cuda_row_backward(const void *x, fg_dtype xtype, int64_t ld_x, void *dx,
                               fg_dtype dxtype, int64_t ld_dx, int64_t M, int64_t V,
                               float inv_temp, const int64_t *tokens, fg_cuda_row_stats stats,
                               const float *g, const float *e, float *bias_sum,
                               cudaStream_t stream, char *msg, size_t msg_size)
{
    fg_status st = check_rows(x, xtype, M, V, ld_x, inv_temp, tokens, stats, msg, msg_size);
    if (st == FG_OK)
        st = check_backward(dx, dxtype, ld_dx, V, g, e, msg, msg_size);
    if (st != FG_OK)
        return st;
    const bool xb = xtype == FG_DTYPE_BF16, ob = dxtype == FG_DTYPE_BF16;
    if (xb && ob)
        launch_backward<__nv_bfloat16, __nv_bfloat16>(x, ld_x, dx, ld_dx, M, V, inv_temp, tokens,
                                                      stats, g, e, stream);
    else if (xb)
        launch_backward<__nv_bfloat16, float>(x, ld_x, dx, ld_dx, M, V, inv_temp, tokens, stats,
                                              g, e, stream);
    else if (ob)
        launch_backward<float, __nv_bfloat16>(x, ld_x, dx, ld_dx, M, V, inv_temp, tokens, stats,
                                              g, e, stream);
    else
        launch_backward<float, float>(x, ld_x, dx, ld_dx, M, V, inv_temp, tokens, stats, g, e,
                                      stream);
    if ((st = launched("the row backward", msg, msg_size)) != FG_OK || !bias_sum)
        return st;
    if (ob)
        column_sums_kernel<<<blocks_for(V, THREADS), THREADS, 0, stream>>>(
            static_cast<const __nv_bfloat16 *>(dx), ld_dx, M, V, bias_sum);
    else
        column_sums_kernel<<<blocks_for(V, THREADS), THREADS, 0, stream>>>(
            static_cast<const float *>(dx), ld_dx, M, V, bias_sum);
    return launched("the bias column sums", msg, msg_size);
}

template <typename Tin, typename Tout>
static void launch_backward_ref(const void *x, int64_t ld_x, void *dx, int64_t ld_dx, int64_t M,
                                int64_t V, float inv_temp, const int64_t *tokens,
                                fg_cuda_row_stats st, const float *g, const float *e,
                                float *bias_sum, cudaStream_t stream)
{
    row_backward_ref_kernel<Tin, Tout><<<blocks_for(M, 128), 128, 0, stream>>>(
        static_cast<const Tin *>(x), ld_x, static_cast<Tout *>(dx), ld_dx, M, V, inv_temp, tokens,
        st, g, e);
    if (bias_sum)
        column_sums_ref_kernel<Tout><<<blocks_for(V, 128), 128, 0, stream>>>(
            static_cast<const Tout *>(dx), ld_dx, M, V, bias_sum);
}

fg_status fg_cuda_row_backward_ref(const void *x, fg_dtype xtype, int64_t ld_x, void *dx,
                                   fg_dtype dxtype, int64_t ld_dx, int64_t M, int64_t V,
                                   float inv_temp, const int64_t *tokens, fg_cuda_row_stats stats,
                                   const float *g, const float *e, float *bias_sum,
                                   cudaStream_t stream, char *msg, size_t msg_size)
{
    fg_status st = check_rows(x, xtype, M, V, ld_x, inv_temp, tokens, stats, msg, msg_size);
    if (st == FG_OK)
        st = check_backward(dx, dxtype, ld_dx, V, g, e, msg, msg_size);
    if (st != FG_OK)
        return st;
    const bool xb = xtype == FG_DTYPE_BF16, ob = dxtype == FG_DTYPE_BF16;
    if (xb && ob)
        launch_backward_ref<__nv_bfloat16, __nv_bfloat16>(x, ld_x, dx, ld_dx, M, V, inv_temp,
                                                          tokens, stats, g, e, bias_sum, stream);
    else if (xb)
        launch_backward_ref<__nv_bfloat16, float>(x, ld_x, dx, ld_dx, M, V, inv_temp, tokens,
                                                  stats, g, e, bias_sum, stream);
    else if (ob)
        launch_backward_ref<float, __nv_bfloat16>(x, ld_x, dx, ld_dx, M, V, inv_temp, tokens,
                                                  stats, g, e, bias_sum, stream);
    else
        launch_backward_ref<float, float>(x, ld_x, dx, ld_dx, M, V, inv_temp, tokens, stats, g,
                                          e, bias_sum, stream);
    return launched("the reference row backward", msg, msg_size);
}
