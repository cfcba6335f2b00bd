/*
 * A vocab shard that fails mid-call stops every shard, none waiting in a
 * reduction (fg_communicator's failure flag and exit agreement).
 *
 * Needs the library's test-only fault hook (-DFG_FAULT_INJECTION): the k-th
 * GEMM execution of the process fails (fg_fault_exec_arm), after the entry
 * agreement, while outputs are being written. Three shards run as threads
 * (fake_comm.h) through a fused call of several chunks, token level (one
 * sweep: MAX, SUM, grad_hidden's SUM per chunk) and sequence level (a forward
 * sweep, then a gradient sweep with only grad_hidden's SUM), and for every k
 * of a clean run's executions: every shard returns FG_ERR_BACKEND, the
 * shards made the same number of reductions (checked by the communicator:
 * a count mismatch fails the call), and all of them return (a hang would be
 * killed by ctest's timeout and fail). Then the same contexts run clean.
 * Also with no fault: the entry agreement of shards that disagree (a token id
 * differs on one shard) returns FG_ERR_COMMUNICATOR on every shard.
 * Built without the hook, the fault part prints SKIP; the rest runs.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "fake_comm.h"
#include "test_util.h"

#ifdef FG_FAULT_INJECTION
void fg_fault_exec_arm(long k);
long fg_fault_exec_points(void);
#endif

enum { SHARDS = 3, B = 3, T = 9, H = 17, V = 229, N = B * T };

typedef struct job {
    fg_context *ctx;
    const fg_loss_config *cfg;
    const fg_batch *batch;
    fg_linear_inputs in;
    fg_linear_outputs out;
    fg_exec exec;
    fg_status status;
} job;

static void *run_shard(void *arg)
{
    job *j = arg;
    j->status = fg_linear_grpo(j->ctx, NULL, j->cfg, &j->in, j->batch, &j->out, &j->exec);
    return NULL;
}

/* Runs the three shards once, each in its thread. */
static void run_all(job *jobs)
{
    pthread_t th[SHARDS];
    for (int r = 0; r < SHARDS; r++)
        pthread_create(&th[r], NULL, run_shard, &jobs[r]);
    for (int r = 0; r < SHARDS; r++)
        pthread_join(th[r], NULL);
}

typedef struct setup {
    tu_problem prob;
    fake_comm *comm;
    job jobs[SHARDS];
    float *gh[SHARDS], *gw;
    fg_loss_config cfg;
} setup;

static void make(setup *s, fg_is_level level)
{
    tu_problem_make(&s->prob, B, T, H, V, FG_DTYPE_F32, 1, 17);
    tu_problem_fill_logp(&s->prob, 1.0, 0.2, 0.2);
    s->prob.tb.is_mode = 0;
    const fg_batch *batch = tu_batch_view(&s->prob.tb);
    fg_loss_config_init(&s->cfg);
    s->cfg.loss_type = FG_LOSS_GRPO;
    s->cfg.importance_sampling_level = level;
    s->comm = fake_comm_create(SHARDS);
    s->gw = tu_xmalloc((size_t)V * H * sizeof(float));
    for (int r = 0; r < SHARDS; r++) {
        const int64_t v0 = V * r / SHARDS, vl = V * (r + 1) / SHARDS - v0;
        job *j = &s->jobs[r];
        memset(j, 0, sizeof *j);
        fg_context_options o;
        fg_context_options_init(&o);
        o.threads = 1;
        o.comm = fake_comm_rank(s->comm, r);
        fg_context_create(&o, &j->ctx);
        j->cfg = &s->cfg;
        j->batch = batch;
        j->in = tu_problem_inputs(&s->prob);
        j->in.weight = fg_matrix_make((float *)s->prob.weight_s + v0 * H, FG_DTYPE_F32, vl, H);
        j->in.bias = fg_vector_make((float *)s->prob.bias_s + v0, FG_DTYPE_F32, vl);
        j->in.vocab_start = v0;
        j->in.vocab_total = V;
        s->gh[r] = tu_xmalloc((size_t)N * H * sizeof(float));
        j->out.grad_hidden = fg_matrix_make(s->gh[r], FG_DTYPE_F32, N, H);
        j->out.grad_weight = fg_matrix_make(s->gw + v0 * H, FG_DTYPE_F32, vl, H);
        /* The planner's smallest budget plus a few rows: several chunks. */
        fg_linear_plan_info pi;
        memset(&pi, 0, sizeof pi);
        fg_exec_init(&j->exec);
        CHECK(fg_linear_grpo_plan(j->ctx, NULL, &s->cfg, &j->in, batch, &j->out, NULL, &pi) ==
                  FG_OK,
              "plan: %s", fg_last_error(j->ctx));
        j->exec.memory_budget = pi.min_budget_bytes + (size_t)(4 * vl * 8);
    }
}

static void unmake(setup *s)
{
    for (int r = 0; r < SHARDS; r++) {
        fg_context_destroy(s->jobs[r].ctx);
        free(s->gh[r]);
    }
    free(s->gw);
    fake_comm_destroy(s->comm);
    tu_problem_free(&s->prob);
}

static int all_are(const setup *s, fg_status want)
{
    int ok = 1;
    for (int r = 0; r < SHARDS; r++)
        ok &= s->jobs[r].status == want;
    return ok;
}

#ifdef FG_FAULT_INJECTION
static void check_midcall(fg_is_level level)
{
    const char *lv = level == FG_LEVEL_TOKEN ? "token" : "sequence";
    setup s;
    make(&s, level);
    fg_fault_exec_arm(-1);
    run_all(s.jobs);
    CHECK(all_are(&s, FG_OK), "%s: the clean run failed: %s", lv, fg_last_error(s.jobs[0].ctx));
    fg_memory_stats ms;
    fg_get_memory_stats(s.jobs[0].ctx, &ms);
    CHECK(ms.chunks > 2, "%s: %lld chunks, several wanted", lv, (long long)ms.chunks);
    fg_fault_exec_arm(-1);
    run_all(s.jobs);
    const long execs = fg_fault_exec_points();
    int stopped = 0;
    for (long k = 0; k < execs; k++) {
        fg_fault_exec_arm(k);
        run_all(s.jobs);
        const int ok = all_are(&s, FG_ERR_BACKEND);
        CHECK(ok, "%s k=%ld: statuses %s %s %s", lv, k, fg_status_name(s.jobs[0].status),
              fg_status_name(s.jobs[1].status), fg_status_name(s.jobs[2].status));
        stopped += ok;
    }
    fg_fault_exec_arm(-1);
    run_all(s.jobs); /* the contexts survive */
    CHECK(all_are(&s, FG_OK), "%s: after the faults: %s", lv, fg_last_error(s.jobs[0].ctx));
    printf("%-8s level: %ld GEMM executions over 3 shards; a failure at each stopped every shard "
           "with FG_ERR_BACKEND (%d of %ld)\n",
           lv, execs, stopped, execs);
    unmake(&s);
}
#endif

/* One shard's token id differs: the entry agreement's hash catches it. */
static void check_disagreement(void)
{
    setup s;
    make(&s, FG_LEVEL_TOKEN);
    int64_t *ids = tu_xmalloc((size_t)N * sizeof(int64_t));
    memcpy(ids, s.prob.tb.token_ids, (size_t)N * sizeof(int64_t));
    int64_t n = 0;
    while (!s.prob.tb.mask[n])
        n++;
    ids[n] = (ids[n] + 1) % V;
    fg_batch other = *s.jobs[1].batch;
    other.token_ids = ids;
    s.jobs[1].batch = &other;
    run_all(s.jobs);
    CHECK(all_are(&s, FG_ERR_COMMUNICATOR), "disagreement: statuses %s %s %s",
          fg_status_name(s.jobs[0].status), fg_status_name(s.jobs[1].status),
          fg_status_name(s.jobs[2].status));
    printf("shards that disagree on a token id: every shard returned %s\n",
           fg_status_name(s.jobs[0].status));
    free(ids);
    unmake(&s);
}

int main(void)
{
    check_disagreement();
#ifdef FG_FAULT_INJECTION
    check_midcall(FG_LEVEL_TOKEN);
    check_midcall(FG_LEVEL_SEQUENCE);
#else
    printf("SKIP (mid-call faults): the library was built without -DFG_FAULT_INJECTION\n");
#endif
    return tu_finish();
}
