/*
 * fusedgrpo_demo: fused vs materialized on one synthetic GRPO batch.
 *
 *   fusedgrpo_demo [--batch B] [--seq-len T] [--hidden H] [--vocab V]
 *                  [--dtype f32|bf16] [--steps S] [--threads K] [--budget-mib M]
 *
 * Prints, for each implementation, the loss, the agreement of loss, log-probs
 * and gradients with the baseline, the cold (first) step time, the median
 * [min, max] of S warm steps (default 5) taken in turns with the other
 * implementation, and the peak working memory the library counted.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fusedgrpo.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double uniform(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return ((double)(rng_state >> 11) + 0.5) / 9007199254740992.0;
}
static double normal(void) { return sqrt(-2 * log(uniform())) * cos(6.283185307179586 * uniform()); }

static void *xmalloc(size_t n)
{
    void *p = malloc(n);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

static void store(void *p, fg_dtype t, size_t i, float v)
{
    if (t == FG_DTYPE_BF16)
        ((uint16_t *)p)[i] = fg_f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

static double rel_l2(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

typedef struct result {
    double loss, cold_s, med_s, min_s, max_s; /* warm steps: median, min, max */
    size_t peak;
    int64_t chunks, chunk_rows;
    double gemm_s, call_s; /* last call: time inside GEMMs, whole call */
    float *logp, *gh, *gw;
} result;

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One step of an implementation on its own context (each keeps its own warm
 * workspace, so the two never share or evict each other's buffers). */
static int step(fg_context *ctx, fg_impl impl, const fg_loss_config *cfg,
                const fg_linear_inputs *in, const fg_batch *batch, result *r, double *seconds)
{
    const int64_t N = batch->batch * batch->seq_len, H = in->hidden.cols, V = in->weight.rows;
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    out.logp = r->logp;
    out.grad_hidden = fg_matrix_make(r->gh, FG_DTYPE_F32, N, H);
    out.grad_weight = fg_matrix_make(r->gw, FG_DTYPE_F32, V, H);
    fg_linear_options opts = {impl, 0, 0.0};
    const double t0 = now_s();
    const fg_status st = fg_linear_grpo(ctx, &opts, cfg, in, batch, &out, NULL);
    *seconds = now_s() - t0;
    if (st != FG_OK) {
        fprintf(stderr, "fg_linear_grpo failed: %s\n", fg_last_error(ctx));
        return 1;
    }
    r->loss = out.loss;
    return 0;
}

/* A cold step of each, then `steps` warm rounds in which the two take turns
 * (the order alternating round by round), so that a slow stretch of the
 * machine (another process, frequency) falls on both: the ratio of their
 * medians is what a reader can trust, one warm step is not. */
static int run_interleaved(fg_context *ctx[2], const fg_impl impls[2], const fg_loss_config *cfg,
                           const fg_linear_inputs *in, const fg_batch *batch, int steps,
                           result r[2])
{
    double *times[2] = {xmalloc(sizeof(double) * (size_t)steps),
                        xmalloc(sizeof(double) * (size_t)steps)};
    int rc = 0;
    for (int k = 0; k < 2 && !rc; k++) {
        fg_release_workspace(ctx[k]);
        fg_reset_peak_memory(ctx[k]);
        rc = step(ctx[k], impls[k], cfg, in, batch, &r[k], &r[k].cold_s);
    }
    for (int s = 0; s < steps && !rc; s++)
        for (int j = 0; j < 2 && !rc; j++) {
            const int k = s % 2 ? 1 - j : j;
            rc = step(ctx[k], impls[k], cfg, in, batch, &r[k], &times[k][s]);
        }
    for (int k = 0; k < 2 && !rc; k++) {
        qsort(times[k], (size_t)steps, sizeof(double), cmp_double);
        r[k].min_s = times[k][0];
        r[k].max_s = times[k][steps - 1];
        r[k].med_s = steps % 2 ? times[k][steps / 2]
                               : 0.5 * (times[k][steps / 2 - 1] + times[k][steps / 2]);
        fg_memory_stats ms;
        fg_get_memory_stats(ctx[k], &ms);
        r[k].peak = ms.peak_bytes;
        r[k].chunks = ms.chunks;
        r[k].chunk_rows = ms.chunk_rows;
        r[k].gemm_s = ms.gemm_seconds;
        r[k].call_s = ms.call_seconds;
        fg_release_workspace(ctx[k]);
    }
    free(times[0]);
    free(times[1]);
    return rc;
}

int main(int argc, char **argv)
{
    int64_t B = 2, T = 512, H = 1024, V = 151936;
    int steps = 5, threads = 0;
    double budget_mib = (double)(FG_DEFAULT_MEMORY_BUDGET >> 20);
    fg_dtype dtype = FG_DTYPE_F32;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--batch")) B = atoll(v);
        else if (!strcmp(k, "--seq-len")) T = atoll(v);
        else if (!strcmp(k, "--hidden")) H = atoll(v);
        else if (!strcmp(k, "--vocab")) V = atoll(v);
        else if (!strcmp(k, "--steps")) steps = atoi(v);
        else if (!strcmp(k, "--threads")) threads = atoi(v);
        else if (!strcmp(k, "--budget-mib")) budget_mib = atof(v);
        else if (!strcmp(k, "--dtype")) dtype = strcmp(v, "bf16") ? FG_DTYPE_F32 : FG_DTYPE_BF16;
        else {
            fprintf(stderr, "unknown option %s (see the comment at the top of demo/demo.c)\n", k);
            return 2;
        }
    }
    if (argc % 2 == 0) {
        fprintf(stderr, "options come in pairs: --name value\n");
        return 2;
    }
    if (steps < 1) {
        fprintf(stderr, "--steps must be at least 1 (warm steps of each implementation)\n");
        return 2;
    }
    const int64_t N = B * T;
    const size_t es = dtype == FG_DTYPE_BF16 ? 2 : 4;
    printf("fusedgrpo demo: B=%lld T=%lld H=%lld V=%lld dtype=%s, loss dapo (token level), "
           "off-policy, beta=0.04\n",
           (long long)B, (long long)T, (long long)H, (long long)V,
           dtype == FG_DTYPE_BF16 ? "bf16" : "f32");

    void *hidden = xmalloc((size_t)N * H * es), *weight = xmalloc((size_t)V * H * es);
    int64_t *ids = xmalloc((size_t)N * sizeof(int64_t));
    uint8_t *mask = xmalloc((size_t)N);
    float *adv = xmalloc((size_t)B * 4), *old = xmalloc((size_t)N * 4), *ref = xmalloc((size_t)N * 4);
    for (size_t i = 0; i < (size_t)N * H; i++)
        store(hidden, dtype, i, (float)normal());
    const float wscale = (float)(2.0 / sqrt((double)H));
    for (size_t i = 0; i < (size_t)V * H; i++)
        store(weight, dtype, i, (float)(uniform() * 2 - 1) * wscale * 1.7f);
    for (int64_t b = 0; b < B; b++) {
        adv[b] = (float)normal();
        int64_t len = T - (int64_t)(uniform() * (double)T / 4); /* ragged completions */
        for (int64_t t = 0; t < T; t++) {
            ids[b * T + t] = (int64_t)(uniform() * (double)V) % V;
            mask[b * T + t] = t < len;
        }
    }
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.beta = 0.04;
    fg_batch batch = {B, T, ids, mask, adv, NULL, NULL, NULL, 0, NULL};
    fg_linear_inputs in = {fg_matrix_make(hidden, dtype, N, H), fg_matrix_make(weight, dtype, V, H),
                           {NULL, dtype, 0}, 0, 0};
    fg_context_options o;
    fg_context_options_init(&o);
    o.threads = threads;
    o.memory_budget = (size_t)(budget_mib * 1048576.0);
    fg_context *ctxs[2];
    ctxs[0] = ctxs[1] = NULL;
    if (fg_context_create(&o, &ctxs[0]) != FG_OK || fg_context_create(&o, &ctxs[1]) != FG_OK) {
        fprintf(stderr, "cannot create a context: %s\n", fg_context_create_error());
        fg_context_destroy(ctxs[0]);
        return 1;
    }
    fg_context *ctx = ctxs[1];
    /* Plausible old/ref log-probs: the current policy's, jittered. */
    {
        float *lp = xmalloc((size_t)N * 4);
        fg_linear_outputs out;
        memset(&out, 0, sizeof out);
        out.logp = lp;
        fg_loss_config c0;
        fg_loss_config_init(&c0);
        if (fg_linear_grpo(ctx, NULL, &c0, &in, &batch, &out, NULL) != FG_OK) {
            fprintf(stderr, "%s\n", fg_last_error(ctx));
            return 1;
        }
        for (int64_t n = 0; n < N; n++) {
            old[n] = lp[n] + 0.1f * (float)normal();
            ref[n] = lp[n] + 0.1f * (float)normal();
        }
        free(lp);
    }
    batch.old_logp = old;
    batch.ref_logp = ref;

    result r[2];
    const char *names[2] = {"materialized", "fused"};
    const fg_impl impls[2] = {FG_IMPL_MATERIALIZED, FG_IMPL_FUSED};
    for (int k = 0; k < 2; k++) {
        r[k].logp = xmalloc((size_t)N * 4);
        r[k].gh = xmalloc((size_t)N * H * 4);
        r[k].gw = xmalloc((size_t)V * H * 4);
        memset(r[k].gw, 0, (size_t)V * H * 4); /* first touch outside the timings */
        memset(r[k].gh, 0, (size_t)N * H * 4);
    }
    if (run_interleaved(ctxs, impls, &cfg, &in, &batch, steps, r))
        return 1;
    printf("\n%d warm steps of each, interleaved; seconds: median [min, max]\n", steps);
    printf("%-13s %14s %8s %24s %8s %14s %7s\n", "impl", "loss", "cold_s", "warm_s", "gemm_s",
           "peak_work_MiB", "chunks");
    for (int k = 0; k < 2; k++)
        printf("%-13s %14.8f %8.3f %8.3f [%6.3f, %6.3f] %8.3f %14.1f %7lld\n", names[k], r[k].loss,
               r[k].cold_s, r[k].med_s, r[k].min_s, r[k].max_s, r[k].gemm_s,
               (double)r[k].peak / 1048576.0, (long long)r[k].chunks);
    const double dl = fabs(r[1].loss - r[0].loss) / fmax(fabs(r[0].loss), 1e-12);
    printf("\nfused vs materialized: loss rel diff %.2e, logp rel-L2 %.2e, grad_hidden %.2e, "
           "grad_weight %.2e\n",
           dl, rel_l2(r[1].logp, r[0].logp, (size_t)N), rel_l2(r[1].gh, r[0].gh, (size_t)N * H),
           rel_l2(r[1].gw, r[0].gw, (size_t)V * H));
    printf("fused: %.2fx the materialized step time (medians of %d interleaved warm steps; "
           "fastest against fastest %.2fx), %.1f%% of its peak working memory (budget %.0f MiB)\n",
           r[1].med_s / r[0].med_s, steps, r[1].min_s / r[0].min_s,
           100.0 * (double)r[1].peak / (double)r[0].peak, budget_mib);
    fg_context_destroy(ctxs[0]);
    fg_context_destroy(ctxs[1]);
    const int ok = dl < 1e-4;
    printf("%s\n", ok ? "OK: fused and materialized agree" : "MISMATCH");
    return ok ? 0 : 1;
}
