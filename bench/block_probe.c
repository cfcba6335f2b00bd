/*
 * block_probe: one grad_hidden-shaped block, C[M,N] = A[M,K] · B[K,N] with A
 * row-major and B's rows ldb floats apart (W's rows, N <= ldb columns of
 * them), through oneDNN's f32 matmul on one thread, best of 3: whether oneDNN
 * runs that block with its packed or its no-copy kernels shows as a 2x rate
 * (docs/BENCHMARKS.md, "Tried and dropped"; src/backends/cpu/gemm_onednn.h, fg_gemm_fast_rows).
 * `bash bench/run_benchmarks.sh blocks` runs the blocks the library's shapes rest on.
 * With a fifth argument `t`, a logits-shaped block instead: B = Wᵀ, B's
 * columns ldb floats apart (N weight rows of K = H floats, ldb >= K).
 *
 *   cc -O2 -o build/block_probe bench/block_probe.c -ldnnl
 *   for mn in "410 256" "410 1024" "512 576"; do
 *       OMP_NUM_THREADS=1 build/block_probe $mn 37984 1024; done
 *   OMP_NUM_THREADS=1 build/block_probe 342 1008 2048 2048 t
 */
#define _GNU_SOURCE
#include "probe_buffer.h"

#include <oneapi/dnnl/dnnl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc != 5 && !(argc == 6 && argv[5][0] == 't')) {
        fprintf(stderr, "usage: block_probe M N K ldb [t]   (ldb >= N; with t, B transposed and ldb >= K)\n");
        return 2;
    }
    const long M = atol(argv[1]), N = atol(argv[2]), K = atol(argv[3]), ldb = atol(argv[4]);
    const int tb = argc == 6;
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    if (M < 1 || N < 1 || K < 1 || ldb < (tb ? K : N) || dnnl_engine_create(&engine, dnnl_cpu, 0) ||
        dnnl_stream_create(&stream, engine, dnnl_stream_default_flags)) {
        fprintf(stderr, "block_probe: bad sizes or no oneDNN engine\n");
        return 2;
    }
    float *A = probe_buffer((size_t)(M * K), 1e-3f), *B = probe_buffer((size_t)((tb ? N : K) * ldb), 1e-3f),
          *C = probe_buffer((size_t)(M * N), 1e-3f);
    dnnl_memory_desc_t a, b, c;
    dnnl_dims_t ad = {M, K}, as = {K, 1}, bd = {K, N}, bs = {tb ? 1 : ldb, tb ? ldb : 1}, cd = {M, N}, cs = {N, 1};
    dnnl_matmul_desc_t md;
    dnnl_primitive_desc_t pd;
    dnnl_primitive_t prim;
    dnnl_memory_t ma, mb, mc;
    if (dnnl_memory_desc_init_by_strides(&a, 2, ad, dnnl_f32, as) ||
        dnnl_memory_desc_init_by_strides(&b, 2, bd, dnnl_f32, bs) ||
        dnnl_memory_desc_init_by_strides(&c, 2, cd, dnnl_f32, cs) || dnnl_matmul_desc_init(&md, &a, &b, NULL, &c) ||
        dnnl_primitive_desc_create(&pd, &md, NULL, engine, NULL) || dnnl_primitive_create(&prim, pd) ||
        dnnl_memory_create(&ma, &a, engine, A) || dnnl_memory_create(&mb, &b, engine, B) ||
        dnnl_memory_create(&mc, &c, engine, C)) {
        fprintf(stderr, "block_probe: oneDNN refused the product\n");
        return 1;
    }
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}};
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        const double t0 = now();
        if (dnnl_primitive_execute(prim, stream, 3, args) || dnnl_stream_wait(stream))
            return 1;
        const double t = now() - t0;
        best = t < best ? t : best;
    }
    printf("M=%ld N=%ld K=%ld ldb=%ld%s: %.1f GFLOP/s (1/M + 1/N = %.5f)\n", M, N, K, ldb, tb ? " Bt" : "",
           2.0 * (double)M * (double)N * (double)K / best / 1e9, 1.0 / (double)M + 1.0 / (double)N);
    return 0;
}
