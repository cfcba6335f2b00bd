/*
 * logits_blocks_ab: what the logits product's fixed blocks cost, in one
 * process. The product C[M, V] = hidden[M, H] · Wᵀ runs through the library's
 * GEMM layer (src/backends/cpu/gemm_onednn.c) once per blocking per round, the blockings
 * taking turns, on 2 workers; prints each blocking's median [min, max] over
 * the rounds after a warm-up one, and its time over the first blocking's.
 *
 * A blocking is KIND:BMxBN[:kmajor|:ldN]:
 *   fixed  every primitive call one BM x BN block, rows past the last whole
 *          block zero-padded, C through a worker's tile (the library's
 *          logits product: fixed:144x1008, FG_BLOCK_LOGITS_M/N)
 *   free   BM-row blocks, the last one shorter, C written in place, blocks
 *          row by row (the product before the fixed blocks: free:504x1008)
 *   kmajor the weight stored [H, V] (B not transposed) instead of [V, H]
 *   ldN    the weight's rows N >= H floats apart instead of H (f32: the
 *          library reads an f32 weight in place, at the caller's stride)
 * V = 151936. The GFLOP/s column counts the M real rows only.
 *
 *   cmake --build build-nocuda
 *   cc -O2 -fopenmp -Isrc -Iinclude -o build/logits_blocks_ab bench/logits_blocks_ab.c \
 *       build-nocuda/libfusedgrpo.a -ldnnl -lm
 *   build/logits_blocks_ab 410 1024 f32 5 fixed:144x1008 free:504x1008
 *
 * `bash bench/run_benchmarks.sh logits_blocks` runs the shapes of
 * docs/BENCHMARKS.md ("Cost of the fixed-shape logits product").
 */
#define _GNU_SOURCE
#include "bf16.h"
#include "gemm_onednn.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define VOCAB 151936
#define MAX_BLOCKINGS 8
#define MAX_ROUNDS 64

static void *mapped(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    return p;
}

/* n small nonzero values ((i * prime) % 1000 - 500) / 1000, in f32 or bf16. */
static void fill(void *p, size_t n, int bf16, long prime)
{
    for (size_t i = 0; i < n; i++) {
        const float v = (float)((int)((i * (size_t)prime) % 1000) - 500) * 1e-3f;
        if (bf16)
            ((uint16_t *)p)[i] = fg_bf16_store(v);
        else
            ((float *)p)[i] = v;
    }
}

static int by_value(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc < 6 || argc - 5 > MAX_BLOCKINGS) {
        fprintf(stderr, "usage: logits_blocks_ab M H f32|bf16 ROUNDS KIND:BMxBN[:kmajor|:ldN]...\n");
        return 2;
    }
    const long M = atol(argv[1]), H = atol(argv[2]), rounds = atol(argv[4]);
    const int bf16 = strcmp(argv[3], "bf16") == 0, nb = argc - 5, workers = 2;
    if (M < 1 || H < 1 || rounds < 1 || rounds > MAX_ROUNDS) {
        fprintf(stderr, "logits_blocks_ab: bad sizes\n");
        return 2;
    }
    fg_gemm_cache *cache;
    fg_error err = {{0}};
    if (fg_gemm_cache_create(&cache) != FG_OK) {
        fprintf(stderr, "logits_blocks_ab: no oneDNN engine\n");
        return 1;
    }
    /* as the library passes them: hidden widened to f32 where bf16 is not native */
    const int a_bf16 = bf16 && fg_gemm_native_bf16(cache);
    const fg_dtype at = a_bf16 ? FG_DTYPE_BF16 : FG_DTYPE_F32, wt = bf16 ? FG_DTYPE_BF16 : FG_DTYPE_F32;
    const size_t ea = a_bf16 ? 2 : 4, ew = bf16 ? 2 : 4;
    const long ldw = H + 64; /* room for any ldN up to H + 64 */
    void *A = mapped((size_t)(M * H) * ea), *W = mapped((size_t)VOCAB * (size_t)ldw * ew),
         *C = mapped((size_t)M * VOCAB * ew);
    fill(A, (size_t)(M * H), a_bf16, 7919);
    fill(W, (size_t)VOCAB * (size_t)ldw, bf16, 7907);

    fg_gemm_shape shape[MAX_BLOCKINGS];
    void *scratch[MAX_BLOCKINGS];
    for (int b = 0; b < nb; b++) {
        char kind[16] = {0}, layout[16] = {0};
        long bm = 0, bn = 0;
        if (sscanf(argv[5 + b], "%15[a-z]:%ldx%ld:%15s", kind, &bm, &bn, layout) < 3 || bm < 1 ||
            bn < 1 || (strcmp(kind, "fixed") && strcmp(kind, "free")) ||
            (layout[0] && strcmp(layout, "kmajor") && strncmp(layout, "ld", 2))) {
            fprintf(stderr, "logits_blocks_ab: bad blocking %s\n", argv[5 + b]);
            return 2;
        }
        const int kmajor = strcmp(layout, "kmajor") == 0;
        const long ld = strncmp(layout, "ld", 2) == 0 ? atol(layout + 2) : H;
        if (ld < H || ld > ldw) {
            fprintf(stderr, "logits_blocks_ab: ldN wants H <= N <= H + 64\n");
            return 2;
        }
        shape[b] = (fg_gemm_shape){.M = M, .N = VOCAB, .K = H, .a_type = at, .b_type = wt,
                                   .c_type = wt, .a_rs = H, .a_cs = 1,
                                   .b_rs = kmajor ? VOCAB : 1, .b_cs = kmajor ? 1 : ld,
                                   .c_ld = VOCAB, .tile_bytes = FG_TILE_CAP_BYTES,
                                   .block_m = bm, .block_n = bn,
                                   .fixed_blocks = strcmp(kind, "fixed") == 0};
        fg_gemm_scratch need = {0, 0};
        if (fg_gemm_prepare(cache, &shape[b], workers, &need, &err) != FG_OK) {
            fprintf(stderr, "logits_blocks_ab: %s\n", err.msg);
            return 1;
        }
        scratch[b] = mapped(fg_gemm_scratch_bytes(&need, workers) + 64);
    }
    printf("M=%ld V=%d H=%ld %s (products in %s), %d workers, %ld rounds after a warm-up\n", M, VOCAB,
           H, argv[3], bf16 && !a_bf16 ? "f32 on converted weight tiles" : argv[3], workers,
           rounds);
    static double t[MAX_BLOCKINGS][MAX_ROUNDS];
    for (long r = 0; r <= rounds; r++)
        for (int b = 0; b < nb; b++) {
            const double t0 = omp_get_wtime();
            if (fg_gemm_run(cache, &shape[b], A, W, C, NULL, scratch[b], workers, NULL, &err) !=
                FG_OK) {
                fprintf(stderr, "logits_blocks_ab: %s\n", err.msg);
                return 1;
            }
            if (r > 0)
                t[b][r - 1] = omp_get_wtime() - t0;
        }
    double first = 0;
    for (int b = 0; b < nb; b++) {
        qsort(t[b], (size_t)rounds, sizeof(double), by_value);
        const double med = t[b][rounds / 2];
        first = b == 0 ? med : first;
        printf("  %-22s p50 %.3f [%.3f, %.3f] s  %6.1f GFLOP/s  / first %.3f\n", argv[5 + b], med,
               t[b][0], t[b][rounds - 1], 2.0 * (double)M * VOCAB * (double)H / med / 1e9,
               med / first);
    }
    fg_gemm_cache_destroy(cache);
    return 0;
}
