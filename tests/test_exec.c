/*
 * test_exec: per-call execution options (fg_exec) and what the context
 * reports about the last call.
 *
 *  - Budget per call: one context serving calls of several budgets gives the
 *    same bits, chunks and counted peak as one context created per budget
 *    (fg_context_options.memory_budget), and fg_memory_stats.budget_bytes is
 *    the budget of the last call that ran. (Threads per call: test_threads.)
 *  - Last-call figures: a plan query, and calls that fail (bad argument,
 *    budget too small, refused workspace), leave budget_bytes, chunk_rows,
 *    chunks and gemm_flops as the last call that ran left them.
 *  - Caller workspace (fg_exec.workspace), for the fused path (at the default
 *    budget and at a budget that cuts the tokens into chunks) and the
 *    materialized path, f32 and bf16: a workspace of exactly the planner's
 *    working_bytes (filled with garbage first) works and gives the same bits
 *    as the context's own arena at the same budget; one page less is
 *    refused with FG_ERR_BUDGET_TOO_SMALL and writes no output; a misaligned
 *    one is refused with FG_ERR_INVALID_SIZE. While a caller workspace is
 *    used the context maps no arena: current_bytes does not move (none held,
 *    or the arena of an earlier call, untouched) and the peak counts the
 *    workspace's working_bytes and nothing more. The logits path runs in a
 *    caller workspace too.
 */
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { B = 4, T = 50, H = 61, V = 2053, N = B * T };

#define SENT 0xA5

static fg_loss_config cfg;

static fg_context *make_ctx(size_t budget)
{
    fg_context_options o;
    fg_context_options_init(&o);
    o.threads = 2;
    o.memory_budget = budget;
    fg_context *c = NULL;
    if (fg_context_create(&o, &c) != FG_OK)
        return NULL;
    return c;
}

static fg_exec exec_of(size_t budget, void *workspace, size_t bytes)
{
    fg_exec e;
    fg_exec_init(&e);
    e.memory_budget = budget;
    e.workspace = workspace;
    e.workspace_bytes = bytes;
    return e;
}

/* The last-call figures of fg_memory_stats (not the memory counters). */
static int same_last_call(const fg_memory_stats *a, const fg_memory_stats *b)
{
    return a->budget_bytes == b->budget_bytes && a->chunk_rows == b->chunk_rows &&
           a->chunks == b->chunks && a->gemm_flops == b->gemm_flops &&
           a->gemm_seconds == b->gemm_seconds && a->call_seconds == b->call_seconds;
}

/* ------------------------------------------------------ budget per call */

/* min_budget: the planner's smallest; chunked: a budget with several chunks
 * (main). */
static void budget_per_call(const tu_problem *p, size_t min_budget, size_t chunked)
{
    const size_t budgets[4] = {0, 2 * chunked - min_budget, min_budget, chunked};
    const fg_linear_inputs in = tu_problem_inputs(p);
    const fg_batch *batch = &p->tb.view;
    fg_context *shared = make_ctx(0);
    CHECK(shared != NULL, "%s", "shared context");
    if (!shared)
        return;
    for (int k = 0; k < 4; k++) {
        const size_t b = budgets[k];
        const size_t effective = b ? b : FG_DEFAULT_MEMORY_BUDGET;
        fg_context *own = make_ctx(b);
        tu_linear_outs r_own, r_shared;
        tu_linear_outs_make(&r_own, N, H, V, 1);
        tu_linear_outs_make(&r_shared, N, H, V, 1);
        fg_exec e = exec_of(b, NULL, 0);
        fg_release_workspace(shared);
        fg_reset_peak_memory(shared);
        fg_status s1 = fg_linear_grpo(shared, NULL, &cfg, &in, batch, &r_shared.out, &e);
        fg_memory_stats st_shared, st_own;
        fg_get_memory_stats(shared, &st_shared);
        fg_status s2 = own ? fg_linear_grpo(own, NULL, &cfg, &in, batch, &r_own.out, NULL)
                           : FG_ERR_OUT_OF_MEMORY;
        if (own)
            fg_get_memory_stats(own, &st_own);
        CHECK(s1 == FG_OK && s2 == FG_OK, "budget %zu: per call %s, per context %s", effective,
              fg_status_name(s1), fg_status_name(s2));
        if (s1 == FG_OK && s2 == FG_OK) {
            CHECK(tu_linear_outs_same(&r_shared, &r_own),
                  "budget %zu: per call and per context give different bits", effective);
            CHECK(st_shared.chunk_rows == st_own.chunk_rows && st_shared.chunks == st_own.chunks &&
                      st_shared.peak_bytes == st_own.peak_bytes,
                  "budget %zu: per call %lld rows x %lld chunks, peak %zu; per context %lld x "
                  "%lld, peak %zu", effective, (long long)st_shared.chunk_rows,
                  (long long)st_shared.chunks, st_shared.peak_bytes, (long long)st_own.chunk_rows,
                  (long long)st_own.chunks, st_own.peak_bytes);
            CHECK(st_shared.budget_bytes == effective && st_own.budget_bytes == effective,
                  "budget_bytes %zu (per call) / %zu (per context), the call's %zu",
                  st_shared.budget_bytes, st_own.budget_bytes, effective);
            CHECK(st_shared.peak_bytes <= effective, "budget %zu: peak %zu", effective,
                  st_shared.peak_bytes);
        }
        printf("budget %9zu: %3lld rows x %2lld chunks, peak %8zu bytes, per call = per context: "
               "%s\n", effective, (long long)st_shared.chunk_rows, (long long)st_shared.chunks,
               st_shared.peak_bytes, tu_linear_outs_same(&r_shared, &r_own) ? "yes" : "NO");
        tu_linear_outs_free(&r_own);
        tu_linear_outs_free(&r_shared);
        fg_context_destroy(own);
    }
    fg_context_destroy(shared);
}

/* ------------------------------------------------- last-call figures */

static void last_call_figures(const tu_problem *p, size_t min_budget, size_t chunked)
{
    const fg_linear_inputs in = tu_problem_inputs(p);
    const fg_batch *batch = &p->tb.view;
    fg_context *ctx = make_ctx(0);
    CHECK(ctx != NULL, "%s", "context");
    if (!ctx)
        return;
    tu_linear_outs o;
    tu_linear_outs_make(&o, N, H, V, 1);
    fg_exec e = exec_of(chunked, NULL, 0);
    fg_status s = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &o.out, &e);
    CHECK(s == FG_OK, "first call: %s (%s)", fg_status_name(s), fg_last_error(ctx));
    fg_memory_stats ran, now;
    fg_get_memory_stats(ctx, &ran);
    CHECK(ran.budget_bytes == chunked && ran.chunks > 1 && ran.gemm_flops > 0,
          "after a call at %zu: budget_bytes %zu, %lld chunks, %lld flops", chunked,
          ran.budget_bytes, (long long)ran.chunks, (long long)ran.gemm_flops);

    /* a plan query at another budget (one that runs on any CPU) */
    fg_linear_plan_info plan;
    const size_t other = 2 * chunked - min_budget;
    fg_exec e2 = exec_of(other, NULL, 0);
    s = fg_linear_grpo_plan(ctx, NULL, &cfg, &in, batch, &o.out, &e2, &plan);
    fg_get_memory_stats(ctx, &now);
    CHECK(s == FG_OK && same_last_call(&ran, &now),
          "a plan query changed the last call's figures: budget %zu -> %zu, rows %lld -> %lld",
          ran.budget_bytes, now.budget_bytes, (long long)ran.chunk_rows,
          (long long)now.chunk_rows);

    /* failed calls: a bad argument, a budget below the smallest, a refused workspace */
    fg_batch bad = *batch;
    bad.advantages = NULL;
    tu_linear_outs_fill(&o, SENT);
    s = fg_linear_grpo(ctx, NULL, &cfg, &in, &bad, &o.out, &e2);
    fg_get_memory_stats(ctx, &now);
    CHECK(s == FG_ERR_NULL_ARGUMENT && same_last_call(&ran, &now),
          "a refused call (%s) changed the last call's figures: budget %zu -> %zu",
          fg_status_name(s), ran.budget_bytes, now.budget_bytes);
    fg_exec e3 = exec_of(min_budget - 4096, NULL, 0);
    s = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &o.out, &e3);
    fg_get_memory_stats(ctx, &now);
    CHECK(s == FG_ERR_BUDGET_TOO_SMALL && same_last_call(&ran, &now),
          "a call over budget (%s) changed the last call's figures: budget %zu -> %zu",
          fg_status_name(s), ran.budget_bytes, now.budget_bytes);
    unsigned char *buf = tu_xmalloc_aligned(8192 + 64);
    fg_exec e4 = exec_of(0, buf + 8, 8192);
    s = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &o.out, &e4);
    fg_get_memory_stats(ctx, &now);
    CHECK(s == FG_ERR_INVALID_SIZE && same_last_call(&ran, &now),
          "a misaligned workspace (%s) changed the last call's figures", fg_status_name(s));
    CHECK(tu_linear_outs_are(&o, SENT), "%s", "a refused call wrote an output");
    free(buf);

    /* and the next call that runs replaces them */
    s = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &o.out, &e2);
    fg_get_memory_stats(ctx, &now);
    CHECK(s == FG_OK && now.budget_bytes == other && now.chunk_rows == plan.chunk_rows &&
              now.chunks == plan.chunks,
          "after a call at %zu: budget_bytes %zu, rows %lld (planned %lld)", other,
          now.budget_bytes, (long long)now.chunk_rows, (long long)plan.chunk_rows);
    tu_linear_outs_free(&o);
    fg_context_destroy(ctx);
}

/* ------------------------------------------------- caller workspace */

/* chunked: the fused path at the planner's smallest budget for p plus a
 * third of its one-chunk plan's chunk bytes (several chunks on any CPU),
 * else at the default budget (one chunk here). */
static void caller_workspace(const tu_problem *p, fg_impl impl, int chunked)
{
    const fg_linear_inputs in = tu_problem_inputs(p);
    const fg_batch *batch = &p->tb.view;
    const fg_linear_options lo = {impl, 0, 0.0};
    size_t budget = 0;
    if (chunked) {
        fg_context *c = make_ctx(0);
        tu_linear_outs o;
        tu_linear_outs_make(&o, N, H, V, 1);
        fg_linear_plan_info plan;
        CHECK(c && fg_linear_grpo_plan(c, &lo, &cfg, &in, batch, &o.out, NULL, &plan) == FG_OK,
              "%s", "plan for the chunked budget");
        budget = plan.min_budget_bytes + plan.chunk_bytes / 3;
        tu_linear_outs_free(&o);
        fg_context_destroy(c);
    }
    char tag[96];
    snprintf(tag, sizeof tag, "%s %s budget %zu", impl == FG_IMPL_FUSED ? "fused" : "materialized",
             p->dtype == FG_DTYPE_BF16 ? "bf16" : "f32",
             budget ? budget : FG_DEFAULT_MEMORY_BUDGET);
    fg_context *arena_ctx = make_ctx(0), *ctx = make_ctx(0);
    CHECK(arena_ctx && ctx, "%s: contexts", tag);
    if (!arena_ctx || !ctx) {
        fg_context_destroy(arena_ctx);
        fg_context_destroy(ctx);
        return;
    }
    tu_linear_outs ref, got;
    tu_linear_outs_make(&ref, N, H, V, 1);
    tu_linear_outs_make(&got, N, H, V, 1);

    /* the plan and the reference call, on the context's arena */
    const fg_exec plain = exec_of(budget, NULL, 0);
    fg_linear_plan_info plan;
    fg_status s = fg_linear_grpo_plan(arena_ctx, &lo, &cfg, &in, batch, &ref.out, &plain, &plan);
    CHECK(s == FG_OK && plan.working_bytes > 4096, "%s: plan %s, working_bytes %zu", tag,
          fg_status_name(s), plan.working_bytes);
    if (s != FG_OK || plan.working_bytes <= 4096)
        goto out;
    s = fg_linear_grpo(arena_ctx, &lo, &cfg, &in, batch, &ref.out, &plain);
    CHECK(s == FG_OK, "%s: arena call %s (%s)", tag, fg_status_name(s), fg_last_error(arena_ctx));

    /* exactly working_bytes, holding garbage, on a context with no arena */
    const size_t W = plan.working_bytes;
    unsigned char *ws = tu_xmalloc_aligned(W + 64);
    memset(ws, 0x5A, W + 64);
    fg_release_workspace(ctx);
    fg_reset_peak_memory(ctx);
    fg_memory_stats before, after;
    fg_get_memory_stats(ctx, &before);
    fg_exec e = exec_of(budget, ws, W);
    tu_linear_outs_fill(&got, SENT);
    s = fg_linear_grpo(ctx, &lo, &cfg, &in, batch, &got.out, &e);
    fg_get_memory_stats(ctx, &after);
    CHECK(s == FG_OK, "%s: workspace of working_bytes %zu: %s (%s)", tag, W, fg_status_name(s),
          fg_last_error(ctx));
    const int same = s == FG_OK && tu_linear_outs_same(&got, &ref);
    CHECK(same, "%s: a workspace of working_bytes (%zu) gives other bits than the arena (%lld rows "
          "x %lld chunks, planned %lld x %lld)", tag, W, (long long)after.chunk_rows,
          (long long)after.chunks, (long long)plan.chunk_rows, (long long)plan.chunks);
    CHECK(after.current_bytes == before.current_bytes,
          "%s: current_bytes %zu -> %zu with a caller workspace", tag, before.current_bytes,
          after.current_bytes);
    CHECK(after.peak_bytes == before.current_bytes + W,
          "%s: peak %zu with a caller workspace of %zu (current %zu): it counts the workspace "
          "and nothing else", tag, after.peak_bytes, W, before.current_bytes);
    CHECK(tu_bytes_are(ws + W, 64, 0x5A), "%s: written past workspace_bytes", tag);
    printf("%-34s working_bytes %8zu: workspace call %s, same bits as the arena: %s, "
           "current %zu -> %zu, peak %zu\n", tag, W, fg_status_name(s), same ? "yes" : "NO",
           before.current_bytes, after.current_bytes, after.peak_bytes);

    /* a page less: refused, nothing written, no figures changed */
    fg_memory_stats ran = after;
    tu_linear_outs_fill(&got, SENT);
    e = exec_of(budget, ws, W - 4096);
    s = fg_linear_grpo(ctx, &lo, &cfg, &in, batch, &got.out, &e);
    fg_get_memory_stats(ctx, &after);
    CHECK(s == FG_ERR_BUDGET_TOO_SMALL, "%s: a workspace of working_bytes - 4096 = %zu: %s, want "
          "FG_ERR_BUDGET_TOO_SMALL (%lld rows x %lld chunks)", tag, W - 4096, fg_status_name(s),
          (long long)after.chunk_rows, (long long)after.chunks);
    if (s != FG_OK) {
        CHECK(tu_linear_outs_are(&got, SENT), "%s: the refused call wrote an output", tag);
        CHECK(same_last_call(&ran, &after) && after.current_bytes == ran.current_bytes,
              "%s: the refused call changed the context's figures", tag);
    }

    /* misaligned: refused before anything else */
    tu_linear_outs_fill(&got, SENT);
    e = exec_of(budget, ws + 16, W - 64);
    s = fg_linear_grpo(ctx, &lo, &cfg, &in, batch, &got.out, &e);
    CHECK(s == FG_ERR_INVALID_SIZE && tu_linear_outs_are(&got, SENT),
          "%s: a misaligned workspace: %s", tag, fg_status_name(s));

    /* a context that holds an arena already: the workspace call leaves it be */
    s = fg_linear_grpo(ctx, &lo, &cfg, &in, batch, &got.out, &plain);
    fg_get_memory_stats(ctx, &before);
    CHECK(s == FG_OK && before.current_bytes > 0, "%s: arena call %s, current %zu", tag,
          fg_status_name(s), before.current_bytes);
    e = exec_of(budget, ws, W);
    s = fg_linear_grpo(ctx, &lo, &cfg, &in, batch, &got.out, &e);
    fg_get_memory_stats(ctx, &after);
    CHECK(s == FG_OK && after.current_bytes == before.current_bytes,
          "%s: with an arena held, a workspace call: %s, current %zu -> %zu", tag,
          fg_status_name(s), before.current_bytes, after.current_bytes);
    free(ws);
    /* the library kept no pointer to the freed workspace (ASan would see it) */
    s = fg_linear_grpo(ctx, &lo, &cfg, &in, batch, &got.out, &plain);
    CHECK(s == FG_OK && tu_linear_outs_same(&got, &ref), "%s: arena call after the workspace: %s",
          tag, fg_status_name(s));
out:
    tu_linear_outs_free(&ref);
    tu_linear_outs_free(&got);
    fg_context_destroy(arena_ctx);
    fg_context_destroy(ctx);
}

/* The logits path: its per-token arrays come out of the caller's workspace. */
static void logits_workspace(const tu_problem *p)
{
    double *z = tu_problem_logits(p);
    float *lg = tu_store_matrix(z, N, V, V, FG_DTYPE_F32);
    free(z);
    const fg_matrix lm = fg_matrix_make(lg, FG_DTYPE_F32, N, V);
    float *gl[2], *lp[2];
    fg_logits_outputs out[2];
    for (int k = 0; k < 2; k++) {
        gl[k] = tu_xmalloc(sizeof(float) * N * V);
        lp[k] = tu_xmalloc(sizeof(float) * N);
        memset(&out[k], 0, sizeof out[k]);
        out[k].logp = lp[k];
        out[k].grad_logits = fg_matrix_make(gl[k], FG_DTYPE_F32, N, V);
    }
    fg_context *ctx = make_ctx(0);
    const size_t bytes = (size_t)1 << 20;
    unsigned char *ws = tu_xmalloc_aligned(bytes);
    fg_exec e = exec_of(0, ws, bytes);
    fg_release_workspace(ctx);
    fg_memory_stats before, after;
    fg_get_memory_stats(ctx, &before);
    fg_status s1 = fg_logits_grpo(ctx, &cfg, &lm, &p->tb.view, &out[0], &e);
    fg_get_memory_stats(ctx, &after);
    fg_status s2 = fg_logits_grpo(ctx, &cfg, &lm, &p->tb.view, &out[1], NULL);
    CHECK(s1 == FG_OK && s2 == FG_OK, "logits: workspace %s, arena %s (%s)", fg_status_name(s1),
          fg_status_name(s2), fg_last_error(ctx));
    CHECK(memcmp(&out[0].loss, &out[1].loss, sizeof out[0].loss) == 0 &&
              memcmp(lp[0], lp[1], sizeof(float) * N) == 0 &&
              memcmp(gl[0], gl[1], sizeof(float) * N * V) == 0,
          "%s", "logits: a caller workspace gives other bits than the arena");
    CHECK(after.current_bytes == before.current_bytes, "logits: current %zu -> %zu",
          before.current_bytes, after.current_bytes);
    free(ws);
    for (int k = 0; k < 2; k++) {
        free(gl[k]);
        free(lp[k]);
    }
    free(lg);
    fg_context_destroy(ctx);
}

int main(void)
{
    fg_loss_config_init(&cfg);
    cfg.loss_type = FG_LOSS_GRPO;
    cfg.beta = 0.04;
    cfg.entropy_coef = 0.01;
    tu_problem prob[2];
    for (int d = 0; d < 2; d++) {
        tu_problem_make(&prob[d], B, T, H, V, d ? FG_DTYPE_BF16 : FG_DTYPE_F32, 1, 4711);
        /* a stand-in for the policy's log-probs: bits are compared here, not values */
        double lp[N];
        for (int n = 0; n < N; n++) lp[n] = -7.5 + tu_uniform(&prob[d].rng);
        prob[d].tb.have_old = prob[d].tb.have_ref = 1;
        prob[d].tb.is_mode = 1;
        tu_batch_fill_logp(&prob[d].tb, lp, 0.2, 0.2, &prob[d].rng);
        tu_batch_view(&prob[d].tb);
    }

    /* the planner's smallest budget for the f32 call (one row a chunk), and one
     * with several chunks: that plus a third of the one-chunk plan's chunk
     * bytes (not a multiple of the smallest: where GEMM scratch dominates it,
     * as on AVX-512, a multiple holds every row in one chunk) */
    size_t min_budget = 0, chunked = 0;
    {
        fg_context *c = make_ctx(0);
        tu_linear_outs o;
        tu_linear_outs_make(&o, N, H, V, 1);
        const fg_linear_inputs in = tu_problem_inputs(&prob[0]);
        fg_linear_plan_info plan;
        CHECK(c && fg_linear_grpo_plan(c, NULL, &cfg, &in, &prob[0].tb.view, &o.out, NULL,
                                       &plan) == FG_OK,
              "%s", "plan");
        min_budget = plan.min_budget_bytes;
        chunked = plan.min_budget_bytes + plan.chunk_bytes / 3;
        tu_linear_outs_free(&o);
        fg_context_destroy(c);
    }
    budget_per_call(&prob[0], min_budget, chunked);
    last_call_figures(&prob[0], min_budget, chunked);
    for (int d = 0; d < 2; d++) {
        caller_workspace(&prob[d], FG_IMPL_FUSED, 0);
        caller_workspace(&prob[d], FG_IMPL_FUSED, 1);
        caller_workspace(&prob[d], FG_IMPL_MATERIALIZED, 0);
    }
    logits_workspace(&prob[0]);
    tu_problem_free(&prob[0]);
    tu_problem_free(&prob[1]);
    return tu_finish();
}
