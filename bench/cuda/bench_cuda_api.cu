/* The GPU benchmark of the C API: a whole fused step through fg_linear_grpo
 * on an FG_BACKEND_CUDA context, as a framework calls it, against the bare
 * products and the materialized baseline, in one process.
 *
 * The shape (the seeds' headline): B = 1, T = 8192 and T = 32768 tokens,
 * H = 4096, V = 151936; hidden ~ N(0, 1) and weight ~ N(0, 1)/sqrt(H) in
 * bf16 (logits of about unit size), no bias; random token ids, ~90% of the
 * tokens unmasked; DAPO with epsilon_high 0.28 and beta 0.04, old_logp and
 * ref_logp within ~0.1 of the policy's own log-probs (one fg_linear_logprobs
 * call makes them), so that some ratios clip. Forward and backward to
 * grad_hidden and grad_weight in bf16 (what torch keeps for bf16
 * parameters), with logp and entropy.
 *
 * Rows of each shape:
 *   (a) floor         the three bare cuBLASLt products at full shape, bf16
 *                     outputs (as torch.mm runs them): logits [N, V],
 *                     grad_hidden [N, H], grad_weight [V, H]; each alone and
 *                     the three together (the floor every ratio divides by),
 *                     and the three on the unmasked rows only, which is what
 *                     the library multiplies; where the [N, V] logits do not
 *                     fit the device, over the fewest equal row slices that
 *                     do (grad_weight summed over them), named so;
 *   (b) fused         fg_linear_grpo at each memory budget (fg_exec), planned
 *                     first with fg_linear_grpo_plan (chunks, working bytes,
 *                     whether a bf16 grad_weight is summed in float32); a
 *                     budget the plan refuses is a row with its message; once
 *                     more at the largest budget with float32 gradients;
 *   (bw) waits        the fused step at each budget with the context's
 *                     finite check off, the rest as (b): the host then checks
 *                     each chunk's statistics before its products, one wait a
 *                     chunk (the walk every call took before the backend's
 *                     derivs op), where (b) runs the chunks with no host wait
 *                     between them (g and e on the device, every token
 *                     checked once after the chunks). The same products, so
 *                     the pair measures the per-chunk waits in one run, less
 *                     (b)'s NaN/Inf scan of the inputs, which (bw) skips;
 *                     --no-waits skips them;
 *   (bg) graph        the fused step at each budget as a device-reported call
 *                     (fg_exec.device_report: no host wait anywhere, the
 *                     checks and the loss on the device) captured once in a
 *                     CUDA graph (global capture mode) and timed as graph
 *                     replays, the rest as (b): what a framework that
 *                     captures its step (torch.cuda.graph) runs; the loss
 *                     read from the record, its status checked after the
 *                     row; --no-graph skips them;
 *   (b') filtered     the same fused step at each budget with gradient
 *                     filtering at its "auto" threshold (filter_eps =
 *                     FG_FILTER_EPS_AUTO: 1e-5 for bf16 inputs): the dropped
 *                     entries of each chunk's dlogits zeroed on the device,
 *                     the products dense over them; each row also reports the
 *                     fraction of dlogits entries kept (fg_memory_stats:
 *                     dlogits_kept / dlogits_entries of the last call; 1 for
 *                     a chunk some row of which keeps over V/8). The loss is
 *                     the dense rows' (filtering changes the two gradient
 *                     products only). A backend or driver that refuses
 *                     filtering gives rows with its message. --no-filter
 *                     skips them;
 *   (c) materialized  FG_IMPL_MATERIALIZED on the same context (whole [N, V]
 *                     logits and dlogits), unless cudaMemGetInfo says its
 *                     working memory cannot fit;
 *   (d) f32 inputs    at the first token count only (8192 by default; a
 *                     larger T would multiply seconds of f32 products): the
 *                     same hidden and weight draws unrounded in float32, the
 *                     same tokens, mask and old/ref log-probs. The three
 *                     bare products in float32 (CUBLAS_COMPUTE_32F, no TF32,
 *                     float32 outputs: the f32 floor, which these rows'
 *                     ratios divide by), fg_linear_grpo fused with float32
 *                     gradients at one budget (2 GiB, or the largest given if
 *                     smaller), and materialized. The library's products run
 *                     true float32 too (gemm_cublaslt.h), so these are the
 *                     timings of the path whose results match the CPU's
 *                     float32 tolerances. --no-f32 skips it.
 *
 * Timing: each row is the median of --reps calls (default 7) after 2
 * warm-ups, with min and max, in host wall time from an idle stream to the
 * call's return followed by cudaStreamSynchronize (fg_linear_grpo already
 * waits for its stream before it returns; the host's share of the step, its
 * checks and waits (one a chunk in the "a wait a chunk" rows), is part of
 * the time). The f32 rows are
 * the median of 5 (or --reps if fewer) after 1 warm-up: one f32 product at
 * [8192, 4096] x [4096, 151936] runs ~0.2 s without tensor cores, and the
 * section stays under ~20 s of device time.
 *
 * Memory of each library row:
 *   peak    fg_memory_stats.peak_bytes over the row's calls after
 *           fg_release_workspace and fg_reset_peak_memory: the library's
 *           counted working memory (the device workspace, and its few MiB of
 *           host scratch); the cuBLASLt workspace the context holds since
 *           create (32 MiB) is planned against the budget but not counted;
 *   pool    the high-water mark of the device's default memory pool over the
 *           row (cudaMemPoolAttrUsedMemHigh): the backend allocates its
 *           workspace there (cudaMallocAsync), this program never does;
 *   held    cudaMemGetInfo's free bytes before the row's first call minus
 *           after its last (the workspace the context keeps for reuse).
 *
 * usage: bench_cuda_api --out DIR [--tokens N[,N...]]... [--budgets B[,B...]]
 *                       [--reps R] [--quick] [--no-f32] [--no-filter] [--no-waits] [--no-graph]
 *                       [--lean] [--floor-rows R]
 * Budgets: a number of MiB, or with a K/M/G suffix (binary). Writes
 * DIR/bench_api.json and DIR/bench_api.txt (a markdown table with the
 * command line and the GPU on top). Exit 77 ("skipped: <reason>") without a
 * CUDA device; 1 on any failure (the library's message from fg_last_error);
 * 2 on bad arguments. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "cuda_ok.h"
#include "fusedgrpo.h"
#include "gemm_cublaslt.h"

#define WARMUPS 2
/* The f32-input section's calls: fewer, since each f32 step takes ~0.6 s. */
#define F32_WARMUPS 1
#define F32_REPS 5

static const double MiB = 1024.0 * 1024.0, GiB = 1024.0 * MiB;

/* ---- arguments -------------------------------------------------------------------- */

struct Options {
    std::string out, command;
    std::vector<int64_t> tokens;
    std::vector<size_t> budgets;
    int reps = 7;
    bool quick = false;
    bool f32 = true; /* the f32-input section at the first token count */
    bool filter = true; /* the filtered fused rows (b') */
    bool waits = true;  /* the fused rows with a host wait a chunk (bw) */
    bool graph = true;  /* the device-reported fused rows replayed as a CUDA graph (bg) */
    bool lean = false;  /* no single-product floor rows, no f32-gradient or
                           materialized row (long context) */
    int64_t floor_rows = 0; /* the floor's slices hold at most this many rows
                               (0: as many as fit) */
};

static void usage(const char *why)
{
    fprintf(stderr,
            "bench_cuda_api: %s\n"
            "usage: bench_cuda_api --out DIR [--tokens N[,N...]]... [--budgets B[,B...]] "
            "[--reps R] [--quick] [--no-f32] [--no-filter] [--no-waits] [--no-graph] [--lean] "
            "[--floor-rows R]\n"
            "  budgets: MiB, or with a K/M/G suffix (512M,1G); defaults: tokens 8192,32768, "
            "budgets 512M,1G,2G,3G, reps 7\n"
            "  --no-f32: skip the f32-input rows (otherwise run at the first token count only)\n"
            "  --no-filter: skip the filtered fused rows (filter_eps auto at each budget)\n"
            "  --no-waits: skip the fused rows with the finite check off (a host wait a "
            "chunk)\n"
            "  --no-graph: skip the device-reported fused rows replayed as a CUDA graph\n"
            "  --lean: skip the single-product floor rows, the float32-gradient row and the "
            "materialized row (long context)\n"
            "  --floor-rows R: the floor's products over row slices of at most R rows (by "
            "default only where [N, V] does not fit)\n",
            why);
    exit(2);
}

/* "512", "512M", "512MiB", "1G", "1.5G": bytes; 0 when malformed. */
static size_t parse_bytes(const std::string &s)
{
    char *end = NULL;
    const double x = strtod(s.c_str(), &end);
    if (end == s.c_str() || !(x > 0))
        return 0;
    std::string unit(end);
    double scale = MiB;
    if (!unit.empty()) {
        const char u = (char)toupper((unsigned char)unit[0]);
        scale = u == 'K' ? 1024.0 : u == 'M' ? MiB : u == 'G' ? GiB : 0;
        const std::string rest = unit.substr(1);
        if (scale == 0 || !(rest.empty() || rest == "B" || rest == "iB"))
            return 0;
    }
    return (size_t)(x * scale);
}

static std::vector<std::string> split_list(const char *s)
{
    std::vector<std::string> items;
    std::string cur;
    for (const char *p = s;; p++) {
        if (*p == ',' || *p == '\0') {
            if (!cur.empty())
                items.push_back(cur);
            cur.clear();
            if (*p == '\0')
                break;
        } else if (*p != ' ') {
            cur += *p;
        }
    }
    return items;
}

static Options parse_args(int argc, char **argv)
{
    Options o;
    for (int i = 0; i < argc; i++)
        o.command += (i ? " " : "") + std::string(argv[i]);
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        const bool has_value = i + 1 < argc;
        if (a == "--quick") {
            o.quick = true;
        } else if (a == "--no-f32") {
            o.f32 = false;
        } else if (a == "--no-filter") {
            o.filter = false;
        } else if (a == "--no-waits") {
            o.waits = false;
        } else if (a == "--no-graph") {
            o.graph = false;
        } else if (a == "--lean") {
            o.lean = true;
        } else if (a == "--out" && has_value) {
            o.out = argv[++i];
        } else if (a == "--tokens" && has_value) {
            for (const std::string &t : split_list(argv[++i])) {
                char *end = NULL;
                const long long n = strtoll(t.c_str(), &end, 10);
                if (*end != '\0' || n < 1)
                    usage(("bad token count: " + t).c_str());
                o.tokens.push_back(n);
            }
        } else if (a == "--budgets" && has_value) {
            for (const std::string &b : split_list(argv[++i])) {
                const size_t bytes = parse_bytes(b);
                if (!bytes)
                    usage(("bad budget: " + b).c_str());
                o.budgets.push_back(bytes);
            }
        } else if (a == "--floor-rows" && has_value) {
            o.floor_rows = strtoll(argv[++i], NULL, 10);
            if (o.floor_rows < 1)
                usage("--floor-rows must be at least 1");
        } else if (a == "--reps" && has_value) {
            o.reps = atoi(argv[++i]);
            if (o.reps < 1)
                usage("--reps must be at least 1");
        } else {
            usage(("unknown or incomplete argument: " + a).c_str());
        }
    }
    if (o.out.empty())
        usage("--out DIR is required");
    /* The quick shape is small (H = 1024, V = 32000): its budgets hold
     * several chunks of it. Each budget includes the 32 MiB cuBLASLt
     * workspace. */
    if (o.tokens.empty())
        o.tokens = o.quick ? std::vector<int64_t>{2048} : std::vector<int64_t>{8192, 32768};
    if (o.budgets.empty())
        o.budgets = o.quick ? std::vector<size_t>{(size_t)(48 * MiB), (size_t)(64 * MiB),
                                                  (size_t)(128 * MiB), (size_t)(256 * MiB)}
                            : std::vector<size_t>{(size_t)(512 * MiB), (size_t)GiB,
                                                  (size_t)(2 * GiB), (size_t)(3 * GiB)};
    return o;
}

/* ---- failures --------------------------------------------------------------------- */

/* A library call that must succeed: its status and fg_last_error, exit 1. */
static void lib_ok(const fg_context *ctx, fg_status st, const char *what)
{
    if (st != FG_OK) {
        printf("FAIL %s: %s: %s\n", what, fg_status_name(st), ctx ? fg_last_error(ctx) : "");
        exit(1);
    }
}

/* The products' own status and message (gemm_cublaslt.h). */
static void gemm_ok(fg_status st, const char *msg)
{
    if (st != FG_OK) {
        printf("FAIL cuBLASLt product: %s: %s\n", fg_status_name(st), msg);
        exit(1);
    }
}

/* ---- device data -------------------------------------------------------------------- */

static cudaStream_t stream;

static size_t dtype_bytes(fg_dtype t)
{
    return t == FG_DTYPE_BF16 ? 2 : 4;
}

static const char *dtype_str(fg_dtype t)
{
    return t == FG_DTYPE_BF16 ? "bf16" : "f32";
}

__device__ static uint64_t splitmix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A standard normal from element i of stream `seed` (Box-Muller on the two
 * 32-bit halves of one hash; u1 in (0, 1] keeps the log finite). */
__device__ static float normal_at(int64_t i, uint64_t seed)
{
    const uint64_t h = splitmix64((uint64_t)i ^ (seed << 40));
    const float u1 = ((float)(uint32_t)(h >> 40) + 1.0f) * 0x1p-24f;
    const float u2 = (float)((uint32_t)h >> 8) * 0x1p-24f;
    return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__device__ static void store_as(__nv_bfloat16 *x, float v)
{
    *x = __float2bfloat16_rn(v);
}

__device__ static void store_as(float *x, float v)
{
    *x = v;
}

/* Element i is the same draw in either dtype: the f32 inputs are the bf16
 * ones before rounding. */
template <typename T> __global__ void fill_normal(T *x, int64_t n, uint64_t seed, float scale)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        store_as(&x[i], scale * normal_at(i, seed));
}

/* x [n] of dtype t = scale · N(0, 1) from stream `seed`, on the stream. */
static void fill_normal_as(void *x, fg_dtype t, int64_t n, uint64_t seed, float scale)
{
    if (t == FG_DTYPE_BF16)
        fill_normal<<<4096, 256, 0, stream>>>((__nv_bfloat16 *)x, n, seed, scale);
    else
        fill_normal<<<4096, 256, 0, stream>>>((float *)x, n, seed, scale);
    CUDA_OK(cudaGetLastError());
}

/* Token ids uniform in [0, V); mask 1 for ~9 tokens in 10. */
__global__ void fill_tokens(int64_t *tokens, uint8_t *mask, int64_t n, int64_t V)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        tokens[i] = (int64_t)(splitmix64((uint64_t)i ^ (11ull << 40)) % (uint64_t)V);
        mask[i] = splitmix64((uint64_t)i ^ (12ull << 40)) % 10 != 0;
    }
}

/* old_logp, ref_logp [N] = logp + 0.1 · N(0, 1): ratios near 1, some clipped. */
__global__ void fill_near(const float *logp, float *old_logp, float *ref_logp, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        old_logp[i] = logp[i] + 0.1f * normal_at(i, 13);
        ref_logp[i] = logp[i] + 0.1f * normal_at(i, 14);
    }
}

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

/* ---- timing ------------------------------------------------------------------------- */

struct Timing {
    double median, min, max; /* ms */
};

/* How a section times its rows: WARMUPS and --reps, or the f32 section's. */
struct Reps {
    int warmups, reps;
};

/* rp.warmups calls, then rp.reps timed ones: host wall time from an idle
 * stream until the call returned and the stream is idle again. */
template <typename F> static Timing time_calls(const Reps &rp, F call)
{
    for (int i = 0; i < rp.warmups; i++)
        call();
    std::vector<double> ms;
    for (int i = 0; i < rp.reps; i++) {
        CUDA_OK(cudaStreamSynchronize(stream));
        const auto t0 = std::chrono::steady_clock::now();
        call();
        CUDA_OK(cudaStreamSynchronize(stream));
        const auto t1 = std::chrono::steady_clock::now();
        ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const size_t n = ms.size();
    const double median = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
    return Timing{median, ms.front(), ms.back()};
}

/* ---- device memory watch ------------------------------------------------------------- */

static cudaMemPool_t pool; /* the device's default pool; NULL without pools */

struct MemWatch {
    size_t free_before;
};

static size_t free_bytes(void)
{
    size_t f = 0, t = 0;
    CUDA_OK(cudaDeviceSynchronize()); /* frees done, the pool trimmed */
    CUDA_OK(cudaMemGetInfo(&f, &t));
    return f;
}

static MemWatch watch_start(void)
{
    MemWatch w;
    w.free_before = free_bytes();
    if (pool) {
        uint64_t zero = 0; /* the only value the mark can be set to */
        CUDA_OK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    }
    return w;
}

/* pool: the pool's high-water mark since watch_start (0 without pools);
 * held: the bytes less free than at watch_start. */
static void watch_end(const MemWatch &w, double *pool_peak, double *held)
{
    const size_t f = free_bytes();
    *held = (double)w.free_before - (double)f;
    *pool_peak = 0;
    if (pool) {
        uint64_t high = 0;
        CUDA_OK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
        *pool_peak = (double)high;
    }
}

/* ---- rows --------------------------------------------------------------------------- */

struct Row {
    std::string kind, name, note; /* note: why it did not run, or a remark */
    std::string inputs = "bf16";  /* hidden and weight (and the floor's operands) */
    bool ran = false;
    size_t budget = 0;
    std::string grads;
    Timing t = {0, 0, 0};
    double ratio = 0; /* median / the floor's */
    int64_t chunks = 0, chunk_rows = 0;
    double working = 0, gemm_scratch = 0, gw_sum = 0; /* the plan's bytes */
    double peak = 0, pool_peak = 0, held = 0;         /* measured bytes */
    double loss = NAN;
    double kept = NAN; /* library rows: dlogits_kept / dlogits_entries (1: dense) */
};

struct ShapeResult {
    int64_t B, T, H, V, unmasked;
    double floor_ms = 0, floor_active_ms = 0;         /* bf16 products */
    double f32_floor_ms = 0, f32_floor_active_ms = 0; /* f32 products, 0 if not run */
    bool f32 = false;                                 /* the f32 section ran here */
    std::vector<Row> rows;
};

static std::string mib(double bytes)
{
    char s[32];
    snprintf(s, sizeof s, "%.0f", bytes / MiB);
    return s;
}

static std::string budget_name(size_t b)
{
    char s[32];
    if (b % (size_t)GiB == 0)
        snprintf(s, sizeof s, "%zu GiB", b / (size_t)GiB);
    else
        snprintf(s, sizeof s, "%.0f MiB", (double)b / MiB);
    return s;
}

/* A kept fraction as a percentage ("" when unknown). */
static std::string kept_str(double kept)
{
    if (!isfinite(kept))
        return "";
    char s[32];
    snprintf(s, sizeof s, "%.3g%%", 100.0 * kept);
    return s;
}

static void print_row(const Row &r)
{
    if (!r.ran) {
        printf("%-13s %-72s skipped: %s\n", r.kind.c_str(), r.name.c_str(), r.note.c_str());
        return;
    }
    printf("%-13s %-72s %9.2f %9.2f %9.2f", r.kind.c_str(), r.name.c_str(), r.t.median, r.t.min,
           r.t.max);
    if (r.ratio > 0)
        printf("  %.3fx %s floor", r.ratio, r.inputs.c_str());
    if (r.kind != "floor")
        printf("  %lld chunks, peak %s MiB, pool %s MiB, held %s MiB, loss %.6g",
               (long long)r.chunks, mib(r.peak).c_str(), mib(r.pool_peak).c_str(),
               mib(r.held).c_str(), r.loss);
    if (r.kind == "filtered")
        printf(", kept %s", kept_str(r.kept).c_str());
    printf("\n");
}

/* ---- one shape ------------------------------------------------------------------------ */

struct Problem {
    int64_t B, T, H, V, N;
    fg_dtype in_t; /* hidden and weight */
    void *hidden, *weight;
    int64_t *tokens;
    uint8_t *mask;
    float *adv, *old_logp, *ref_logp, *logp, *entropy;
    void *gh, *gw; /* bf16 gradients; NULL for f32 inputs */
};

static Problem problem_make(int64_t B, int64_t T, int64_t H, int64_t V)
{
    Problem p;
    p.B = B;
    p.T = T;
    p.H = H;
    p.V = V;
    p.N = B * T;
    p.in_t = FG_DTYPE_BF16;
    p.hidden = dev_alloc((size_t)p.N * H * 2);
    p.weight = dev_alloc((size_t)V * H * 2);
    p.tokens = (int64_t *)dev_alloc((size_t)p.N * 8);
    p.mask = (uint8_t *)dev_alloc((size_t)p.N);
    p.adv = (float *)dev_alloc((size_t)B * 4);
    p.old_logp = (float *)dev_alloc((size_t)p.N * 4);
    p.ref_logp = (float *)dev_alloc((size_t)p.N * 4);
    p.logp = (float *)dev_alloc((size_t)p.N * 4);
    p.entropy = (float *)dev_alloc((size_t)p.N * 4);
    p.gh = dev_alloc((size_t)p.N * H * 2);
    p.gw = dev_alloc((size_t)V * H * 2);
    fill_normal_as(p.hidden, p.in_t, p.N * H, 1, 1.0f);
    fill_normal_as(p.weight, p.in_t, V * H, 2, (float)(1.0 / sqrt((double)H)));
    fill_tokens<<<1024, 256, 0, stream>>>(p.tokens, p.mask, p.N, V);
    CUDA_OK(cudaGetLastError());
    std::vector<float> adv((size_t)B);
    for (int64_t b = 0; b < B; b++)
        adv[(size_t)b] = b % 2 ? -0.6f : 0.8f; /* one group's advantages of both signs */
    CUDA_OK(cudaMemcpyAsync(p.adv, adv.data(), adv.size() * 4, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    return p;
}

static void problem_free(Problem &p)
{
    void *all[] = {p.hidden, p.weight, p.tokens,  p.mask, p.adv, p.old_logp,
                   p.ref_logp, p.logp, p.entropy, p.gh,   p.gw};
    for (void *q : all)
        CUDA_OK(cudaFree(q));
}

/* The f32-input problem: bf's token arrays, advantages and old/ref log-probs
 * (no second log-probs pass: the f32 policy's log-probs differ from the bf16
 * one's by its rounding, well inside the ~0.1 spread), with its own hidden
 * [N, H] and weight [V, H] in float32, the same draws unrounded. Free with
 * f32_problem_free. */
static Problem f32_problem_make(const Problem &bf)
{
    Problem p = bf;
    p.in_t = FG_DTYPE_F32;
    p.hidden = dev_alloc((size_t)p.N * p.H * 4);
    p.weight = dev_alloc((size_t)p.V * p.H * 4);
    p.gh = p.gw = NULL;
    fill_normal_as(p.hidden, p.in_t, p.N * p.H, 1, 1.0f);
    fill_normal_as(p.weight, p.in_t, p.V * p.H, 2, (float)(1.0 / sqrt((double)p.H)));
    CUDA_OK(cudaStreamSynchronize(stream));
    return p;
}

static void f32_problem_free(Problem &p)
{
    CUDA_OK(cudaFree(p.hidden));
    CUDA_OK(cudaFree(p.weight));
}

static fg_linear_inputs inputs_of(const Problem &p)
{
    fg_linear_inputs in;
    memset(&in, 0, sizeof in);
    in.hidden = fg_matrix_make(p.hidden, p.in_t, p.N, p.H);
    in.weight = fg_matrix_make(p.weight, p.in_t, p.V, p.H);
    in.bias = fg_vector_make(NULL, p.in_t, 0);
    return in;
}

static fg_batch batch_of(const Problem &p)
{
    fg_batch b;
    memset(&b, 0, sizeof b);
    b.batch = p.B;
    b.seq_len = p.T;
    b.token_ids = p.tokens;
    b.mask = p.mask;
    b.advantages = p.adv;
    b.old_logp = p.old_logp;
    b.ref_logp = p.ref_logp;
    return b;
}

static fg_loss_config dapo_config(void)
{
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = FG_LOSS_DAPO;
    cfg.epsilon_low = 0.2;
    cfg.epsilon_high = 0.28;
    cfg.beta = 0.04;
    return cfg;
}

/* The outputs: logp, entropy, and gradients in gdt (gh, gw of that dtype). */
static fg_linear_outputs outputs_of(const Problem &p, fg_dtype gdt, void *gh, void *gw)
{
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    out.logp = p.logp;
    out.entropy = p.entropy;
    out.grad_hidden = fg_matrix_make(gh, gdt, p.N, p.H);
    out.grad_weight = fg_matrix_make(gw, gdt, p.V, p.H);
    out.grad_bias = fg_vector_make(NULL, gdt, 0);
    return out;
}

/* (a), and the f32 floor of (d): the three bare products at full shape in
 * p's input dtype, outputs of that dtype (bf16 as torch.mm gives them; f32,
 * CUBLAS_COMPUTE_32F without TF32, as the library's f32 path multiplies), on
 * this program's own cuBLASLt handle; and on the unmasked rows only. Where
 * the [N, V] logits do not fit the device (T = 262144 at V = 151936 is 80 GB
 * in bf16), the products run over slices of the rows, each slice's logits
 * product then its grad_hidden rows, grad_weight summed over the slices
 * (beta 1 after the first): the same arithmetic in the fewest pieces that
 * fit, and the rows say so. --lean leaves out the three products' single
 * rows. */
static void run_floor(const Problem &p, const Reps &rp, const Options &o, ShapeResult &res)
{
    const int64_t N = p.N, H = p.H, V = p.V;
    const fg_dtype in_t = p.in_t;
    const size_t es = dtype_bytes(in_t);
    const bool f32 = in_t == FG_DTYPE_F32;
    double &floor_ms = f32 ? res.f32_floor_ms : res.floor_ms;
    double &floor_active_ms = f32 ? res.f32_floor_active_ms : res.floor_active_ms;
    const std::string dt = dtype_str(in_t);
    const size_t workspace_bytes = fg_cuda_gemm_workspace_hint();
    /* grad_hidden [N, H], grad_weight [V, H] and the cuBLASLt workspace
     * whatever the slice; the logits [M, V] of a slice of M rows. f32 logits
     * at N = 32768, V = 151936 are 20 GB. */
    const size_t fixed = ((size_t)N * H + (size_t)V * H) * es + workspace_bytes;
    const size_t margin = (size_t)(256 * MiB);
    const size_t free_now = free_bytes();
    const size_t row_bytes = (size_t)V * es;
    int64_t slice = 0;
    if (fixed + margin < free_now)
        slice = std::min<int64_t>(N, (int64_t)((free_now - fixed - margin) / row_bytes));
    if (o.floor_rows > 0)
        slice = std::min(slice, o.floor_rows);
    if (slice < N) /* equal slices, the fewest that fit */
        slice = slice < 1 ? 0 : (N + (N + slice - 1) / slice - 1) / ((N + slice - 1) / slice);
    const int64_t pieces = slice > 0 ? (N + slice - 1) / slice : 0;
    const std::string floor_name =
        pieces > 1 ? "three products in " + std::to_string(pieces) + " slices of " +
                         std::to_string(slice) + " rows (the " + dt + " floor)"
                   : "three products (the " + dt + " floor)";
    if (slice < 1) {
        Row r;
        r.kind = "floor";
        r.inputs = dt;
        r.name = floor_name;
        char why[160];
        snprintf(why, sizeof why, "needs over %.2f GiB, %.2f GiB free",
                 (double)(fixed + row_bytes) / GiB, (double)free_now / GiB);
        r.note = why;
        print_row(r);
        res.rows.push_back(r);
        return;
    }
    if (pieces > 1)
        printf("floor: [%lld, %lld] logits need %.1f GiB, %.1f GiB free: %lld slices of %lld "
               "rows\n",
               (long long)N, (long long)V, (double)N * (double)row_bytes / GiB,
               (double)free_now / GiB, (long long)pieces, (long long)slice);
    cublasLtHandle_t lt;
    if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) {
        printf("FAIL cublasLtCreate\n");
        exit(1);
    }
    fg_cuda_gemm g = {lt, stream, NULL, workspace_bytes};
    g.workspace = dev_alloc(g.workspace_bytes);
    /* The logits double as dlogits: the products' speed does not depend on
     * what the values mean. */
    void *z = dev_alloc((size_t)slice * row_bytes), *gh = dev_alloc((size_t)N * H * es),
         *gw = dev_alloc((size_t)V * H * es);
    fill_normal_as(z, in_t, slice * V, 3, 0.01f);
    char msg[512] = "";
    const char *hid = (const char *)p.hidden;
    auto gemm1 = [&](int64_t r0, int64_t M) {
        gemm_ok(fg_cuda_gemm_logits(&g, in_t, M, V, H, hid + (size_t)r0 * H * es, H, p.weight, H,
                                    z, in_t, V, msg, sizeof msg),
                msg);
    };
    auto gemm2 = [&](int64_t r0, int64_t M) {
        gemm_ok(fg_cuda_gemm_grad_hidden(&g, in_t, M, V, H, z, V, p.weight, H,
                                         (char *)gh + (size_t)r0 * H * es, in_t, H, 0.0f, msg,
                                         sizeof msg),
                msg);
    };
    auto gemm3 = [&](int64_t r0, int64_t M) {
        gemm_ok(fg_cuda_gemm_grad_weight(&g, in_t, M, V, H, z, V, hid + (size_t)r0 * H * es, H,
                                         gw, in_t, H, r0 > 0 ? 1.0f : 0.0f, msg, sizeof msg),
                msg);
    };
    /* Product k (0, 1, 2; 3: the three) over the first `rows` rows, slice by
     * slice. */
    auto products = [&](int k, int64_t rows) {
        for (int64_t r0 = 0; r0 < rows; r0 += slice) {
            const int64_t M = std::min(slice, rows - r0);
            if (k == 0 || k == 3)
                gemm1(r0, M);
            if (k == 1 || k == 3)
                gemm2(r0, M);
            if (k == 2 || k == 3)
                gemm3(r0, M);
        }
    };
    const std::string names[3] = {"GEMM 1 logits [N, V] (" + dt + " out)",
                                  "GEMM 2 grad_hidden [N, H] (" + dt + " out)",
                                  "GEMM 3 grad_weight [V, H] (" + dt + " out)"};
    for (int k = 0; k < 3 && !o.lean; k++) {
        Row r;
        r.kind = "floor";
        r.inputs = dt;
        r.name = names[k] + (pieces > 1 ? ", sliced" : "");
        r.t = time_calls(rp, [&] { products(k, N); });
        r.ran = true;
        print_row(r);
        res.rows.push_back(r);
    }
    Row all;
    all.kind = "floor";
    all.inputs = dt;
    all.name = floor_name;
    all.t = time_calls(rp, [&] { products(3, N); });
    all.ran = true;
    floor_ms = all.t.median;
    all.ratio = 1.0;
    print_row(all);
    res.rows.push_back(all);
    Row act;
    act.kind = "floor";
    act.inputs = dt;
    act.name = "three products, unmasked rows only";
    const int64_t M = res.unmasked;
    if (M > 0) {
        act.t = time_calls(rp, [&] { products(3, M); });
        act.ran = true;
        act.ratio = act.t.median / floor_ms;
        floor_active_ms = act.t.median;
    } else {
        act.note = "no unmasked token";
    }
    print_row(act);
    res.rows.push_back(act);
    for (void *q : {z, gh, gw, g.workspace})
        CUDA_OK(cudaFree(q));
    cublasLtDestroy(lt);
}

/* (b), (bw), (b'), (c): one library row; plan first, then the timed calls.
 * filter_eps: fg_linear_options.filter_eps (0: off; FG_FILTER_EPS_AUTO);
 * waits: the finite check off (bw). */
/* (bg): one device-reported call outside a capture (it sizes the context's
 * workspace: an allocation), then the same call captured on the stream in
 * global mode, instantiated: the executable graph, or NULL with the reason
 * in r->note (a host synchronisation inside the call fails the capture). */
static cudaGraphExec_t capture_call(fg_context *ctx, const fg_linear_options &opts,
                                    const fg_loss_config &cfg, const fg_linear_inputs &in,
                                    const fg_batch &batch, fg_linear_outputs out,
                                    const fg_exec &exec, Row *r)
{
    lib_ok(ctx, fg_linear_grpo(ctx, &opts, &cfg, &in, &batch, &out, &exec),
           "fg_linear_grpo (device-reported)");
    CUDA_OK(cudaStreamSynchronize(stream));
    cudaGraph_t g = NULL;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const fg_status st = fg_linear_grpo(ctx, &opts, &cfg, &in, &batch, &out, &exec);
    const cudaError_t end = cudaStreamEndCapture(stream, &g);
    cudaGraphExec_t replay = NULL;
    if (st != FG_OK || end != cudaSuccess) {
        (void)cudaGetLastError();
        r->note = std::string("capture failed: ") + fg_status_name(st) + " " +
                  cudaGetErrorName(end) + " " + fg_last_error(ctx);
        printf("%s: %s\n", r->name.c_str(), r->note.c_str());
    } else {
        CUDA_OK(cudaGraphInstantiate(&replay, g, 0));
    }
    if (g)
        CUDA_OK(cudaGraphDestroy(g));
    return replay;
}

static void run_library_row(fg_context *ctx, const Problem &p, fg_impl impl, size_t budget,
                            fg_dtype gdt, const Reps &rp, ShapeResult &res,
                            double filter_eps = 0.0, bool waits = false, bool graph = false)
{
    Row r;
    const bool filtered = filter_eps != 0.0;
    r.kind = impl != FG_IMPL_FUSED ? "materialized"
             : filtered            ? "filtered"
             : waits               ? "waits"
             : graph               ? "graph"
                                   : "fused";
    r.inputs = dtype_str(p.in_t);
    r.budget = impl == FG_IMPL_FUSED ? budget : 0;
    r.grads = dtype_str(gdt);
    r.name = impl == FG_IMPL_FUSED ? "fg_linear_grpo, budget " + budget_name(budget)
                                   : std::string("fg_linear_grpo, materialized");
    r.name += ", " + r.grads + " grads";
    if (filtered) {
        char e[64];
        const double eps =
            filter_eps == FG_FILTER_EPS_AUTO ? fg_filter_eps_auto(p.in_t) : filter_eps;
        snprintf(e, sizeof e, ", filtered (eps %s%.3g)",
                 filter_eps == FG_FILTER_EPS_AUTO ? "auto = " : "", eps);
        r.name += e;
    }
    if (waits)
        r.name += ", no scan: a wait a chunk";
    if (graph)
        r.name += ", device-reported, CUDA graph replays";

    const size_t gh_bytes = (size_t)p.N * p.H * dtype_bytes(gdt);
    const size_t gw_bytes = (size_t)p.V * p.H * dtype_bytes(gdt);
    /* p's bf16 gradients, or float32 ones for this row. */
    const bool own_grads = gdt != FG_DTYPE_BF16 || !p.gh;
    void *gh = p.gh, *gw = p.gw;
    if (own_grads) {
        gh = dev_alloc(gh_bytes);
        gw = dev_alloc(gw_bytes);
    }
    const fg_linear_options opts = {impl, 0, filter_eps};
    const fg_loss_config cfg = dapo_config();
    lib_ok(ctx, fg_context_set_check_finite(ctx, waits ? 0 : 1), "fg_context_set_check_finite");
    const fg_linear_inputs in = inputs_of(p);
    const fg_batch batch = batch_of(p);
    fg_exec exec;
    fg_exec_init(&exec);
    exec.memory_budget = budget;
    fg_device_report *rep_dev = NULL;
    if (graph) {
        rep_dev = static_cast<fg_device_report *>(dev_alloc(sizeof *rep_dev));
        exec.device_report = rep_dev;
    }

    fg_release_workspace(ctx); /* each row allocates its own workspace */
    fg_linear_outputs out = outputs_of(p, gdt, gh, gw);
    fg_linear_plan_info plan;
    memset(&plan, 0, sizeof plan);
    const fg_status pst = fg_linear_grpo_plan(ctx, &opts, &cfg, &in, &batch, &out, &exec, &plan);
    if (pst == FG_ERR_BUDGET_TOO_SMALL || (filtered && pst == FG_ERR_UNSUPPORTED)) {
        r.note = fg_last_error(ctx);
        printf("plan %s: refused: %s\n", r.name.c_str(), r.note.c_str());
    } else {
        lib_ok(ctx, pst, "fg_linear_grpo_plan");
        r.chunks = plan.chunks;
        r.chunk_rows = plan.chunk_rows;
        r.working = (double)plan.working_bytes;
        r.gemm_scratch = (double)plan.gemm_scratch_bytes;
        r.gw_sum = (double)plan.grad_weight_sum_bytes;
        printf("plan %s: %lld chunks of %lld rows; working %.1f MiB (fixed %.1f, chunk %.1f), "
               "GEMM scratch %.1f MiB, grad_weight %s\n",
               r.name.c_str(), (long long)plan.chunks, (long long)plan.chunk_rows,
               (double)plan.working_bytes / MiB, (double)plan.fixed_bytes / MiB,
               (double)plan.chunk_bytes / MiB, (double)plan.gemm_scratch_bytes / MiB,
               plan.grad_weight_sum_bytes ? "summed in float32 (rounded once)"
               : gdt == FG_DTYPE_BF16 && plan.chunks > 1 ? "rounded to bf16 per chunk"
                                                         : "written directly");
        /* A whole-shape row can exceed the device: say so instead of failing. */
        const size_t margin = (size_t)(256 * MiB);
        const size_t free_now = free_bytes();
        if (plan.working_bytes + plan.gemm_scratch_bytes + margin > free_now) {
            char why[160];
            snprintf(why, sizeof why, "needs %.2f GiB of working memory, %.2f GiB free",
                     (double)(plan.working_bytes + plan.gemm_scratch_bytes) / GiB,
                     (double)free_now / GiB);
            r.note = why;
        } else {
            const MemWatch w = watch_start();
            fg_reset_peak_memory(ctx);
            double loss = NAN;
            cudaGraphExec_t replay = graph ? capture_call(ctx, opts, cfg, in, batch,
                                                          outputs_of(p, gdt, gh, gw), exec, &r)
                                           : NULL;
            if (!graph || replay)
                r.t = time_calls(rp, [&] {
                    if (replay) {
                        CUDA_OK(cudaGraphLaunch(replay, stream));
                        return;
                    }
                    fg_linear_outputs o = outputs_of(p, gdt, gh, gw);
                    lib_ok(ctx, fg_linear_grpo(ctx, &opts, &cfg, &in, &batch, &o, &exec),
                           "fg_linear_grpo");
                    loss = o.loss;
                });
            if (replay) {
                CUDA_OK(cudaGraphExecDestroy(replay));
                fg_device_report rep;
                CUDA_OK(cudaMemcpy(&rep, rep_dev, sizeof rep, cudaMemcpyDeviceToHost));
                char msg[512];
                if (fg_device_report_status(&rep, msg, sizeof msg) != FG_OK) {
                    fprintf(stderr, "bench_cuda_api: %s: the record: %s\n", r.name.c_str(),
                            msg);
                    exit(1);
                }
                loss = rep.loss;
            }
            fg_memory_stats ms;
            lib_ok(ctx, fg_get_memory_stats(ctx, &ms), "fg_get_memory_stats");
            watch_end(w, &r.pool_peak, &r.held);
            r.ran = !graph || replay;
            r.peak = (double)ms.peak_bytes;
            r.chunks = ms.chunks;
            r.chunk_rows = ms.chunk_rows;
            r.loss = loss;
            r.kept = ms.dlogits_entries > 0
                         ? (double)ms.dlogits_kept / (double)ms.dlogits_entries
                         : NAN;
            const double floor_ms =
                p.in_t == FG_DTYPE_F32 ? res.f32_floor_ms : res.floor_ms;
            r.ratio = floor_ms > 0 ? r.t.median / floor_ms : 0;
        }
    }
    print_row(r);
    res.rows.push_back(r);
    fg_release_workspace(ctx);
    if (rep_dev)
        CUDA_OK(cudaFree(rep_dev));
    if (own_grads) {
        CUDA_OK(cudaFree(gh));
        CUDA_OK(cudaFree(gw));
    }
}

/* (d) The f32-input rows of one shape (bf: its bf16 problem, whose token
 * arrays and old/ref log-probs they share): the f32 floor, the fused step at
 * one budget with float32 gradients (the only ones the backend writes for
 * f32 inputs), the materialized path. */
static void run_f32_section(fg_context *ctx, const Options &o, const Problem &bf,
                            ShapeResult &res)
{
    const Reps rp = {F32_WARMUPS, std::min(o.reps, F32_REPS)};
    printf("\n## B %lld, T %lld, H %lld, V %lld, f32 inputs (no TF32), median of %d after %d "
           "warm-up\n",
           (long long)bf.B, (long long)bf.T, (long long)bf.H, (long long)bf.V, rp.reps,
           rp.warmups);
    const auto t0 = std::chrono::steady_clock::now();
    Problem p = f32_problem_make(bf);
    printf("%-13s %-72s %9s %9s %9s\n", "row", "what", "median", "min", "max");
    run_floor(p, rp, o, res);
    /* One budget: 2 GiB holds chunks of ~3300 f32 rows at V = 151936 (the
     * logits, reused as dlogits, and the hidden and grad_hidden rows): three
     * chunks at T = 8192, whose overhead is small next to f32 products. */
    const size_t budget =
        std::min((size_t)(2 * GiB), *std::max_element(o.budgets.begin(), o.budgets.end()));
    run_library_row(ctx, p, FG_IMPL_FUSED, budget, FG_DTYPE_F32, rp, res);
    run_library_row(ctx, p, FG_IMPL_MATERIALIZED, 0, FG_DTYPE_F32, rp, res);
    f32_problem_free(p);
    res.f32 = true;
    const auto t1 = std::chrono::steady_clock::now();
    printf("f32 section: %.1f s\n", std::chrono::duration<double>(t1 - t0).count());
}

/* f32: run the f32-input rows too (the first token count only). */
static ShapeResult run_shape(fg_context *ctx, const Options &o, int64_t T, bool f32)
{
    const int64_t B = 1, H = o.quick ? 1024 : 4096, V = o.quick ? 32000 : 151936;
    ShapeResult res;
    res.B = B;
    res.T = T;
    res.H = H;
    res.V = V;
    printf("\n## B %lld, T %lld, H %lld, V %lld, bf16\n", (long long)B, (long long)T,
           (long long)H, (long long)V);
    Problem p = problem_make(B, T, H, V);
    std::vector<uint8_t> mask((size_t)p.N);
    CUDA_OK(cudaMemcpy(mask.data(), p.mask, mask.size(), cudaMemcpyDeviceToHost));
    res.unmasked = (int64_t)std::count_if(mask.begin(), mask.end(), [](uint8_t m) { return m; });
    printf("%lld of %lld tokens unmasked\n", (long long)res.unmasked, (long long)p.N);

    /* The policy's own log-probs, then old and reference log-probs near them. */
    {
        const fg_linear_inputs in = inputs_of(p);
        const fg_tokens tok = {p.B, p.T, p.tokens, p.mask};
        fg_exec exec;
        fg_exec_init(&exec);
        exec.memory_budget = *std::max_element(o.budgets.begin(), o.budgets.end());
        const auto t0 = std::chrono::steady_clock::now();
        lib_ok(ctx, fg_linear_logprobs(ctx, NULL, 1.0, &in, &tok, p.logp, NULL, &exec),
               "fg_linear_logprobs");
        const auto t1 = std::chrono::steady_clock::now();
        printf("fg_linear_logprobs (old/ref log-probs, first call): %.1f ms\n",
               std::chrono::duration<double, std::milli>(t1 - t0).count());
        fill_near<<<1024, 256, 0, stream>>>(p.logp, p.old_logp, p.ref_logp, p.N);
        CUDA_OK(cudaGetLastError());
        CUDA_OK(cudaStreamSynchronize(stream));
        fg_release_workspace(ctx);
    }

    printf("%-13s %-72s %9s %9s %9s\n", "row", "what", "median", "min", "max");
    const Reps rp = {WARMUPS, o.reps};
    run_floor(p, rp, o, res);
    for (size_t b : o.budgets)
        run_library_row(ctx, p, FG_IMPL_FUSED, b, FG_DTYPE_BF16, rp, res);
    if (o.waits) /* (bw): the finite check off, one host wait a chunk */
        for (size_t b : o.budgets)
            run_library_row(ctx, p, FG_IMPL_FUSED, b, FG_DTYPE_BF16, rp, res, 0.0, true);
    if (o.graph) /* (bg): device-reported, captured, replayed */
        for (size_t b : o.budgets)
            run_library_row(ctx, p, FG_IMPL_FUSED, b, FG_DTYPE_BF16, rp, res, 0.0, false, true);
    if (o.filter) /* (b'): the same steps with filtering at the auto threshold */
        for (size_t b : o.budgets)
            run_library_row(ctx, p, FG_IMPL_FUSED, b, FG_DTYPE_BF16, rp, res,
                            FG_FILTER_EPS_AUTO);
    /* float32 gradients once, at the largest budget that runs. */
    size_t largest = 0;
    for (const Row &r : res.rows)
        if (r.kind == "fused" && r.ran)
            largest = std::max(largest, r.budget);
    if (largest && !o.lean)
        run_library_row(ctx, p, FG_IMPL_FUSED, largest, FG_DTYPE_F32, rp, res);
    if (!o.lean)
        run_library_row(ctx, p, FG_IMPL_MATERIALIZED, 0, FG_DTYPE_BF16, rp, res);
    if (f32)
        run_f32_section(ctx, o, p, res);
    problem_free(p);
    return res;
}

/* ---- the report ---------------------------------------------------------------------- */

static std::string json_str(const std::string &s)
{
    std::string r = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') {
            r += '\\';
            r += c;
        } else if ((unsigned char)c < 0x20) {
            char u[8];
            snprintf(u, sizeof u, "\\u%04x", (unsigned)c);
            r += u;
        } else {
            r += c;
        }
    }
    return r + "\"";
}

static std::string json_num(double x)
{
    if (!isfinite(x))
        return "null";
    char s[40];
    snprintf(s, sizeof s, "%.6g", x);
    return s;
}

static FILE *open_out(const std::string &path)
{
    FILE *f = fopen(path.c_str(), "w");
    if (!f) {
        printf("FAIL cannot write %s: %s\n", path.c_str(), strerror(errno));
        exit(1);
    }
    return f;
}

static void write_json(const std::string &path, const Options &o, const std::string &device,
                       const std::vector<ShapeResult> &shapes)
{
    FILE *f = open_out(path);
    fprintf(f, "{\n  \"command\": %s,\n  \"device\": %s,\n", json_str(o.command).c_str(),
            json_str(device).c_str());
    fprintf(f, "  \"warmups\": %d, \"reps\": %d, \"f32_warmups\": %d, \"f32_reps\": %d,\n",
            WARMUPS, o.reps, F32_WARMUPS, std::min(o.reps, F32_REPS));
    fprintf(f, "  \"timing\": \"host wall time per call, idle stream to return + "
               "cudaStreamSynchronize; median, min, max in ms\",\n");
    fprintf(f, "  \"loss\": \"dapo, epsilon 0.2 / 0.28, beta 0.04, old_logp and ref_logp, "
               "no bias; hidden and weight in each row's inputs dtype\",\n");
    fprintf(f, "  \"f32_inputs\": \"%s\",\n  \"shapes\": [\n",
            o.f32 ? "rows with inputs f32 at the first token count only: true float32 "
                    "products (CUBLAS_COMPUTE_32F, no TF32), f32 gradients, one budget; "
                    "their ratio_to_floor divides by f32_floor_ms"
                  : "skipped (--no-f32)");
    for (size_t s = 0; s < shapes.size(); s++) {
        const ShapeResult &sh = shapes[s];
        fprintf(f,
                "    {\"B\": %lld, \"T\": %lld, \"H\": %lld, \"V\": %lld, \"unmasked\": %lld, "
                "\"floor_ms\": %s, \"floor_unmasked_ms\": %s, \"f32_rows\": %s, "
                "\"f32_floor_ms\": %s, \"f32_floor_unmasked_ms\": %s,\n     \"rows\": [\n",
                (long long)sh.B, (long long)sh.T, (long long)sh.H, (long long)sh.V,
                (long long)sh.unmasked, json_num(sh.floor_ms).c_str(),
                json_num(sh.floor_active_ms).c_str(), sh.f32 ? "true" : "false",
                json_num(sh.f32_floor_ms > 0 ? sh.f32_floor_ms : NAN).c_str(),
                json_num(sh.f32_floor_active_ms > 0 ? sh.f32_floor_active_ms : NAN).c_str());
        for (size_t i = 0; i < sh.rows.size(); i++) {
            const Row &r = sh.rows[i];
            fprintf(f,
                    "      {\"kind\": %s, \"name\": %s, \"inputs\": %s, \"ran\": %s, "
                    "\"note\": %s, \"budget_bytes\": %zu, \"grads\": %s, \"median_ms\": %s, "
                    "\"min_ms\": %s, \"max_ms\": %s, \"ratio_to_floor\": %s, \"chunks\": %lld, "
                    "\"chunk_rows\": %lld, \"working_bytes\": %s, \"gemm_scratch_bytes\": %s, "
                    "\"grad_weight_sum_bytes\": %s, \"peak_bytes\": %s, "
                    "\"pool_peak_bytes\": %s, \"held_bytes\": %s, \"loss\": %s, "
                    "\"kept_fraction\": %s}%s\n",
                    json_str(r.kind).c_str(), json_str(r.name).c_str(),
                    json_str(r.inputs).c_str(), r.ran ? "true" : "false",
                    json_str(r.note).c_str(), r.budget,
                    json_str(r.grads).c_str(), json_num(r.ran ? r.t.median : NAN).c_str(),
                    json_num(r.ran ? r.t.min : NAN).c_str(),
                    json_num(r.ran ? r.t.max : NAN).c_str(),
                    json_num(r.ran && r.ratio > 0 ? r.ratio : NAN).c_str(), (long long)r.chunks,
                    (long long)r.chunk_rows, json_num(r.working).c_str(),
                    json_num(r.gemm_scratch).c_str(), json_num(r.gw_sum).c_str(),
                    json_num(r.peak).c_str(), json_num(r.pool_peak).c_str(),
                    json_num(r.held).c_str(), json_num(r.loss).c_str(),
                    json_num(r.ran ? r.kept : NAN).c_str(), i + 1 < sh.rows.size() ? "," : "");
        }
        fprintf(f, "    ]}%s\n", s + 1 < shapes.size() ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
    fclose(f);
}

/* The rows of one shape whose hidden and weight are `inputs`, as a table. */
static void table_rows(FILE *f, const ShapeResult &sh, const std::string &inputs)
{
    fprintf(f, "| row | grads | median ms | min | max | x %s floor | chunks x rows | "
               "working MiB (plan) | peak MiB | pool MiB | held MiB | loss | kept |\n",
            inputs.c_str());
    fprintf(f, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
               "| ---: | ---: |\n");
    for (const Row &r : sh.rows) {
        if (r.inputs != inputs)
            continue;
        if (!r.ran) {
            fprintf(f, "| %s | %s | skipped: %s | | | | | | | | | | |\n", r.name.c_str(),
                    r.grads.c_str(), r.note.c_str());
            continue;
        }
        fprintf(f, "| %s | %s | %.2f | %.2f | %.2f | %s |", r.name.c_str(), r.grads.c_str(),
                r.t.median, r.t.min, r.t.max,
                r.ratio > 0 ? (json_num(r.ratio) + "x").c_str() : "");
        if (r.kind == "floor")
            fprintf(f, " | | | | | | |\n");
        else
            fprintf(f, " %lld x %lld | %s | %s | %s | %s | %.6g | %s |\n", (long long)r.chunks,
                    (long long)r.chunk_rows, mib(r.working + r.gemm_scratch).c_str(),
                    mib(r.peak).c_str(), mib(r.pool_peak).c_str(), mib(r.held).c_str(),
                    r.loss, kept_str(r.kept).c_str());
    }
}

static void write_table(const std::string &path, const Options &o, const std::string &device,
                        const std::vector<ShapeResult> &shapes)
{
    FILE *f = open_out(path);
    fprintf(f, "# bench_cuda_api\n\n`%s`\n\nGPU: %s\n\n", o.command.c_str(), device.c_str());
    fprintf(f, "DAPO (epsilon 0.2 / 0.28, beta 0.04, old and reference log-probs), bf16 "
               "hidden and weight, no bias, ~90%% of the tokens unmasked; forward and backward "
               "to grad_hidden and grad_weight. Median of %d calls after %d warm-ups (min, max) "
               "in host wall time per call. The floor is the three bare cuBLASLt products at "
               "full shape with bf16 outputs (all N rows; the library multiplies the unmasked "
               "rows only). peak: fg_memory_stats.peak_bytes; pool: the device memory pool's "
               "high-water mark; held: cudaMemGetInfo's drop over the row; kept: the "
               "fraction of dlogits entries the backward products used (fg_memory_stats).\n",
            o.reps, WARMUPS);
    if (o.waits)
        fprintf(f, "\n'a wait a chunk' rows: the fused step at each budget with the finite "
                   "check off: the host checks each chunk's statistics before its products, "
                   "one wait a chunk, where the fused rows run their chunks with no host wait "
                   "between them (g and e from the backend's derivs op, every token checked "
                   "once after the chunks). Same products: the pair measures those waits, "
                   "less the fused rows' NaN/Inf scan of the inputs.\n");
    if (o.filter)
        fprintf(f, "\nfiltered rows: the fused step at each budget with gradient filtering at "
                   "its auto threshold (filter_eps = FG_FILTER_EPS_AUTO: 1e-5 for bf16): each "
                   "chunk's dropped dlogits entries zeroed on the device, the products dense "
                   "over them (docs/LOSS_SPEC.md \"Gradient filtering\"); a chunk some row of "
                   "which keeps over V/8 entries counts as all kept.\n");
    else
        fprintf(f, "\nfiltered rows: skipped (--no-filter).\n");
    if (o.f32)
        fprintf(f, "\nf32 inputs: at the first token count only (T = %lld; larger ones skip "
                   "them to save GPU time), the same hidden and weight draws unrounded in "
                   "float32. Products in true float32 (CUBLAS_COMPUTE_32F, no TF32) in the "
                   "library and in the f32 floor (the three bare products with f32 outputs, "
                   "which these rows' ratios divide by); f32 gradients; one budget (2 GiB, or "
                   "the largest given if smaller). Median of %d calls after %d warm-up: each "
                   "f32 product runs without tensor cores. Speed reported, no target.\n",
                (long long)o.tokens[0], std::min(o.reps, F32_REPS), F32_WARMUPS);
    else
        fprintf(f, "\nf32 inputs: skipped (--no-f32).\n");
    for (const ShapeResult &sh : shapes) {
        fprintf(f, "\n## B %lld, T %lld, H %lld, V %lld (%lld tokens unmasked)\n\n",
                (long long)sh.B, (long long)sh.T, (long long)sh.H, (long long)sh.V,
                (long long)sh.unmasked);
        table_rows(f, sh, "bf16");
        if (sh.f32) {
            fprintf(f, "\n### f32 inputs (no TF32)\n\n");
            table_rows(f, sh, "f32");
        }
    }
    fclose(f);
}

/* ---- main ------------------------------------------------------------------------------ */

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* every row reaches the log as it is measured */
    const Options o = parse_args(argc, argv);
#ifdef FG_CUDA_LIBRARY_PATH
    /* The backend built beside this program, unless the caller names one. */
    setenv("FUSEDGRPO_CUDA_LIBRARY", FG_CUDA_LIBRARY_PATH, 0);
#endif
    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices == 0) {
        (void)cudaGetLastError();
        printf("skipped: %s\n",
               err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA device is present");
        return 77;
    }
    if (mkdir(o.out.c_str(), 0755) != 0 && errno != EEXIST) {
        printf("FAIL cannot create %s: %s\n", o.out.c_str(), strerror(errno));
        return 1;
    }
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    int driver = 0, runtime = 0, pools = 0;
    CUDA_OK(cudaDriverGetVersion(&driver));
    CUDA_OK(cudaRuntimeGetVersion(&runtime));
    CUDA_OK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, 0));
    if (pools)
        CUDA_OK(cudaDeviceGetDefaultMemPool(&pool, 0));
    char device[768];
    snprintf(device, sizeof device, "%s (sm_%d%d, %d SMs, %.1f GiB; CUDA driver %d.%d, runtime %d.%d)",
             prop.name, prop.major, prop.minor, prop.multiProcessorCount,
             (double)prop.totalGlobalMem / GiB, driver / 1000, driver % 1000 / 10,
             runtime / 1000, runtime % 1000 / 10);
    printf("%s\ndevice: %s\n", o.command.c_str(), device);
    printf("timing: host wall time per call (idle stream to return + cudaStreamSynchronize), "
           "median of %d after %d warm-ups (f32 inputs: %d after %d)\n",
           o.reps, WARMUPS, std::min(o.reps, F32_REPS), F32_WARMUPS);

    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    fg_context_options co;
    fg_context_options_init(&co);
    co.backend = FG_BACKEND_CUDA;
    co.stream = stream;
    fg_context *ctx = NULL;
    const fg_status st = fg_context_create(&co, &ctx);
    if (st != FG_OK) {
        /* No context, so no fg_last_error: the status says it (a missing
         * libfusedgrpo_cuda.so: set FUSEDGRPO_CUDA_LIBRARY). */
        printf("FAIL fg_context_create(FG_BACKEND_CUDA): %s (FUSEDGRPO_CUDA_LIBRARY=%s)\n",
               fg_status_name(st),
               getenv("FUSEDGRPO_CUDA_LIBRARY") ? getenv("FUSEDGRPO_CUDA_LIBRARY") : "unset");
        return 1;
    }

    std::vector<ShapeResult> shapes;
    for (size_t i = 0; i < o.tokens.size(); i++)
        shapes.push_back(run_shape(ctx, o, o.tokens[i], o.f32 && i == 0));

    const std::string json = o.out + "/bench_api.json", txt = o.out + "/bench_api.txt";
    write_json(json, o, device, shapes);
    write_table(txt, o, device, shapes);
    printf("\nwrote %s and %s\n", json.c_str(), txt.c_str());
    fg_context_destroy(ctx);
    CUDA_OK(cudaStreamDestroy(stream));
    return 0;
}
