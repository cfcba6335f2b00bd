/*
 * gemm_probe: the three GEMM-sized products of one fused chunk of m token
 * rows, each timed alone through oneDNN's f32 matmul (best of 3), so that a
 * chunk size's GEMM efficiency can be seen product by product.
 *
 *   G1 logits[m,V]   = hbuf[m,H] · Wᵀ           (the forward)
 *   G2 gh[m,H]       = dlogits[m,V] · W[V,H]     (grad_hidden)
 *   G3 gW[V,H]      += dlogitsᵀ · hbuf           (grad_weight, accumulated)
 *
 * Build and run (docs/BENCHMARKS.md):
 *   cc -O2 -o /tmp/gemm_probe bench/gemm_probe.c -ldnnl
 *   OMP_NUM_THREADS=2 /tmp/gemm_probe 2048 151936 205 410
 * Needs 2·V·H·4 + m·(V + 2H)·4 bytes (about 2.9 GB at H=2048, m=410).
 */
#define _GNU_SOURCE
#include <oneapi/dnnl/dnnl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

static dnnl_engine_t engine;
static dnnl_stream_t stream;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Pre-faulted, filled with small nonzero values (zeros can run faster). */
static float *buffer(size_t floats)
{
    void *p = mmap(NULL, floats * 4, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    float *f = p;
    for (size_t i = 0; i < floats; i++)
        f[i] = 1e-3f * (float)((i * 2654435761u) % 17) - 8e-3f;
    return f;
}

/* C[M,N] (+)= A·B with explicit strides; returns the best of 3 timed runs. */
static double matmul(long M, long N, long K, long a_rs, long a_cs, long b_rs, long b_cs,
                     int accumulate, float *A, float *B, float *C)
{
    dnnl_memory_desc_t a, b, c;
    dnnl_dims_t ad = {M, K}, as = {a_rs, a_cs}, bd = {K, N}, bs = {b_rs, b_cs}, cd = {M, N},
                cs = {N, 1};
    dnnl_memory_desc_init_by_strides(&a, 2, ad, dnnl_f32, as);
    dnnl_memory_desc_init_by_strides(&b, 2, bd, dnnl_f32, bs);
    dnnl_memory_desc_init_by_strides(&c, 2, cd, dnnl_f32, cs);
    dnnl_matmul_desc_t md;
    dnnl_matmul_desc_init(&md, &a, &b, NULL, &c);
    dnnl_primitive_attr_t attr;
    dnnl_primitive_attr_create(&attr);
    dnnl_post_ops_t po = NULL;
    if (accumulate) {
        dnnl_post_ops_create(&po);
        dnnl_post_ops_append_sum(po, 1.0f);
        dnnl_primitive_attr_set_post_ops(attr, po);
    }
    dnnl_primitive_desc_t pd;
    if (dnnl_primitive_desc_create(&pd, &md, attr, engine, NULL) != dnnl_success) {
        fprintf(stderr, "oneDNN refused M=%ld N=%ld K=%ld\n", M, N, K);
        exit(1);
    }
    dnnl_primitive_t prim;
    dnnl_primitive_create(&prim, pd);
    dnnl_memory_t ma, mb, mc;
    dnnl_memory_create(&ma, &a, engine, A);
    dnnl_memory_create(&mb, &b, engine, B);
    dnnl_memory_create(&mc, &c, engine, C);
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}};
    double best = 1e30;
    for (int r = 0; r < 4; r++) { /* the first run is a warm-up */
        double t = now();
        dnnl_primitive_execute(prim, stream, 3, args);
        dnnl_stream_wait(stream);
        t = now() - t;
        if (r > 0 && t < best)
            best = t;
    }
    dnnl_memory_destroy(ma);
    dnnl_memory_destroy(mb);
    dnnl_memory_destroy(mc);
    dnnl_primitive_destroy(prim);
    dnnl_primitive_desc_destroy(pd);
    dnnl_primitive_attr_destroy(attr);
    if (po)
        dnnl_post_ops_destroy(po);
    return best;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s H V m [m ...]\n", argv[0]);
        return 2;
    }
    const long H = atol(argv[1]), V = atol(argv[2]);
    long mmax = 0;
    for (int i = 3; i < argc; i++)
        mmax = atol(argv[i]) > mmax ? atol(argv[i]) : mmax;
    dnnl_engine_create(&engine, dnnl_cpu, 0);
    dnnl_stream_create(&stream, engine, dnnl_stream_default_flags);
    float *W = buffer((size_t)V * H), *gW = buffer((size_t)V * H);
    float *hbuf = buffer((size_t)mmax * H), *dl = buffer((size_t)mmax * V);
    float *gh = buffer((size_t)mmax * H);
    printf("%6s %14s %14s %14s %12s\n", "m", "G1 GFLOP/s", "G2 GFLOP/s", "G3 GFLOP/s", "ms/token");
    for (int i = 3; i < argc; i++) {
        const long m = atol(argv[i]);
        const double flop = 2.0 * (double)m * (double)H * (double)V;
        double t1 = matmul(m, V, H, H, 1, 1, H, 0, hbuf, W, dl);
        double t2 = matmul(m, H, V, V, 1, H, 1, 0, dl, W, gh);
        double t3 = matmul(V, H, m, 1, V, H, 1, 1, dl, hbuf, gW);
        printf("%6ld %14.1f %14.1f %14.1f %12.2f\n", m, flop / t1 / 1e9, flop / t2 / 1e9,
               flop / t3 / 1e9, (t1 + t2 + t3) / (double)m * 1e3);
    }
    return 0;
}
