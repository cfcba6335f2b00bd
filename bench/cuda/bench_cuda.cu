/* The GPU benchmark of the pieces of a fused step, at one shape (default the
 * headline: N = 8192 tokens, H = 4096, V = 151936, bf16):
 *
 *   (a) floor    the three bare cuBLASLt products at full shape, bf16 outputs
 *                (as torch.mm runs them): the step time to compare against;
 *   (b) chunked  the same products in chunks of M rows: logits f32 out,
 *                grad_weight summed over the chunks in a float32 buffer;
 *   (c) rows     the row statistics and the dlogits kernels alone on an
 *                [M, V] chunk, against the memory roofline;
 *   (d) step     a whole chunked step as the fused schedule runs it:
 *                GEMM 1 → row stats → g, e (a trivial kernel standing in for
 *                the loss math) → dlogits (bf16) → GEMM 2 → GEMM 3, then
 *                grad_weight rounded to bf16; with its working memory; once
 *                with the row check read after every chunk, once with the
 *                logits chunk in bf16 instead of f32.
 *
 * Every time is the median of REPS runs after WARMUPS, with min and max,
 * measured with CUDA events on one stream. Prints a table; writes JSON.
 *
 * usage: bench_cuda OUT.json [N]   (exit 77 without a CUDA device) */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include "gemm_cublaslt.h"
#include "row_stats.h"

#define WARMUPS 2
#define REPS 7

#include "cuda_ok.h"

static char msg[512];

/* A status from the library under test: the bench stops on any failure. */
static void must(fg_status st)
{
    if (st != FG_OK) {
        fprintf(stderr, "bench_cuda: status %d: %s\n", (int)st, msg);
        exit(1);
    }
}

static const int64_t H = 4096, V = 151936;
static int64_t N = 8192;

static cudaStream_t stream;
static double bandwidth_spec, bandwidth_copy; /* bytes/s */

/* ---- device helpers ------------------------------------------------------------ */

static void *dev_alloc(size_t bytes)
{
    void *p;
    CUDA_OK(cudaMalloc(&p, bytes));
    return p;
}

/* x[i] = scale · uniform(-1, 1) from a hash of (seed, i). */
__global__ void fill_bf16_kernel(__nv_bfloat16 *x, int64_t n, uint32_t seed, float scale)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 0x9e3779b1u ^ seed;
        h ^= h >> 16;
        h *= 0x7feb352du;
        h ^= h >> 15;
        h *= 0x846ca68bu;
        h ^= h >> 16;
        x[i] = __float2bfloat16_rn(scale * ((float)(h >> 8) * 0x1p-23f - 1.0f));
    }
}

__global__ void tokens_kernel(int64_t *tokens, int64_t n, int64_t V_)
{
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        tokens[i] = (i * 7919) % V_;
}

/* Stands in for the loss math: g = dL/dlogp, e = dL/dentropy of each row
 * (the mean of −logp with an entropy bonus). */
__global__ void loss_grads_kernel(const float *logp, int64_t M, float inv_n, float *g, float *e)
{
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r < M) {
        g[r] = isfinite(logp[r]) ? -inv_n : 0.0f;
        e[r] = -0.01f * inv_n;
    }
}

__global__ void round_bf16_kernel(const float *src, __nv_bfloat16 *dst, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

static void *random_bf16(int64_t n, uint32_t seed, float scale)
{
    __nv_bfloat16 *p = (__nv_bfloat16 *)dev_alloc((size_t)n * 2);
    fill_bf16_kernel<<<4096, 256, 0, stream>>>(p, n, seed, scale);
    CUDA_OK(cudaGetLastError());
    return p;
}

/* ---- timing and the report ---------------------------------------------------------- */

struct Timing {
    double median, min, max; /* ms */
};

template <typename F> static Timing time_it(F enqueue)
{
    cudaEvent_t start, stop;
    CUDA_OK(cudaEventCreate(&start));
    CUDA_OK(cudaEventCreate(&stop));
    for (int i = 0; i < WARMUPS; i++)
        enqueue();
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<double> ms;
    for (int i = 0; i < REPS; i++) {
        CUDA_OK(cudaEventRecord(start, stream));
        enqueue();
        CUDA_OK(cudaEventRecord(stop, stream));
        CUDA_OK(cudaEventSynchronize(stop));
        float t;
        CUDA_OK(cudaEventElapsedTime(&t, start, stop));
        ms.push_back(t);
    }
    CUDA_OK(cudaEventDestroy(start));
    CUDA_OK(cudaEventDestroy(stop));
    std::sort(ms.begin(), ms.end());
    return Timing{ms[ms.size() / 2], ms.front(), ms.back()};
}

struct Row {
    std::string section, name;
    int64_t M;
    Timing t;
    double flops, bytes, memory; /* 0 where not meaningful */
};
static std::vector<Row> rows;
static double floor_ms; /* (a)'s three products */

static void report(const char *section, const char *name, int64_t M, Timing t, double flops,
                   double bytes, double memory)
{
    rows.push_back(Row{section, name, M, t, flops, bytes, memory});
    printf("%-8s %-46s %6lld %9.3f %9.3f %9.3f", section, name, (long long)M, t.median, t.min,
           t.max);
    if (flops > 0)
        printf("  %6.0f TFLOP/s", flops / (t.median * 1e-3) / 1e12);
    if (bytes > 0)
        printf("  %6.0f GB/s = %3.0f%% of spec, %3.0f%% of copy",
               bytes / (t.median * 1e-3) / 1e9, 100 * bytes / (t.median * 1e-3) / bandwidth_spec,
               100 * bytes / (t.median * 1e-3) / bandwidth_copy);
    if (memory > 0)
        printf("  %.2f GiB", memory / (1 << 30));
    if (floor_ms > 0 && !strcmp(section, "step"))
        printf("  %.3fx floor", t.median / floor_ms);
    printf("\n");
}

static void write_json(const char *path, const cudaDeviceProp &prop)
{
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "bench_cuda: cannot write %s\n", path);
        exit(1);
    }
    fprintf(f, "{\n  \"device\": \"%s\",\n  \"N\": %lld, \"H\": %lld, \"V\": %lld,\n", prop.name,
            (long long)N, (long long)H, (long long)V);
    fprintf(f, "  \"warmups\": %d, \"reps\": %d,\n", WARMUPS, REPS);
    fprintf(f, "  \"bandwidth_spec_GBps\": %.1f, \"bandwidth_copy_GBps\": %.1f,\n",
            bandwidth_spec / 1e9, bandwidth_copy / 1e9);
    fprintf(f, "  \"floor_ms\": %.4f,\n  \"rows\": [\n", floor_ms);
    for (size_t i = 0; i < rows.size(); i++) {
        const Row &r = rows[i];
        fprintf(f,
                "    {\"section\": \"%s\", \"name\": \"%s\", \"M\": %lld, \"median_ms\": %.4f, "
                "\"min_ms\": %.4f, \"max_ms\": %.4f, \"flops\": %.6g, \"bytes\": %.6g, "
                "\"memory_bytes\": %.6g}%s\n",
                r.section.c_str(), r.name.c_str(), (long long)r.M, r.t.median, r.t.min, r.t.max,
                r.flops, r.bytes, r.memory, i + 1 < rows.size() ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
    fclose(f);
}

/* ---- the sections ----------------------------------------------------------------- */

static const fg_dtype BF16 = FG_DTYPE_BF16, F32 = FG_DTYPE_F32;

/* Device-to-device copy bandwidth: the roofline a kernel can reach. */
static void measure_copy_bandwidth(void)
{
    const size_t bytes = (size_t)2 << 30;
    void *a = dev_alloc(bytes), *b = dev_alloc(bytes);
    const Timing t = time_it([&] {
        CUDA_OK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream));
    });
    bandwidth_copy = 2.0 * (double)bytes / (t.median * 1e-3);
    CUDA_OK(cudaFree(a));
    CUDA_OK(cudaFree(b));
}

static void section_floor(const fg_cuda_gemm *g, const void *h, const void *w)
{
    /* The logits double as dlogits: the products' speed does not depend on
     * what the values mean. */
    void *z = dev_alloc((size_t)N * V * 2), *gh = dev_alloc((size_t)N * H * 2),
         *gw = dev_alloc((size_t)V * H * 2);
    fill_bf16_kernel<<<4096, 256, 0, stream>>>((__nv_bfloat16 *)z, N * V, 99, 0.01f);
    const double flops = 2.0 * N * V * H;
    const Timing t1 = time_it([&] {
        must(fg_cuda_gemm_logits(g, BF16, N, V, H, h, H, w, H, z, BF16, V, msg, sizeof msg));
    });
    const Timing t2 = time_it([&] {
        must(fg_cuda_gemm_grad_hidden(g, BF16, N, V, H, z, V, w, H, gh, BF16, H, 0.0f, msg,
                                      sizeof msg));
    });
    const Timing t3 = time_it([&] {
        must(fg_cuda_gemm_grad_weight(g, BF16, N, V, H, z, V, h, H, gw, BF16, H, 0.0f, msg,
                                      sizeof msg));
    });
    const Timing all = time_it([&] {
        must(fg_cuda_gemm_logits(g, BF16, N, V, H, h, H, w, H, z, BF16, V, msg, sizeof msg));
        must(fg_cuda_gemm_grad_hidden(g, BF16, N, V, H, z, V, w, H, gh, BF16, H, 0.0f, msg,
                                      sizeof msg));
        must(fg_cuda_gemm_grad_weight(g, BF16, N, V, H, z, V, h, H, gw, BF16, H, 0.0f, msg,
                                      sizeof msg));
    });
    report("floor", "GEMM 1 logits (bf16 out)", N, t1, flops, 0, 0);
    report("floor", "GEMM 2 grad_hidden (bf16 out)", N, t2, flops, 0, 0);
    report("floor", "GEMM 3 grad_weight (bf16 out)", N, t3, flops, 0, 0);
    report("floor", "three products", N, all, 3 * flops, 0, 0);
    floor_ms = all.median;
    CUDA_OK(cudaFree(z));
    CUDA_OK(cudaFree(gh));
    CUDA_OK(cudaFree(gw));
}

static void section_chunked(const fg_cuda_gemm *g, const void *h, const void *w, int64_t M)
{
    void *z = dev_alloc((size_t)M * V * 4), *d = dev_alloc((size_t)M * V * 2);
    void *gh = dev_alloc((size_t)N * H * 2), *gw = dev_alloc((size_t)V * H * 4);
    fill_bf16_kernel<<<4096, 256, 0, stream>>>((__nv_bfloat16 *)d, M * V, 98, 0.01f);
    const Timing t = time_it([&] {
        for (int64_t r0 = 0; r0 < N; r0 += M) {
            const int64_t m = std::min(M, N - r0);
            const void *hc = (const __nv_bfloat16 *)h + r0 * H;
            must(fg_cuda_gemm_logits(g, BF16, m, V, H, hc, H, w, H, z, F32, V, msg, sizeof msg));
            must(fg_cuda_gemm_grad_hidden(g, BF16, m, V, H, d, V, w, H,
                                          (__nv_bfloat16 *)gh + r0 * H, BF16, H, 0.0f, msg,
                                          sizeof msg));
            must(fg_cuda_gemm_grad_weight(g, BF16, m, V, H, d, V, hc, H, gw, F32, H,
                                          r0 == 0 ? 0.0f : 1.0f, msg, sizeof msg));
        }
    });
    char name[96];
    snprintf(name, sizeof name, "three products, %lld chunks", (long long)((N + M - 1) / M));
    report("chunked", name, M, t, 6.0 * N * V * H, 0, 0);
    CUDA_OK(cudaFree(z));
    CUDA_OK(cudaFree(d));
    CUDA_OK(cudaFree(gh));
    CUDA_OK(cudaFree(gw));
}

/* Per-row buffers of a chunk of M rows. */
struct RowBuffers {
    float *buf, *g, *e;
    fg_cuda_row_stats st;
    fg_cuda_row_check *check;
    int64_t *tokens;
};

static RowBuffers row_buffers(int64_t M)
{
    RowBuffers b;
    b.buf = (float *)dev_alloc((size_t)M * 6 * sizeof(float));
    b.st = {b.buf, b.buf + M, b.buf + 2 * M, b.buf + 3 * M};
    b.g = b.buf + 4 * M;
    b.e = b.buf + 5 * M;
    b.check = (fg_cuda_row_check *)dev_alloc(sizeof *b.check);
    b.tokens = (int64_t *)dev_alloc((size_t)M * sizeof(int64_t));
    tokens_kernel<<<(unsigned)((M + 255) / 256), 256, 0, stream>>>(b.tokens, M, V);
    CUDA_OK(cudaGetLastError());
    must(fg_cuda_row_check_reset(b.check, stream, msg, sizeof msg));
    return b;
}

static void row_buffers_free(RowBuffers &b)
{
    CUDA_OK(cudaFree(b.buf));
    CUDA_OK(cudaFree(b.check));
    CUDA_OK(cudaFree(b.tokens));
}

static void section_rows(int64_t M, fg_dtype ztype, bool bias)
{
    const size_t zs = ztype == BF16 ? 2 : 4;
    void *z = dev_alloc((size_t)M * V * zs), *d = dev_alloc((size_t)M * V * 2);
    float *bias_sum = bias ? (float *)dev_alloc((size_t)V * 4) : NULL;
    if (ztype == BF16) {
        fill_bf16_kernel<<<4096, 256, 0, stream>>>((__nv_bfloat16 *)z, M * V, 97, 4.0f);
    } else { /* f32 logits: twice the bf16 values; each float's high half is one in [-4, 4] */
        fill_bf16_kernel<<<4096, 256, 0, stream>>>((__nv_bfloat16 *)z, 2 * M * V, 97, 4.0f);
    }
    RowBuffers b = row_buffers(M);
    must(fg_cuda_row_stats_forward(z, ztype, M, V, V, 1.0f, b.tokens, b.st, b.check, stream, msg,
                                   sizeof msg));
    loss_grads_kernel<<<(unsigned)((M + 255) / 256), 256, 0, stream>>>(b.st.logp, M, 1.0f / M,
                                                                       b.g, b.e);
    const Timing tf = time_it([&] {
        must(fg_cuda_row_stats_forward(z, ztype, M, V, V, 1.0f, b.tokens, b.st, b.check, stream,
                                       msg, sizeof msg));
    });
    const Timing tb = time_it([&] {
        must(fg_cuda_row_backward(z, ztype, V, d, BF16, V, M, V, 1.0f, b.tokens, b.st, b.g, b.e,
                                  bias_sum, stream, msg, sizeof msg));
    });
    char name[96];
    const char *zn = ztype == BF16 ? "bf16" : "f32";
    const double mv = (double)M * V;
    snprintf(name, sizeof name, "stats forward, %s logits", zn);
    report("rows", name, M, tf, 0, mv * zs, 0);
    snprintf(name, sizeof name, "dlogits bf16 from %s logits%s", zn, bias ? ", bias sums" : "");
    /* The bias sums read the stored dlogits once more, rows in order. */
    report("rows", name, M, tb, 0, mv * (zs + 2 + (bias ? 2 : 0)), 0);
    if (bias)
        CUDA_OK(cudaFree(bias_sum));
    row_buffers_free(b);
    CUDA_OK(cudaFree(z));
    CUDA_OK(cudaFree(d));
}

/* A whole step in chunks of M rows, the logits chunk in ztype; with
 * check_each_chunk the host reads the row check after each chunk's
 * statistics (the refusal of bad rows before anything of that chunk is
 * written), which costs a synchronization. */
static void section_step(const fg_cuda_gemm *g, const void *h, const void *w, int64_t M,
                         fg_dtype ztype, bool check_each_chunk)
{
    const size_t z_bytes = (size_t)M * V * (ztype == BF16 ? 2 : 4), d_bytes = (size_t)M * V * 2;
    const size_t gw32_bytes = (size_t)V * H * 4;
    void *z = dev_alloc(z_bytes), *d = dev_alloc(d_bytes), *gw32 = dev_alloc(gw32_bytes);
    void *gh = dev_alloc((size_t)N * H * 2), *gw = dev_alloc((size_t)V * H * 2);
    RowBuffers b = row_buffers(M); /* the tokens of every chunk: the pattern repeats */
    const float inv_n = 1.0f / (float)N;
    const Timing t = time_it([&] {
        for (int64_t r0 = 0; r0 < N; r0 += M) {
            const int64_t m = std::min(M, N - r0);
            const void *hc = (const __nv_bfloat16 *)h + r0 * H;
            must(fg_cuda_gemm_logits(g, BF16, m, V, H, hc, H, w, H, z, ztype, V, msg,
                                     sizeof msg));
            must(fg_cuda_row_stats_forward(z, ztype, m, V, V, 1.0f, b.tokens, b.st, b.check,
                                           stream, msg, sizeof msg));
            if (check_each_chunk)
                must(fg_cuda_row_check_status(b.check, r0, stream, msg, sizeof msg));
            loss_grads_kernel<<<(unsigned)((m + 255) / 256), 256, 0, stream>>>(b.st.logp, m, inv_n,
                                                                               b.g, b.e);
            must(fg_cuda_row_backward(z, ztype, V, d, BF16, V, m, V, 1.0f, b.tokens, b.st, b.g,
                                      b.e, NULL, stream, msg, sizeof msg));
            must(fg_cuda_gemm_grad_hidden(g, BF16, m, V, H, d, V, w, H,
                                          (__nv_bfloat16 *)gh + r0 * H, BF16, H, 0.0f, msg,
                                          sizeof msg));
            must(fg_cuda_gemm_grad_weight(g, BF16, m, V, H, d, V, hc, H, gw32, F32, H,
                                          r0 == 0 ? 0.0f : 1.0f, msg, sizeof msg));
        }
        round_bf16_kernel<<<4096, 256, 0, stream>>>((const float *)gw32, (__nv_bfloat16 *)gw,
                                                    V * H);
    });
    CUDA_OK(cudaGetLastError());
    must(fg_cuda_row_check_status(b.check, 0, stream, msg, sizeof msg));
    /* Working memory: everything beyond the inputs and the bf16 outputs. */
    const double working = (double)(z_bytes + d_bytes + gw32_bytes + (size_t)M * 32 +
                                    g->workspace_bytes);
    char name[96];
    snprintf(name, sizeof name, "fused, %lld chunks, %s logits%s", (long long)((N + M - 1) / M),
             ztype == BF16 ? "bf16" : "f32", check_each_chunk ? ", check per chunk" : "");
    report("step", name, M, t, 6.0 * N * V * H, 0, working);
    row_buffers_free(b);
    for (void *p : {z, d, gw32, gh, gw})
        CUDA_OK(cudaFree(p));
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* every row reaches the log as it is measured */
    if (argc < 2 || argc > 3 || (argc == 3 && (N = atoll(argv[2])) <= 0)) {
        fprintf(stderr, "usage: bench_cuda OUT.json [N tokens, default 8192]\n");
        return 2;
    }
    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices == 0) {
        printf("skipped: %s\n", err != cudaSuccess ? cudaGetErrorString(err)
                                                   : "no CUDA device is present");
        return 77;
    }
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    int mem_clock_khz = 0, bus_bits = 0;
    CUDA_OK(cudaDeviceGetAttribute(&mem_clock_khz, cudaDevAttrMemoryClockRate, 0));
    CUDA_OK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0));
    bandwidth_spec = 2.0 * mem_clock_khz * 1e3 * bus_bits / 8; /* double data rate */
    CUDA_OK(cudaStreamCreate(&stream));
    measure_copy_bandwidth();
    printf("device: %s, %d SMs, %.1f GiB; memory bandwidth %.0f GB/s (spec), %.0f GB/s (copy)\n",
           prop.name, prop.multiProcessorCount, (double)prop.totalGlobalMem / (1 << 30),
           bandwidth_spec / 1e9, bandwidth_copy / 1e9);
    printf("shape: N %lld, H %lld, V %lld, bf16 inputs; median of %d after %d warm-ups\n\n",
           (long long)N, (long long)H, (long long)V, REPS, WARMUPS);
    printf("%-8s %-46s %6s %9s %9s %9s\n", "section", "what", "M", "median", "min", "max");

    cublasLtHandle_t lt;
    if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "bench_cuda: cublasLtCreate failed\n");
        return 1;
    }
    fg_cuda_gemm g = {lt, stream, NULL, fg_cuda_gemm_workspace_hint()};
    g.workspace = dev_alloc(g.workspace_bytes);
    /* h ~ U(-1, 1), W ~ U(-0.05, 0.05): logits of about unit size. */
    void *h = random_bf16(N * H, 1, 1.0f), *w = random_bf16(V * H, 2, 0.05f);

    section_floor(&g, h, w);
    const int64_t chunks[] = {8192, 4096, 2048, 1024, 512};
    for (int64_t M : chunks)
        if (M <= N)
            section_chunked(&g, h, w, M);
    section_rows(std::min<int64_t>(N, 4096), F32, false);
    section_rows(std::min<int64_t>(N, 4096), BF16, false);
    section_rows(std::min<int64_t>(N, 4096), BF16, true);
    section_rows(std::min<int64_t>(N, 1024), F32, false);
    for (int64_t M : chunks)
        if (M <= N && M >= 1024)
            section_step(&g, h, w, M, F32, false);
    section_step(&g, h, w, std::min<int64_t>(N, 2048), F32, true);
    section_step(&g, h, w, std::min<int64_t>(N, 4096), BF16, false);

    write_json(argv[1], prop);
    printf("\nwrote %s\n", argv[1]);
    CUDA_OK(cudaFree(h));
    CUDA_OK(cudaFree(w));
    CUDA_OK(cudaFree(g.workspace));
    cublasLtDestroy(lt);
    CUDA_OK(cudaStreamDestroy(stream));
    return 0;
}
