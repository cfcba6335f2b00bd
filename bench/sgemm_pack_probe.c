/*
 * sgemm_pack_probe: could the logits product keep its fixed 144-row blocks
 * and still run oneDNN's packed kernels on AVX2, by packing each 1008-row
 * weight block once and running the chunk's 144-row blocks against it?
 * One thread, C[M, N] = hidden[M, H] · W[N, H]ᵀ over N / 1008 weight blocks,
 * each way in turn, 5 rounds after a warm-up, median [min, max] s:
 *   sgemm 144    dnnl_sgemm per 144 x 1008 block (the library's blocks: no-copy
 *                kernels, 1/144 + 1/1008 >= 0.0038)
 *   sgemm whole  dnnl_sgemm per M x 1008 block (packed kernels from 357 rows)
 *   pack A + 144 the weight block packed once as oneDNN's A operand
 *                (sgemm_pack), then sgemm_compute per 144-row block against it
 *   pack B + 144 the same with the roles swapped: Cᵀ = hidden_blk · W_blkᵀ,
 *                the weight block packed as the B operand (Cᵀ to a scratch
 *                block: its time only)
 * sgemm_pack and sgemm_compute are oneDNN's own (src/cpu/gemm/gemm_pack.hpp,
 * exported from libdnnl.so 2.6 but in no public header), declared here by
 * their C++ symbol names: a probe, not something the library may rest on.
 * M must be a multiple of 144.
 *
 *   cc -O2 -fopenmp -o build/sgemm_pack_probe bench/sgemm_pack_probe.c -ldnnl
 *   build/sgemm_pack_probe 432 1024 30240
 */
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t dim_t;

/* dnnl::impl::cpu::sgemm_pack_get_size, sgemm_pack, sgemm_compute (Fortran
 * order: C[m x n] = op(A)[m x k] · op(B)[k x n], column-major) */
dnnl_status_t _ZN4dnnl4impl3cpu19sgemm_pack_get_sizeEPKcS3_S3_PKlS5_S5_S5_S5_PmPb(
    const char *id, const char *ta, const char *tb, const dim_t *m, const dim_t *n,
    const dim_t *k, const dim_t *lda, const dim_t *ldb, size_t *size, bool *pack);
dnnl_status_t _ZN4dnnl4impl3cpu10sgemm_packEPKcS3_S3_PKlS5_S5_S5_S5_PKfPf(
    const char *id, const char *ta, const char *tb, const dim_t *m, const dim_t *n,
    const dim_t *k, const dim_t *lda, const dim_t *ldb, const float *src, float *dst);
dnnl_status_t _ZN4dnnl4impl3cpu13sgemm_computeEPKcS3_PKlS5_S5_PKfS5_S7_S5_S7_PfS5_(
    const char *ta, const char *tb, const dim_t *m, const dim_t *n, const dim_t *k,
    const float *a, const dim_t *lda, const float *b, const dim_t *ldb, const float *beta,
    float *c, const dim_t *ldc);
#define pack_get_size _ZN4dnnl4impl3cpu19sgemm_pack_get_sizeEPKcS3_S3_PKlS5_S5_S5_S5_PmPb
#define pack_block _ZN4dnnl4impl3cpu10sgemm_packEPKcS3_S3_PKlS5_S5_S5_S5_PKfPf
#define packed_compute _ZN4dnnl4impl3cpu13sgemm_computeEPKcS3_PKlS5_S5_PKfS5_S7_S5_S7_PfS5_

#define BM 144
#define BN 1008
#define ROUNDS 5

static int by_value(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void report(const char *name, double *t, double first_p50, double flops)
{
    qsort(t, ROUNDS, sizeof *t, by_value);
    printf("  %-13s p50 %.3f [%.3f, %.3f] s  %6.1f GFLOP/s  / first %.3f\n", name, t[ROUNDS / 2],
           t[0], t[ROUNDS - 1], flops / t[ROUNDS / 2] * 1e-9,
           first_p50 > 0 ? t[ROUNDS / 2] / first_p50 : 1.0);
}

int main(int argc, char **argv)
{
    if (argc != 4 || atol(argv[1]) % BM || atol(argv[3]) % BN) {
        fprintf(stderr, "usage: sgemm_pack_probe M H N   (M a multiple of 144, N of 1008)\n");
        return 2;
    }
    const dim_t M = atol(argv[1]), H = atol(argv[2]), N = atol(argv[3]), nblocks = N / BN;
    float *W = malloc(sizeof(float) * (size_t)(N * H)), *h = malloc(sizeof(float) * (size_t)(M * H));
    float *c_sgemm = calloc((size_t)(M * N), sizeof(float)), *c_pack = calloc((size_t)(M * N), sizeof(float));
    if (!W || !h || !c_sgemm || !c_pack)
        return 1;
    for (dim_t i = 0; i < N * H; i++)
        W[i] = (float)((int)((i * 7919) % 1000) - 500) * 1e-3f;
    for (dim_t i = 0; i < M * H; i++)
        h[i] = (float)((int)((i * 104729) % 1000) - 500) * 1e-3f;
    omp_set_num_threads(1);
    /* Column-major view of one block: C_cm[1008 x 144] = W_blk (stored [1008, H]:
     * transposed, lda H) · hidden_blkᵀ (stored [144, H]: not transposed, ldb H). */
    const dim_t m = BN, n = BM, k = H, lda = H, ldb = H, ldc = N;
    size_t packed_bytes = 0;
    bool packs = false;
    if (pack_get_size("A", "T", "N", &m, &n, &k, &lda, &ldb, &packed_bytes, &packs) != dnnl_success)
        return 1;
    /* Swapped: C_cm[144 x 1008] = hidden_blk (stored [144, H]: transposed, lda H)
     * · W_blkᵀ (stored [1008, H]: K x 1008 column-major, not transposed, ldb H). */
    const dim_t m2 = BM, n2 = BN, ldc2 = BM;
    size_t packed_b_bytes = 0;
    if (pack_get_size("B", "T", "N", &m2, &n2, &k, &lda, &ldb, &packed_b_bytes, &packs) != dnnl_success)
        return 1;
    float *packed = malloc(packed_bytes), *packed_b = malloc(packed_b_bytes),
          *c_t = malloc(sizeof(float) * BM * BN);
    if (!packed || !packed_b || !c_t)
        return 1;
    const float zero = 0.f;
    double t_blocks[ROUNDS], t_whole[ROUNDS], t_pack[ROUNDS], t_packing[ROUNDS], t_pack_b[ROUNDS],
        t_packing_b[ROUNDS];
    for (int round = -1; round < ROUNDS; round++) {
        const double t0 = omp_get_wtime();
        for (dim_t c = 0; c < nblocks; c++)
            for (dim_t r = 0; r < M; r += BM)
                dnnl_sgemm('N', 'T', BM, BN, H, 1.f, h + r * H, H, W + c * BN * H, H, 0.f,
                           c_sgemm + r * N + c * BN, N);
        const double t1 = omp_get_wtime();
        for (dim_t c = 0; c < nblocks; c++)
            dnnl_sgemm('N', 'T', M, BN, H, 1.f, h, H, W + c * BN * H, H, 0.f, c_pack + c * BN, N);
        const double t2 = omp_get_wtime();
        double packing = 0;
        for (dim_t c = 0; c < nblocks; c++) {
            const double p0 = omp_get_wtime();
            if (pack_block("A", "T", "N", &m, &n, &k, &lda, &ldb, W + c * BN * H, packed) != dnnl_success)
                return 1;
            packing += omp_get_wtime() - p0;
            for (dim_t r = 0; r < M; r += BM)
                if (packed_compute("P", "N", &m, &n, &k, packed, &lda, h + r * H, &ldb, &zero,
                                   c_pack + r * N + c * BN, &ldc) != dnnl_success)
                    return 1;
        }
        const double t3 = omp_get_wtime();
        double packing_b = 0;
        for (dim_t c = 0; c < nblocks; c++) {
            const double p0 = omp_get_wtime();
            if (pack_block("B", "T", "N", &m2, &n2, &k, &lda, &ldb, W + c * BN * H, packed_b) !=
                dnnl_success)
                return 1;
            packing_b += omp_get_wtime() - p0;
            for (dim_t r = 0; r < M; r += BM)
                if (packed_compute("T", "P", &m2, &n2, &k, h + r * H, &lda, packed_b, &ldb, &zero,
                                   c_t, &ldc2) != dnnl_success)
                    return 1;
        }
        const double t4 = omp_get_wtime();
        if (round >= 0) {
            t_pack_b[round] = t4 - t3;
            t_packing_b[round] = packing_b;
            t_blocks[round] = t1 - t0;
            t_whole[round] = t2 - t1;
            t_pack[round] = t3 - t2;
            t_packing[round] = packing;
        }
    }
    dim_t differ = 0;
    for (dim_t i = 0; i < M * N; i++)
        differ += c_sgemm[i] != c_pack[i];
    const double flops = 2.0 * (double)M * (double)N * (double)H;
    printf("M=%ld H=%ld N=%ld f32, one thread, %d rounds after a warm-up; packed weight block %.1f MB (A), %.1f MB (B)\n",
           (long)M, (long)H, (long)N, ROUNDS, (double)packed_bytes * 1e-6, (double)packed_b_bytes * 1e-6);
    double sorted[ROUNDS];
    memcpy(sorted, t_blocks, sizeof sorted);
    qsort(sorted, ROUNDS, sizeof *sorted, by_value);
    const double first = sorted[ROUNDS / 2];
    report("sgemm 144", t_blocks, 0, flops);
    report("sgemm whole", t_whole, first, flops);
    report("pack A + 144", t_pack, first, flops);
    report("(packing A)", t_packing, first, 0);
    report("pack B + 144", t_pack_b, first, flops);
    report("(packing B)", t_packing_b, first, 0);
    printf("  pack A + 144 against sgemm 144: %ld of %ld elements differ\n", (long)differ, (long)(M * N));
    return 0;
}
