/*
 * accumulate_ab: the accumulation path (fg_linear_outputs.accumulate = 1) of
 * two builds of libfusedgrpo.so in one process, their steps interleaved
 * (A, B, A, B, ...), so that a shared, noisy machine slows both alike.
 *
 *   cc -O2 -I include bench/accumulate_ab.c -o accumulate_ab -ldl
 *   ./accumulate_ab OLD/libfusedgrpo.so NEW/libfusedgrpo.so [T H V steps beta]
 *
 * Each library is loaded RTLD_LOCAL (its own symbols, its own oneDNN state)
 * and runs fg_linear_grpo (fused, dapo, old_logp, grad_hidden and
 * grad_weight, the default budget; beta != 0: the KL against ref_logp =
 * old_logp) on the same seeded batch. Prints each
 * step's seconds, the median, min and max per library, the ratio of the
 * medians, and the counted working memory (fg_memory_stats.peak_bytes) and
 * chunks of each.
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fusedgrpo.h"

typedef struct lib {
    const char *path;
    void *h;
    fg_status (*context_create)(const fg_context_options *, fg_context **);
    void (*context_destroy)(fg_context *);
    void (*config_init)(fg_loss_config *);
    fg_status (*linear_grpo)(fg_context *, const fg_linear_options *, const fg_loss_config *,
                             const fg_linear_inputs *, const fg_batch *, fg_linear_outputs *,
                             const fg_exec *);
    fg_status (*memory_stats)(const fg_context *, fg_memory_stats *);
    const char *(*last_error)(const fg_context *);
    fg_context *ctx;
    double t[64];
} lib;

static int load(lib *l, const char *path)
{
    l->path = path;
    l->h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!l->h) {
        fprintf(stderr, "accumulate_ab: %s\n", dlerror());
        return -1;
    }
    *(void **)&l->context_create = dlsym(l->h, "fg_context_create");
    *(void **)&l->context_destroy = dlsym(l->h, "fg_context_destroy");
    *(void **)&l->config_init = dlsym(l->h, "fg_loss_config_init");
    *(void **)&l->linear_grpo = dlsym(l->h, "fg_linear_grpo");
    *(void **)&l->memory_stats = dlsym(l->h, "fg_get_memory_stats");
    *(void **)&l->last_error = dlsym(l->h, "fg_last_error");
    if (!l->context_create || !l->linear_grpo || !l->memory_stats ||
        l->context_create(NULL, &l->ctx) != FG_OK) {
        fprintf(stderr, "accumulate_ab: %s: missing symbols or no context\n", path);
        return -1;
    }
    return 0;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng = 88172645463325252ull;
static double uniform(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: accumulate_ab OLD.so NEW.so [T H V steps beta]\n");
        return 2;
    }
    const int64_t T = argc > 3 ? atoll(argv[3]) : 512, H = argc > 4 ? atoll(argv[4]) : 1024;
    const int64_t V = argc > 5 ? atoll(argv[5]) : 151936;
    const int steps = argc > 6 ? atoi(argv[6]) : 5;
    const double beta = argc > 7 ? atof(argv[7]) : 0.0;
    if (steps < 1 || steps > 64)
        return 2;
    lib libs[2];
    memset(libs, 0, sizeof libs);
    if (load(&libs[0], argv[1]) != 0 || load(&libs[1], argv[2]) != 0)
        return 1;
    float *hidden = malloc(sizeof(float) * (size_t)(T * H));
    float *weight = malloc(sizeof(float) * (size_t)(V * H));
    float *gh = malloc(sizeof(float) * (size_t)(T * H));
    float *gw = calloc((size_t)(V * H), sizeof(float));
    float *old = malloc(sizeof(float) * (size_t)T);
    int64_t *tok = malloc(sizeof(int64_t) * (size_t)T);
    uint8_t *mask = malloc((size_t)T);
    if (!hidden || !weight || !gh || !gw || !old || !tok || !mask)
        return 1;
    const double ws = 3.0 / sqrt((double)H);
    for (int64_t i = 0; i < T * H; i++)
        hidden[i] = (float)(2.0 * uniform() - 1.0);
    for (int64_t i = 0; i < V * H; i++)
        weight[i] = (float)(ws * (2.0 * uniform() - 1.0));
    for (int64_t t = 0; t < T; t++) {
        tok[t] = (int64_t)(uniform() * (double)V);
        mask[t] = 1;
        old[t] = (float)(-log((double)V) + 0.3 * (uniform() - 0.5));
    }
    float adv = 0.7f;
    const fg_batch batch = {1, T, tok, mask, &adv, old, beta != 0 ? old : NULL, NULL, 0, NULL};
    /* (the views by hand: nothing of either library is linked in) */
    const fg_linear_inputs in = {{hidden, FG_DTYPE_F32, T, H, H},
                                 {weight, FG_DTYPE_F32, V, H, H},
                                 {NULL, FG_DTYPE_F32, 0}, 0, 0};
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    out.grad_hidden = (fg_matrix){gh, FG_DTYPE_F32, T, H, H};
    out.grad_weight = (fg_matrix){gw, FG_DTYPE_F32, V, H, H};
    out.accumulate = 1;
    printf("T = %lld, H = %lld, V = %lld, f32, beta = %g, accumulate = 1, %d steps each, "
           "interleaved\n", (long long)T, (long long)H, (long long)V, beta, steps);
    for (int s = -1; s < steps; s++) /* s = -1: the untimed warm-up of each */
        for (int k = 0; k < 2; k++) {
            lib *l = &libs[k];
            fg_loss_config cfg;
            l->config_init(&cfg);
            cfg.beta = beta;
            const double t0 = now();
            const fg_status st = l->linear_grpo(l->ctx, NULL, &cfg, &in, &batch, &out, NULL);
            const double dt = now() - t0;
            if (st != FG_OK) {
                fprintf(stderr, "accumulate_ab: %s: %s\n", l->path, l->last_error(l->ctx));
                return 1;
            }
            if (s >= 0) {
                l->t[s] = dt;
                printf("step %d %s: %.3f s\n", s, k ? "B" : "A", dt);
            }
        }
    double med[2];
    for (int k = 0; k < 2; k++) {
        lib *l = &libs[k];
        fg_memory_stats ms;
        l->memory_stats(l->ctx, &ms);
        qsort(l->t, (size_t)steps, sizeof(double), cmp);
        med[k] = steps % 2 ? l->t[steps / 2] : 0.5 * (l->t[steps / 2 - 1] + l->t[steps / 2]);
        printf("%s %s: median %.3f s, min %.3f, max %.3f; peak working memory %zu bytes, "
               "%lld chunks of %lld rows\n",
               k ? "B" : "A", l->path, med[k], l->t[0], l->t[steps - 1], ms.peak_bytes,
               (long long)ms.chunks, (long long)ms.chunk_rows);
        l->context_destroy(l->ctx);
    }
    printf("B / A median: %.3f\n", med[1] / med[0]);
    return 0;
}
