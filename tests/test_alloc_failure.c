/*
 * test_alloc_failure: every allocation the library makes can fail, one at a
 * time, and each failure is clean.
 *
 * Needs the library's test-only fault hook (-DFG_FAULT_INJECTION, see
 * src/api/internal.h): each fault point (context and GEMM-cache calloc, the mmap
 * of the workspace arena, tracked blocks, every oneDNN engine / stream /
 * primitive descriptor / primitive / memory object the library creates)
 * counts itself, and the armed one fails as if out of memory. Built without
 * the hook this test prints SKIP and exits 77 (ctest: skipped).
 *
 * For each scenario (fused f32 token level in several chunks, materialized
 * f32 sequence level, logits f32, fused bf16 sequence level through the
 * weight-tile GEMM path in several chunks, materialized bf16 with logits
 * rounded to bf16, the logits path in place, and a fused call in a caller
 * workspace sized by the planner: no arena is mapped), a clean run counts P fault
 * points from fg_context_create to fg_context_destroy. Then for every k in
 * [0, P): arm the k-th point, create a context and call:
 *   - the failure surfaces as FG_ERR_OUT_OF_MEMORY (library allocations) or
 *     FG_ERR_BACKEND (a oneDNN object), from fg_context_create (with *out
 *     NULL) or from the call, with a message in fg_last_error;
 *   - a failed call writes no output byte (all buffers, with slack, and the
 *     logits of an in-place call are compared with sentinels / a copy);
 *   - the same context is still usable: the call repeated with no fault
 *     succeeds with results bitwise equal to the clean run and the same
 *     library-counted memory (nothing tracked leaked);
 *   - no fault is absorbed: the bf16 capability probe in fg_context_create
 *     tells "no bf16 kernel on this CPU" (portable path) from a failure
 *     (create fails), so an OOM never silently changes the compute path.
 * Small budgets come from the planner (fg_linear_grpo_plan), not constants:
 * GEMM scratch differs by CPU.
 * Leaks of untracked memory are found by LeakSanitizer / valgrind, which
 * scripts/robustness.sh runs this test under.
 */
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#ifndef FG_FAULT_INJECTION

int main(void)
{
    printf("SKIP: the library was built without -DFG_FAULT_INJECTION (no fault hook)\n");
    return 77;
}

#else

void fg_fault_arm(long k);
long fg_fault_points(void);

enum { B = 3, T = 7, H = 19, V = 211, N = B * T, SLACK = 64 };
#define SENT 0xA5

enum { P_FUSED, P_MAT, P_LOGITS };

typedef struct scenario {
    const char *name;
    int path;
    fg_dtype dt;
    fg_is_level level;
    size_t budget; /* 0: default; 1: the planner's smallest (budget_of) */
    int round_logits, in_place;
    int workspace; /* the call runs in a caller workspace of the plan's working_bytes */
} scenario;

static const scenario SCEN[] = {
    {"fused f32 token, 3+ chunks", P_FUSED, FG_DTYPE_F32, FG_LEVEL_TOKEN, 1, 0, 0, 0},
    {"materialized f32 sequence", P_MAT, FG_DTYPE_F32, FG_LEVEL_SEQUENCE, 0, 0, 0, 0},
    {"logits f32 token", P_LOGITS, FG_DTYPE_F32, FG_LEVEL_TOKEN, 0, 0, 0, 0},
    {"fused bf16 sequence, 3+ chunks", P_FUSED, FG_DTYPE_BF16, FG_LEVEL_SEQUENCE, 1, 0, 0, 0},
    {"materialized bf16 round_logits", P_MAT, FG_DTYPE_BF16, FG_LEVEL_TOKEN, 0, 1, 0, 0},
    {"logits bf16 sequence in place", P_LOGITS, FG_DTYPE_BF16, FG_LEVEL_SEQUENCE, 0, 0, 1, 0},
    {"fused f32 token, caller workspace", P_FUSED, FG_DTYPE_F32, FG_LEVEL_TOKEN, 1, 0, 0, 1},
};
#define NSCEN (sizeof SCEN / sizeof SCEN[0])

typedef struct res {
    double loss;
    fg_metrics metrics;
    float logp[N + SLACK], ent[N + SLACK];
    float gh[N * H + SLACK], gw[V * H + SLACK], gb[V + SLACK];
    float gl[N * V + SLACK];
    uint16_t logits_io[N * V]; /* the in-place bf16 logits (input and output) */
    size_t mem_after;          /* library-counted bytes after the call */
} res;

/* The problem stored as f32 [0] and bf16 [1]; one batch (prob[0]'s). */
static tu_problem prob[2];
/* The caller workspace of the current scenario (scenario.workspace). */
static void *g_workspace;
static size_t g_workspace_bytes;
static float log32[N * V];
static uint16_t log16[N * V];
static res ref, cur, again;

static void make_inputs(void)
{
    const tu_problem_opts po = {1.0, 0.3, 0.1, 0, 0, 2};
    for (int d = 0; d < 2; d++)
        tu_problem_make_opts(&prob[d], B, T, H, V, d ? FG_DTYPE_BF16 : FG_DTYPE_F32, 1, 777, &po);
    tu_batch *tb = &prob[0].tb;
    tu_rng *rng = &prob[0].rng;
    tb->have_old = tb->have_ref = 1;
    tb->is_mode = 1;
    double lp[N]; /* a stand-in for the policy's log-probs: bits are compared, not values */
    for (int n = 0; n < N; n++) lp[n] = -5.0 + tu_uniform(rng);
    tu_batch_fill_logp(tb, lp, 0.3, 0.3, rng);
    for (int i = 0; i < N * V; i++)
        log16[i] = fg_f32_to_bf16(log32[i] = (float)(2.0 * tu_normal(rng)));
}

static void fill(res *r)
{
    tu_fill_bytes(r, offsetof(res, logits_io), SENT);
    memcpy(r->logits_io, log16, sizeof r->logits_io);
}

/* All output bytes still hold the sentinel (and the in-place logits the input). */
static int untouched(const res *r)
{
    return tu_bytes_are(r, offsetof(res, logits_io), SENT) &&
           memcmp(r->logits_io, log16, sizeof r->logits_io) == 0;
}

static int same(const res *a, const res *b)
{
    return memcmp(a, b, offsetof(res, mem_after)) == 0 && a->mem_after == b->mem_after;
}

/* plan: instead of the call, the planner's answer for it (fg_linear_grpo_plan). */
static fg_status call_or_plan(fg_context *ctx, const scenario *s, res *r, fg_linear_plan_info *plan)
{
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = FG_LOSS_GRPO;
    cfg.importance_sampling_level = s->level;
    cfg.beta = 0.04;
    cfg.entropy_coef = 0.01;
    cfg.temperature = 0.8;
    const fg_batch *batch = tu_batch_view(&prob[0].tb);
    fg_status st;
    if (s->path == P_LOGITS) {
        fg_logits_outputs out;
        memset(&out, 0, sizeof out);
        out.loss = r->loss; /* the sentinels: a failing call must leave them */
        out.metrics = r->metrics;
        out.logp = r->logp;
        out.entropy = r->ent;
        fg_matrix lm = s->dt == FG_DTYPE_BF16 ? fg_matrix_make(r->logits_io, FG_DTYPE_BF16, N, V)
                                              : fg_matrix_make(log32, FG_DTYPE_F32, N, V);
        out.grad_logits = s->in_place ? lm : fg_matrix_make(r->gl, FG_DTYPE_F32, N, V);
        st = fg_logits_grpo(ctx, &cfg, &lm, batch, &out, NULL);
        r->loss = out.loss;
        r->metrics = out.metrics;
    } else {
        fg_linear_outputs out;
        memset(&out, 0, sizeof out);
        out.loss = r->loss;
        out.metrics = r->metrics;
        out.logp = r->logp;
        out.entropy = r->ent;
        const fg_linear_inputs in = tu_problem_inputs(&prob[s->dt == FG_DTYPE_BF16]);
        out.grad_hidden = fg_matrix_make(r->gh, FG_DTYPE_F32, N, H);
        out.grad_weight = fg_matrix_make(r->gw, FG_DTYPE_F32, V, H);
        out.grad_bias = fg_vector_make(r->gb, FG_DTYPE_F32, V);
        const fg_linear_options lo = {s->path == P_FUSED ? FG_IMPL_FUSED : FG_IMPL_MATERIALIZED,
                                      s->round_logits, 0.0};
        if (plan)
            return fg_linear_grpo_plan(ctx, &lo, &cfg, &in, batch, &out, NULL, plan);
        fg_exec ex;
        fg_exec_init(&ex);
        if (s->workspace) {
            ex.workspace = g_workspace;
            ex.workspace_bytes = g_workspace_bytes;
        }
        st = fg_linear_grpo(ctx, &lo, &cfg, &in, batch, &out, &ex);
        r->loss = out.loss;
        r->metrics = out.metrics;
    }
    fg_memory_stats ms;
    fg_get_memory_stats(ctx, &ms);
    r->mem_after = ms.current_bytes;
    return st;
}

static fg_status call(fg_context *ctx, const scenario *s, res *r)
{
    return call_or_plan(ctx, s, r, NULL);
}

/* The scenario's budget: BUDGET_MIN is the planner's smallest for this CPU
 * (one token row a chunk: 21 chunks), found before any fault is armed. */
#define BUDGET_MIN ((size_t)1)
static size_t budget_of(const scenario *s)
{
    static size_t planned[16];
    const size_t i = (size_t)(s - SCEN);
    if (s->budget != BUDGET_MIN)
        return s->budget;
    if (!planned[i]) {
        fg_context *ctx = NULL;
        fg_linear_plan_info plan;
        CHECK(fg_context_create(NULL, &ctx) == FG_OK, "%s: plan context", s->name);
        CHECK(call_or_plan(ctx, s, &cur, &plan) == FG_OK, "%s: plan (%s)", s->name,
              fg_last_error(ctx));
        planned[i] = plan.min_budget_bytes;
        fg_context_destroy(ctx);
    }
    return planned[i];
}

static fg_status create(const scenario *s, fg_context **ctx)
{
    fg_context_options o;
    fg_context_options_init(&o);
    o.threads = 2;
    o.memory_budget = budget_of(s);
    return fg_context_create(&o, ctx);
}

static void run_scenario(const scenario *s)
{
    /* Clean run: the reference, and the number of fault points. */
    budget_of(s);
    fg_fault_arm(-1);
    fg_context *ctx = NULL;
    if (s->workspace) { /* sized by the planner, before the count starts */
        fg_linear_plan_info plan;
        memset(&plan, 0, sizeof plan);
        CHECK(create(s, &ctx) == FG_OK && call_or_plan(ctx, s, &cur, &plan) == FG_OK,
              "%s: plan of the workspace", s->name);
        fg_context_destroy(ctx);
        ctx = NULL;
        g_workspace_bytes = plan.working_bytes;
        g_workspace = tu_xmalloc_aligned(g_workspace_bytes);
        fg_fault_arm(-1); /* restarts the count of fault points */
    }
    fill(&ref);
    fg_status st = create(s, &ctx);
    CHECK(st == FG_OK, "%s: clean create: %s", s->name, fg_status_name(st));
    if (st != FG_OK) return;
    const long p_create = fg_fault_points();
    st = call(ctx, s, &ref);
    CHECK(st == FG_OK, "%s: clean call: %s (%s)", s->name, fg_status_name(st), fg_last_error(ctx));
    fg_context_destroy(ctx);
    const long points = fg_fault_points();
    CHECK(points > p_create, "%s: no fault point inside the call", s->name);

    long n_create = 0, n_call = 0, n_oom = 0, n_backend = 0, n_absorbed = 0;
    for (long k = 0; k < points; k++) {
        fill(&cur);
        fg_fault_arm(k);
        ctx = NULL;
        fg_context *sentinel = (fg_context *)&ref; /* create must overwrite *out */
        ctx = sentinel;
        st = create(s, &ctx);
        if (st != FG_OK) {
            n_create++;
            CHECK(ctx == NULL, "%s k=%ld: failed create left *out = %p", s->name, k, (void *)ctx);
            CHECK(st == FG_ERR_OUT_OF_MEMORY || st == FG_ERR_BACKEND, "%s k=%ld: create gave %s",
                  s->name, k, fg_status_name(st));
            n_oom += st == FG_ERR_OUT_OF_MEMORY;
            n_backend += st == FG_ERR_BACKEND;
            continue;
        }
        st = call(ctx, s, &cur);
        const long reached = fg_fault_points();
        CHECK(reached > k, "%s k=%ld: the armed point was not reached (%ld points)", s->name, k,
              reached);
        if (st == FG_OK) {
            n_absorbed++;
            CHECK(0, "%s k=%ld: a fault was ignored (%s)", s->name, k,
                  k < p_create ? "in create" : "in the call");
        } else {
            n_call++;
            n_oom += st == FG_ERR_OUT_OF_MEMORY;
            n_backend += st == FG_ERR_BACKEND;
            CHECK(st == FG_ERR_OUT_OF_MEMORY || st == FG_ERR_BACKEND, "%s k=%ld: call gave %s (%s)",
                  s->name, k, fg_status_name(st), fg_last_error(ctx));
            CHECK(fg_last_error(ctx)[0] != '\0', "%s k=%ld: empty fg_last_error", s->name, k);
            CHECK(untouched(&cur), "%s k=%ld: %s wrote outputs (%s)", s->name, k,
                  fg_status_name(st), fg_last_error(ctx));
            /* The context survives: the same call with no fault gives the clean results. */
            fg_fault_arm(-1);
            fill(&again);
            fg_status st2 = call(ctx, s, &again);
            CHECK(st2 == FG_OK, "%s k=%ld: retry after the fault: %s (%s)", s->name, k,
                  fg_status_name(st2), fg_last_error(ctx));
            CHECK(st2 != FG_OK || same(&again, &ref),
                  "%s k=%ld: retry differs from the clean run (memory %zu vs %zu bytes)", s->name,
                  k, again.mem_after, ref.mem_after);
        }
        fg_context_destroy(ctx);
    }
    fg_fault_arm(-1);
    printf("%-40s %3ld fault points: %3ld in create, %3ld in the call (%ld OOM, %ld backend), "
           "%ld absorbed\n",
           s->name, points, n_create, n_call, n_oom, n_backend, n_absorbed);
    free(g_workspace);
    g_workspace = NULL;
    g_workspace_bytes = 0;
}

int main(void)
{
    make_inputs();
    for (size_t i = 0; i < NSCEN; i++)
        run_scenario(&SCEN[i]);
    /* fg_context_create with no fault hook armed after all that still works. */
    fg_context *ctx = NULL;
    CHECK(fg_context_create(NULL, &ctx) == FG_OK, "%s", "final create");
    fg_context_destroy(ctx);
    tu_problem_free(&prob[0]);
    tu_problem_free(&prob[1]);
    return tu_finish();
}

#endif
