/*
 * bf16_products_ab: where a CPU has oneDNN bf16 matmul kernels, are they worth
 * taking? Three contexts in one process, their fused steps interleaved (a
 * slow stretch of a shared machine falls on all three alike):
 *   bf16 native  bf16 inputs, bf16 products (the library's choice where
 *                oneDNN has bf16 kernels)
 *   bf16 via f32 bf16 inputs, f32 products on widened tiles (the path of CPUs
 *                without them; FUSEDGRPO_BF16_PRODUCTS=f32 when the context is
 *                created)
 *   f32          f32 inputs
 *
 *   cc -O2 -I include bench/bf16_products_ab.c -o bf16_products_ab -L build -lfusedgrpo
 *   ./bf16_products_ab [T H V steps]       (default 2048 1024 151936 5)
 *
 * fused, dapo, old_logp, grad_hidden and grad_weight, the default budget.
 * Prints each arm's median [min, max] seconds over the warm steps and its
 * ratio to the f32 step and to the bf16-native step.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fusedgrpo.h"

enum { ARMS = 3, MAX_STEPS = 64 };

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng = 0x243F6A8885A308D3ull;
static float uniform(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0);
}

static int cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    const int64_t T = argc > 1 ? atoll(argv[1]) : 2048, H = argc > 2 ? atoll(argv[2]) : 1024,
                  V = argc > 3 ? atoll(argv[3]) : 151936;
    int steps = argc > 4 ? atoi(argv[4]) : 5;
    if (steps < 1 || steps > MAX_STEPS)
        steps = 5;
    const char *name[ARMS] = {"bf16 native", "bf16 via f32", "f32"};
    const fg_dtype dt[ARMS] = {FG_DTYPE_BF16, FG_DTYPE_BF16, FG_DTYPE_F32};
    float *h32 = malloc(sizeof(float) * (size_t)(T * H));
    float *w32 = malloc(sizeof(float) * (size_t)(V * H));
    uint16_t *h16 = malloc(2 * (size_t)(T * H)), *w16 = malloc(2 * (size_t)(V * H));
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)T);
    uint8_t *mask = malloc((size_t)T);
    float *old = malloc(sizeof(float) * (size_t)T), adv = 0.7f;
    float *gh = malloc(sizeof(float) * (size_t)(T * H)), *gw = malloc(sizeof(float) * (size_t)(V * H));
    if (!h32 || !w32 || !h16 || !w16 || !ids || !mask || !old || !gh || !gw) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (int64_t i = 0; i < T * H; i++) {
        h16[i] = fg_f32_to_bf16(2 * uniform() - 1);
        h32[i] = fg_bf16_to_f32(h16[i]);
    }
    const float ws = 2.0f / sqrtf((float)H);
    for (int64_t i = 0; i < V * H; i++) {
        w16[i] = fg_f32_to_bf16((2 * uniform() - 1) * ws);
        w32[i] = fg_bf16_to_f32(w16[i]);
    }
    for (int64_t t = 0; t < T; t++) {
        ids[t] = (int64_t)(uniform() * (float)V) % V;
        mask[t] = 1;
        old[t] = -10.0f - uniform();
    }
    memset(gh, 0, sizeof(float) * (size_t)(T * H));
    memset(gw, 0, sizeof(float) * (size_t)(V * H));
    fg_context *ctx[ARMS];
    for (int a = 0; a < ARMS; a++) {
        if (a == 1)
            setenv("FUSEDGRPO_BF16_PRODUCTS", "f32", 1);
        else
            unsetenv("FUSEDGRPO_BF16_PRODUCTS");
        if (fg_context_create(NULL, &ctx[a]) != FG_OK) {
            fprintf(stderr, "context: %s\n", fg_context_create_error());
            return 1;
        }
    }
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    fg_batch batch = {1, T, ids, mask, &adv, old, NULL, NULL, 0, NULL};
    double t[ARMS][MAX_STEPS + 1];
    for (int s = 0; s <= steps; s++)
        for (int j = 0; j < ARMS; j++) {
            const int a = (j + s) % ARMS; /* rotate the order round by round */
            const int bf = dt[a] == FG_DTYPE_BF16;
            fg_linear_inputs in = {fg_matrix_make(bf ? (void *)h16 : h32, dt[a], T, H),
                                   fg_matrix_make(bf ? (void *)w16 : w32, dt[a], V, H),
                                   {NULL, dt[a], 0}, 0, 0};
            fg_linear_outputs out;
            memset(&out, 0, sizeof out);
            out.grad_hidden = fg_matrix_make(gh, FG_DTYPE_F32, T, H);
            out.grad_weight = fg_matrix_make(gw, FG_DTYPE_F32, V, H);
            const double t0 = now_s();
            if (fg_linear_grpo(ctx[a], NULL, &cfg, &in, &batch, &out, NULL) != FG_OK) {
                fprintf(stderr, "%s: %s\n", name[a], fg_last_error(ctx[a]));
                return 1;
            }
            t[a][s] = now_s() - t0;
        }
    double med[ARMS];
    printf("T=%lld H=%lld V=%lld, fused dapo, %d warm steps each after one cold, interleaved\n",
           (long long)T, (long long)H, (long long)V, steps);
    for (int a = 0; a < ARMS; a++) {
        double *w = &t[a][1];
        qsort(w, (size_t)steps, sizeof(double), cmp);
        med[a] = steps % 2 ? w[steps / 2] : 0.5 * (w[steps / 2 - 1] + w[steps / 2]);
        printf("%-13s %8.3f s [%7.3f, %7.3f]\n", name[a], med[a], w[0], w[steps - 1]);
    }
    printf("bf16 native / f32 %.3f, bf16 via f32 / f32 %.3f, bf16 via f32 / bf16 native %.3f\n",
           med[0] / med[2], med[1] / med[2], med[1] / med[0]);
    for (int a = 0; a < ARMS; a++)
        fg_context_destroy(ctx[a]);
    return 0;
}
