/* The C API's CUDA path (FG_BACKEND_CUDA) against its CPU path.
 *
 * Without a CUDA device: fg_context_create with FG_BACKEND_CUDA, and the
 * backend's own fg_backend_cuda_create, must refuse with FG_ERR_UNSUPPORTED
 * (the backend library loads, finds no device, and says so); then
 * "skipped: <reason>" and exit 77. With one:
 *
 *   - A random LM-head problem of odd sizes (B = 3, T = 37, H = 96, V = 1031;
 *     a third of the tokens masked, their ids out of range on purpose; hidden
 *     and weight rows padded with NaN that must never be read), the same
 *     inputs on the host and, copied with cudaMalloc/cudaMemcpy, on the
 *     device: hidden, weight, bias, every fg_batch array, and every output.
 *   - fg_linear_grpo on a CUDA context (its own non-blocking stream) against
 *     the CPU context on the host copies: every loss type, both levels,
 *     fused with a small budget (several chunks; a bf16 grad_weight summed
 *     in float32, found with the plan query) and materialized; float32
 *     inputs with float32 gradients, bf16 inputs with bf16 gradients (and
 *     once with float32 gradients, once at the least budget, where a bf16
 *     grad_weight is summed in place); accumulate = 1 once per input dtype
 *     (and in place); fg_linear_logprobs once per dtype. The status must match; on success
 *     loss, metrics, logp, entropy and the gradients must agree within the
 *     tolerances below, masked tokens' logp/entropy and grad_hidden rows be
 *     exact zeros, and grad_hidden's padding columns untouched.
 *   - The phase API of a vocab-sharded call, 2 shards of the vocabulary:
 *     (a) -> MAX -> (b) -> SUM -> finish -> (d) with every array in device
 *     memory (the stats too; the reductions by hand between device copies)
 *     against the CPU context's same phases: logp, entropy, grad_hidden
 *     summed over the shards, each shard's grad_weight and grad_bias rows
 *     (float32 gradients, the tolerances below), the GEMM phases at the
 *     fused tests' budget.
 *   - The backend's ops one by one (backend.h, ABI 6) against the reference
 *     backend (see "the backend's ops" below): the ops table, supports and
 *     chunk_scratch, logits, stats and row_check, shard_stats, dhidden,
 *     put_grad_hidden, grads' `first` on gw_sum, the bias sums' bits in
 *     chunks of 7 rows and of all rows, finish's grad_bias = gb_sum; filter
 *     (the same dlogits bits and kept count as the reference's, kept and
 *     dense chunks); grads of a filtered chunk (test_sparse: the sparse
 *     branch's bits those of fmaf sums in the CPU's order, the dense
 *     branch within tolerance, the branch read back); derivs against the
 *     host's loss math (within 2 ulp).
 *   - Device-reported calls (exec.device_report; test_reported): token-level
 *     losses, GSPO and vespo at the sequence level (a forward sweep, the
 *     sequences' constants on the device) captured in a CUDA graph (global
 *     capture mode) and replayed,
 *     against the host-checked call, with the advantages changed between
 *     captures' replays; filtered at two thresholds (the chunks' products a
 *     conditional node of the caller's graph); the entropy quantile at both
 *     levels; two refusals reported with the host's status and message.
 *   - Refusals: an unmasked token id = V (FG_ERR_TOKEN_OUT_OF_RANGE) and a
 *     NaN in an unmasked hidden row (FG_ERR_NONFINITE_INPUT), fused and
 *     materialized, accumulating or not: the same status as the CPU and every
 *     device output (and loss, metrics) bitwise unchanged. A NaN in a masked
 *     hidden row is not read: the call succeeds and matches the CPU's.
 *
 * The CPU path is the reference (CI checks it against the float64 oracle).
 * Each check prints its worst error as a fraction of its tolerance.
 *
 * Tolerances (|got − want| <= tol per value; M = max |want| over the array):
 *   loss, metrics:       1e-4 · (1 + |want|). Both paths take the same float32
 *                        logp into the same host loss code; what differs is
 *                        the logits' summation order (~1e-6 relative).
 *   logp, entropy:       2e-5 · (1 + |want|): the float32 logits of two GEMMs
 *                        summing H = 96 products in different orders.
 *   gradients, float32 inputs (true float32 on both, no TF32):
 *                        1e-4 · |want| + 2e-5 · M.
 *   gradients, bf16 inputs: 2^-7 · |want| + 2^-7 · M. The GPU's backward
 *                        products run on tensor cores with dlogits rounded to
 *                        bf16 (2^-9 relative each; the CPU rounds them too only
 *                        where it has bf16 kernels), float32 accumulation, and
 *                        bf16 outputs are rounded once more on each side
 *                        (2^-9 |want| each).
 * Clip metrics count tokens: a token whose log-ratio sat within float error of
 * a clip bound could count on one side only; the test prints the smallest
 * distance of any token's log-ratio to the default bounds so that such a
 * failure is recognized (the seeds are fixed). */
#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "backend.h"
#include "chunk_ops.h"
#include "fusedgrpo.h"
#include "shard_stats.h"
#include "sparse_products.h"
extern "C" {
#include "loss_math.h" /* a C header without its own extern "C" */
}

/* The CUDA backend's entry point (libfusedgrpo_cuda.so, linked for the ops
 * tests below; the core opens the same library at run time). */
extern "C" fg_status fg_backend_cuda_create(void *stream, fg_device *out, char *msg,
                                            size_t msg_size);

static int checks_run, checks_failed;

#include "cuda_ok.h"

static void check_true(const char *what, bool ok)
{
    checks_run++;
    checks_failed += !ok;
    printf("%s %s\n", ok ? "ok  " : "FAIL", what);
}

/* ---- problem sizes and tolerances ------------------------------------------------- */

enum { B = 3, T = 37, H = 96, V = 1031, N = B * T };
static const int64_t LDH = H + 8;  /* hidden and weight rows: 8 NaN columns each */
static const int64_t LDGH = H + 4; /* grad_hidden: 4 padding columns, untouched  */
static const int64_t LDGW = H + 8; /* grad_weight                                */
static const double TEMPERATURE = 0.9;

struct Tol {
    double rel, abs_of_max;
};
static const Tol TOL_SCALAR = {1e-4, 0};       /* loss, metrics: · (1 + |want|) */
static const Tol TOL_TOKEN = {2e-5, 0};        /* logp, entropy: · (1 + |want|) */
static const Tol TOL_GRAD_F32 = {1e-4, 2e-5};  /* · |want| + · M                */
static const Tol TOL_GRAD_BF16 = {0x1p-7, 0x1p-7};

/* ---- host helpers ----------------------------------------------------------------- */

static uint64_t rng_state;
static double uniform(void) /* [0, 1), splitmix64 */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
}
static double normal(void)
{
    const double u = uniform(), v = uniform();
    return sqrt(-2.0 * log(1.0 - u)) * cos(6.283185307179586 * v);
}

static size_t dsize(fg_dtype t) { return t == FG_DTYPE_BF16 ? 2 : 4; }
static const char *dname(fg_dtype t) { return t == FG_DTYPE_BF16 ? "bf16" : "f32"; }

static double load(const std::vector<unsigned char> &b, fg_dtype t, size_t i)
{
    if (t == FG_DTYPE_BF16) {
        uint16_t h;
        memcpy(&h, &b[2 * i], 2);
        return fg_bf16_to_f32(h);
    }
    float f;
    memcpy(&f, &b[4 * i], 4);
    return f;
}
static void store(std::vector<unsigned char> &b, fg_dtype t, size_t i, double v)
{
    if (t == FG_DTYPE_BF16) {
        const uint16_t h = fg_f32_to_bf16((float)v);
        memcpy(&b[2 * i], &h, 2);
    } else {
        const float f = (float)v;
        memcpy(&b[4 * i], &f, 4);
    }
}

/* cudaMemcpy from pageable memory may return before the bytes reach the
 * device, and the CUDA context's stream is non-blocking (not ordered after
 * the legacy stream): every upload waits for the device. */
static void upload(void *dst, const void *host, size_t bytes)
{
    CUDA_OK(cudaMemcpy(dst, host, bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaDeviceSynchronize());
}

template <typename T> static T *device_copy(const T *host, size_t n)
{
    T *d = NULL;
    CUDA_OK(cudaMalloc(&d, n * sizeof(T) + 1)); /* + 1: never a zero-byte allocation */
    if (n)
        upload(d, host, n * sizeof(T));
    return d;
}
template <typename T> static std::vector<T> host_copy(const T *d, size_t n)
{
    std::vector<T> v(n);
    if (n)
        CUDA_OK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}

/* ---- the problem -------------------------------------------------------------------- */

struct Problem {
    fg_dtype dtype;
    std::vector<unsigned char> hidden, weight, bias; /* stored, rows LDH apart */
    std::vector<int64_t> tokens;
    std::vector<uint8_t> mask;
    std::vector<float> adv, old_logp, ref_logp, is_ratio;
};

/* The same values before rounding for both dtypes (one seed). */
static Problem problem_make(fg_dtype dtype)
{
    Problem p;
    p.dtype = dtype;
    rng_state = 20240917;
    const size_t es = dsize(dtype);
    p.hidden.assign((size_t)N * LDH * es, 0xff); /* padding: NaN in both dtypes */
    p.weight.assign((size_t)V * LDH * es, 0xff);
    p.bias.assign((size_t)V * es, 0);
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < H; k++)
            store(p.hidden, dtype, (size_t)(n * LDH + k), normal());
    const double ws = 3.0 / sqrt((double)H); /* logits of a few units */
    for (int64_t v = 0; v < V; v++)
        for (int64_t k = 0; k < H; k++)
            store(p.weight, dtype, (size_t)(v * LDH + k), ws * normal());
    for (int64_t v = 0; v < V; v++)
        store(p.bias, dtype, (size_t)v, 0.5 * normal());
    /* Completions of lengths T, 25 and 12 (right padding), two holes in the
     * first: 72 of 111 tokens unmasked. Masked ids are out of range. */
    const int64_t len[B] = {T, 25, 12};
    p.tokens.resize(N);
    p.mask.resize(N);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t n = b * T + t;
            p.mask[n] = t < len[b] && !(b == 0 && (t == 5 || t == 6));
            p.tokens[n] = p.mask[n] ? (int64_t)(uniform() * V) % V : (n % 2 ? V + 11 : -7);
        }
    p.adv = {0.8f, -1.1f, 0.5f};
    p.old_logp.assign(N, -1e30f); /* hostile where masked: never read */
    p.ref_logp.assign(N, -1e30f);
    p.is_ratio.assign(N, 1e30f);
    return p;
}

static fg_linear_inputs host_inputs(Problem &p)
{
    fg_linear_inputs in;
    memset(&in, 0, sizeof in);
    in.hidden = {p.hidden.data(), p.dtype, N, H, LDH};
    in.weight = {p.weight.data(), p.dtype, V, H, LDH};
    in.bias = {p.bias.data(), p.dtype, V};
    return in;
}

static fg_batch host_batch(Problem &p)
{
    fg_batch b;
    memset(&b, 0, sizeof b);
    b.batch = B;
    b.seq_len = T;
    b.token_ids = p.tokens.data();
    b.mask = p.mask.data();
    b.advantages = p.adv.data();
    b.old_logp = p.old_logp.data();
    b.ref_logp = p.ref_logp.data();
    b.is_ratio = p.is_ratio.data();
    return b;
}

/* old_logp, ref_logp, is_ratio around the CPU's own log-probs, so that the
 * ratios straddle the clip bounds. */
static void fill_logp(fg_context *cpu, Problem &p)
{
    std::vector<float> logp(N);
    fg_linear_inputs in = host_inputs(p);
    const fg_tokens tok = {B, T, p.tokens.data(), p.mask.data()};
    const fg_status st = fg_linear_logprobs(cpu, NULL, TEMPERATURE, &in, &tok, logp.data(), NULL,
                                            NULL);
    if (st != FG_OK) {
        printf("FAIL the CPU's log-probs: %s\n", fg_last_error(cpu));
        exit(1);
    }
    double closest = INFINITY; /* to log(1 ± 0.2), the default clip bounds */
    for (int64_t n = 0; n < N; n++) {
        if (!p.mask[n])
            continue;
        p.old_logp[n] = logp[n] + (float)(0.25 * normal());
        p.ref_logp[n] = logp[n] + (float)(0.2 * normal());
        p.is_ratio[n] = (float)(0.5 + uniform());
        const double r = (double)logp[n] - p.old_logp[n];
        closest = fmin(closest, fmin(fabs(r - log(1.2)), fabs(r - log(0.8))));
    }
    printf("     %s: the closest token log-ratio to a default clip bound is %.3g away\n",
           dname(p.dtype), closest);
}

/* The problem's arrays in device memory. */
struct DeviceProblem {
    void *hidden, *weight, *bias;
    int64_t *tokens;
    uint8_t *mask;
    float *adv, *old_logp, *ref_logp, *is_ratio;
};

static DeviceProblem device_problem(const Problem &p)
{
    DeviceProblem d;
    d.hidden = device_copy(p.hidden.data(), p.hidden.size());
    d.weight = device_copy(p.weight.data(), p.weight.size());
    d.bias = device_copy(p.bias.data(), p.bias.size());
    d.tokens = device_copy(p.tokens.data(), p.tokens.size());
    d.mask = device_copy(p.mask.data(), p.mask.size());
    d.adv = device_copy(p.adv.data(), p.adv.size());
    d.old_logp = device_copy(p.old_logp.data(), p.old_logp.size());
    d.ref_logp = device_copy(p.ref_logp.data(), p.ref_logp.size());
    d.is_ratio = device_copy(p.is_ratio.data(), p.is_ratio.size());
    return d;
}

static void device_problem_free(DeviceProblem &d)
{
    void *all[9] = {d.hidden, d.weight, d.bias, d.tokens, d.mask, d.adv,
                    d.old_logp, d.ref_logp, d.is_ratio};
    for (void *q : all)
        CUDA_OK(cudaFree(q));
}

static fg_linear_inputs device_inputs(const DeviceProblem &d, fg_dtype t)
{
    fg_linear_inputs in;
    memset(&in, 0, sizeof in);
    in.hidden = {d.hidden, t, N, H, LDH};
    in.weight = {d.weight, t, V, H, LDH};
    in.bias = {d.bias, t, V};
    return in;
}

static fg_batch device_batch(const DeviceProblem &d)
{
    fg_batch b;
    memset(&b, 0, sizeof b);
    b.batch = B;
    b.seq_len = T;
    b.token_ids = d.tokens;
    b.mask = d.mask;
    b.advantages = d.adv;
    b.old_logp = d.old_logp;
    b.ref_logp = d.ref_logp;
    b.is_ratio = d.is_ratio;
    return b;
}

/* ---- outputs ---------------------------------------------------------------------- */

/* Host copies of a call's outputs. */
struct Outputs {
    fg_dtype gdt;
    double loss;
    fg_metrics metrics;
    std::vector<float> logp, entropy;
    std::vector<unsigned char> gh, gw, gb; /* [N, LDGH], [V, LDGW], [V] of gdt */
};

/* Earlier contents, finite and distinct: what an accumulating caller holds,
 * scaled by `scale`; the non-accumulating calls must overwrite them. */
static Outputs outputs_make(fg_dtype gdt, double scale)
{
    Outputs o;
    o.gdt = gdt;
    o.loss = 12.5;
    memset(&o.metrics, 0x5a, sizeof o.metrics);
    o.logp.resize(N);
    o.entropy.resize(N);
    for (int64_t n = 0; n < N; n++)
        o.logp[n] = o.entropy[n] = -1.0f - (float)n;
    o.gh.resize((size_t)N * LDGH * dsize(gdt));
    o.gw.resize((size_t)V * LDGW * dsize(gdt));
    o.gb.resize((size_t)V * dsize(gdt));
    for (size_t i = 0; i < (size_t)N * LDGH; i++)
        store(o.gh, gdt, i, scale * (0.5 * (double)(i % 5) - 1.0));
    for (size_t i = 0; i < (size_t)V * LDGW; i++)
        store(o.gw, gdt, i, scale * (0.125 * (double)(i % 13) - 0.75) / 0.75);
    for (size_t i = 0; i < (size_t)V; i++)
        store(o.gb, gdt, i, scale * (0.25 * (double)(i % 7) - 0.75) / 0.75);
    return o;
}

static fg_linear_outputs outputs_view(Outputs &o, int accumulate)
{
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    out.loss = o.loss;
    out.metrics = o.metrics;
    out.logp = o.logp.data();
    out.entropy = o.entropy.data();
    out.grad_hidden = {o.gh.data(), o.gdt, N, H, LDGH};
    out.grad_weight = {o.gw.data(), o.gdt, V, H, LDGW};
    out.grad_bias = {o.gb.data(), o.gdt, V};
    out.accumulate = accumulate;
    return out;
}

/* The same outputs in device memory. */
struct DeviceOutputs {
    fg_dtype gdt;
    float *logp, *entropy;
    unsigned char *gh, *gw, *gb;
    size_t gh_bytes, gw_bytes, gb_bytes;
};

static DeviceOutputs device_outputs(const Outputs &o)
{
    DeviceOutputs d;
    d.gdt = o.gdt;
    d.logp = device_copy(o.logp.data(), o.logp.size());
    d.entropy = device_copy(o.entropy.data(), o.entropy.size());
    d.gh = device_copy(o.gh.data(), o.gh.size());
    d.gw = device_copy(o.gw.data(), o.gw.size());
    d.gb = device_copy(o.gb.data(), o.gb.size());
    d.gh_bytes = o.gh.size();
    d.gw_bytes = o.gw.size();
    d.gb_bytes = o.gb.size();
    return d;
}

static void device_outputs_free(DeviceOutputs &d)
{
    void *all[5] = {d.logp, d.entropy, d.gh, d.gw, d.gb};
    for (void *q : all)
        CUDA_OK(cudaFree(q));
}

static fg_linear_outputs device_view(const DeviceOutputs &d, const Outputs &host_fields,
                                     int accumulate)
{
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    out.loss = host_fields.loss;
    out.metrics = host_fields.metrics;
    out.logp = d.logp;
    out.entropy = d.entropy;
    out.grad_hidden = {d.gh, d.gdt, N, H, LDGH};
    out.grad_weight = {d.gw, d.gdt, V, H, LDGW};
    out.grad_bias = {d.gb, d.gdt, V};
    out.accumulate = accumulate;
    return out;
}

/* The device outputs, and the host fields of `out`, as host copies. */
static Outputs outputs_read(const DeviceOutputs &d, const fg_linear_outputs &out)
{
    Outputs o;
    o.gdt = d.gdt;
    o.loss = out.loss;
    o.metrics = out.metrics;
    o.logp = host_copy(d.logp, N);
    o.entropy = host_copy(d.entropy, N);
    o.gh = host_copy(d.gh, d.gh_bytes);
    o.gw = host_copy(d.gw, d.gw_bytes);
    o.gb = host_copy(d.gb, d.gb_bytes);
    return o;
}

static bool outputs_same(const Outputs &a, const Outputs &b)
{
    return memcmp(&a.loss, &b.loss, sizeof a.loss) == 0 &&
           memcmp(&a.metrics, &b.metrics, sizeof a.metrics) == 0 && a.logp == b.logp &&
           a.entropy == b.entropy && a.gh == b.gh && a.gw == b.gw && a.gb == b.gb;
}

/* ---- comparisons ---------------------------------------------------------------------- */

/* The worst |got − want| / tol of one quantity. */
struct Worst {
    double ratio = 0, got = 0, want = 0;
    size_t at = 0;
};

static void consider(Worst &w, size_t i, double got, double want, double tol)
{
    double r;
    if (isnan(got) || isnan(want))
        r = isnan(got) && isnan(want) ? 0 : INFINITY;
    else
        r = fabs(got - want) / fmax(tol, 1e-300);
    if (r > w.ratio || (w.ratio == 0 && i == 0)) {
        w.ratio = r;
        w.at = i;
        w.got = got;
        w.want = want;
    }
}

static void scalar(Worst &w, size_t i, double got, double want, Tol t)
{
    consider(w, i, got, want, t.rel * (1 + fabs(want)));
}

/* Element (r, c < cols) of a [rows, ld] array of dtype t. */
static Worst compare_matrix(const std::vector<unsigned char> &got,
                            const std::vector<unsigned char> &want, fg_dtype t, int64_t rows,
                            int64_t cols, int64_t ld, Tol tol)
{
    double M = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            M = fmax(M, fabs(load(want, t, (size_t)(r * ld + c))));
    Worst w;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const size_t i = (size_t)(r * ld + c);
            const double g = load(got, t, i), x = load(want, t, i);
            consider(w, i, g, x, tol.rel * fabs(x) + tol.abs_of_max * M);
        }
    return w;
}

/* One call's results against the CPU's; prints one line of worst fractions
 * (and the offending value of any over 1). */
static void compare_outputs(const char *label, const Outputs &got, const Outputs &want,
                            const Outputs &before, const Problem &p, bool grads)
{
    Worst loss, tok[2];
    scalar(loss, 0, got.loss, want.loss, TOL_SCALAR);
    const double *gm = &got.metrics.kl, *wm = &want.metrics.kl;
    for (size_t i = 0; i < sizeof(fg_metrics) / sizeof(double); i++)
        scalar(loss, i + 1, gm[i], wm[i], TOL_SCALAR);
    for (int64_t n = 0; n < N; n++) {
        scalar(tok[0], (size_t)n, got.logp[n], want.logp[n], TOL_TOKEN);
        scalar(tok[1], (size_t)n, got.entropy[n], want.entropy[n], TOL_TOKEN);
    }
    Worst gr[3];
    const Tol gt = p.dtype == FG_DTYPE_BF16 ? TOL_GRAD_BF16 : TOL_GRAD_F32;
    bool zeros = true, padding = true;
    if (grads) {
        gr[0] = compare_matrix(got.gh, want.gh, got.gdt, N, H, LDGH, gt);
        gr[1] = compare_matrix(got.gw, want.gw, got.gdt, V, H, LDGW, gt);
        gr[2] = compare_matrix(got.gb, want.gb, got.gdt, 1, V, V, gt);
        const size_t es = dsize(got.gdt);
        for (int64_t n = 0; n < N; n++) {
            const unsigned char *row = &got.gh[(size_t)(n * LDGH) * es];
            if (!p.mask[n])
                for (size_t b = 0; b < (size_t)H * es; b++)
                    zeros = zeros && row[b] == 0;
            padding = padding && memcmp(row + H * es, &before.gh[(size_t)(n * LDGH + H) * es],
                                        (size_t)(LDGH - H) * es) == 0;
        }
        for (int64_t v = 0; v < V; v++)
            padding = padding && memcmp(&got.gw[(size_t)(v * LDGW + H) * es],
                                        &before.gw[(size_t)(v * LDGW + H) * es],
                                        (size_t)(LDGW - H) * es) == 0;
    }
    for (int64_t n = 0; n < N; n++)
        if (!p.mask[n])
            zeros = zeros && got.logp[n] == 0 && got.entropy[n] == 0;
    const Worst *all[6] = {&loss, &tok[0], &tok[1], &gr[0], &gr[1], &gr[2]};
    const char *names[6] = {"loss/metrics", "logp", "entropy", "grad_hidden", "grad_weight",
                            "grad_bias"};
    bool bad = !zeros || !padding;
    for (int i = 0; i < 6; i++)
        bad = bad || !(all[i]->ratio <= 1);
    checks_run++;
    checks_failed += bad;
    printf("%s %-40s loss %.3f logp %.3f ent %.3f", bad ? "FAIL" : "ok  ", label, loss.ratio,
           tok[0].ratio, tok[1].ratio);
    if (grads)
        printf(" gh %.3f gw %.3f gb %.3f", gr[0].ratio, gr[1].ratio, gr[2].ratio);
    printf(" of tol\n");
    for (int i = 0; i < 6; i++)
        if (!(all[i]->ratio <= 1))
            printf("       %s: at %zu got %.9g want %.9g (%.3g of tol)\n", names[i], all[i]->at,
                   all[i]->got, all[i]->want, all[i]->ratio);
    if (!zeros)
        printf("       masked tokens: logp/entropy or grad_hidden rows are not exact zeros\n");
    if (!padding)
        printf("       padding columns of grad_hidden / grad_weight were written\n");
}

/* ---- the calls ------------------------------------------------------------------------ */

struct Contexts {
    fg_context *cpu, *gpu;
    cudaStream_t stream;
};

static fg_loss_config config(int loss, int level)
{
    fg_loss_config c;
    fg_loss_config_init(&c);
    c.loss_type = (fg_loss_type)loss;
    c.importance_sampling_level = (fg_is_level)level;
    c.temperature = TEMPERATURE;
    c.beta = 0.04;
    c.entropy_coef = 0.01;
    return c;
}

static fg_linear_options options(fg_impl impl)
{
    fg_linear_options o;
    memset(&o, 0, sizeof o);
    o.impl = impl;
    return o;
}

/* A fused call's budget, its chunks, and whether a bf16 grad_weight is
 * summed in the float32 buffer (else in place, rounded per chunk). */
struct Budget {
    size_t bytes;
    int64_t chunks;
    bool sums;
};

/* The least budget (grown from the least that runs, by the plan query) that
 * gives the CUDA context's fused call at most 6 chunks and, with
 * `want_sums`, a bf16 grad_weight's float32 sums. */
static Budget fused_budget(const Contexts &cx, const DeviceProblem &d, fg_dtype in_t,
                           const DeviceOutputs &dout, const Outputs &fields, bool want_sums)
{
    const fg_loss_config cfg = config(FG_LOSS_GRPO, FG_LEVEL_TOKEN);
    const fg_linear_options o = options(FG_IMPL_FUSED);
    const fg_linear_inputs in = device_inputs(d, in_t);
    const fg_batch b = device_batch(d);
    const fg_linear_outputs out = device_view(dout, fields, 0);
    fg_linear_plan_info info;
    fg_status st = fg_linear_grpo_plan(cx.gpu, &o, &cfg, &in, &b, &out, NULL, &info);
    if (st != FG_OK) {
        printf("FAIL the CUDA plan query: %s: %s\n", fg_status_name(st), fg_last_error(cx.gpu));
        exit(1);
    }
    const bool bf16_gw = dout.gdt == FG_DTYPE_BF16;
    const size_t step = (size_t)V * 8 + (size_t)H * 16 + 256; /* about a row */
    Budget r = {info.min_budget_bytes, 0, false};
    for (int i = 0; i < 4000; i++, r.bytes += step) {
        fg_exec e;
        fg_exec_init(&e);
        e.memory_budget = r.bytes;
        st = fg_linear_grpo_plan(cx.gpu, &o, &cfg, &in, &b, &out, &e, &info);
        if (st == FG_OK && info.chunks <= 6 &&
            (!want_sums || !bf16_gw || info.grad_weight_sum_bytes > 0))
            break;
    }
    r.chunks = info.chunks;
    r.sums = info.grad_weight_sum_bytes > 0;
    return r;
}

/* " (k chunks ...)" for a label. */
static void budget_note(char *label, size_t size, const Budget &bu, fg_dtype gdt)
{
    const size_t len = strlen(label);
    snprintf(label + len, size - len, " (%lld chunks%s)", (long long)bu.chunks,
             gdt != FG_DTYPE_BF16 ? ""
             : bu.sums           ? ", f32 grad_weight sums"
                                 : ", grad_weight summed in bf16");
}

/* fg_linear_grpo on both contexts from the same earlier outputs; returns the
 * CPU's status, writes both results. */
static void run_pair(const Contexts &cx, Problem &p, const DeviceProblem &d, fg_impl impl,
                     size_t budget, const fg_loss_config &cfg, const Outputs &before,
                     int accumulate, fg_status *st_cpu, fg_status *st_gpu, Outputs *cpu_out,
                     Outputs *gpu_out, double filter_eps = 0.0)
{
    fg_linear_options o = options(impl);
    o.filter_eps = filter_eps;
    fg_exec e;
    fg_exec_init(&e);
    e.memory_budget = budget;

    *cpu_out = before;
    fg_linear_inputs hin = host_inputs(p);
    const fg_batch hb = host_batch(p);
    fg_linear_outputs hout = outputs_view(*cpu_out, accumulate);
    *st_cpu = fg_linear_grpo(cx.cpu, &o, &cfg, &hin, &hb, &hout, NULL);
    cpu_out->loss = hout.loss;
    cpu_out->metrics = hout.metrics;

    DeviceOutputs dout = device_outputs(before);
    const fg_linear_inputs din = device_inputs(d, p.dtype);
    const fg_batch db = device_batch(d);
    fg_linear_outputs gout = device_view(dout, before, accumulate);
    *st_gpu = fg_linear_grpo(cx.gpu, &o, &cfg, &din, &db, &gout, impl == FG_IMPL_FUSED ? &e : NULL);
    CUDA_OK(cudaStreamSynchronize(cx.stream));
    *gpu_out = outputs_read(dout, gout);
    device_outputs_free(dout);
}

/* Every loss type and level (or GRPO token-level only), one impl, against
 * the CPU; bu NULL: materialized. */
static void test_losses(const Contexts &cx, Problem &p, const DeviceProblem &d, const Budget *bu,
                        fg_dtype gdt, bool all_losses)
{
    const fg_impl impl = bu ? FG_IMPL_FUSED : FG_IMPL_MATERIALIZED;
    const Outputs before = outputs_make(gdt, 1.0);
    for (int loss = 0; loss < (all_losses ? (int)FG_LOSS_TYPE_COUNT : 1); loss++)
        for (int level = 0; level < (all_losses ? (int)FG_LEVEL_COUNT : 1); level++) {
            const fg_loss_config cfg = config(loss, level);
            fg_status sc, sg;
            Outputs co, go;
            run_pair(cx, p, d, impl, bu ? bu->bytes : 0, cfg, before, 0, &sc, &sg, &co, &go);
            char label[160];
            snprintf(label, sizeof label, "%s->%s %s %s/%s", dname(p.dtype), dname(gdt),
                     bu ? "fused" : "materialized", fg_loss_type_name((fg_loss_type)loss),
                     fg_is_level_name((fg_is_level)level));
            if (bu)
                budget_note(label, sizeof label, *bu, gdt);
            if (sc != FG_OK || sg != FG_OK) {
                char what[512];
                snprintf(what, sizeof what, "%s: statuses CPU %s, CUDA %s (%s)", label,
                         fg_status_name(sc), fg_status_name(sg),
                         sg != FG_OK ? fg_last_error(cx.gpu) : fg_last_error(cx.cpu));
                check_true(what, sc == sg);
                continue;
            }
            compare_outputs(label, go, co, before, p, true);
        }
}

/* accumulate = 1 onto earlier sums of the gradients' own size. */
static void test_accumulate(const Contexts &cx, Problem &p, const DeviceProblem &d,
                            const Budget &bu, fg_dtype gdt)
{
    const fg_loss_config cfg = config(FG_LOSS_DAPO, FG_LEVEL_TOKEN);
    fg_status sc, sg;
    Outputs co, go;
    run_pair(cx, p, d, FG_IMPL_FUSED, bu.bytes, cfg, outputs_make(gdt, 1.0), 0, &sc, &sg, &co,
             &go);
    double M = 0;
    for (size_t i = 0; i < (size_t)V * LDGW; i++)
        M = fmax(M, fabs(load(co.gw, gdt, i)));
    const Outputs before = outputs_make(gdt, M > 0 ? M : 1.0);
    run_pair(cx, p, d, FG_IMPL_FUSED, bu.bytes, cfg, before, 1, &sc, &sg, &co, &go);
    char label[160];
    snprintf(label, sizeof label, "%s->%s fused dapo/token accumulate", dname(p.dtype),
             dname(gdt));
    budget_note(label, sizeof label, bu, gdt);
    if (sc != FG_OK || sg != FG_OK) {
        char what[512];
        snprintf(what, sizeof what, "%s: statuses CPU %s, CUDA %s (%s)", label,
                 fg_status_name(sc), fg_status_name(sg), fg_last_error(cx.gpu));
        check_true(what, false);
        return;
    }
    compare_outputs(label, go, co, before, p, true);
}

/* fg_linear_logprobs: logp and entropy alone. */
static void test_logprobs(const Contexts &cx, Problem &p, const DeviceProblem &d)
{
    std::vector<float> cl(N, 7.0f), ce(N, 7.0f);
    float *dl = device_copy(cl.data(), N), *de = device_copy(ce.data(), N); /* 7: unwritten */
    fg_linear_inputs hin = host_inputs(p);
    const fg_tokens ht = {B, T, p.tokens.data(), p.mask.data()};
    const fg_status sc =
        fg_linear_logprobs(cx.cpu, NULL, TEMPERATURE, &hin, &ht, cl.data(), ce.data(), NULL);
    const fg_linear_inputs din = device_inputs(d, p.dtype);
    const fg_tokens dt = {B, T, d.tokens, d.mask};
    const fg_status sg = fg_linear_logprobs(cx.gpu, NULL, TEMPERATURE, &din, &dt, dl, de, NULL);
    CUDA_OK(cudaStreamSynchronize(cx.stream));
    const std::vector<float> gl = host_copy(dl, N), ge = host_copy(de, N);
    CUDA_OK(cudaFree(dl));
    CUDA_OK(cudaFree(de));
    char label[160];
    snprintf(label, sizeof label, "%s fg_linear_logprobs", dname(p.dtype));
    if (sc != FG_OK || sg != FG_OK) {
        char what[512];
        snprintf(what, sizeof what, "%s: statuses CPU %s, CUDA %s (%s)", label,
                 fg_status_name(sc), fg_status_name(sg), fg_last_error(cx.gpu));
        check_true(what, false);
        return;
    }
    Worst w[2];
    for (int64_t n = 0; n < N; n++) {
        scalar(w[0], (size_t)n, gl[n], cl[n], TOL_TOKEN);
        scalar(w[1], (size_t)n, ge[n], ce[n], TOL_TOKEN);
    }
    const bool bad = !(w[0].ratio <= 1 && w[1].ratio <= 1);
    checks_run++;
    checks_failed += bad;
    printf("%s %-40s logp %.3f ent %.3f of tol\n", bad ? "FAIL" : "ok  ", label, w[0].ratio,
           w[1].ratio);
}

/* ---- the phase API of a vocab-sharded call ------------------------------------------ */

/* Two shards of the vocabulary, [0, V0) and [V0, V): (a) -> MAX -> (b) -> SUM
 * -> finish -> (d) on the CUDA context with every array in device memory
 * (the stats too: the reductions by hand, between device copies), against
 * the CPU context's same phases: logp and entropy, grad_hidden summed over
 * the shards, each shard's grad_weight and grad_bias rows (float32
 * gradients). Tokens held by the other shard are in every row group; the
 * masked tokens' ids are out of range (never read). */
static const int64_t V0 = 500;

static fg_linear_inputs shard_view(void *hidden, void *weight, void *bias, fg_dtype t, int s)
{
    const int64_t v0 = s == 0 ? 0 : V0, Vs = s == 0 ? V0 : V - V0;
    const size_t es = dsize(t);
    fg_linear_inputs in;
    memset(&in, 0, sizeof in);
    in.hidden = {hidden, t, N, H, LDH};
    in.weight = {static_cast<unsigned char *>(weight) + (size_t)(v0 * LDH) * es, t, Vs, H, LDH};
    in.bias = {static_cast<unsigned char *>(bias) + (size_t)v0 * es, t, Vs};
    in.vocab_start = v0;
    in.vocab_total = V;
    return in;
}

/* MAX (max = true) or SUM of stats[o, o + count) over the two shards, in place. */
static void reduce_pair(std::vector<float> *st, int64_t o, int64_t count, bool max)
{
    for (int64_t i = o; i < o + count; i++) {
        const float a = st[0][i], b = st[1][i];
        st[0][i] = st[1][i] = max ? (a > b ? a : b) : a + b;
    }
}

static void reduce_device(float *const *dst, int64_t o, int64_t count, bool max)
{
    std::vector<float> st[2];
    for (int s = 0; s < 2; s++)
        st[s] = host_copy(dst[s], (size_t)FG_SHARD_STATS_FLOATS(N));
    reduce_pair(st, o, count, max);
    for (int s = 0; s < 2; s++)
        upload(dst[s] + o, st[s].data() + o, (size_t)count * sizeof(float));
}

static void test_shard_phases(const Contexts &cx, Problem &p, const DeviceProblem &d,
                              size_t budget)
{
    const int64_t F = FG_SHARD_STATS_FLOATS(N);
    fg_exec ex; /* the GEMM phases on the device in chunks (the fused tests' budget) */
    fg_exec_init(&ex);
    ex.memory_budget = budget;
    int64_t chunks[2] = {0, 0}; /* the most of (a), of (d) */
    fg_memory_stats ms;
    char label[160];
    snprintf(label, sizeof label, "%s phase API, 2 vocab shards", dname(p.dtype));
    int held[2] = {0, 0};
    for (int64_t n = 0; n < N; n++)
        if (p.mask[n])
            held[p.tokens[n] >= V0]++;
    std::vector<float> dlogp(N, 0.0f), dent(N, 0.0f);
    for (int64_t n = 0; n < N; n++)
        if (p.mask[n]) {
            dlogp[n] = (float)(0.3 * normal());
            dent[n] = (float)(0.1 * normal());
        }
    const fg_tokens ht = {B, T, p.tokens.data(), p.mask.data()};
    const fg_tokens dtk = {B, T, d.tokens, d.mask};
    float *d_dlogp = device_copy(dlogp.data(), N), *d_dent = device_copy(dent.data(), N);
    std::vector<float> cstats[2], cl[2], ce[2], cgh[2], cgw[2], cgb[2];
    float *gstats[2], *gl[2], *ge[2], *ggh[2], *ggw[2], *ggb[2];
    fg_status sc = FG_OK, sg = FG_OK, st;
    for (int s = 0; s < 2; s++) {
        const int64_t Vs = s == 0 ? V0 : V - V0;
        cstats[s].assign(F, 0.0f);
        cl[s].assign(N, 7.0f);
        ce[s].assign(N, 7.0f);
        cgh[s].assign((size_t)N * H, 0.0f);
        cgw[s].assign((size_t)Vs * H, 0.0f);
        cgb[s].assign((size_t)Vs, 0.0f);
        gstats[s] = device_copy(cstats[s].data(), F);
        gl[s] = device_copy(cl[s].data(), N);
        ge[s] = device_copy(ce[s].data(), N);
        ggh[s] = device_copy(cgh[s].data(), cgh[s].size());
        ggw[s] = device_copy(cgw[s].data(), cgw[s].size());
        ggb[s] = device_copy(cgb[s].data(), cgb[s].size());
    }
    /* (a) */
    for (int s = 0; s < 2; s++) {
        fg_linear_inputs hin = shard_view(p.hidden.data(), p.weight.data(), p.bias.data(),
                                          p.dtype, s);
        fg_linear_inputs din = shard_view(d.hidden, d.weight, d.bias, p.dtype, s);
        if ((st = fg_linear_shard_stats(cx.cpu, NULL, TEMPERATURE, &hin, &ht, cstats[s].data(),
                                        NULL)) != FG_OK)
            sc = st;
        if ((st = fg_linear_shard_stats(cx.gpu, NULL, TEMPERATURE, &din, &dtk, gstats[s],
                                        &ex)) != FG_OK)
            sg = st;
        fg_get_memory_stats(cx.gpu, &ms);
        chunks[0] = ms.chunks > chunks[0] ? ms.chunks : chunks[0];
    }
    CUDA_OK(cudaStreamSynchronize(cx.stream));
    /* MAX, (b), SUM, finish */
    reduce_pair(cstats, 0, FG_SHARD_STATS_MAX_COUNT(N), true);
    reduce_device(gstats, 0, FG_SHARD_STATS_MAX_COUNT(N), true);
    for (int s = 0; s < 2 && sc == FG_OK && sg == FG_OK; s++) {
        if ((st = fg_shard_stats_rescale(cx.cpu, &ht, cstats[s].data())) != FG_OK)
            sc = st;
        if ((st = fg_shard_stats_rescale(cx.gpu, &dtk, gstats[s])) != FG_OK)
            sg = st;
    }
    CUDA_OK(cudaStreamSynchronize(cx.stream));
    reduce_pair(cstats, FG_SHARD_STATS_SUM_OFFSET(N), FG_SHARD_STATS_SUM_COUNT(N), false);
    reduce_device(gstats, FG_SHARD_STATS_SUM_OFFSET(N), FG_SHARD_STATS_SUM_COUNT(N), false);
    for (int s = 0; s < 2 && sc == FG_OK && sg == FG_OK; s++) {
        if ((st = fg_shard_stats_finish(cx.cpu, &ht, cstats[s].data(), cl[s].data(),
                                        ce[s].data())) != FG_OK)
            sc = st;
        if ((st = fg_shard_stats_finish(cx.gpu, &dtk, gstats[s], gl[s], ge[s])) != FG_OK)
            sg = st;
    }
    /* (d) */
    for (int s = 0; s < 2 && sc == FG_OK && sg == FG_OK; s++) {
        const int64_t Vs = s == 0 ? V0 : V - V0;
        fg_linear_inputs hin = shard_view(p.hidden.data(), p.weight.data(), p.bias.data(),
                                          p.dtype, s);
        fg_linear_inputs din = shard_view(d.hidden, d.weight, d.bias, p.dtype, s);
        fg_linear_grads hg = {{cgh[s].data(), FG_DTYPE_F32, N, H, H},
                              {cgw[s].data(), FG_DTYPE_F32, Vs, H, H},
                              {cgb[s].data(), FG_DTYPE_F32, Vs},
                              0};
        fg_linear_grads dg = {{ggh[s], FG_DTYPE_F32, N, H, H},
                              {ggw[s], FG_DTYPE_F32, Vs, H, H},
                              {ggb[s], FG_DTYPE_F32, Vs},
                              0};
        if ((st = fg_linear_shard_backward(cx.cpu, NULL, TEMPERATURE, &hin, &ht, cstats[s].data(),
                                           dlogp.data(), dent.data(), &hg, NULL)) != FG_OK)
            sc = st;
        if ((st = fg_linear_shard_backward(cx.gpu, NULL, TEMPERATURE, &din, &dtk, gstats[s],
                                           d_dlogp, d_dent, &dg, &ex)) != FG_OK)
            sg = st;
        fg_get_memory_stats(cx.gpu, &ms);
        chunks[1] = ms.chunks > chunks[1] ? ms.chunks : chunks[1];
    }
    CUDA_OK(cudaStreamSynchronize(cx.stream));
    if (sc != FG_OK || sg != FG_OK) {
        char what[512];
        snprintf(what, sizeof what, "%s: statuses CPU %s (%s), CUDA %s (%s)", label,
                 fg_status_name(sc), fg_last_error(cx.cpu), fg_status_name(sg),
                 fg_last_error(cx.gpu));
        check_true(what, false);
    } else {
        /* logp, entropy; grad_hidden summed over the shards; each shard's rows */
        Worst w[5];
        for (int s = 0; s < 2; s++) {
            const std::vector<float> l = host_copy(gl[s], N), e = host_copy(ge[s], N);
            for (int64_t n = 0; n < N; n++) {
                scalar(w[0], (size_t)n, l[n], cl[0][n], TOL_TOKEN);
                scalar(w[1], (size_t)n, e[n], ce[0][n], TOL_TOKEN);
            }
        }
        const Tol gt = p.dtype == FG_DTYPE_BF16 ? TOL_GRAD_BF16 : TOL_GRAD_F32;
        const std::vector<float> gh0 = host_copy(ggh[0], (size_t)N * H),
                                 gh1 = host_copy(ggh[1], (size_t)N * H);
        std::vector<float> want((size_t)N * H), got((size_t)N * H);
        double M = 0;
        for (size_t i = 0; i < want.size(); i++) {
            want[i] = cgh[0][i] + cgh[1][i];
            got[i] = gh0[i] + gh1[i];
            M = fmax(M, fabs(want[i]));
        }
        for (size_t i = 0; i < want.size(); i++)
            consider(w[2], i, got[i], want[i], gt.rel * fabs(want[i]) + gt.abs_of_max * M);
        for (int s = 0; s < 2; s++)
            for (int k = 0; k < 2; k++) {
                const std::vector<float> &c = k == 0 ? cgw[s] : cgb[s];
                const std::vector<float> g = host_copy(k == 0 ? ggw[s] : ggb[s], c.size());
                double Mk = 0;
                for (float x : c)
                    Mk = fmax(Mk, fabs(x));
                for (size_t i = 0; i < c.size(); i++)
                    consider(w[3 + k], i, g[i], c[i], gt.rel * fabs(c[i]) + gt.abs_of_max * Mk);
            }
        const bool bad = !(w[0].ratio <= 1 && w[1].ratio <= 1 && w[2].ratio <= 1 &&
                           w[3].ratio <= 1 && w[4].ratio <= 1 && held[0] > 0 && held[1] > 0);
        checks_run++;
        checks_failed += bad;
        printf("%s %-40s logp %.3f ent %.3f grad_hidden %.3f grad_weight %.3f grad_bias %.3f "
               "of tol (tokens held: %d, %d; chunks: (a) %lld, (d) %lld)\n",
               bad ? "FAIL" : "ok  ", label, w[0].ratio, w[1].ratio, w[2].ratio, w[3].ratio,
               w[4].ratio, held[0], held[1], (long long)chunks[0], (long long)chunks[1]);
    }
    for (int s = 0; s < 2; s++) {
        float *all[6] = {gstats[s], gl[s], ge[s], ggh[s], ggw[s], ggb[s]};
        for (float *q : all)
            CUDA_OK(cudaFree(q));
    }
    CUDA_OK(cudaFree(d_dlogp));
    CUDA_OK(cudaFree(d_dent));
}

/* ---- refusals ------------------------------------------------------------------------- */

/* One refused call: the CPU's status and the CUDA context's, every device
 * output (and loss, metrics) bitwise unchanged. */
static void refused(const Contexts &cx, Problem &p, const DeviceProblem &d, fg_impl impl,
                    size_t budget, int accumulate, fg_status want, const char *what)
{
    const fg_loss_config cfg = config(FG_LOSS_DAPO, FG_LEVEL_TOKEN);
    const Outputs before = outputs_make(p.dtype, 1.0);
    fg_status sc, sg;
    Outputs co, go;
    run_pair(cx, p, d, impl, budget, cfg, before, accumulate, &sc, &sg, &co, &go);
    char label[512];
    snprintf(label, sizeof label, "%s %s%s: %s: CPU %s, CUDA %s (%s)", dname(p.dtype),
             impl == FG_IMPL_FUSED ? "fused" : "materialized", accumulate ? " accumulate" : "",
             what, fg_status_name(sc), fg_status_name(sg), fg_last_error(cx.gpu));
    check_true(label, sc == want && sg == want);
    check_true("     every output unchanged", outputs_same(go, before));
}

static void test_refusals(const Contexts &cx, Problem &p, DeviceProblem &d, size_t budget)
{
    /* The last unmasked token: in the last chunk. */
    int64_t last = N - 1, masked = -1;
    while (!p.mask[last])
        last--;
    for (int64_t n = 0; n < N && masked < 0; n++)
        if (!p.mask[n])
            masked = n;
    const fg_impl impls[2] = {FG_IMPL_FUSED, FG_IMPL_MATERIALIZED};

    /* An unmasked id = V. */
    const int64_t id = p.tokens[last];
    p.tokens[last] = V;
    upload(d.tokens + last, &p.tokens[last], sizeof(int64_t));
    for (fg_impl impl : impls)
        for (int acc = 0; acc < 2; acc++)
            refused(cx, p, d, impl, budget, acc, FG_ERR_TOKEN_OUT_OF_RANGE, "token id = V");
    p.tokens[last] = id;
    upload(d.tokens + last, &id, sizeof(int64_t));

    /* A NaN in an unmasked hidden row (its last column), then in a masked one. */
    const size_t es = dsize(p.dtype);
    for (int pass = 0; pass < 2; pass++) {
        const int64_t row = pass == 0 ? last : masked;
        const size_t at = (size_t)(row * LDH + H - 1) * es;
        std::vector<unsigned char> keep(p.hidden.begin() + at, p.hidden.begin() + at + es);
        store(p.hidden, p.dtype, (size_t)(row * LDH + H - 1), NAN);
        unsigned char *dh = static_cast<unsigned char *>(d.hidden);
        upload(dh + at, &p.hidden[at], es);
        if (pass == 0) {
            for (fg_impl impl : impls)
                for (int acc = 0; acc < 2; acc++)
                    refused(cx, p, d, impl, budget, acc, FG_ERR_NONFINITE_INPUT,
                            "NaN in an unmasked hidden row");
        } else {
            fg_status sc, sg;
            Outputs co, go;
            const Outputs before = outputs_make(p.dtype, 1.0);
            run_pair(cx, p, d, FG_IMPL_FUSED, budget, config(FG_LOSS_DAPO, FG_LEVEL_TOKEN),
                     before, 0, &sc, &sg, &co, &go);
            char label[256];
            snprintf(label, sizeof label, "%s NaN in a masked hidden row: CPU %s, CUDA %s",
                     dname(p.dtype), fg_status_name(sc), fg_status_name(sg));
            check_true(label, sc == FG_OK && sg == FG_OK);
            if (sc == FG_OK && sg == FG_OK)
                compare_outputs("     ... and the same results", go, co, before, p, true);
        }
        memcpy(&p.hidden[at], keep.data(), es);
        upload(dh + at, keep.data(), es);
    }

    /* hidden in pageable host memory: refused (the scan checks it before
     * its kernel reads it), never a fault; the device outputs unchanged. */
    {
        DeviceProblem hd = d;
        hd.hidden = p.hidden.data();
        const Outputs before = outputs_make(p.dtype, 1.0);
        DeviceOutputs dout = device_outputs(before);
        const fg_linear_inputs din = device_inputs(hd, p.dtype);
        const fg_batch db = device_batch(hd);
        fg_linear_outputs gout = device_view(dout, before, 0);
        const fg_linear_options o = options(FG_IMPL_FUSED);
        const fg_loss_config cfg = config(FG_LOSS_DAPO, FG_LEVEL_TOKEN);
        const fg_status sg = fg_linear_grpo(cx.gpu, &o, &cfg, &din, &db, &gout, NULL);
        CUDA_OK(cudaStreamSynchronize(cx.stream));
        const Outputs go = outputs_read(dout, gout);
        device_outputs_free(dout);
        char label[512];
        snprintf(label, sizeof label, "%s hidden in host memory: CUDA %s (%s)", dname(p.dtype),
                 fg_status_name(sg), fg_last_error(cx.gpu));
        check_true(label, sg == FG_ERR_UNSUPPORTED);
        check_true("     every output unchanged", outputs_same(go, before));
    }
}

/* ---- the backend's ops against the reference backend (backend.h) ------------------- */

/* The CUDA backend (libfusedgrpo_cuda.so, linked) and the reference
 * (backend_reference.c, in the static core) run the same ops on the same
 * inputs, each in its own memory, every byte through the ops' own alloc /
 * to_device / to_host. Checked: the ops table of ABI 6; supports and
 * chunk_scratch on the call the one driver sends (and their refusals: no
 * mask with grad_hidden or one in host memory, chunks of no row or over the
 * row kernels' launch, dlogits of another dtype); logits, stats and row_check; shard_stats (by
 * row and by token), dhidden and put_grad_hidden against the reference;
 * grads obeying `first` on gw_sum at r0 == 0 (both ways), later, and in
 * place; the bias sums' bits the same in chunks of 7 rows as in one chunk
 * (and those of a host sum of every row in order); finish storing
 * grad_bias = gb_sum without adding the caller's values; filter and derivs
 * (see their tests). */

struct Side {
    const char *name;
    fg_device dev;
    std::vector<void *> blocks;
};

static void side_die(const Side &s, const char *what, fg_status st, const char *msg)
{
    printf("FAIL %s backend: %s: %s: %s\n", s.name, what, fg_status_name(st), msg);
    exit(1);
}

static void *side_alloc(Side &s, size_t bytes)
{
    char msg[256] = "";
    void *p = NULL;
    const fg_status st = s.dev.ops->alloc(s.dev.state, bytes, &p, msg, sizeof msg);
    if (st != FG_OK)
        side_die(s, "alloc", st, msg);
    s.blocks.push_back(p);
    return p;
}

static void side_put(Side &s, void *dst, const void *host, size_t bytes)
{
    char msg[256] = "";
    const fg_status st = s.dev.ops->to_device(s.dev.state, dst, host, bytes, msg, sizeof msg);
    if (st != FG_OK)
        side_die(s, "to_device", st, msg);
}

static void side_get(Side &s, void *host, const void *src, size_t bytes)
{
    char msg[256] = "";
    fg_status st = s.dev.ops->to_host(s.dev.state, host, src, bytes, msg, sizeof msg);
    if (st == FG_OK)
        st = s.dev.ops->wait(s.dev.state, msg, sizeof msg);
    if (st != FG_OK)
        side_die(s, "to_host", st, msg);
}

template <typename T> static T *side_copy(Side &s, const std::vector<T> &host)
{
    T *p = static_cast<T *>(side_alloc(s, host.size() * sizeof(T)));
    side_put(s, p, host.data(), host.size() * sizeof(T));
    return p;
}

template <typename T> static std::vector<T> side_read(Side &s, const void *src, size_t n)
{
    std::vector<T> v(n);
    side_get(s, v.data(), src, n * sizeof(T));
    return v;
}

static void side_close(Side &s)
{
    for (void *p : s.blocks)
        s.dev.ops->release(s.dev.state, p);
    s.blocks.clear();
    if (s.dev.ops)
        s.dev.ops->destroy(s.dev.state);
    s.dev.ops = NULL;
}

/* An op's status, checked. */
static bool op_ran(const Side &s, const char *what, fg_status st, const char *msg)
{
    char line[512];
    snprintf(line, sizeof line, "%s: %s %s%s%s", s.name, what, fg_status_name(st),
             st != FG_OK ? ": " : "", st != FG_OK ? msg : "");
    check_true(line, st == FG_OK);
    return st == FG_OK;
}

#define OP(side, call, name, ...)                                                                 \
    do {                                                                                          \
        char msg_[512] = "";                                                                      \
        const fg_status st_ = (side).dev.ops->call((side).dev.state, __VA_ARGS__, msg_,           \
                                                   sizeof msg_);                                  \
        op_ran((side), (name), st_, msg_);                                                        \
    } while (0)

/* Grad_weight of the ops tests: float32 (a bf16 one goes through gw_sum,
 * tested here on its own). */
static const int64_t LDGW_OPS = H + 4;

/* The call of the active rows `rows` (targets `tg`) in s's memory: every
 * input uploaded, every buffer for one chunk of all the rows. */
static fg_backend_call ops_call(Side &s, const Problem &p, const std::vector<int64_t> &rows,
                                const std::vector<int64_t> &tg)
{
    const fg_dtype t = p.dtype;
    const size_t es = dsize(t), n = rows.size();
    fg_backend_call c;
    memset(&c, 0, sizeof c);
    c.N = N;
    c.H = H;
    c.V = V;
    c.n_active = (int64_t)n;
    c.chunk_rows = (int64_t)n;
    c.in_t = t;
    c.logit_t = FG_DTYPE_F32;
    c.dlogit_t = t; /* compute_dtype(in_t), what the one driver sends */
    c.inv_temp = (float)(1.0 / TEMPERATURE);
    c.workers = 1;
    c.hidden = {side_copy(s, p.hidden), t, N, H, LDH};
    c.weight = {side_copy(s, p.weight), t, V, H, LDH};
    c.bias = {side_copy(s, p.bias), t, V};
    c.mask = side_copy(s, p.mask);
    c.grad_hidden = {side_alloc(s, (size_t)N * LDGH * es), t, N, H, LDGH};
    c.grad_weight = {side_alloc(s, (size_t)V * LDGW_OPS * 4), FG_DTYPE_F32, V, H, LDGW_OPS};
    c.grad_bias = {side_alloc(s, (size_t)V * es), t, V};
    c.rows = side_copy(s, rows);
    c.targets = side_copy(s, tg);
    c.logits = side_alloc(s, n * V * 4);
    c.dlogits = side_alloc(s, n * V * es);
    c.hbuf = side_alloc(s, n * H * es);
    c.ghbuf = static_cast<float *>(side_alloc(s, n * H * 4));
    float *st = static_cast<float *>(side_alloc(s, 6 * n * 4));
    c.zmax = st;
    c.lsum = st + n;
    c.entropy = st + 2 * n;
    c.logp = st + 3 * n;
    c.g = st + 4 * n;
    c.e = st + 5 * n;
    c.gw_sum = static_cast<float *>(side_alloc(s, (size_t)V * H * 4));
    c.gb_sum = static_cast<float *>(side_alloc(s, (size_t)V * 4));
    c.row_check = static_cast<int *>(side_alloc(s, sizeof(int)));
    return c;
}

static void put_row_check(Side &s, const fg_backend_call &c)
{
    const int none = FG_BACKEND_ROW_NONE;
    side_put(s, c.row_check, &none, sizeof none);
}

/* Values of dtype t, rounded on the host as the device stores them. */
static std::vector<unsigned char> random_values(fg_dtype t, size_t n, double scale)
{
    std::vector<unsigned char> b(n * dsize(t));
    for (size_t i = 0; i < n; i++)
        store(b, t, i, scale * normal());
    return b;
}

static std::vector<float> random_floats(size_t n, double scale)
{
    std::vector<float> v(n);
    for (float &x : v)
        x = (float)(scale * normal());
    return v;
}

/* |got − want| <= tol[i] everywhere (NaN only against NaN); prints the worst. */
static void close_all(const char *what, const std::vector<double> &got,
                      const std::vector<double> &want, const std::vector<double> &tol)
{
    Worst w;
    for (size_t i = 0; i < want.size(); i++)
        consider(w, i, got[i], want[i], tol[i]);
    char line[300];
    snprintf(line, sizeof line, "%s: worst %.3g of tol at %zu (got %.9g, want %.9g)", what,
             w.ratio, w.at, w.got, w.want);
    check_true(line, w.ratio <= 1.0);
}

static std::vector<double> as_doubles(const std::vector<float> &v)
{
    return std::vector<double>(v.begin(), v.end());
}

/* The ops table of ABI 6, supports and chunk_scratch. */
/* The filter's row scratch as the backend lays it out, the sparse
 * products' after it (backend_cuda.cu). */
static size_t filter_rows_bytes(int64_t rows)
{
    return ((size_t)rows * sizeof(fg_cuda_filter_row) + 255) / 256 * 256;
}

/* Whether the driver runs conditional graph nodes with an else branch. */
static bool conditional_nodes()
{
    int driver = 0;
    return cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12080;
}

static void test_ops_table(Side &cu, const fg_backend_call &c, const uint8_t *host_mask)
{
    const fg_backend_ops *o = cu.dev.ops;
    check_true("cuda ops: abi, name", o->abi == FG_BACKEND_ABI && strcmp(o->name, "cuda") == 0);
    check_true("cuda ops: caps ASYNC | THREAD_INVARIANT",
               o->caps == (FG_BACKEND_ASYNC | FG_BACKEND_THREAD_INVARIANT));
    check_true("cuda ops: align 256, logits_block_rows 0, fast_chunk_rows 1024",
               o->align == 256 && o->logits_block_rows == 0 && o->fast_chunk_rows == 1024);
    check_true("cuda ops: compute_dtype is the inputs' dtype",
               o->compute_dtype && o->compute_dtype(cu.dev.state, FG_DTYPE_F32) == FG_DTYPE_F32 &&
                   o->compute_dtype(cu.dev.state, FG_DTYPE_BF16) == FG_DTYPE_BF16);
    check_true("cuda ops: shard_stats, dhidden, put_grad_hidden, derivs, filter, the report "
               "ops; no stats_backward, chunk_slow",
               o->shard_stats && o->dhidden && o->put_grad_hidden && o->derivs && o->filter &&
                   o->report_batch && o->report_prepare && o->report_scan && o->report_tokens &&
                   !o->stats_backward &&
                   !o->chunk_slow && o->chunk_scratch);
    char msg[512] = "", what[300];
    fg_status st = o->supports(cu.dev.state, &c, msg, sizeof msg);
    snprintf(what, sizeof what, "supports: the call as planned (%s): %s", dname(c.in_t), msg);
    check_true(what, st == FG_OK);
    size_t bytes = 1;
    st = o->chunk_scratch(cu.dev.state, &c, c.chunk_rows, 5, &bytes, msg, sizeof msg);
    check_true("chunk_scratch: FG_OK, no bytes (the bias sums need none)",
               st == FG_OK && bytes == 0);
    st = o->chunk_scratch(cu.dev.state, &c, (int64_t)INT_MAX + 1, 1, &bytes, msg, sizeof msg);
    check_true("chunk_scratch: refuses chunks over the row kernels' launch",
               st == FG_ERR_UNSUPPORTED);
    {
        fg_backend_call f = c;
        f.filter_eps = 1e-5;
        f.kept_cap = V / 8;
        bytes = 0;
        st = o->chunk_scratch(cu.dev.state, &f, 5, c.chunk_rows, &bytes, msg, sizeof msg);
        const size_t rows_bytes = filter_rows_bytes(c.chunk_rows);
        size_t sparse = 0;
        if (conditional_nodes())
            (void)fg_cuda_sparse_bytes(c.chunk_rows, V, &sparse, msg, sizeof msg);
        snprintf(what, sizeof what, "chunk_scratch with filtering: the filter's row scratch "
                 "and the sparse products' for the larger chunk (%zu bytes for %lld rows, want "
                 "%zu + %zu)", bytes, (long long)c.chunk_rows, rows_bytes, sparse);
        check_true(what, st == FG_OK && bytes == rows_bytes + sparse);
        st = o->supports(cu.dev.state, &f, msg, sizeof msg);
        snprintf(what, sizeof what, "supports takes filter_eps > 0: %s", msg);
        check_true(what, st == FG_OK);
    }
    struct Bad {
        const char *what;
        fg_backend_call c;
    };
    std::vector<Bad> bad;
    Bad b = {"grad_hidden without the mask", c};
    b.c.mask = NULL;
    bad.push_back(b);
    b = {"chunks of 0 rows with unmasked tokens", c};
    b.c.chunk_rows = 0;
    bad.push_back(b);
    b = {"chunks over the row kernels' launch", c};
    b.c.chunk_rows = (int64_t)INT_MAX + 1;
    bad.push_back(b);
    b = {"dlogits of another dtype than compute_dtype", c};
    b.c.dlogit_t = c.in_t == FG_DTYPE_F32 ? FG_DTYPE_BF16 : FG_DTYPE_F32;
    bad.push_back(b);
    b = {"grad_hidden with fewer rows than tokens", c};
    b.c.grad_hidden.rows = N - 1;
    bad.push_back(b);
    b = {"grad_hidden with a mask in host memory (finish reads it on the device)", c};
    b.c.mask = host_mask;
    bad.push_back(b);
    for (const Bad &x : bad) {
        msg[0] = '\0';
        st = o->supports(cu.dev.state, &x.c, msg, sizeof msg);
        snprintf(what, sizeof what, "supports refuses %s: %s", x.what, msg);
        check_true(what, st == FG_ERR_UNSUPPORTED);
    }
    b = {"no token unmasked, chunks of 0 rows", c};
    b.c.n_active = 0;
    b.c.chunk_rows = 0;
    st = o->supports(cu.dev.state, &b.c, msg, sizeof msg);
    snprintf(what, sizeof what, "supports takes %s: %s", b.what, msg);
    check_true(what, st == FG_OK);
    b = {"grad_hidden not wanted, no mask", c};
    b.c.grad_hidden.data = NULL;
    b.c.mask = NULL;
    st = o->supports(cu.dev.state, &b.c, msg, sizeof msg);
    snprintf(what, sizeof what, "supports takes %s: %s", b.what, msg);
    check_true(what, st == FG_OK);
}

/* GEMM 1 of rows [r0, r0 + m) on both; the reference's logits then replaced
 * by the CUDA ones, so that the row ops after it see the same inputs. */
static void logits_both(Side &cu, Side &ref, const fg_backend_call &C, const fg_backend_call &R,
                        int64_t r0, int64_t m, bool compare)
{
    OP(cu, logits, "logits", &C, r0, m);
    OP(ref, logits, "logits", &R, r0, m);
    const size_t n = (size_t)m * V;
    std::vector<float> lc = side_read<float>(cu, C.logits, n), lr = side_read<float>(ref, R.logits, n);
    const size_t hb = (size_t)m * H * dsize(C.dlogit_t);
    std::vector<unsigned char> hc = side_read<unsigned char>(cu, C.hbuf, hb),
                               hr = side_read<unsigned char>(ref, R.hbuf, hb);
    if (compare) {
        std::vector<double> tol(n);
        for (size_t i = 0; i < n; i++)
            tol[i] = TOL_TOKEN.rel * (1 + fabs(lr[i]));
        close_all("logits vs the reference", as_doubles(lc), as_doubles(lr), tol);
        check_true("hbuf: the gathered rows, the same bits", hc == hr);
    }
    side_put(ref, R.logits, lc.data(), n * sizeof(float));
}

/* shard_stats of rows [r0, r0 + m) at `count` slots, by token or by row. */
static void test_shard_stats(Side &cu, Side &ref, const fg_backend_call &C,
                             const fg_backend_call &R, int64_t r0, int64_t m, int64_t count,
                             int by_token)
{
    const size_t nf = (size_t)fg_shard_floats(count);
    const std::vector<float> sentinel(nf, 1234.5f);
    float *oc = side_copy(cu, sentinel), *orf = side_copy(ref, sentinel);
    OP(cu, shard_stats, "shard_stats", &C, r0, m, oc, count, by_token);
    OP(ref, shard_stats, "shard_stats", &R, r0, m, orf, count, by_token);
    const std::vector<float> gc = side_read<float>(cu, oc, nf), gr = side_read<float>(ref, orf, nf);
    /* max, z_tok and the own max: the same bits (a max of the same float
     * products); the own sums within float32 summation error; every slot
     * the reference left alone left alone. */
    const int64_t own = fg_shard_local_offset(count);
    bool same_slots = true, exact = true;
    int64_t minus_inf = 0;
    std::vector<double> got, want, tol;
    for (size_t i = 0; i < nf; i++) {
        const bool untouched = memcmp(&gr[i], &sentinel[i], sizeof(float)) == 0;
        if (untouched) {
            same_slots &= memcmp(&gc[i], &sentinel[i], sizeof(float)) == 0;
            continue;
        }
        const int64_t k = (int64_t)i;
        if (k < 2 * count || (k >= own && k < own + count)) {
            exact &= memcmp(&gc[i], &gr[i], sizeof(float)) == 0;
            minus_inf += k >= count && k < 2 * count && gr[i] == -INFINITY;
        } else {
            got.push_back(gc[i]);
            want.push_back(gr[i]);
            tol.push_back(1e-5 * fabs(gr[i]) + 1e-6);
        }
    }
    char what[200];
    snprintf(what, sizeof what, "shard_stats rows %lld+%lld %s (count %lld): the same slots written",
             (long long)r0, (long long)m, by_token ? "by token" : "by row", (long long)count);
    check_true(what, same_slots);
    snprintf(what, sizeof what, "shard_stats: max, z_tok (%lld of another shard: -inf), own max "
             "the same bits", (long long)minus_inf);
    check_true(what, exact);
    check_true("shard_stats: some slots written", !got.empty());
    close_all("shard_stats: own sum and dot vs the reference", got, want, tol);
}

/* ---- filter ------------------------------------------------------------------------- */

/* Gradient filtering (docs/LOSS_SPEC.md) on the host, as ref_filter states
 * it: row i keeps v where |d| > (float)(eps · (double)max |d|) (NaN never
 * kept nor the max) or v is its target; the kept count of each row of
 * d [m, V]. */
static std::vector<int64_t> host_kept(const std::vector<unsigned char> &d, fg_dtype t, int64_t m,
                                      const int64_t *tg, double eps,
                                      std::vector<unsigned char> *keep)
{
    std::vector<int64_t> count((size_t)m, 0);
    keep->assign((size_t)m * V, 0);
    for (int64_t i = 0; i < m; i++) {
        float top = 0.0f;
        for (int64_t v = 0; v < V; v++) {
            const float a = fabsf((float)load(d, t, (size_t)(i * V + v)));
            top = a > top ? a : top;
        }
        const float thr = (float)(eps * (double)top);
        for (int64_t v = 0; v < V; v++) {
            const bool k = fabsf((float)load(d, t, (size_t)(i * V + v))) > thr || v == tg[i];
            (*keep)[(size_t)(i * V + v)] = k;
            count[(size_t)i] += k;
        }
    }
    return count;
}

/* filter on both backends from the same dlogits [m, V] of chunk rows
 * [r0, r0 + m): magnitudes log-uniform over 8 decades with random signs, and
 * rows of one kind each: a huge entry (the row keeps it and its target), all
 * zeros (its target alone), a NaN (never kept, never the max), entries at
 * the threshold and one bf16 step above it, a tiny target entry, another
 * shard's target (tg 4 and 30 lie outside [0, V)). eps = 2^-10, so that a
 * row whose max is 1 has a threshold both dtypes hold exactly. At
 * kept_cap = the largest row count (every row within it: dropped entries
 * zeroed) and one less (the rows keeping the most keep every entry, their
 * dlogits untouched and V counted; the others zeroed as before): the CUDA
 * dlogits bits, the reference's and the host's rule the same, kept_count
 * the same (and added to, from 1000). Neither call gets
 * kept_idx / kept_nnz / kept_tgt (both filter in place,
 * FG_BACKEND_FILTER_IN_PLACE): their scratch is chunk_scratch's. */
static void test_filter(Side &cu, Side &ref, const fg_backend_call &C, const fg_backend_call &R,
                        const std::vector<int64_t> &tg, fg_dtype dtype)
{
    const int64_t n = C.n_active;
    const size_t es = dsize(dtype);
    const double eps = 0x1p-10;
    char msg[512] = "", what[300];
    /* Each side's scratch, as its chunk_scratch asks (both filter in place:
     * no kept_* workspace). */
    fg_backend_call fc = C, fr = R;
    fc.filter_eps = fr.filter_eps = eps;
    size_t scratch = 0, ref_scratch = 0;
    fg_status st = cu.dev.ops->chunk_scratch(cu.dev.state, &fc, n, n, &scratch, msg, sizeof msg);
    if (st != FG_OK)
        side_die(cu, "chunk_scratch with filtering", st, msg);
    st = ref.dev.ops->chunk_scratch(ref.dev.state, &fr, n, n, &ref_scratch, msg, sizeof msg);
    if (st != FG_OK)
        side_die(ref, "chunk_scratch with filtering", st, msg);
    fc.scratch = side_alloc(cu, scratch);
    fr.scratch = side_alloc(ref, ref_scratch);
    fc.kept_count = static_cast<int64_t *>(side_alloc(cu, sizeof(int64_t)));
    fr.kept_count = static_cast<int64_t *>(side_alloc(ref, sizeof(int64_t)));

    const int64_t m = 37, starts[2] = {0, 30};
    for (int64_t r0 : starts) {
        rng_state = 555 + (uint64_t)r0;
        std::vector<unsigned char> D((size_t)m * V * es);
        for (int64_t i = 0; i < m; i++)
            for (int64_t v = 0; v < V; v++) {
                const double mag = pow(10.0, -8.0 * uniform());
                store(D, dtype, (size_t)(i * V + v), uniform() < 0.5 ? -mag : mag);
            }
        const int64_t *t = &tg[(size_t)r0];
        for (int64_t i = 3; i < m; i += 7) /* a huge entry: a few kept */
            store(D, dtype, (size_t)(i * V + (i * 131) % V), -1e4);
        for (int64_t v = 0; v < V; v++) /* row 5: zeros, its target alone */
            store(D, dtype, (size_t)(5 * V + v), 0.0);
        store(D, dtype, (size_t)(8 * V + 17), NAN);
        store(D, dtype, (size_t)(9 * V + 0), 1.0); /* row 9: max 1, threshold 2^-10 */
        store(D, dtype, (size_t)(9 * V + 1), 0x1p-10);
        store(D, dtype, (size_t)(9 * V + 2), -0x1p-10 * (1 + 0x1p-7));
        if (t[11] >= 0 && t[11] < V)
            store(D, dtype, (size_t)(11 * V + t[11]), 1e-30);
        std::vector<unsigned char> keep;
        const std::vector<int64_t> count = host_kept(D, dtype, m, t, eps, &keep);
        const int64_t most = *std::max_element(count.begin(), count.end());
        int64_t total = 0, fewest = V;
        for (int64_t k : count) {
            total += k;
            fewest = std::min(fewest, k);
        }
        for (int over = 0; over < 2; over++) {
            const int64_t cap = over ? most - 1 : most;
            fc.kept_cap = fr.kept_cap = cap;
            const int64_t seed = 1000;
            side_put(cu, fc.kept_count, &seed, sizeof seed);
            side_put(ref, fr.kept_count, &seed, sizeof seed);
            side_put(cu, fc.dlogits, D.data(), D.size());
            side_put(ref, fr.dlogits, D.data(), D.size());
            OP(cu, filter, "filter", &fc, r0, m);
            OP(ref, filter, "filter", &fr, r0, m);
            typedef std::vector<unsigned char> Bytes;
            const Bytes dc = side_read<unsigned char>(cu, fc.dlogits, D.size()),
                        dr = side_read<unsigned char>(ref, fr.dlogits, D.size());
            const int64_t kc = side_read<int64_t>(cu, fc.kept_count, 1)[0],
                          kr = side_read<int64_t>(ref, fr.kept_count, 1)[0];
            std::vector<unsigned char> want = D; /* a row over the cap: untouched */
            int64_t kw = seed;
            for (int64_t i = 0; i < m; i++) {
                const bool whole = count[(size_t)i] > cap;
                kw += whole ? (int64_t)V : count[(size_t)i];
                for (int64_t v = 0; v < V && !whole; v++)
                    if (!keep[(size_t)(i * V + v)])
                        store(want, dtype, (size_t)(i * V + v), 0.0);
            }
            size_t differ = 0;
            for (size_t k = 0; k < keep.size(); k++)
                differ += memcmp(&dc[k * es], &want[k * es], es) != 0;
            snprintf(what, sizeof what,
                     "filter %s, rows %lld+%lld, kept_cap %lld (%s): %lld of %lld entries kept "
                     "(rows keep %lld to %lld); dlogits the reference's bits and the rule's "
                     "(%zu differ); kept_count cuda %lld, reference %lld, want %lld",
                     dname(dtype), (long long)r0, (long long)m, (long long)cap,
                     over ? "rows over it keep every entry" : "every row within it",
                     (long long)total,
                     (long long)(m * V), (long long)fewest, (long long)most, differ,
                     (long long)kc, (long long)kr, (long long)kw);
            check_true(what, dc == dr && dc == want && kc == kw && kr == kw);
        }
    }
    /* No scratch: refused by a status, never a fault. */
    fg_backend_call bad = fc;
    bad.scratch = NULL;
    st = cu.dev.ops->filter(cu.dev.state, &bad, 0, m, msg, sizeof msg);
    snprintf(what, sizeof what, "filter refuses a call without its scratch: %s: %s",
             fg_status_name(st), msg);
    check_true(what, st == FG_ERR_NULL_ARGUMENT);
}

/* ---- sparse products ------------------------------------------------------------------------ */

/* GEMMs 2 and 3 of a filtered chunk, as sparse_products.h states them: row
 * i's kept entries (the rule of host_kept) in ascending column order, one
 * fmaf a term from 0 (or, for grad_weight when !first, from its value), the
 * rows of a column ascending. */
static void host_sparse(const std::vector<unsigned char> &d, fg_dtype t, int64_t m,
                        const std::vector<unsigned char> &keep, const Problem &p,
                        const std::vector<unsigned char> &hb, std::vector<float> *gh,
                        std::vector<float> *gw, int first)
{
    gh->assign((size_t)m * H, 0.0f);
    if (first)
        gw->assign((size_t)V * H, 0.0f);
    for (int64_t i = 0; i < m; i++)
        for (int64_t v = 0; v < V; v++) {
            if (!keep[(size_t)(i * V + v)])
                continue;
            const float a = (float)load(d, t, (size_t)(i * V + v));
            for (int64_t h = 0; h < H; h++) {
                float &y = (*gh)[(size_t)(i * H + h)];
                y = fmaf(a, (float)load(p.weight, t, (size_t)(v * LDH + h)), y);
                float &z = (*gw)[(size_t)(v * H + h)];
                z = fmaf(a, (float)load(hb, t, (size_t)(i * H + h)), z);
            }
        }
}

/* grads of a filtered chunk of every row (r0 = 0) after the filter op, twice
 * (first = 1, then 0: added to), into the float32 grad_weight in place and
 * ghbuf: rows keeping at most 4 entries (1 to 3 large dlogits among tiny
 * ones, and the target), within fg_cuda_sparse_entries, run the sparse branch
 * (its flag read from the scratch) and give host_sparse's bits; rows keeping
 * 10 run the dense cuBLASLt branch (flag 0), within 1e-5 of the sum of
 * |terms|. Without conditional graph nodes (a driver before CUDA 12.8) the
 * backend reserves no sparse scratch and both run dense. */
static void test_sparse(Side &cu, const fg_backend_call &C, const Problem &p,
                        const std::vector<int64_t> &tg, fg_dtype dtype)
{
    const int64_t n = C.n_active;
    const size_t es = dsize(dtype);
    const double eps = 0x1p-10;
    char msg[512] = "", what[400];
    fg_backend_call fc = C;
    fc.filter_eps = eps;
    fc.kept_cap = V / 8;
    fc.gw_sum = NULL; /* GEMM 3 into the float32 grad_weight in place */
    size_t scratch = 0;
    fg_status st = cu.dev.ops->chunk_scratch(cu.dev.state, &fc, n, n, &scratch, msg, sizeof msg);
    if (st != FG_OK)
        side_die(cu, "chunk_scratch with filtering", st, msg);
    fc.scratch = side_alloc(cu, scratch);
    fc.kept_count = static_cast<int64_t *>(side_alloc(cu, sizeof(int64_t)));
    const bool sparse_built = conditional_nodes();
    fg_cuda_sparse sp = {};
    if (sparse_built &&
        (st = fg_cuda_sparse_carve(&sp, static_cast<unsigned char *>(fc.scratch) +
                                            filter_rows_bytes(n),
                                   n, V, msg, sizeof msg)) != FG_OK)
        side_die(cu, "the sparse scratch's layout", st, msg);
    rng_state = 9191;
    std::vector<unsigned char> hb((size_t)n * H * es);
    for (size_t k = 0; k < (size_t)n * H; k++)
        store(hb, dtype, k, normal());
    side_put(cu, fc.hbuf, hb.data(), hb.size());
    for (int wide = 0; wide < 2; wide++) {
        const int big = wide ? 10 : 3; /* large entries a row keeps, at most */
        std::vector<unsigned char> D((size_t)n * V * es);
        for (int64_t i = 0; i < n; i++) {
            for (int64_t v = 0; v < V; v++)
                store(D, dtype, (size_t)(i * V + v), (uniform() < 0.5 ? -1e-8 : 1e-8) * uniform());
            for (int64_t j = 0; j < (wide ? big : 1 + i % big); j++)
                store(D, dtype, (size_t)(i * V + (i * 37 + j * 101) % V),
                      (uniform() < 0.5 ? -0.5 : 0.5) - uniform());
        }
        std::vector<unsigned char> keep;
        const std::vector<int64_t> count = host_kept(D, dtype, n, tg.data(), eps, &keep);
        int64_t total = 0;
        for (int64_t k : count)
            total += k;
        const bool want_sparse = sparse_built && total <= fg_cuda_sparse_entries(n, V);
        std::vector<float> gh, gw;
        for (int first = 1; first >= 0; first--) {
            side_put(cu, fc.dlogits, D.data(), D.size());
            const int64_t zero = 0;
            side_put(cu, fc.kept_count, &zero, sizeof zero);
            const int32_t unset = -1; /* decide writes 0 or 1 */
            if (sparse_built)
                side_put(cu, sp.flag, &unset, sizeof unset);
            OP(cu, filter, "filter", &fc, (int64_t)0, n);
            OP(cu, grads, "grads (filtered)", &fc, (int64_t)0, n, first);
            host_sparse(D, dtype, n, keep, p, hb, &gh, &gw, first);
            const std::vector<float> ghd = side_read<float>(cu, fc.ghbuf, (size_t)n * H);
            const std::vector<float> gwl =
                side_read<float>(cu, fc.grad_weight.data, (size_t)V * LDGW_OPS);
            std::vector<float> gwd((size_t)V * H);
            for (int64_t v = 0; v < V; v++)
                for (int64_t h = 0; h < H; h++)
                    gwd[(size_t)(v * H + h)] = gwl[(size_t)(v * LDGW_OPS + h)];
            const int32_t flag = sparse_built ? side_read<int32_t>(cu, sp.flag, 1)[0] : 0;
            snprintf(what, sizeof what,
                     "grads filtered, %s, first = %d: %lld of %lld entries kept (room for %lld): "
                     "the %s branch ran (flag %d)",
                     dname(dtype), first, (long long)total, (long long)(n * V),
                     (long long)fg_cuda_sparse_entries(n, V), want_sparse ? "sparse" : "dense",
                     (int)flag);
            check_true(what, flag == (want_sparse ? 1 : 0));
            if (want_sparse) {
                snprintf(what, sizeof what,
                         "grads sparse, %s, first = %d: ghbuf and grad_weight the bits of the "
                         "kept entries' fmaf sums in order", dname(dtype), first);
                check_true(what, memcmp(ghd.data(), gh.data(), gh.size() * 4) == 0 &&
                                     memcmp(gwd.data(), gw.data(), gw.size() * 4) == 0);
            } else {
                std::vector<double> tol_h((size_t)n * H), tol_w((size_t)V * H);
                for (int64_t i = 0; i < n; i++)
                    for (int64_t v = 0; v < V; v++) {
                        const double a = fabs(load(D, dtype, (size_t)(i * V + v))) *
                                         (keep[(size_t)(i * V + v)] ? 1.0 : 0.0);
                        for (int64_t h = 0; h < H && a > 0; h++) {
                            tol_h[(size_t)(i * H + h)] +=
                                a * fabs(load(p.weight, dtype, (size_t)(v * LDH + h)));
                            tol_w[(size_t)(v * H + h)] +=
                                (first ? 1.0 : 2.0) * a * fabs(load(hb, dtype, (size_t)(i * H + h)));
                        }
                    }
                for (double &t : tol_h)
                    t = 1e-5 * t + 1e-30;
                for (double &t : tol_w)
                    t = 1e-5 * t + 1e-30;
                snprintf(what, sizeof what, "grads dense over the filtered dlogits, %s, first = %d: "
                         "ghbuf", dname(dtype), first);
                close_all(what, as_doubles(ghd), as_doubles(gh), tol_h);
                snprintf(what, sizeof what, "grads dense over the filtered dlogits, %s, first = %d: "
                         "grad_weight", dname(dtype), first);
                close_all(what, as_doubles(gwd), as_doubles(gw), tol_w);
            }
        }
    }
}

/* ---- derivs --------------------------------------------------------------------------- */

/* A float's place on the number line (+0 and -0 both 0): ulps apart is the
 * difference of two places. */
static int64_t float_place(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? -(int64_t)(u & 0x7fffffffu) : (int64_t)u;
}

static int64_t ulps_apart(float a, float b)
{
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b) ? 0 : INT64_MAX;
    const int64_t d = float_place(a) - float_place(b);
    return d < 0 ? -d : d;
}

/* A host array's copy in the backend's memory, NULL for NULL. */
template <typename T> static const T *side_copy_of(Side &s, const T *host, size_t n)
{
    if (!host)
        return NULL;
    return side_copy(s, std::vector<T>(host, host + n));
}

/* derivs against the host's loss math: a plan built on the host
 * (fg_loss_plan_init, fg_loss_prepare where the loss needs every token
 * first) from random log-probs and entropies, its arrays copied to the
 * device, g and e of every unmasked token in two chunks whose logp /
 * entropy / g / e pointers are slices of [n_active] arrays (the driver's
 * layout), against fg_loss_dlogp / fg_loss_dentropy: within 2 ulp (the
 * device's double exp may differ from glibc's in its last bit; the file is
 * compiled without FMA contraction, loss_derivs.h). Every loss with
 * beta = 0.04 (config()), the sequence level, the bias-corrected KL with
 * delta and a per-sequence is_ratio, the entropy quantile and the
 * off-policy mask (prepared), and a caller's own derivatives. */
static void test_derivs(Side &cu, const fg_backend_call &C, const Problem &p,
                        const std::vector<int64_t> &rows)
{
    const int64_t n = (int64_t)rows.size();
    rng_state = 8080;
    std::vector<float> logp(N, 0.0f), entropy(N, 0.0f), old(N, -1e30f), refl(N, -1e30f),
        isr(N, 1e30f), isr_seq(B), ext_g(N), ext_e(N);
    for (int64_t k = 0; k < N; k++) {
        ext_g[k] = (float)normal();
        ext_e[k] = (float)(0.1 * normal());
        if (!p.mask[k])
            continue;
        logp[k] = (float)(-0.05 - 6.0 * uniform());
        entropy[k] = (float)(3.0 * uniform());
        old[k] = logp[k] + (float)(0.25 * normal());
        refl[k] = logp[k] + (float)(0.3 * normal());
        isr[k] = (float)(0.5 + uniform());
    }
    for (float &x : isr_seq)
        x = (float)(0.5 + uniform());
    struct Case {
        const char *what;
        int loss, level;
        bool bias_corr_delta_seq_isr, quantile_offpolicy, external;
        bool bare; /* no old_logp, ref_logp or is_ratio, beta 0: the NULL branches */
    };
    const Case cases[] = {
        {"grpo", FG_LOSS_GRPO, FG_LEVEL_TOKEN, false, false, false, false},
        {"dapo", FG_LOSS_DAPO, FG_LEVEL_TOKEN, false, false, false, false},
        {"cispo", FG_LOSS_CISPO, FG_LEVEL_TOKEN, false, false, false, false},
        {"sapo", FG_LOSS_SAPO, FG_LEVEL_TOKEN, false, false, false, false},
        {"vespo (prepared)", FG_LOSS_VESPO, FG_LEVEL_TOKEN, false, false, false, false},
        {"grpo, sequence level (prepared)", FG_LOSS_GRPO, FG_LEVEL_SEQUENCE, false, false, false,
         false},
        {"dapo, bias-corrected KL, delta 1.3, per-sequence is_ratio", FG_LOSS_DAPO,
         FG_LEVEL_TOKEN, true, false, false, false},
        {"grpo, entropy quantile 0.8, off-policy mask 0.5 (prepared)", FG_LOSS_GRPO,
         FG_LEVEL_TOKEN, false, true, false, false},
        {"a caller's own derivatives (external plan)", FG_LOSS_GRPO, FG_LEVEL_TOKEN, false,
         false, true, false},
        {"dapo, beta 0, no old_logp, ref_logp or is_ratio", FG_LOSS_DAPO, FG_LEVEL_TOKEN, false,
         false, false, true},
    };
    /* The chunk's arrays: slices of [n] arrays, as the driver hands them. */
    std::vector<float> lp_act(n), ent_act(n);
    for (int64_t k = 0; k < n; k++) {
        lp_act[k] = logp[rows[k]];
        ent_act[k] = entropy[rows[k]];
    }
    float *dlp = side_copy(cu, lp_act), *dent = side_copy(cu, ent_act);
    float *dg = static_cast<float *>(side_alloc(cu, (size_t)n * 4)),
          *de = static_cast<float *>(side_alloc(cu, (size_t)n * 4));
    for (const Case &k : cases) {
        fg_loss_config cfg = config(k.loss, k.level);
        fg_batch b;
        memset(&b, 0, sizeof b);
        b.batch = B;
        b.seq_len = T;
        b.token_ids = p.tokens.data();
        b.mask = p.mask.data();
        b.advantages = p.adv.data();
        b.old_logp = old.data();
        b.ref_logp = refl.data();
        b.is_ratio = isr.data();
        if (k.bias_corr_delta_seq_isr) {
            cfg.use_bias_correction_kl = 1;
            cfg.delta = 1.3;
            b.is_ratio = isr_seq.data();
            b.is_ratio_per_sequence = 1;
        }
        if (k.quantile_offpolicy) {
            cfg.top_entropy_quantile = 0.8;
            cfg.off_policy_mask_threshold = 0.5;
        }
        if (k.bare) {
            cfg.beta = 0.0;
            b.old_logp = NULL;
            b.ref_logp = NULL;
            b.is_ratio = NULL;
        }
        std::vector<double> scr((size_t)fg_loss_plan_scratch_doubles(B));
        std::vector<float> sort_scratch(N);
        fg_loss_plan plan;
        if (k.external) {
            fg_loss_plan_init_external(&plan, &b, ext_g.data(), ext_e.data());
        } else {
            fg_loss_plan_init(&plan, &cfg, &b, scr.data());
            if (fg_loss_needs_all_tokens(&plan))
                fg_loss_prepare(&plan, logp.data(), entropy.data(), sort_scratch.data());
        }
        /* The plan's arrays in device memory, its scalars as they are; the
         * ids and the mask NULL, as the driver's put_plan leaves them (the
         * per-token math never reads them). */
        fg_loss_plan dp = plan;
        dp.token_ids = NULL;
        dp.mask = NULL;
        dp.adv = side_copy_of(cu, plan.adv, plan.external ? 0 : B);
        dp.old = side_copy_of(cu, plan.old, N);
        dp.ref = side_copy_of(cu, plan.ref, N);
        dp.is_ratio = side_copy_of(cu, plan.is_ratio, plan.is_per_seq ? B : N);
        dp.sampling = side_copy_of(cu, plan.sampling, N);
        dp.ext_dlogp = side_copy_of(cu, plan.ext_dlogp, N);
        dp.ext_dentropy = side_copy_of(cu, plan.ext_dentropy, N);
        if (!plan.external) {
            double *ds = const_cast<double *>(side_copy_of(cu, scr.data(), scr.size()));
            double **fields[6] = {&dp.seq_weight, &dp.seq_count, &dp.seq_log_ratio,
                                  &dp.seq_dratio, &dp.seq_keep, &dp.seq_phi};
            for (double **f : fields)
                *f = ds + (*f - scr.data());
        }
        const std::vector<float> sentinel((size_t)n, 1234.5f);
        side_put(cu, dg, sentinel.data(), (size_t)n * 4);
        side_put(cu, de, sentinel.data(), (size_t)n * 4);
        const int64_t cut = 30, chunks[2][2] = {{0, cut}, {cut, n - cut}};
        bool slice_only = true;
        for (const auto &ch : chunks) {
            fg_backend_call c = C;
            c.logp = dlp + ch[0];
            c.entropy = dent + ch[0];
            c.g = dg + ch[0];
            c.e = de + ch[0];
            OP(cu, derivs, "derivs", &c, ch[0], ch[1], &dp);
            if (ch[0] == 0) { /* the second chunk's slots untouched */
                const std::vector<float> g1 = side_read<float>(cu, dg, (size_t)n);
                slice_only = std::equal(g1.begin() + cut, g1.end(), sentinel.begin() + cut);
            }
        }
        const std::vector<float> g = side_read<float>(cu, dg, (size_t)n),
                                 e = side_read<float>(cu, de, (size_t)n);
        int64_t worst_g = 0, worst_e = 0, differ = 0, at = 0;
        for (int64_t i = 0; i < n; i++) {
            const int64_t t = rows[(size_t)i];
            const float wg = fg_loss_dlogp(&plan, t, logp[t], entropy[t]),
                        we = fg_loss_dentropy(&plan, t, entropy[t]);
            const int64_t ug = ulps_apart(g[i], wg), ue = ulps_apart(e[i], we);
            differ += ug != 0 || ue != 0;
            if (ug > worst_g)
                at = i;
            worst_g = std::max(worst_g, ug);
            worst_e = std::max(worst_e, ue);
        }
        char what[400];
        snprintf(what, sizeof what,
                 "derivs, %s: g within %lld ulp (worst at row %lld: %.9g), e within %lld ulp "
                 "of the host's (%lld of %lld tokens differ at all); two chunks, each "
                 "writing its own slice%s",
                 k.what, (long long)worst_g, (long long)at,
                 (double)g[(size_t)at], (long long)worst_e, (long long)differ,
                 (long long)n, slice_only ? "" : " (FAILED: wrote outside its slice)");
        check_true(what, worst_g <= 2 && worst_e <= 2 && slice_only);
    }
}

static void test_backend_ops(fg_dtype dtype)
{
    printf("-- the backend's ops against the reference backend, %s\n", dname(dtype));
    Problem p = problem_make(dtype);
    std::vector<int64_t> rows, tg;
    for (int64_t t = 0; t < N; t++)
        if (p.mask[t]) {
            rows.push_back(t);
            tg.push_back(p.tokens[t]);
        }
    const int64_t n = (int64_t)rows.size();
    tg[4] = V + 5; /* another shard's tokens: row_check 4, z_tok -inf, no one-hot term */
    tg[30] = -3;
    const size_t es = dsize(dtype);

    Side cu = {"cuda", {NULL, NULL}, {}}, ref = {"reference", {NULL, NULL}, {}};
    char msg[512] = "";
    fg_status st = fg_backend_cuda_create(NULL, &cu.dev, msg, sizeof msg);
    if (st != FG_OK)
        side_die(cu, "create", st, msg);
    st = fg_backend_reference_create(NULL, &ref.dev, msg, sizeof msg);
    if (st != FG_OK)
        side_die(ref, "create", st, msg);
    const bool ref_ops = ref.dev.ops->shard_stats && ref.dev.ops->dhidden &&
                         ref.dev.ops->put_grad_hidden;
    check_true("the reference has shard_stats, dhidden and put_grad_hidden", ref_ops);
    if (!ref_ops) {
        side_close(cu);
        side_close(ref);
        return;
    }
    const fg_backend_call C = ops_call(cu, p, rows, tg), R = ops_call(ref, p, rows, tg);
    test_ops_table(cu, C, p.mask.data());

    /* logits, stats, row_check over every row. */
    logits_both(cu, ref, C, R, 0, n, true);
    put_row_check(cu, C);
    put_row_check(ref, R);
    OP(cu, stats, "stats", &C, (int64_t)0, n);
    OP(ref, stats, "stats", &R, (int64_t)0, n);
    {
        const std::vector<float> sc = side_read<float>(cu, C.zmax, 4 * n),
                                 sr = side_read<float>(ref, R.zmax, 4 * n);
        std::vector<double> tol(4 * n);
        for (int64_t i = 0; i < 4 * n; i++)
            tol[i] = TOL_TOKEN.rel * (1 + fabs(sr[i]));
        close_all("stats (zmax, lsum, entropy, logp; NaN logp at another shard's targets)",
                  as_doubles(sc), as_doubles(sr), tol);
        const int rc = side_read<int>(cu, C.row_check, 1)[0],
                  rr = side_read<int>(ref, R.row_check, 1)[0];
        char what[160];
        snprintf(what, sizeof what, "row_check: the lowest row outside [0, V), 4 (cuda %d, "
                 "reference %d)", rc, rr);
        check_true(what, rc == 4 && rr == 4);
    }

    /* shard_stats of a later chunk: by token into [N], by row into m + 3. */
    const int64_t r0 = 10, m = 25;
    logits_both(cu, ref, C, R, r0, m, true);
    test_shard_stats(cu, ref, C, R, r0, m, N, 1);
    test_shard_stats(cu, ref, C, R, r0, m, m + 3, 0);

    /* dhidden from the same dlogits. */
    rng_state = 99;
    const std::vector<unsigned char> D = random_values(dtype, (size_t)n * V, 0.05);
    side_put(cu, C.dlogits, D.data(), D.size());
    side_put(ref, R.dlogits, D.data(), D.size());
    OP(cu, dhidden, "dhidden", &C, (int64_t)0, n);
    OP(ref, dhidden, "dhidden", &R, (int64_t)0, n);
    {
        const std::vector<float> gc = side_read<float>(cu, C.ghbuf, (size_t)n * H),
                                 gr = side_read<float>(ref, R.ghbuf, (size_t)n * H);
        std::vector<double> tol((size_t)n * H);
        for (int64_t i = 0; i < n; i++)
            for (int64_t h = 0; h < H; h++) {
                double a = 0;
                for (int64_t v = 0; v < V; v++)
                    a += fabs(load(D, dtype, (size_t)(i * V + v)) *
                              load(p.weight, dtype, (size_t)(v * LDH + h)));
                tol[(size_t)(i * H + h)] = 1e-5 * a + 1e-30;
            }
        close_all("dhidden (ghbuf) vs the reference", as_doubles(gc), as_doubles(gr), tol);
    }

    /* put_grad_hidden of rows [r0, r0 + m) from the same ghbuf: the same bits
     * (one rounding), every other row and the padding untouched. */
    {
        const std::vector<float> G = random_floats((size_t)n * H, 1.0);
        side_put(cu, C.ghbuf, G.data(), G.size() * 4);
        side_put(ref, R.ghbuf, G.data(), G.size() * 4);
        const std::vector<unsigned char> fill((size_t)N * LDGH * es, 0xff);
        side_put(cu, C.grad_hidden.data, fill.data(), fill.size());
        side_put(ref, R.grad_hidden.data, fill.data(), fill.size());
        OP(cu, put_grad_hidden, "put_grad_hidden", &C, r0, m);
        OP(ref, put_grad_hidden, "put_grad_hidden", &R, r0, m);
        const std::vector<unsigned char> hc = side_read<unsigned char>(cu, C.grad_hidden.data, fill.size()),
                                         hr = side_read<unsigned char>(ref, R.grad_hidden.data, fill.size());
        int64_t written = 0;
        for (int64_t t = 0; t < N; t++)
            written += memcmp(&hr[(size_t)t * LDGH * es], &fill[0], es) != 0;
        char what[160];
        snprintf(what, sizeof what, "put_grad_hidden: the same bits as the reference (%lld rows "
                 "written of %lld)", (long long)written, (long long)m);
        check_true(what, hc == hr && written == m);
    }

    /* grads on gw_sum (GEMM 3 alone) from the same dlogits and hbuf. */
    logits_both(cu, ref, C, R, 0, n, false); /* hbuf of every row */
    {
        rng_state = 1234;
        const std::vector<float> P = random_floats((size_t)V * H, 4.0);
        const std::vector<unsigned char> hb = side_read<unsigned char>(ref, R.hbuf, (size_t)n * H * es);
        struct Case {
            const char *what;
            int64_t r0, m;
            int first;
            bool in_place;
        };
        const Case cases[4] = {{"gw_sum, r0 = 0, first = 0: added to", 0, n, 0, false},
                               {"gw_sum, r0 = 0, first = 1: overwritten", 0, n, 1, false},
                               {"gw_sum, r0 = 8, first = 1: overwritten", 8, n - 8, 1, false},
                               {"grad_weight in place, r0 = 0, first = 0: added to", 0, n, 0,
                                true}};
        for (const Case &k : cases) {
            fg_backend_call c2[2] = {C, R};
            Side *sides[2] = {&cu, &ref};
            std::vector<float> out[2];
            for (int s = 0; s < 2; s++) {
                fg_backend_call &c = c2[s];
                c.grad_hidden.data = NULL; /* GEMM 3 alone */
                float *dst = k.in_place ? static_cast<float *>(c.grad_weight.data) : c.gw_sum;
                const int64_t ld = k.in_place ? LDGW_OPS : (int64_t)H;
                if (k.in_place)
                    c.gw_sum = NULL;
                std::vector<float> init((size_t)V * ld, 0.0f);
                for (int64_t v = 0; v < V; v++)
                    for (int64_t h = 0; h < H; h++)
                        init[(size_t)(v * ld + h)] = P[(size_t)(v * H + h)];
                side_put(*sides[s], dst, init.data(), init.size() * 4);
                OP(*sides[s], grads, k.what, &c, k.r0, k.m, k.first);
                out[s] = side_read<float>(*sides[s], dst, init.size());
                if (k.in_place) { /* only the H columns */
                    std::vector<float> packed((size_t)V * H);
                    for (int64_t v = 0; v < V; v++)
                        for (int64_t h = 0; h < H; h++)
                            packed[(size_t)(v * H + h)] = out[s][(size_t)(v * ld + h)];
                    out[s] = packed;
                }
            }
            std::vector<double> tol((size_t)V * H);
            for (int64_t v = 0; v < V; v++)
                for (int64_t h = 0; h < H; h++) {
                    double a = k.first ? 0.0 : fabs(P[(size_t)(v * H + h)]);
                    for (int64_t i = 0; i < k.m; i++)
                        a += fabs(load(D, dtype, (size_t)(i * V + v)) *
                                  load(hb, dtype, (size_t)(i * H + h)));
                    tol[(size_t)(v * H + h)] = 1e-5 * a + 1e-30;
                }
            char what[200];
            snprintf(what, sizeof what, "grads: %s, vs the reference", k.what);
            close_all(what, as_doubles(out[0]), as_doubles(out[1]), tol);
        }
    }

    /* The bias sums: chunks of 7 rows and one chunk of all, from the same
     * logits and g, e: the same bits, those of a host sum of every row in
     * order onto the driver's seed. */
    {
        OP(cu, logits, "logits", &C, (int64_t)0, n);
        const std::vector<float> L = side_read<float>(cu, C.logits, (size_t)n * V);
        rng_state = 4321;
        const std::vector<float> g = random_floats(n, 1.0), e = random_floats(n, 0.3),
                                 seed = random_floats(V, 2.0);
        std::vector<float> sums[2];
        std::vector<unsigned char> dl;
        const int64_t chunk[2] = {n, 7};
        for (int k = 0; k < 2; k++) {
            side_put(cu, C.gb_sum, seed.data(), (size_t)V * 4);
            for (int64_t a = 0; a < n; a += chunk[k]) {
                const int64_t len = std::min(chunk[k], n - a);
                side_put(cu, C.logits, &L[(size_t)(a * V)], (size_t)(len * V) * 4);
                put_row_check(cu, C);
                OP(cu, stats, "stats", &C, a, len);
                side_put(cu, C.g, &g[(size_t)a], (size_t)len * 4);
                side_put(cu, C.e, &e[(size_t)a], (size_t)len * 4);
                OP(cu, backward, "backward", &C, a, len);
            }
            sums[k] = side_read<float>(cu, C.gb_sum, V);
            if (k == 0)
                dl = side_read<unsigned char>(cu, C.dlogits, (size_t)n * V * es);
        }
        std::vector<float> host = seed;
        for (int64_t i = 0; i < n; i++)
            for (int64_t v = 0; v < V; v++)
                host[(size_t)v] += (float)load(dl, dtype, (size_t)(i * V + v));
        check_true("gb_sum: chunks of 7 rows and of all rows, the same bits",
                   memcmp(sums[0].data(), sums[1].data(), (size_t)V * 4) == 0);
        check_true("gb_sum: the bits of the seed plus every row in order (one float add each)",
                   memcmp(sums[0].data(), host.data(), (size_t)V * 4) == 0);

        /* finish: grad_bias = gb_sum (rounded once), the caller's old values
         * not added even when accumulating (the driver seeded the sums). */
        fg_backend_call f = C;
        f.grad_hidden.data = NULL;
        f.grad_weight.data = NULL;
        f.accumulate = 1;
        const std::vector<unsigned char> old = random_values(dtype, V, 3.0);
        side_put(cu, f.grad_bias.data, old.data(), old.size());
        OP(cu, finish, "finish", &f);
        const std::vector<unsigned char> gb = side_read<unsigned char>(cu, f.grad_bias.data, old.size());
        std::vector<unsigned char> want(old.size());
        for (int64_t v = 0; v < V; v++)
            store(want, dtype, (size_t)v, sums[0][(size_t)v]);
        check_true("finish: grad_bias = gb_sum, rounded once, the caller's values not added",
                   gb == want);
    }
    test_filter(cu, ref, C, R, tg, dtype);
    test_sparse(cu, C, p, tg, dtype);
    if (dtype == FG_DTYPE_F32) /* derivs reads no dtype: once */
        test_derivs(cu, C, p, rows);
    side_close(cu);
    side_close(ref);
}

/* ---- device-reported calls --------------------------------------------------------------- */

/* One fg_linear_grpo with exec.device_report on the CUDA context, captured
 * in a CUDA graph (global capture mode: any host synchronisation, pageable
 * copy or allocation inside the call fails the capture), then replayed
 * `replays` times; the record read back after the stream. A first call
 * outside the capture sizes the context's workspace (an allocation). */
static fg_status reported_graph(const Contexts &cx, const DeviceProblem &d, fg_dtype in_t,
                                size_t budget, const fg_loss_config &cfg,
                                fg_linear_outputs &gout, fg_device_report *rep_dev,
                                int replays, fg_device_report *rep, bool *captured,
                                double filter_eps = 0.0)
{
    fg_linear_options o = options(FG_IMPL_FUSED);
    o.filter_eps = filter_eps;
    fg_exec e;
    fg_exec_init(&e);
    e.memory_budget = budget;
    e.device_report = rep_dev;
    const fg_linear_inputs din = device_inputs(d, in_t);
    const fg_batch db = device_batch(d);
    fg_status st = fg_linear_grpo(cx.gpu, &o, &cfg, &din, &db, &gout, &e); /* warm */
    CUDA_OK(cudaStreamSynchronize(cx.stream));
    *captured = false;
    if (st != FG_OK)
        return st;
    cudaGraph_t graph = NULL;
    CUDA_OK(cudaStreamBeginCapture(cx.stream, cudaStreamCaptureModeGlobal));
    st = fg_linear_grpo(cx.gpu, &o, &cfg, &din, &db, &gout, &e);
    const cudaError_t end = cudaStreamEndCapture(cx.stream, &graph);
    if (st != FG_OK || end != cudaSuccess) {
        printf("       capture: %s, %s (%s)\n", fg_status_name(st), cudaGetErrorName(end),
               fg_last_error(cx.gpu));
        (void)cudaGetLastError();
        if (graph)
            CUDA_OK(cudaGraphDestroy(graph));
        return st != FG_OK ? st : FG_ERR_BACKEND;
    }
    cudaGraphExec_t exec = NULL;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < replays; i++)
        CUDA_OK(cudaGraphLaunch(exec, cx.stream));
    CUDA_OK(cudaStreamSynchronize(cx.stream));
    CUDA_OK(cudaMemcpy(rep, rep_dev, sizeof *rep, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    *captured = true;
    return FG_OK;
}

/* Device-reported calls (fusedgrpo.h) on the GPU: token-level losses
 * captured in a CUDA graph and replayed twice against the same context's
 * host-checked call (the record clean, its loss and metrics, logp, entropy
 * and the gradients within the tolerances above; masked rows 0), then the
 * advantages changed on the device between replays (the graph reads them
 * again: no value is baked in), then gradient filtering inside the capture
 * and the entropy quantile, then refusals: the record gives the
 * host-checked call's status and message. */
static void test_reported(const Contexts &cx, Problem &p, DeviceProblem &d, const Budget &bu)
{
    fg_device_report *rep_dev = NULL;
    CUDA_OK(cudaMalloc(&rep_dev, sizeof *rep_dev));
    /* token level, then GSPO and vespo at the sequence level (a forward sweep
     * and report_prepare first) */
    const int losses[][2] = {{FG_LOSS_GRPO, FG_LEVEL_TOKEN},    {FG_LOSS_DAPO, FG_LEVEL_TOKEN},
                             {FG_LOSS_DR_GRPO, FG_LEVEL_TOKEN}, {FG_LOSS_CISPO, FG_LEVEL_TOKEN},
                             {FG_LOSS_SAPO, FG_LEVEL_TOKEN},    {FG_LOSS_GRPO, FG_LEVEL_SEQUENCE},
                             {FG_LOSS_VESPO, FG_LEVEL_SEQUENCE}};
    const Outputs before = outputs_make(p.dtype, 1.0);
    for (int pass = 0; pass < 2; pass++) {
        for (const auto &ll : losses) {
            const int loss = ll[0];
            const fg_loss_config cfg = config(loss, ll[1]);
            fg_status sc, sg;
            Outputs co, go;
            /* pass 1: the advantages negated on the device, after the capture */
            run_pair(cx, p, d, FG_IMPL_FUSED, bu.bytes, cfg, before, 0, &sc, &sg, &co, &go);
            DeviceOutputs dout = device_outputs(before);
            fg_linear_outputs gout = device_view(dout, before, 0);
            fg_device_report rep;
            bool captured = false;
            const fg_status sr =
                reported_graph(cx, d, p.dtype, bu.bytes, cfg, gout, rep_dev, 2, &rep, &captured);
            Outputs ro = outputs_read(dout, gout);
            ro.loss = rep.loss;
            ro.metrics = rep.metrics;
            char msg[512];
            const fg_status rs = fg_device_report_status(&rep, msg, sizeof msg);
            char label[256];
            snprintf(label, sizeof label, "%s reported, graph x2 %s/%s%s (%lld chunks)",
                     dname(p.dtype), fg_loss_type_name((fg_loss_type)loss),
                     fg_is_level_name((fg_is_level)ll[1]), pass ? ", advantages changed" : "",
                     (long long)bu.chunks);
            char what[1024];
            snprintf(what, sizeof what, "%s: host-checked %s, reported call %s, record %s %s",
                     label, fg_status_name(sg), fg_status_name(sr), fg_status_name(rs), msg);
            check_true(what, sg == FG_OK && sr == FG_OK && captured && rs == FG_OK);
            if (sg == FG_OK && sr == FG_OK && rs == FG_OK)
                compare_outputs(label, ro, go, before, p, true);
            device_outputs_free(dout);
        }
        for (float &a : p.adv) /* pass 1: other advantages, in the same device array */
            a = -a;
        upload(d.adv, p.adv.data(), p.adv.size() * sizeof(float));
    }
    for (float &a : p.adv)
        a = -a;
    upload(d.adv, p.adv.data(), p.adv.size() * sizeof(float));

    /* Gradient filtering inside the capture (each filtered chunk's products
     * a conditional node of the caller's graph, sparse where the chunk keeps
     * at most V/256 entries a row: eps 0.25 keeps a few a row, 2^-12 more),
     * and the entropy quantile (its threshold from every unmasked entropy by
     * a radix select on the device, after the forward sweep), against the
     * host-checked call on the same context: the same kept entries, the
     * outputs within the tolerances. */
    const struct {
        double eps, quantile;
        int level;
        bool ties; /* every token of sequences 1 and 2 one hidden row: equal entropies */
    } variants[] = {{0.25, 1.0, FG_LEVEL_TOKEN, false},
                    {0x1p-12, 1.0, FG_LEVEL_TOKEN, false},
                    {0.0, 0.7, FG_LEVEL_TOKEN, false},
                    {0.0, 0.5, FG_LEVEL_SEQUENCE, false},
                    {0.0, 0.5, FG_LEVEL_TOKEN, true},
                    {0.0, 0.2, FG_LEVEL_TOKEN, true}};
    const std::vector<unsigned char> hidden_kept = p.hidden;
    for (const auto &var : variants) {
        const double eps = var.eps;
        p.hidden = hidden_kept;
        const size_t row = (size_t)LDH * dsize(p.dtype);
        for (int64_t n = T; var.ties && n < N; n++)
            memcpy(&p.hidden[(size_t)n * row], &hidden_kept[(size_t)(n < 2 * T ? T : 2 * T) * row],
                   row);
        upload(d.hidden, p.hidden.data(), p.hidden.size());
        fg_loss_config cfg = config(FG_LOSS_DAPO, var.level);
        cfg.top_entropy_quantile = var.quantile;
        fg_status sc, sg;
        Outputs co, go;
        run_pair(cx, p, d, FG_IMPL_FUSED, bu.bytes, cfg, before, 0, &sc, &sg, &co, &go, eps);
        fg_memory_stats ms;
        const bool stats = fg_get_memory_stats(cx.gpu, &ms) == FG_OK;
        DeviceOutputs dout = device_outputs(before);
        fg_linear_outputs gout = device_view(dout, before, 0);
        fg_device_report rep;
        bool captured = false;
        const fg_status sr = reported_graph(cx, d, p.dtype, bu.bytes, cfg, gout, rep_dev, 2, &rep,
                                            &captured, eps);
        Outputs ro = outputs_read(dout, gout);
        ro.loss = rep.loss;
        ro.metrics = rep.metrics;
        char msg[512];
        const fg_status rs = fg_device_report_status(&rep, msg, sizeof msg);
        char label[256], what[1024];
        snprintf(label, sizeof label,
                 "%s reported, filter_eps %g, top_entropy_quantile %g%s, graph x2 dapo/%s (%lld "
                 "chunks)", dname(p.dtype), eps, var.quantile, var.ties ? " (ties)" : "",
                 fg_is_level_name((fg_is_level)var.level), (long long)bu.chunks);
        snprintf(what, sizeof what, "%s: host-checked %s, reported call %s, record %s %s; kept "
                 "entries host-checked %lld, reported %lld", label, fg_status_name(sg),
                 fg_status_name(sr), fg_status_name(rs), msg,
                 stats ? (long long)ms.dlogits_kept : -1LL, (long long)rep.dlogits_kept);
        check_true(what, sg == FG_OK && sr == FG_OK && captured && rs == FG_OK && stats &&
                             (eps == 0 || ms.dlogits_kept == rep.dlogits_kept));
        if (sg == FG_OK && sr == FG_OK && rs == FG_OK)
            compare_outputs(label, ro, go, before, p, true);
        device_outputs_free(dout);
    }
    p.hidden = hidden_kept;
    upload(d.hidden, p.hidden.data(), p.hidden.size());

    /* Refusals: an unmasked id = V, then a NaN in an unmasked hidden row. */
    int64_t last = N - 1;
    while (!p.mask[last])
        last--;
    for (int k = 0; k < 2; k++) {
        const int64_t id = p.tokens[last];
        std::vector<unsigned char> hidden = p.hidden;
        if (k == 0)
            p.tokens[last] = V;
        else
            store(p.hidden, p.dtype, (size_t)(last * LDH + 3), NAN);
        upload(d.tokens, p.tokens.data(), p.tokens.size() * sizeof(int64_t));
        upload(d.hidden, p.hidden.data(), p.hidden.size());
        const fg_loss_config cfg = config(FG_LOSS_DAPO, FG_LEVEL_TOKEN);
        DeviceOutputs dout = device_outputs(before);
        fg_linear_outputs gout = device_view(dout, before, 0);
        const fg_linear_options o = options(FG_IMPL_FUSED);
        fg_exec e;
        fg_exec_init(&e);
        e.memory_budget = bu.bytes;
        const fg_linear_inputs din = device_inputs(d, p.dtype);
        const fg_batch db = device_batch(d);
        const fg_status hs = fg_linear_grpo(cx.gpu, &o, &cfg, &din, &db, &gout, &e);
        char host_msg[512];
        snprintf(host_msg, sizeof host_msg, "%s", fg_last_error(cx.gpu));
        e.device_report = rep_dev;
        const fg_status cs = fg_linear_grpo(cx.gpu, &o, &cfg, &din, &db, &gout, &e);
        CUDA_OK(cudaStreamSynchronize(cx.stream));
        fg_device_report rep;
        CUDA_OK(cudaMemcpy(&rep, rep_dev, sizeof rep, cudaMemcpyDeviceToHost));
        char msg[512];
        const fg_status rs = fg_device_report_status(&rep, msg, sizeof msg);
        char what[1600];
        snprintf(what, sizeof what, "%s reported refusal: host %s \"%s\", call %s, record %s \"%s\"",
                 dname(p.dtype), fg_status_name(hs), host_msg, fg_status_name(cs),
                 fg_status_name(rs), msg);
        check_true(what, hs != FG_OK && cs == FG_OK && rs == hs && strcmp(msg, host_msg) == 0);
        device_outputs_free(dout);
        p.tokens[last] = id;
        p.hidden = hidden;
        upload(d.tokens, p.tokens.data(), p.tokens.size() * sizeof(int64_t));
        upload(d.hidden, p.hidden.data(), p.hidden.size());
    }
    CUDA_OK(cudaFree(rep_dev));
}

/* ---- main ----------------------------------------------------------------------------- */

static fg_context *cuda_context(cudaStream_t stream, fg_status *st)
{
    fg_context_options o;
    fg_context_options_init(&o);
    o.backend = FG_BACKEND_CUDA;
    o.stream = stream;
    fg_context *ctx = NULL;
    *st = fg_context_create(&o, &ctx);
    return ctx;
}

/* One input dtype: the problem, every loss, the refusals. */
static void test_dtype(const Contexts &cx, fg_dtype dtype)
{
    Problem p = problem_make(dtype);
    fill_logp(cx.cpu, p);
    DeviceProblem d = device_problem(p);
    const Outputs fields = outputs_make(dtype, 1.0);
    DeviceOutputs dout = device_outputs(fields);
    /* The float32 sums of a bf16 grad_weight, and (the least budget) maybe
     * its sums in place. */
    const Budget bu = fused_budget(cx, d, dtype, dout, fields, true);
    const Budget least = fused_budget(cx, d, dtype, dout, fields, false);
    device_outputs_free(dout);
    char what[160];
    snprintf(what, sizeof what, "%s: a budget of %zu bytes gives the fused CUDA call %lld chunks",
             dname(dtype), bu.bytes, (long long)bu.chunks);
    check_true(what, bu.chunks >= 2 && (dtype != FG_DTYPE_BF16 || bu.sums));

    test_losses(cx, p, d, &bu, dtype, true);
    test_losses(cx, p, d, NULL, dtype, true);
    test_accumulate(cx, p, d, bu, dtype);
    if (dtype == FG_DTYPE_BF16) {
        test_losses(cx, p, d, &bu, FG_DTYPE_F32, false); /* bf16 inputs, float32 gradients */
        if (!least.sums && least.chunks >= 2) {
            test_losses(cx, p, d, &least, dtype, false);
            test_accumulate(cx, p, d, least, dtype);
        }
    }
    test_logprobs(cx, p, d);
    test_shard_phases(cx, p, d, bu.bytes);
    test_refusals(cx, p, d, bu.bytes);
    test_reported(cx, p, d, bu);
    device_problem_free(d);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* every line reaches a log even if a check crashes */
    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices == 0) {
        (void)cudaGetLastError();
        /* The backend loads and refuses: no fault, a status and a message. */
        fg_status st;
        fg_context *ctx = cuda_context(NULL, &st);
        char what[512];
        snprintf(what, sizeof what,
                 "without a device fg_context_create(FG_BACKEND_CUDA) refuses: %s",
                 fg_status_name(st));
        check_true(what, st == FG_ERR_UNSUPPORTED && ctx == NULL);
        fg_context_destroy(ctx);
        fg_device dev = {NULL, NULL};
        char msg[512] = "";
        st = fg_backend_cuda_create(NULL, &dev, msg, sizeof msg);
        snprintf(what, sizeof what, "without a device fg_backend_cuda_create refuses: %s: %s",
                 fg_status_name(st), msg);
        check_true(what, st == FG_ERR_UNSUPPORTED && dev.ops == NULL && dev.state == NULL);
        printf("skipped: %s\n",
               err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA device is present");
        return checks_failed ? 1 : 77;
    }
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);

    Contexts cx;
    CUDA_OK(cudaStreamCreateWithFlags(&cx.stream, cudaStreamNonBlocking));
    fg_status st = fg_context_create(NULL, &cx.cpu);
    if (st != FG_OK) {
        printf("FAIL the CPU context: %s\n", fg_status_name(st));
        return 1;
    }
    cx.gpu = cuda_context(cx.stream, &st);
    if (st != FG_OK) {
        printf("FAIL fg_context_create(FG_BACKEND_CUDA) on a machine with a device: %s\n",
               fg_status_name(st));
        return 1;
    }

    test_backend_ops(FG_DTYPE_F32);
    test_backend_ops(FG_DTYPE_BF16);
    test_dtype(cx, FG_DTYPE_F32);
    test_dtype(cx, FG_DTYPE_BF16);

    fg_context_destroy(cx.gpu);
    fg_context_destroy(cx.cpu);
    CUDA_OK(cudaStreamDestroy(cx.stream));
    /* A fault in any kernel would surface here at the latest. */
    check_true("no CUDA error pending at the end", cudaDeviceSynchronize() == cudaSuccess);
    printf("%d checks, %d failed\n", checks_run, checks_failed);
    return checks_failed ? 1 : 0;
}
