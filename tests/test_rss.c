/*
 * test_rss: the memory budget holds for the process's real memory, not only
 * for the library's own count.
 *
 * One fused fg_linear_grpo call at the default budget (FG_DEFAULT_MEMORY_BUDGET,
 * 256 MiB) on a shape where the budget binds: B = 1, H = 256, V = 151936
 * (Qwen's vocabulary), f32, every output and gradient wanted, and T the
 * longest that the planner (fg_linear_grpo_plan) cuts into two chunks on
 * this CPU: two chunks of the most rows the budget holds, which fill it
 * (858 on AVX2, 2 x 429: logits alone of T*V*4 = 497 MiB; fewer
 * where oneDNN asks for more GEMM scratch). A T that splits into chunks
 * leaving part of the budget unused would test less: equal chunks one more
 * than the fewest that fit are shorter than the budget holds (on Zen 4 at
 * T = 874, 2 x 437 on AVX2: 3 chunks of 312 rows, 73% of it), so T is found
 * here rather than fixed. The planner sizes chunks with room for 8 GEMM
 * scratchpads whatever the thread count (their size is oneDNN's, per CPU), so
 * the fill is checked on the plan for 8 threads: one more row a chunk must
 * not fit beside its working_bytes. The fill on this call's 2 threads is
 * printed.
 *
 *   working RSS = VmHWM during the call - VmRSS just before it
 *
 * with the inputs and outputs allocated and touched before, the context's
 * workspace released (fg_release_workspace), and VmHWM reset to the current
 * RSS by writing "5" to /proc/self/clear_refs (Linux >= 4.0; where that
 * fails, or under a sanitizer, the test is skipped: exit 77). Everything the
 * call makes resident counts: the arena, oneDNN's own allocations outside the
 * scratchpads the library hands it (JIT code, packing buffers), thread
 * stacks. It must stay within the budget + 5%.
 *
 * Measured twice: the first call on a fresh context (the GEMMs created and
 * JIT-compiled inside the call) and a second one (the GEMMs cached, the
 * arena released again before it). Prints working RSS, the budget, their
 * ratio and the library's counted peak.
 *
 * The bounds. A steady-state call (the second) must stay within budget + 5%
 * (measured: 1.000 on Zen 5 and on AVX2). The first call is held to
 * budget + 25% by default, and to budget + 5% with `--first-call-bound 1.05`,
 * which CMake runs as test_rss_mmap_threshold under
 * GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072 (measured there: 1.025
 * first, 1.010 second, on AVX2).
 *
 * Why the first call exceeds the budget without that setting. oneDNN 2.6's
 * sgemm ("gemm:jit": every f32 product on AVX2, the transposed ones
 * elsewhere) posix_memaligns a 1.4 MiB packing buffer for every block it
 * runs and frees it, outside any scratchpad the library can hand it (2.6 has
 * no allocator hook). The first one is mmapped; freeing it raises glibc's
 * dynamic mmap threshold above 1.4 MiB, and from then on the buffers come
 * from each thread's heap. glibc 2.36's memalign asks its heap for the size
 * plus the alignment slack, so a freed buffer (trimmed to the exact size) is
 * never big enough for the next one: each new buffer extends the heap and the
 * old ones stay resident as free chunks until neighbours coalesce. Seen with
 * malloc_info after the first call on AVX2 (2 threads): the worker thread's
 * heap held 28 free chunks of 1,468,017-1,468,113 bytes (41 MB) in most runs
 * (17 of 20: working RSS 1.178 x the budget), 6 in the rest (1.060), which
 * of the two depending on how the threads' first frees interleave. Later
 * calls reuse them (1.000). The library can bound this only process-wide
 * (mallopt, or the tunable above, which keeps every buffer mmapped), which
 * is the caller's choice, not a library's.
 */
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

/* Sanitizers keep freed memory in quarantine and shadow every byte: the
 * resident size then measures them, not the library. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FG_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define FG_TEST_SANITIZED 1
#endif
#endif

enum { B = 1, T_MOST = 1600, H = 256, V = 151936 };

/* A kB field ("VmRSS:", "VmHWM:") of /proc/self/status, in bytes; -1 if absent. */
static long long status_bytes(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return -1;
    char line[256];
    long long kb = -1;
    const size_t n = strlen(field);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, field, n) == 0) {
            kb = atoll(line + n);
            break;
        }
    fclose(f);
    return kb < 0 ? -1 : kb * 1024;
}

/* Resets VmHWM to the current RSS. 0 on success. */
static int reset_hwm(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f)
        return -1;
    const int ok = fputs("5", f) >= 0;
    return fclose(f) == 0 && ok ? 0 : -1;
}

/* The batch of T tokens the call scores (old and reference log-probs around
 * log(1/V)). */
static void make_batch(tu_batch *tb, int64_t T, tu_rng *rng)
{
    tu_batch_make(tb, B, T, V, 0, rng);
    tb->have_old = tb->have_ref = 1;
    tb->is_mode = 1;
    double *lp = tu_xmalloc(sizeof(double) * (size_t)(B * T));
    for (int64_t n = 0; n < B * T; n++) lp[n] = -12.0 + tu_uniform(rng);
    tu_batch_fill_logp(tb, lp, 0.2, 0.2, rng);
    free(lp);
}

/* The plan of a call on T tokens: *tb made (the caller frees it), in->hidden and
 * o->out.grad_hidden set to T rows. */
static fg_status plan_for(fg_context *ctx, int64_t T, const fg_loss_config *cfg,
                          fg_linear_inputs *in, tu_linear_outs *o, tu_batch *tb, tu_rng *rng,
                          float *hidden, fg_linear_plan_info *plan)
{
    make_batch(tb, T, rng);
    in->hidden = fg_matrix_make(hidden, FG_DTYPE_F32, B * T, H);
    o->out.grad_hidden = fg_matrix_make(o->grad_hidden, FG_DTYPE_F32, B * T, H);
    memset(plan, 0, sizeof *plan);
    return fg_linear_grpo_plan(ctx, NULL, cfg, in, tu_batch_view(tb), &o->out, NULL, plan);
}

/* A cheap uniform in [-1, 1): 40 M draws of Box-Muller would take seconds. */
static float unit(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 40) * (2.0 / 16777216.0) - 1.0);
}

int main(int argc, char **argv)
{
    double first_bound = 1.25; /* see the opening comment */
    if (argc == 3 && strcmp(argv[1], "--first-call-bound") == 0)
        first_bound = atof(argv[2]);
#ifdef FG_TEST_SANITIZED
    printf("SKIP: built with a sanitizer, whose own memory the resident size would count\n");
    return 77;
#endif
    if (reset_hwm() != 0 || status_bytes("VmHWM:") < 0 || status_bytes("VmRSS:") < 0) {
        printf("SKIP: cannot reset VmHWM through /proc/self/clear_refs (Linux >= 4.0 needed)\n");
        return 77;
    }
    float *hidden = tu_xmalloc(sizeof(float) * (size_t)B * T_MOST * H);
    float *weight = tu_xmalloc(sizeof(float) * (size_t)V * H);
    float *bias = tu_xmalloc(sizeof(float) * (size_t)V);
    uint64_t s = 12345;
    for (size_t i = 0; i < (size_t)B * T_MOST * H; i++) hidden[i] = unit(&s);
    for (size_t i = 0; i < (size_t)V * H; i++) weight[i] = 0.1f * unit(&s);
    for (size_t i = 0; i < (size_t)V; i++) bias[i] = 0.1f * unit(&s);
    tu_rng rng;
    tu_rng_seed(&rng, 7);
    tu_linear_outs o;
    tu_linear_outs_make(&o, B * T_MOST, H, V, 1);
    tu_linear_outs_fill(&o, 0); /* touched: their pages are resident before the call */

    fg_linear_inputs in;
    memset(&in, 0, sizeof in);
    in.weight = fg_matrix_make(weight, FG_DTYPE_F32, V, H);
    in.bias = fg_vector_make(bias, FG_DTYPE_F32, V);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = FG_LOSS_GRPO;
    cfg.beta = 0.04;
    cfg.entropy_coef = 0.01;

    fg_context_options opt;
    fg_context_options_init(&opt);
    opt.threads = 2;
    fg_context *ctx = NULL;
    if (fg_context_create(&opt, &ctx) != FG_OK) {
        CHECK(0, "%s", "context create");
        return tu_finish();
    }
    const size_t budget = FG_DEFAULT_MEMORY_BUDGET;
    /* T: the longest that plans two chunks (bisected over the plan query), on
     * another context, so that the measured call is the first one here */
    int64_t lo = 1, hi = T_MOST; /* lo plans at most two chunks, hi more */
    fg_linear_plan_info plan;
    tu_batch tb;
    fg_context *plan_ctx = NULL;
    fg_status ps = fg_context_create(&opt, &plan_ctx);
    while (ps == FG_OK && hi - lo > 1) {
        const int64_t t = lo + (hi - lo) / 2;
        ps = plan_for(plan_ctx, t, &cfg, &in, &o, &tb, &rng, hidden, &plan);
        tu_batch_free(&tb);
        *(plan.chunks <= 2 ? &lo : &hi) = t;
    }
    const int64_t T = lo;
    if (ps == FG_OK) /* the batch of T, kept for the call */
        ps = plan_for(plan_ctx, T, &cfg, &in, &o, &tb, &rng, hidden, &plan);
    /* The chunks are sized with room for the planner's most GEMM scratchpads
     * (8), whatever the thread count; the same plan on 8 threads holds them
     * all, and one more row a chunk must not fit beside them. */
    fg_linear_plan_info full;
    memset(&full, 0, sizeof full);
    fg_exec eight;
    fg_exec_init(&eight);
    eight.threads = 8;
    const fg_status fs =
        ps == FG_OK ? fg_linear_grpo_plan(plan_ctx, NULL, &cfg, &in, tu_batch_view(&tb), &o.out,
                                          &eight, &full)
                    : ps;
    fg_context_destroy(plan_ctx);
    const size_t row = full.chunk_rows > 0 ? full.chunk_bytes / (size_t)full.chunk_rows : 0;
    CHECK(ps == FG_OK && fs == FG_OK && plan.chunks == 2 && full.chunks == 2 &&
              full.chunk_rows == plan.chunk_rows && full.working_bytes + row > budget,
          "plan: %s, T = %lld: %lld chunks of %lld rows; on 8 threads %lld of %lld rows, "
          "working_bytes %zu: a row of %zu bytes more a chunk would fit the budget %zu",
          fg_status_name(fs), (long long)T, (long long)plan.chunks, (long long)plan.chunk_rows,
          (long long)full.chunks, (long long)full.chunk_rows, full.working_bytes, row, budget);
    if (ps != FG_OK)
        return tu_finish();
    printf("T = %lld: %lld chunks of %lld rows, working_bytes %zu of the budget %zu on 2 threads "
           "(%.1f%%), %zu on 8 (%.1f%%)\n",
           (long long)T, (long long)plan.chunks, (long long)plan.chunk_rows, plan.working_bytes,
           budget, 100.0 * (double)plan.working_bytes / (double)budget, full.working_bytes,
           100.0 * (double)full.working_bytes / (double)budget);
    const fg_batch *batch = tu_batch_view(&tb);
    for (int call = 0; call < 2; call++) {
        fg_release_workspace(ctx);
        fg_reset_peak_memory(ctx);
        const long long rss_before = status_bytes("VmRSS:");
        CHECK(reset_hwm() == 0, "%s", "reset VmHWM");
        const fg_status st = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &o.out, NULL);
        const long long hwm = status_bytes("VmHWM:");
        fg_memory_stats ms;
        fg_get_memory_stats(ctx, &ms);
        CHECK(st == FG_OK, "call %d: %s (%s)", call, fg_status_name(st), fg_last_error(ctx));
        const double working = (double)(hwm - rss_before);
        const double ratio = working / (double)budget;
        printf("%s call: working RSS %.1f MiB (VmHWM %.1f - VmRSS before %.1f), budget %.1f "
               "MiB, ratio %.3f; library-counted peak %.1f MiB, %lld rows x %lld chunks\n",
               call ? "second" : "first", working / 1048576.0, (double)hwm / 1048576.0,
               (double)rss_before / 1048576.0, (double)budget / 1048576.0, ratio,
               (double)ms.peak_bytes / 1048576.0, (long long)ms.chunk_rows, (long long)ms.chunks);
        CHECK(ms.chunks > 1, "call %d: %lld chunk(s): the budget does not bind", call,
              (long long)ms.chunks);
        CHECK(ms.peak_bytes <= budget, "call %d: counted peak %zu > budget %zu", call,
              ms.peak_bytes, budget);
        const double bound = call ? 1.05 : first_bound;
        CHECK(working <= bound * (double)budget, "call %d: working RSS %.1f MiB > budget %.1f MiB x %.2f",
              call, working / 1048576.0, (double)budget / 1048576.0, bound);
    }
    fg_context_destroy(ctx);
    tu_linear_outs_free(&o);
    tu_batch_free(&tb);
    free(hidden);
    free(weight);
    free(bias);
    return tu_finish();
}
