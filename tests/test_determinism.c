/*
 * test_determinism: same inputs and same context options (thread count
 * included) give bitwise identical loss, metrics, logp, entropy and gradients:
 * twice on one context (the second call reuses the workspace) and once on a
 * fresh context. Threads 1 and 2; fused (several chunks, the budget given per
 * call in fg_exec), materialized and logits paths; f32 and bf16; a
 * token-level and a sequence-level config.
 * 1 and 2 threads must agree too (tests/test_threads.c covers 4).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { B = 5, T = 40, H = 37, V = 1009, N = B * T };

typedef struct res {
    double loss;
    fg_metrics metrics;
    float logp[N], ent[N];
    float gh[N * H], gw[V * H], gb[V];
    float gl[N * V];
} res;

static res R[4];

typedef struct inputs {
    const tu_problem *prob; /* hidden, weight, bias in the run's dtype */
    void *lg;               /* logits [N, V] in the same dtype */
} inputs;

/* The fused path runs at `budget` (fg_exec), the others ignore it. */
static fg_status run(fg_context *ctx, int path, const fg_loss_config *cfg, const inputs *x,
                     const fg_batch *batch, size_t budget, res *r) {
    memset(r, 0, sizeof(*r));
    fg_exec ex;
    fg_exec_init(&ex);
    ex.memory_budget = budget;
    fg_status s;
    if (path == 2) {
        fg_logits_outputs out;
        memset(&out, 0, sizeof out);
        out.logp = r->logp;
        out.entropy = r->ent;
        out.grad_logits = fg_matrix_make(r->gl, FG_DTYPE_F32, N, V);
        const fg_matrix lm = fg_matrix_make(x->lg, x->prob->dtype, N, V);
        s = fg_logits_grpo(ctx, cfg, &lm, batch, &out, &ex);
        r->loss = out.loss;
        r->metrics = out.metrics;
    } else {
        fg_linear_outputs out;
        memset(&out, 0, sizeof out);
        out.logp = r->logp;
        out.entropy = r->ent;
        out.grad_hidden = fg_matrix_make(r->gh, FG_DTYPE_F32, N, H);
        out.grad_weight = fg_matrix_make(r->gw, FG_DTYPE_F32, V, H);
        out.grad_bias = fg_vector_make(r->gb, FG_DTYPE_F32, V);
        const fg_linear_inputs in = tu_problem_inputs(x->prob);
        const fg_linear_options lo = {path == 0 ? FG_IMPL_FUSED : FG_IMPL_MATERIALIZED, 0, 0.0};
        s = fg_linear_grpo(ctx, &lo, cfg, &in, batch, &out, &ex);
        r->loss = out.loss;
        r->metrics = out.metrics;
    }
    return s;
}

static int same(const res *a, const res *b) {
    return memcmp(&a->loss, &b->loss, sizeof a->loss) == 0 &&
           memcmp(&a->metrics, &b->metrics, sizeof a->metrics) == 0 &&
           memcmp(a->logp, b->logp, sizeof a->logp) == 0 &&
           memcmp(a->ent, b->ent, sizeof a->ent) == 0 && memcmp(a->gh, b->gh, sizeof a->gh) == 0 &&
           memcmp(a->gw, b->gw, sizeof a->gw) == 0 && memcmp(a->gb, b->gb, sizeof a->gb) == 0 &&
           memcmp(a->gl, b->gl, sizeof a->gl) == 0;
}

static fg_context *make_ctx(int threads) {
    fg_context_options o;
    fg_context_options_init(&o);
    o.threads = threads;
    fg_context *c = NULL;
    if (fg_context_create(&o, &c) != FG_OK) return NULL;
    return c;
}

int main(void) {
    /* one problem, stored as f32 and as bf16 */
    tu_problem prob[2];
    for (int d = 0; d < 2; d++)
        tu_problem_make(&prob[d], B, T, H, V, d ? FG_DTYPE_BF16 : FG_DTYPE_F32, 1, 2024);
    tu_batch *tb = &prob[0].tb;
    tu_rng *rng = &prob[0].rng;
    /* logp of a plausible policy for old / ref: a cheap stand-in (bits are
     * compared here, not values) */
    double lp[N];
    for (int n = 0; n < N; n++) lp[n] = -3.0 - 2.0 * tu_uniform(rng);
    tu_batch_fill_logp(tb, lp, 0.2, 0.3, rng);

    /* A budget with several chunks on the fused path: the planner's smallest
     * plus a third of its one-chunk plan's chunk bytes (a third of the unmasked
     * rows), each dtype its own: their GEMM scratch differs by CPU (native bf16
     * kernels have scratchpads of their own), so one dtype's budget may hold the
     * other's every row. Not a multiple of the smallest: where GEMM scratch
     * dominates it (AVX-512's, or the logits blocks' tiles) that holds every row
     * in one chunk. */
    size_t budgets[2] = {0, 0};
    for (int d = 0; d < 2; d++) {
        fg_context *c = make_ctx(1);
        static res scratch;
        fg_linear_outputs out;
        memset(&out, 0, sizeof out);
        out.grad_hidden = fg_matrix_make(scratch.gh, FG_DTYPE_F32, N, H);
        out.grad_weight = fg_matrix_make(scratch.gw, FG_DTYPE_F32, V, H);
        out.grad_bias = fg_vector_make(scratch.gb, FG_DTYPE_F32, V);
        const fg_linear_inputs in = tu_problem_inputs(&prob[d]);
        fg_loss_config cfg;
        fg_loss_config_init(&cfg);
        fg_linear_plan_info plan;
        CHECK(c && fg_linear_grpo_plan(c, NULL, &cfg, &in, tu_batch_view(tb), &out, NULL, &plan) ==
                       FG_OK,
              "%s", "plan for the budget");
        budgets[d] = plan.min_budget_bytes + plan.chunk_bytes / 3;
        fg_context_destroy(c);
    }

    for (int dti = 0; dti < 2; dti++) {
        const fg_dtype dt = dti ? FG_DTYPE_BF16 : FG_DTYPE_F32;
        const size_t budget = budgets[dti];
        double *l2 = tu_xmalloc(sizeof(double) * N * V);
        for (int64_t i = 0; i < (int64_t)N * V; i++) l2[i] = 4.0 * tu_normal(rng);
        inputs x = {&prob[dti], tu_store_matrix(l2, N, V, V, dt)};
        for (int ci = 0; ci < 2; ci++) {
            fg_loss_config cfg;
            fg_loss_config_init(&cfg);
            if (ci == 0) {
                cfg.loss_type = FG_LOSS_DAPO;
                cfg.beta = 0.04;
                cfg.entropy_coef = 0.1;
                cfg.temperature = 0.7;
                tb->have_old = tb->have_ref = 1;
                tb->is_mode = 1;
            } else {
                cfg.loss_type = FG_LOSS_GRPO;
                cfg.importance_sampling_level = FG_LEVEL_SEQUENCE;
                cfg.beta = 0.1;
                cfg.use_bias_correction_kl = 1;
                cfg.delta = 1.3;
                tb->have_old = 0;
                tb->have_ref = 1;
                tb->is_mode = 2;
            }
            const fg_batch *batch = tu_batch_view(tb);
            for (int path = 0; path < 3; path++) {
                static const char *pn[3] = {"fused", "materialized", "logits"};
                for (int thr = 1; thr <= 2; thr++) {
                    fg_context *c1 = make_ctx(thr), *c2 = make_ctx(thr);
                    if (!c1 || !c2) {
                        CHECK(0, "%s", "context create");
                        fg_context_destroy(c1);
                        fg_context_destroy(c2);
                        continue;
                    }
                    fg_status s = run(c1, path, &cfg, &x, batch, budget, &R[0]);
                    CHECK(s == FG_OK, "%s %s cfg %d threads %d: %s (%s)", pn[path],
                          dti ? "bf16" : "f32", ci, thr, fg_status_name(s), fg_last_error(c1));
                    if (path == 0) {
                        fg_memory_stats st;
                        fg_get_memory_stats(c1, &st);
                        CHECK(st.chunks > 1, "fused %s cfg %d: only %lld chunk(s) of %lld rows "
                              "at budget %zu", dti ? "bf16" : "f32", ci, (long long)st.chunks,
                              (long long)st.chunk_rows, budget);
                    }
                    fg_status s2 = run(c1, path, &cfg, &x, batch, budget, &R[1]);
                    fg_status s3 = run(c2, path, &cfg, &x, batch, budget, &R[2]);
                    CHECK(s2 == FG_OK && s3 == FG_OK, "%s reruns: %s %s", pn[path],
                          fg_status_name(s2), fg_status_name(s3));
                    CHECK(same(&R[0], &R[1]), "%s %s cfg %d threads %d: second call on the same "
                          "context differs (loss %.17g vs %.17g)", pn[path], dti ? "bf16" : "f32",
                          ci, thr, R[0].loss, R[1].loss);
                    CHECK(same(&R[0], &R[2]), "%s %s cfg %d threads %d: a fresh context differs "
                          "(loss %.17g vs %.17g)", pn[path], dti ? "bf16" : "f32", ci, thr,
                          R[0].loss, R[2].loss);
                    if (thr == 1) memcpy(&R[3], &R[0], sizeof R[3]);
                    else
                        CHECK(same(&R[3], &R[0]), "%s %s cfg %d: 1 vs 2 threads differ", pn[path],
                              dti ? "bf16" : "f32", ci);
                    fg_context_destroy(c1);
                    fg_context_destroy(c2);
                }
            }
        }
        free(x.lg);
        free(l2);
    }
    printf("fused budgets used: %zu bytes (f32), %zu (bf16)\n", budgets[0], budgets[1]);
    tu_problem_free(&prob[0]);
    tu_problem_free(&prob[1]);
    return tu_finish();
}
