/* A device-reported call's checks, constants and loss on the GPU: see
 * report.h here and src/core/report.h, whose FG_HD functions every kernel
 * below calls, so that the device finds what the host's checks find and
 * sums the loss in the host's order.
 *
 * The per-sequence and per-segment work is one thread each (a few thousand
 * at most, each a loop over its tokens): what must follow the host's order
 * of additions does, and the rest only has to avoid a host round trip. The
 * combines are one thread. Compiled with --fmad=false (cuda/CMakeLists.txt),
 * as loss_derivs.cu: the double expressions of the loss math round as the
 * host's C does. */
#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include "fail.h"
#include "report.h"
#include "report_kernels.h"

#define THREADS 128

static unsigned blocks_of(int64_t n) { return (unsigned)((n + THREADS - 1) / THREADS); }

/* The record keeps the smallest key: ~key, atomically maxed. */
__device__ static void report_key(fg_device_report *rep, uint64_t key)
{
    if (key)
        atomicMax(reinterpret_cast<unsigned long long *>(&rep->failed),
                  (unsigned long long)~key);
}

/* ---- report_batch ----------------------------------------------------------- */

/* Sequence b: its values, and its raw token count into seq_count[b]. */
__global__ void __launch_bounds__(THREADS)
    batch_sequences_kernel(fg_loss_plan plan, fg_report_batch r, int constants,
                           fg_device_report *rep)
{
    const int64_t b = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    if (b >= plan.B)
        return;
    report_key(rep, fg_report_sequence(&plan, &r, b));
    if (constants)
        plan.seq_count[b] = fg_loss_seq_count(&plan, b);
}

/* The total in sequence order and the batch scalars; the record's sizes. */
__global__ void batch_total_kernel(fg_loss_plan plan, fg_report_batch r, int constants,
                                   fg_device_report *rep)
{
    rep->seq_len = plan.T;
    rep->vocab = r.vocab;
    if (!constants)
        return;
    double total = 0;
    for (int64_t b = 0; b < plan.B; b++)
        total += plan.seq_count[b];
    double *scalars = const_cast<double *>(plan.batch_scalars);
    scalars[0] = total;
    scalars[1] = fg_loss_entropy_weight(&plan, total);
    scalars[2] = plan.entropy_threshold; /* every token; report_prepare's quantile */
}

/* Sequence b's constants (fg_loss_plan_init's, then fg_loss_prepare's). */
__global__ void __launch_bounds__(THREADS) batch_constants_kernel(fg_loss_plan plan)
{
    const int64_t b = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    if (b >= plan.B)
        return;
    fg_loss_seq_init(&plan, b, plan.seq_count[b], plan.batch_scalars[0]);
    if (!fg_loss_tokens_first(&plan)) /* else report_prepare, after the forward sweep */
        fg_loss_seq_prepare(&plan, b, NULL);
}

/* Token n: its values; the walk's row and target. */
__global__ void __launch_bounds__(THREADS)
    batch_tokens_kernel(fg_loss_plan plan, fg_report_batch r, int64_t *rows, int64_t *targets,
                        fg_device_report *rep)
{
    const int64_t n = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    if (n >= plan.B * plan.T)
        return;
    report_key(rep, fg_report_token_input(&plan, &r, n));
    const int64_t id = plan.token_ids[n];
    rows[n] = n;
    targets[n] = plan.mask[n] && id >= 0 && id < r.vocab ? id : -1;
}

fg_status fg_cuda_report_batch(const fg_loss_plan *plan, const fg_report_batch *r, int64_t *rows,
                               int64_t *targets, fg_device_report *rep, cudaStream_t stream,
                               char *msg, size_t msg_size)
{
    const int64_t N = plan->B * plan->T;
    if (N > (int64_t)INT_MAX * THREADS)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size, "report: %lld tokens", (long long)N);
    const int constants = r->loss && !plan->external;
    batch_sequences_kernel<<<blocks_of(plan->B), THREADS, 0, stream>>>(*plan, *r, constants, rep);
    batch_total_kernel<<<1, 1, 0, stream>>>(*plan, *r, constants, rep);
    if (constants)
        batch_constants_kernel<<<blocks_of(plan->B), THREADS, 0, stream>>>(*plan);
    batch_tokens_kernel<<<blocks_of(N), THREADS, 0, stream>>>(*plan, *r, rows, targets, rep);
    return launched("the batch's checks", msg, msg_size);
}

/* ---- report_prepare --------------------------------------------------------- */

/* Sequence b's constants from every token's log-prob (fg_loss_prepare's
 * first loop). */
__global__ void __launch_bounds__(THREADS) prepare_kernel(fg_loss_plan plan, const float *logp)
{
    const int64_t b = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    if (b >= plan.B)
        return;
    fg_loss_plan p = fg_loss_plan_resolved(&plan);
    fg_loss_seq_prepare(&p, b, logp);
}

/* Sequence b's Σ ∂L/∂ratio at the sequence level (fg_loss_prepare's last
 * loop, after the entropy quantile). */
__global__ void __launch_bounds__(THREADS)
    dratio_kernel(fg_loss_plan plan, const float *logp, const float *entropy)
{
    const int64_t b = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    if (b >= plan.B)
        return;
    fg_loss_plan p = fg_loss_plan_resolved(&plan);
    fg_loss_seq_dratio(&p, b, logp, entropy);
}

/* A float's place in the order of floats, as an unsigned key (-0 before +0),
 * and back. */
__device__ static uint32_t order_key(float x)
{
    const uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ static float from_order_key(uint32_t k)
{
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

#define QUANTILE_THREADS 512

/* hist[digit] += 1 for each thread of the warp whose digit is below 256, one
 * shared atomic per distinct digit (entropies crowd into a few digits). The
 * whole warp calls it. */
__device__ static void histogram_add(unsigned int *hist, unsigned digit)
{
    const unsigned peers = __match_any_sync(0xffffffffu, digit);
    if (digit < 256 && (threadIdx.x & 31) == (unsigned)(__ffs(peers) - 1))
        atomicAdd(&hist[digit], (unsigned)__popc(peers));
}

/* The entropy quantile (fg_loss_prepare's middle step) in one block: x[lo],
 * the lo-th smallest unmasked entropy, by a radix select on order keys (four
 * 8-bit digits, a shared histogram each; the first also counts the unmasked
 * tokens m); x[hi] (hi = lo + 1 at most): x[lo] again if more than hi
 * entropies are at most x[lo], else the least entropy above it; the
 * threshold fg_quantile_lerp; the tokens at or above it; the entropy
 * bonus's weight. Integer counts and a min only: the values the host's sort
 * gives (a value does not depend on how equal ones were ordered), in any
 * launch order. Into the batch scalars [1] and [2]. */
__global__ void __launch_bounds__(QUANTILE_THREADS)
    quantile_kernel(fg_loss_plan plan, const float *entropy)
{
    __shared__ unsigned long long count;
    __shared__ unsigned int hist[256], prefix, prefix_mask, least_above;
    __shared__ long long rank, m;
    __shared__ fg_quantile_rank r;
    const int64_t N = plan.B * plan.T;
    const unsigned tid = threadIdx.x;
    if (tid == 0) {
        count = 0;
        prefix = 0;
        prefix_mask = 0;
        least_above = 0xffffffffu;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (unsigned d = tid; d < 256; d += QUANTILE_THREADS)
            hist[d] = 0;
        __syncthreads();
        for (int64_t base = 0; base < N; base += QUANTILE_THREADS) { /* uniform: whole warps */
            const int64_t n = base + tid;
            unsigned digit = 256;
            if (n < N && plan.mask[n]) {
                const uint32_t k = order_key(entropy[n]);
                if ((k & prefix_mask) == prefix)
                    digit = (k >> shift) & 255u;
            }
            histogram_add(hist, digit);
        }
        __syncthreads();
        if (tid == 0) {
            if (shift == 24) { /* every unmasked token is in the first histogram */
                long long all = 0;
                for (int d = 0; d < 256; d++)
                    all += hist[d];
                m = all;
                if (all > 0) {
                    r = fg_quantile_rank_of(all, 1.0 - plan.top_entropy_quantile);
                    rank = r.lo;
                }
            }
            if (m > 0) { /* the digit holding the rank-th key of those left */
                unsigned d = 0;
                while (d < 255 && (long long)hist[d] <= rank) {
                    rank -= hist[d];
                    d++;
                }
                prefix |= d << shift;
                prefix_mask |= 255u << shift;
            }
        }
        __syncthreads();
        if (m == 0)
            break; /* every thread: m is shared and set before the barrier */
    }
    double *scalars = const_cast<double *>(plan.batch_scalars);
    if (m == 0) { /* no token: nothing is effective */
        if (tid == 0) {
            scalars[1] = fg_loss_entropy_weight(&plan, 0.0);
            scalars[2] = INFINITY;
        }
        return;
    }
    const uint32_t lo_key = prefix;
    unsigned long long at_most = 0;
    unsigned int least = 0xffffffffu;
    for (int64_t n = tid; n < N; n += QUANTILE_THREADS) {
        if (!plan.mask[n])
            continue;
        const uint32_t k = order_key(entropy[n]);
        at_most += k <= lo_key;
        least = k > lo_key && k < least ? k : least;
    }
    atomicAdd(&count, at_most); /* the entropies at most x[lo] */
    atomicMin(&least_above, least);
    __syncthreads();
    const float a = from_order_key(lo_key);
    const float b = r.hi == r.lo || (long long)count > r.hi ? a : from_order_key(least_above);
    const float threshold = fg_quantile_lerp(a, b, r.w);
    __syncthreads(); /* every thread has read count */
    if (tid == 0)
        count = 0;
    __syncthreads();
    plan.entropy_threshold = threshold;
    unsigned long long eff = 0;
    for (int64_t n = tid; n < N; n += QUANTILE_THREADS)
        eff += plan.mask[n] && fg_token_in_entropy_mask(&plan, entropy[n]);
    atomicAdd(&count, eff);
    __syncthreads();
    if (tid == 0) {
        scalars[1] = fg_loss_entropy_weight(&plan, (double)count);
        scalars[2] = threshold;
    }
}

fg_status fg_cuda_report_prepare(const fg_loss_plan *plan, const float *logp,
                                 const float *entropy, cudaStream_t stream, char *msg,
                                 size_t msg_size)
{
    if (!logp || !entropy)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size,
                    "report prepare: every token's logp and entropy are required");
    prepare_kernel<<<blocks_of(plan->B), THREADS, 0, stream>>>(*plan, logp);
    if (plan->top_entropy_quantile < 1.0 && !plan->external)
        quantile_kernel<<<1, QUANTILE_THREADS, 0, stream>>>(*plan, entropy);
    if (plan->level == FG_LEVEL_SEQUENCE)
        dratio_kernel<<<blocks_of(plan->B), THREADS, 0, stream>>>(*plan, logp, entropy);
    return launched("the sequences' constants", msg, msg_size);
}

/* ---- report_scan ------------------------------------------------------------ */

template <typename T> __device__ __forceinline__ bool finite_at(const T *x, int64_t i);
template <> __device__ __forceinline__ bool finite_at<float>(const float *x, int64_t i)
{
    return isfinite(x[i]);
}
template <> __device__ __forceinline__ bool finite_at<uint16_t>(const uint16_t *x, int64_t i)
{
    return (x[i] & 0x7f80u) != 0x7f80u; /* bf16: exponent all ones is Inf or NaN */
}

/* Row r's first non-finite column, block-reduced; grid: one block per row. */
template <typename T>
__global__ void __launch_bounds__(THREADS)
    scan_kernel(const T *x, int64_t cols, int64_t ld, const uint8_t *mask, int stage,
                fg_device_report *rep)
{
    const int64_t r = blockIdx.x;
    if (mask && !mask[r])
        return;
    int64_t first = cols;
    for (int64_t c = threadIdx.x; c < cols && first == cols; c += THREADS)
        if (!finite_at(x, r * ld + c))
            first = c;
    __shared__ int64_t lowest[THREADS];
    lowest[threadIdx.x] = first;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s /= 2) {
        if (threadIdx.x < s && lowest[threadIdx.x + s] < lowest[threadIdx.x])
            lowest[threadIdx.x] = lowest[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0 && lowest[0] < cols)
        report_key(rep, fg_report_entry_key(stage, r, lowest[0]));
}

fg_status fg_cuda_report_scan(const void *x, fg_dtype type, int64_t rows, int64_t cols,
                              int64_t ld, const uint8_t *mask, int stage, fg_device_report *rep,
                              cudaStream_t stream, char *msg, size_t msg_size)
{
    if (rows <= 0 || rows > INT_MAX || cols <= 0 || ld < cols)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size, "report scan: [%lld, %lld] with ld %lld",
                    (long long)rows, (long long)cols, (long long)ld);
    if (type == FG_DTYPE_BF16)
        scan_kernel<<<(unsigned)rows, THREADS, 0, stream>>>(static_cast<const uint16_t *>(x),
                                                            cols, ld, mask, stage, rep);
    else
        scan_kernel<<<(unsigned)rows, THREADS, 0, stream>>>(static_cast<const float *>(x), cols,
                                                            ld, mask, stage, rep);
    return launched("the report's scan", msg, msg_size);
}

/* ---- report_tokens ---------------------------------------------------------- */

/* Token n's checks and its outputs. */
__global__ void __launch_bounds__(THREADS)
    tokens_kernel(fg_loss_plan plan, fg_report_batch r, fg_backend_tokens t,
                  fg_device_report *rep)
{
    const int64_t n = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    if (n >= plan.B * plan.T)
        return;
    const fg_loss_plan p = fg_loss_plan_resolved(&plan);
    report_key(rep, fg_report_token(&p, &r, n, t.zmax[n], t.lsum[n], t.logp[n], t.entropy[n],
                                    t.scanned));
    if (t.logp_out)
        t.logp_out[n] = p.mask[n] ? t.logp[n] : 0.0f;
    if (t.entropy_out)
        t.entropy_out[n] = p.mask[n] ? t.entropy[n] : 0.0f;
}

/* Segment k of sequence b: grid over B * segments. */
__global__ void __launch_bounds__(THREADS)
    segments_kernel(fg_loss_plan plan, fg_backend_tokens t, int64_t segments)
{
    const int64_t i = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    if (i >= plan.B * segments)
        return;
    const fg_loss_plan p = fg_loss_plan_resolved(&plan);
    static_cast<fg_seq_sums *>(t.sums)[i] = fg_seg_eval(&p, i / segments, i % segments, t.logp,
                                                         t.entropy);
}

/* The loss from the segments' sums (loss_sequence.h's order) and its check;
 * then the first failure's values. */
__global__ void finish_kernel(fg_loss_plan plan, fg_report_batch r, fg_backend_tokens t,
                              int64_t segments, fg_device_report *rep)
{
    const fg_loss_plan p = fg_loss_plan_resolved(&plan);
    if (r.loss) {
        fg_loss_from_segments(&p, static_cast<const fg_seq_sums *>(t.sums), segments,
                              &rep->loss, &rep->metrics);
        double value = 0;
        const uint64_t key = fg_report_sums(rep->loss, &rep->metrics, &value);
        if (key && ~key > rep->failed) { /* this thread is alone now */
            rep->failed = ~key;
            rep->value[0] = value;
        }
    }
    if (rep->failed && fg_report_stage_of(~rep->failed) != FG_REPORT_SUM)
        fg_report_values(&p, &r, t.logp, t.entropy, ~rep->failed, rep->value);
}

fg_status fg_cuda_report_tokens(const fg_loss_plan *plan, const fg_report_batch *r,
                                const fg_backend_tokens *t, fg_device_report *rep,
                                cudaStream_t stream, char *msg, size_t msg_size)
{
    const int64_t N = plan->B * plan->T;
    const int64_t segments = (plan->T + FG_EVAL_SEGMENT - 1) / FG_EVAL_SEGMENT;
    if (N > (int64_t)INT_MAX * THREADS)
        return fail(FG_ERR_INVALID_SIZE, msg, msg_size, "report: %lld tokens", (long long)N);
    if (r->loss && !t->sums)
        return fail(FG_ERR_NULL_ARGUMENT, msg, msg_size, "report: the loss's sums are required");
    tokens_kernel<<<blocks_of(N), THREADS, 0, stream>>>(*plan, *r, *t, rep);
    if (r->loss)
        segments_kernel<<<blocks_of(plan->B * segments), THREADS, 0, stream>>>(*plan, *t,
                                                                               segments);
    finish_kernel<<<1, 1, 0, stream>>>(*plan, *r, *t, segments, rep);
    return launched("the tokens' checks and the loss", msg, msg_size);
}
