/*
 * test_threads: are results independent of the thread count?
 *
 * Fixed inputs, contexts with 1, 2 and 4 threads (4 oversubscribes a 2-core
 * machine on purpose: the split of the work changes, the results must not).
 * Paths: fused in several chunks, fused in one chunk, materialized, logits
 * (separate grad_logits) and logits in place; f32 and bf16; token and
 * sequence level. Every output (loss, metrics, logp, entropy, grad_hidden,
 * grad_weight, grad_bias, grad_logits) is compared bitwise with the 1-thread
 * run.
 *
 * Asserted: bitwise identical for every path and thread count.
 *   - fg_logits_grpo: no GEMM; rows are computed whole by one thread,
 *     reductions in a fixed order;
 *   - fg_linear_grpo: the GEMM layer cuts every product into fixed blocks,
 *     each one single-threaded oneDNN call with its whole K (grad_hidden's
 *     in fixed pieces, summed in order, when a chunk is one block: V here is
 *     large enough for two), and the planner
 *     picks chunk sizes without looking at the thread count
 *     (src/backends/cpu/gemm_onednn.h, docs/ROBUSTNESS.md).
 * Every run is also repeated on the same context: same thread count, same
 * bits (the header's promise). And one more context, created with the
 * default thread count, runs every case with the thread count given per call
 * (fg_exec.threads): the same bits as the context created with that count.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { B = 4, T = 40, H = 96, V = 4099, N = B * T }; /* V >= 2 * FG_GEMM_MIN_PIECE_K: grad_hidden's K in pieces */
enum { O_LOSS, O_METRICS, O_LOGP, O_ENT, O_GH, O_GW, O_GB, O_GL, O_COUNT };
static const char *O_NAME[O_COUNT] = {"loss", "metrics", "logp", "entropy", "grad_hidden",
                                      "grad_weight", "grad_bias", "grad_logits"};

typedef struct res {
    double loss;
    fg_metrics metrics;
    float logp[N], ent[N];
    float gh[N * H], gw[V * H], gb[V];
    float gl[N * V];
    uint16_t lio[N * V]; /* in-place bf16 logits / grad */
} res;

enum { P_FUSED_CHUNKS, P_FUSED_ONE, P_MAT, P_LOGITS, P_LOGITS_INPLACE, P_COUNT };
static const char *P_NAME[P_COUNT] = {"fused (chunks)", "fused (1 chunk)", "materialized", "logits",
                                      "logits in place"};

/* The same problem stored as f32 [0] and bf16 [1] (one batch: prob[0].tb). */
static tu_problem prob[2];
static float log32[N * V];
static uint16_t log16[N * V];
static res R[3], again, per_call;

/* threads > 0: the call's thread count (fg_exec.threads); 0: the context's. */
static fg_status run(fg_context *ctx, int threads, int path, fg_dtype dt, fg_is_level level,
                     res *r)
{
    memset(r, 0, sizeof *r);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = FG_LOSS_DAPO;
    cfg.importance_sampling_level = level;
    cfg.beta = 0.04;
    cfg.entropy_coef = 0.01;
    cfg.temperature = 0.7;
    const int bf = dt == FG_DTYPE_BF16;
    const fg_batch *batch = tu_batch_view(&prob[0].tb);
    fg_exec ex;
    fg_exec_init(&ex);
    ex.threads = threads;
    fg_status st;
    if (path >= P_LOGITS) {
        fg_logits_outputs out;
        memset(&out, 0, sizeof out);
        out.logp = r->logp;
        out.entropy = r->ent;
        fg_matrix lm;
        if (path == P_LOGITS_INPLACE) {
            memcpy(r->lio, log16, sizeof r->lio);
            lm = fg_matrix_make(r->lio, FG_DTYPE_BF16, N, V);
            out.grad_logits = lm;
        } else {
            lm = fg_matrix_make(bf ? (void *)log16 : (void *)log32, dt, N, V);
            out.grad_logits = fg_matrix_make(r->gl, FG_DTYPE_F32, N, V);
        }
        st = fg_logits_grpo(ctx, &cfg, &lm, batch, &out, &ex);
        r->loss = out.loss;
        r->metrics = out.metrics;
    } else {
        const fg_linear_inputs in = tu_problem_inputs(&prob[bf]);
        fg_linear_outputs out;
        memset(&out, 0, sizeof out);
        out.logp = r->logp;
        out.entropy = r->ent;
        out.grad_hidden = fg_matrix_make(r->gh, FG_DTYPE_F32, N, H);
        out.grad_weight = fg_matrix_make(r->gw, FG_DTYPE_F32, V, H);
        out.grad_bias = fg_vector_make(r->gb, FG_DTYPE_F32, V);
        const fg_linear_options lo = {path == P_MAT ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED, 0, 0.0};
        if (path == P_FUSED_CHUNKS) { /* several chunks: the smallest budget plus a third of
            the one-chunk plan's chunk bytes, both from the plan query (what the GEMMs need
            differs by ISA) */
            fg_linear_plan_info plan;
            st = fg_linear_grpo_plan(ctx, &lo, &cfg, &in, batch, &out, &ex, &plan);
            if (st != FG_OK)
                return st;
            ex.memory_budget = plan.min_budget_bytes + plan.chunk_bytes / 3;
        }
        st = fg_linear_grpo(ctx, &lo, &cfg, &in, batch, &out, &ex);
        r->loss = out.loss;
        r->metrics = out.metrics;
    }
    return st;
}

/* max |a-b| / max |b| over n floats (0 when bitwise equal). */
static double diff_f(const float *a, const float *b, size_t n, int *bitwise)
{
    *bitwise = memcmp(a, b, n * sizeof(float)) == 0;
    double m = 0, d = 0;
    for (size_t i = 0; i < n; i++) {
        m = fmax(m, fabs((double)b[i]));
        d = fmax(d, fabs((double)a[i] - (double)b[i]));
    }
    return m > 0 ? d / m : d;
}

static double diff_bf16(const uint16_t *a, const uint16_t *b, size_t n, int *bitwise)
{
    *bitwise = memcmp(a, b, n * sizeof(uint16_t)) == 0;
    double m = 0, d = 0;
    for (size_t i = 0; i < n; i++) {
        const double x = fg_bf16_to_f32(a[i]), y = fg_bf16_to_f32(b[i]);
        m = fmax(m, fabs(y));
        d = fmax(d, fabs(x - y));
    }
    return m > 0 ? d / m : d;
}

/* Per-output relative difference of a against b; bits[o] = bitwise equal. */
static void diff(const res *a, const res *b, int path, double *d, int *bits)
{
    d[O_LOSS] = fabs(a->loss - b->loss) / fmax(fabs(b->loss), 1e-300);
    bits[O_LOSS] = memcmp(&a->loss, &b->loss, sizeof a->loss) == 0;
    bits[O_METRICS] = memcmp(&a->metrics, &b->metrics, sizeof a->metrics) == 0;
    d[O_METRICS] = fmax(fabs(a->metrics.kl - b->metrics.kl) / fmax(fabs(b->metrics.kl), 1e-300),
                        fabs(a->metrics.entropy - b->metrics.entropy) /
                            fmax(fabs(b->metrics.entropy), 1e-300));
    d[O_LOGP] = diff_f(a->logp, b->logp, N, &bits[O_LOGP]);
    d[O_ENT] = diff_f(a->ent, b->ent, N, &bits[O_ENT]);
    d[O_GH] = diff_f(a->gh, b->gh, (size_t)N * H, &bits[O_GH]);
    d[O_GW] = diff_f(a->gw, b->gw, (size_t)V * H, &bits[O_GW]);
    d[O_GB] = diff_f(a->gb, b->gb, V, &bits[O_GB]);
    if (path == P_LOGITS_INPLACE)
        d[O_GL] = diff_bf16(a->lio, b->lio, (size_t)N * V, &bits[O_GL]);
    else
        d[O_GL] = diff_f(a->gl, b->gl, (size_t)N * V, &bits[O_GL]);
}

int main(void)
{
    const tu_problem_opts po = {1.0, 0.2, 0.1, 0, 0, 1};
    for (int d = 0; d < 2; d++)
        tu_problem_make_opts(&prob[d], B, T, H, V, d ? FG_DTYPE_BF16 : FG_DTYPE_F32, 1, 2024, &po);
    tu_batch *tb = &prob[0].tb;
    tu_rng *rng = &prob[0].rng;
    tb->have_old = tb->have_ref = 1;
    tb->is_mode = 1;
    double lp[N]; /* a cheap stand-in for the policy's log-probs: bits are compared, not values */
    for (int n = 0; n < N; n++) lp[n] = -6.0 + tu_uniform(rng);
    tu_batch_fill_logp(tb, lp, 0.3, 0.3, rng);
    for (int i = 0; i < N * V; i++)
        log16[i] = fg_f32_to_bf16(log32[i] = (float)(2.0 * tu_normal(rng)));

    const int threads[3] = {1, 2, 4};
    fg_context *ctx[3], *shared;
    for (int k = 0; k < 3; k++) {
        fg_context_options o;
        fg_context_options_init(&o);
        o.threads = threads[k];
        if (fg_context_create(&o, &ctx[k]) != FG_OK) {
            CHECK(0, "context with %d threads", threads[k]);
            return tu_finish();
        }
    }
    if (fg_context_create(NULL, &shared) != FG_OK) {
        CHECK(0, "%s", "context with the default thread count");
        return tu_finish();
    }
    int per_call_all_bitwise = 1;
    int linear_all_bitwise = 1;
    printf("%-16s %-5s %-8s %-8s  %s\n", "path", "dtype", "level", "threads",
           "outputs that differ from 1 thread (max |a-b|/max|b|)");
    for (int path = 0; path < P_COUNT; path++)
        for (int dt = 0; dt < 2; dt++)
            for (int level = 0; level < 2; level++) {
                if (path == P_LOGITS_INPLACE && dt == 0)
                    continue; /* in place is the bf16 case */
                for (int k = 0; k < 3; k++) {
                    fg_status st = run(ctx[k], 0, path, (fg_dtype)dt, (fg_is_level)level, &R[k]);
                    CHECK(st == FG_OK, "%s %d threads: %s (%s)", P_NAME[path], threads[k],
                          fg_status_name(st), fg_last_error(ctx[k]));
                    /* same context, same thread count: same bits */
                    st = run(ctx[k], 0, path, (fg_dtype)dt, (fg_is_level)level, &again);
                    CHECK(st == FG_OK && memcmp(&again, &R[k], sizeof again) == 0,
                          "%s %s %s: %d threads, a second call differs", P_NAME[path],
                          dt ? "bf16" : "f32", level ? "sequence" : "token", threads[k]);
                    /* one context, the thread count given per call: the same bits
                     * as the context created with that count */
                    st = run(shared, threads[k], path, (fg_dtype)dt, (fg_is_level)level,
                             &per_call);
                    const int same = st == FG_OK && memcmp(&per_call, &R[k], sizeof per_call) == 0;
                    per_call_all_bitwise &= same;
                    CHECK(same, "%s %s %s: fg_exec.threads = %d on one context differs from a "
                          "%d-thread context (%s)", P_NAME[path], dt ? "bf16" : "f32",
                          level ? "sequence" : "token", threads[k], threads[k],
                          fg_status_name(st));
                }
                for (int k = 1; k < 3; k++) {
                    double d[O_COUNT];
                    int bits[O_COUNT];
                    diff(&R[k], &R[0], path, d, bits);
                    char line[600];
                    int used = 0, all = 1;
                    for (int o = 0; o < O_COUNT; o++)
                        if (!bits[o]) {
                            all = 0;
                            used += snprintf(line + used, sizeof line - (size_t)used, " %s %.2g",
                                             O_NAME[o], d[o]);
                        }
                    printf("%-16s %-5s %-8s 1 vs %d   %s\n", P_NAME[path], dt ? "bf16" : "f32",
                           level ? "sequence" : "token", threads[k], all ? "bitwise identical" : line);
                    if (path < P_LOGITS)
                        linear_all_bitwise &= all;
                    CHECK(all, "%s %s %s: %d threads differ from 1 thread:%s", P_NAME[path],
                          dt ? "bf16" : "f32", level ? "sequence" : "token", threads[k], line);
                }
            }
    printf("fg_linear_grpo across thread counts: %s\n",
           linear_all_bitwise ? "bitwise identical" : "DIFFERS (see above)");
    printf("threads per call (fg_exec) on one context vs one context per thread count: %s\n",
           per_call_all_bitwise ? "bitwise identical" : "DIFFERS (see above)");
    for (int k = 0; k < 3; k++)
        fg_context_destroy(ctx[k]);
    fg_context_destroy(shared);
    tu_problem_free(&prob[0]);
    tu_problem_free(&prob[1]);
    return tu_finish();
}
