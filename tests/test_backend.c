/*
 * test_backend: the one driver (src/driver/linear_grpo.c) over the seam's
 * plain reference backend (FG_BACKEND_REFERENCE), through its device path
 * (staging, per-chunk copies: the path a CUDA context takes), on any
 * machine.
 *
 *  1. Every loss type and level, f32 and bf16 inputs, odd sizes (B = 3,
 *     T = 7, H = 24, V = 67, a ragged mask, padded row strides, a bias in
 *     half the cases): loss, metrics, logp, entropy and the three gradients
 *     against the float64 oracle, fused in several chunks (a budget from the
 *     plan query) and materialized. bf16 inputs: the backward products take
 *     dlogits rounded to bf16 (as the CUDA backend's tensor-core products
 *     do), so the gradients carry about 2^-9 relative error.
 *  2. Accumulation: a second call adds its gradient to the first's.
 *  3. fg_linear_logprobs and fg_linear_logprobs_backward against the oracle.
 *  4. The phase API of a vocab-sharded call (fusedgrpo.h): 2 and 3 uneven
 *     shards, f32 and bf16 inputs, (a) -> MAX -> (b) -> SUM -> finish -> (d)
 *     with the reductions by hand, each GEMM phase in chunks (its least
 *     budget), against the CPU context's same phases: logp, entropy,
 *     grad_hidden (summed over the shards), grad_weight and grad_bias rows.
 *     Every case has masked tokens and tokens held by another shard. A
 *     shard whose (a) fails (a bad token id) writes nothing; its status
 *     slot makes every shard's (b), finish and (d) return that status.
 *  5. Refusals: the same status and the same message as the CPU backend for
 *     a bad token id, NaN in hidden / weight / bias, an overflowing hidden
 *     row and a bad option, with every output bitwise unchanged; the
 *     host-only entry points refused with FG_ERR_UNSUPPORTED.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "test_util.h"

enum { B = 3, T = 7, H = 24, V = 67, N = B * T };

static fg_context *ctx_cpu, *ctx_ref;

/* Tolerances (relative: losses to fg_oracle_loss_scale, logp/entropy to
 * max(|x|, 1), gradients in L2), by input dtype. f32: the reference sums in
 * double and stores float32 once, so its errors are float32 roundings. bf16:
 * the inputs are exact in the oracle too; dlogits rounded to bf16 for the
 * backward products. */
static const double TOL_LOSS[2] = {2e-6, 2e-6};
static const double TOL_TOKEN[2] = {2e-6, 2e-6};
static const double TOL_GRAD[2] = {2e-6, 6e-3};

static int di(fg_dtype dt) { return dt == FG_DTYPE_BF16; }

/* The smallest budget (in 256-byte steps above the least) with which the
 * fused call walks two or three chunks; else the largest that walks several
 * (a bf16 grad_weight's float32 sums can take more than all the rows). */
static size_t three_chunks(const fg_loss_config *cfg, const fg_linear_inputs *in,
                           const fg_batch *batch, const fg_linear_outputs *out)
{
    fg_linear_plan_info info;
    fg_exec ex;
    fg_exec_init(&ex);
    ex.memory_budget = 1;
    fg_linear_grpo_plan(ctx_ref, NULL, cfg, in, batch, out, &ex, &info);
    size_t several = 0;
    for (ex.memory_budget = info.min_budget_bytes; ex.memory_budget < ((size_t)1 << 30);
         ex.memory_budget += 256) {
        if (fg_linear_grpo_plan(ctx_ref, NULL, cfg, in, batch, out, &ex, &info) != FG_OK)
            continue;
        if (info.chunks >= 2 && info.chunks <= 3)
            return ex.memory_budget;
        if (info.chunks < 2)
            break;
        several = ex.memory_budget;
    }
    return several;
}

static void compare(const char *tag, fg_dtype dt, const fg_loss_config *cfg, const tu_batch *tb,
                    const fg_oracle_result *ref, const tu_linear_outs *o, int with_bias)
{
    const fg_batch *batch = &tb->view;
    const double scale = fg_oracle_loss_scale(cfg, batch, ref->logp, ref->entropy);
    char name[64];
    snprintf(name, sizeof name, "backend %s loss", dt ? "bf16" : "f32");
    TOL_CHECK(name, tu_rel_err(o->out.loss, ref->loss, scale), TOL_LOSS[di(dt)], "%s", tag);
    TOL_CHECK(name, tu_rel_err(o->out.metrics.policy_loss, ref->metrics.policy_loss, scale),
              TOL_LOSS[di(dt)], "%s policy_loss", tag);
    snprintf(name, sizeof name, "backend %s logp/entropy", dt ? "bf16" : "f32");
    TOL_CHECK(name, tu_max_rel(o->logp, ref->logp, N, tb->mask, 1.0), TOL_TOKEN[di(dt)], "%s logp", tag);
    TOL_CHECK(name, tu_max_rel(o->entropy, ref->entropy, N, tb->mask, 1.0), TOL_TOKEN[di(dt)],
              "%s entropy", tag);
    TOL_CHECK(name, tu_rel_err(o->out.metrics.entropy, ref->metrics.entropy, 1.0), TOL_TOKEN[di(dt)],
              "%s entropy metric", tag);
    TOL_CHECK(name, tu_rel_err(o->out.metrics.kl, ref->metrics.kl, 1.0), TOL_TOKEN[di(dt)],
              "%s kl metric", tag);
    snprintf(name, sizeof name, "backend %s gradients", dt ? "bf16" : "f32");
    TOL_CHECK(name, tu_rel_l2(o->grad_hidden, FG_DTYPE_F32, N, H, H, ref->grad_hidden),
              TOL_GRAD[di(dt)], "%s grad_hidden", tag);
    TOL_CHECK(name, tu_rel_l2(o->grad_weight, FG_DTYPE_F32, V, H, H, ref->grad_weight),
              TOL_GRAD[di(dt)], "%s grad_weight", tag);
    if (with_bias)
        TOL_CHECK(name, tu_rel_l2(o->grad_bias, FG_DTYPE_F32, 1, V, V, ref->grad_bias),
                  TOL_GRAD[di(dt)], "%s grad_bias", tag);
    int zero = 1;
    for (int64_t n = 0; n < N; n++)
        if (!tb->mask[n]) {
            zero &= o->logp[n] == 0.0f && o->entropy[n] == 0.0f;
            for (int64_t h = 0; h < H; h++)
                zero &= o->grad_hidden[n * H + h] == 0.0f;
        }
    CHECK(zero, "%s: logp, entropy or grad_hidden not 0 at a masked token", tag);
}

/* Part 1 and 2: one loss type and level in one dtype. */
static void loss_case(int lt, int lvl, fg_dtype dt)
{
    const int with_bias = (lt + lvl) % 2 == 0;
    const tu_problem_opts po = {0, 0, 0, lt % 2 ? 3 : 0, lt % 3 ? 5 : 0, lt + lvl};
    tu_problem prob;
    tu_problem_make_opts(&prob, B, T, H, V, dt, with_bias, 4243u + 31u * (uint64_t)lt + 7u * (uint64_t)lvl,
                         &po);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = (fg_loss_type)lt;
    cfg.importance_sampling_level = (fg_is_level)lvl;
    cfg.temperature = 0.7;
    cfg.beta = lt % 2 ? 0.04 : 0.0;
    cfg.entropy_coef = lt == FG_LOSS_DAPO ? 0.1 : 0.0;
    if (lt == FG_LOSS_GRPO)
        cfg.top_entropy_quantile = 0.5;
    char tag[128];
    snprintf(tag, sizeof tag, "[%s %s %s%s]", tu_loss_name(lt), tu_level_name(lvl),
             dt ? "bf16" : "f32", with_bias ? " bias" : "");
    if (tu_problem_fill_logp(&prob, cfg.temperature, 0.2, 0.3) != 0) {
        CHECK(0, "%s oracle refused the batch", tag);
        tu_problem_free(&prob);
        return;
    }
    const fg_batch *batch = tu_batch_view(&prob.tb);
    fg_oracle_result ref;
    if (fg_oracle_linear(&cfg, batch, prob.hidden, prob.weight, prob.bias, H, V, &ref) != 0) {
        CHECK(0, "%s oracle failed", tag);
        tu_problem_free(&prob);
        return;
    }
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    tu_linear_outs o;
    tu_linear_outs_make(&o, N, H, V, with_bias);
    if (!with_bias)
        o.out.grad_bias.data = NULL;
    fg_exec ex;
    fg_exec_init(&ex);
    ex.memory_budget = three_chunks(&cfg, &in, batch, &o.out);
    fg_status st = fg_linear_grpo(ctx_ref, NULL, &cfg, &in, batch, &o.out, &ex);
    CHECK(st == FG_OK, "%s fused: %s", tag, fg_last_error(ctx_ref));
    fg_memory_stats ms;
    fg_get_memory_stats(ctx_ref, &ms);
    CHECK(ms.chunks >= 2, "%s fused walked %lld chunks (budget %zu), several wanted", tag,
          (long long)ms.chunks, ex.memory_budget);
    if (st == FG_OK)
        compare(tag, dt, &cfg, &prob.tb, &ref, &o, with_bias);

    /* Accumulation: a second call adds the same gradient. */
    float *gw1 = tu_xmalloc((size_t)V * H * sizeof(float));
    memcpy(gw1, o.grad_weight, (size_t)V * H * sizeof(float));
    o.out.accumulate = 1;
    st = fg_linear_grpo(ctx_ref, NULL, &cfg, &in, batch, &o.out, &ex);
    CHECK(st == FG_OK, "%s accumulate: %s", tag, fg_last_error(ctx_ref));
    double worst = 0.0, norm = 0.0;
    for (int64_t i = 0; i < V * H; i++) {
        worst = fmax(worst, fabs((double)o.grad_weight[i] - 2.0 * gw1[i]));
        norm = fmax(norm, fabs(2.0 * gw1[i]));
    }
    TOL_CHECK("backend accumulate (max abs / max)", worst / (norm > 0 ? norm : 1), 1e-6,
              "%s", tag);
    free(gw1);

    /* bf16 gradient outputs: grad_hidden rows and grad_bias rounded once;
     * grad_weight summed in float32 over the chunks, rounded at the end,
     * onto the caller's values when accumulating. */
    if (dt == FG_DTYPE_BF16 && lvl == 0) {
        uint16_t *gh = tu_xmalloc((size_t)N * H * 2), *gw = tu_xmalloc((size_t)V * H * 2);
        uint16_t *gb = tu_xmalloc((size_t)V * 2);
        fg_linear_outputs bo = o.out;
        bo.accumulate = 0;
        bo.grad_hidden = fg_matrix_make(gh, FG_DTYPE_BF16, N, H);
        bo.grad_weight = fg_matrix_make(gw, FG_DTYPE_BF16, V, H);
        bo.grad_bias = with_bias ? fg_vector_make(gb, FG_DTYPE_BF16, V) : fg_vector_make(NULL, FG_DTYPE_BF16, V);
        fg_exec bx = ex;
        bx.memory_budget = three_chunks(&cfg, &in, batch, &bo);
        st = fg_linear_grpo(ctx_ref, NULL, &cfg, &in, batch, &bo, &bx);
        CHECK(st == FG_OK, "%s bf16 gradients: %s", tag, fg_last_error(ctx_ref));
        fg_get_memory_stats(ctx_ref, &ms);
        CHECK(ms.chunks >= 2, "%s bf16 gradients: %lld chunks", tag, (long long)ms.chunks);
        fg_linear_plan_info bi;
        fg_linear_grpo_plan(ctx_ref, NULL, &cfg, &in, batch, &bo, &bx, &bi);
        printf("%s bf16 gradients: %lld chunks, grad_weight %s\n", tag, (long long)ms.chunks,
               bi.grad_weight_sum_bytes ? "summed in float32" : "rounded per chunk");
        const char *gname = "backend bf16 gradients stored in bf16";
        TOL_CHECK(gname, tu_rel_l2(gh, FG_DTYPE_BF16, N, H, H, ref.grad_hidden), 8e-3, "%s grad_hidden", tag);
        TOL_CHECK(gname, tu_rel_l2(gw, FG_DTYPE_BF16, V, H, H, ref.grad_weight), 8e-3, "%s grad_weight", tag);
        if (with_bias)
            TOL_CHECK(gname, tu_rel_l2(gb, FG_DTYPE_BF16, 1, V, V, ref.grad_bias), 8e-3, "%s grad_bias", tag);
        bo.accumulate = 1; /* twice the gradient, within one more rounding */
        st = fg_linear_grpo(ctx_ref, NULL, &cfg, &in, batch, &bo, &bx);
        CHECK(st == FG_OK, "%s bf16 accumulate: %s", tag, fg_last_error(ctx_ref));
        double *twice = tu_xmalloc((size_t)V * H * sizeof(double));
        for (int64_t i = 0; i < V * H; i++)
            twice[i] = 2.0 * ref.grad_weight[i];
        TOL_CHECK(gname, tu_rel_l2(gw, FG_DTYPE_BF16, V, H, H, twice), 8e-3, "%s grad_weight accumulated", tag);
        free(twice);
        free(gh);
        free(gw);
        free(gb);
    }

    /* Materialized: one chunk of every row. */
    tu_linear_outs m;
    tu_linear_outs_make(&m, N, H, V, with_bias);
    if (!with_bias)
        m.out.grad_bias.data = NULL;
    const fg_linear_options mat = {FG_IMPL_MATERIALIZED, 0, 0.0};
    st = fg_linear_grpo(ctx_ref, &mat, &cfg, &in, batch, &m.out, NULL);
    CHECK(st == FG_OK, "%s materialized: %s", tag, fg_last_error(ctx_ref));
    if (st == FG_OK)
        compare(tag, dt, &cfg, &prob.tb, &ref, &m, with_bias);
    tu_linear_outs_free(&m);
    tu_linear_outs_free(&o);
    fg_oracle_result_free(&ref);
    tu_problem_free(&prob);
}

/* Part 3: the head's log-probs and the backward of a caller's loss. */
static void head_case(fg_dtype dt)
{
    tu_problem prob;
    tu_problem_make(&prob, B, T, H, V, dt, 1, 99u + (uint64_t)dt);
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_tokens tokens = {B, T, batch->token_ids, batch->mask};
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    double dlogp_d[N], dent_d[N];
    float dlogp[N], dent[N];
    for (int64_t n = 0; n < N; n++) {
        dlogp[n] = (float)(0.3 * tu_normal(&prob.rng));
        dent[n] = (float)(0.1 * tu_normal(&prob.rng));
        dlogp_d[n] = dlogp[n];
        dent_d[n] = dent[n];
    }
    fg_oracle_result ref;
    if (fg_oracle_linear_head(batch, prob.hidden, prob.weight, prob.bias, H, V, 0.9, dlogp_d,
                              dent_d, &ref) != 0) {
        CHECK(0, "head oracle failed");
        tu_problem_free(&prob);
        return;
    }
    const char *tag = dt ? "[head bf16]" : "[head f32]";
    float logp[N], ent[N];
    fg_status st = fg_linear_logprobs(ctx_ref, NULL, 0.9, &in, &tokens, logp, ent, NULL);
    CHECK(st == FG_OK, "%s logprobs: %s", tag, fg_last_error(ctx_ref));
    TOL_CHECK(dt ? "backend bf16 logp/entropy" : "backend f32 logp/entropy",
              tu_max_rel(logp, ref.logp, N, prob.tb.mask, 1.0), TOL_TOKEN[di(dt)], "%s logp", tag);
    tu_linear_outs o;
    tu_linear_outs_make(&o, N, H, V, 1);
    fg_linear_grads g = {o.out.grad_hidden, o.out.grad_weight, o.out.grad_bias, 0};
    st = fg_linear_logprobs_backward(ctx_ref, NULL, 0.9, &in, &tokens, dlogp, dent, &g, NULL);
    CHECK(st == FG_OK, "%s backward: %s", tag, fg_last_error(ctx_ref));
    const char *name = dt ? "backend bf16 gradients" : "backend f32 gradients";
    TOL_CHECK(name, tu_rel_l2(o.grad_hidden, FG_DTYPE_F32, N, H, H, ref.grad_hidden),
              TOL_GRAD[di(dt)], "%s grad_hidden", tag);
    TOL_CHECK(name, tu_rel_l2(o.grad_weight, FG_DTYPE_F32, V, H, H, ref.grad_weight),
              TOL_GRAD[di(dt)], "%s grad_weight", tag);
    TOL_CHECK(name, tu_rel_l2(o.grad_bias, FG_DTYPE_F32, 1, V, V, ref.grad_bias),
              TOL_GRAD[di(dt)], "%s grad_bias", tag);
    tu_linear_outs_free(&o);
    fg_oracle_result_free(&ref);
    tu_problem_free(&prob);
}

/* Part 5: one bad input, refused by both backends alike. */
static void refusal(const char *what, tu_problem *prob, const fg_loss_config *cfg)
{
    const fg_linear_inputs in = tu_problem_inputs(prob);
    const fg_batch *batch = tu_batch_view(&prob->tb);
    tu_linear_outs a, b;
    tu_linear_outs_make(&a, N, H, V, 1);
    tu_linear_outs_make(&b, N, H, V, 1);
    tu_linear_outs_fill(&a, 0x5a);
    tu_linear_outs_fill(&b, 0x5a);
    const fg_status sc = fg_linear_grpo(ctx_cpu, NULL, cfg, &in, batch, &a.out, NULL);
    const fg_status sr = fg_linear_grpo(ctx_ref, NULL, cfg, &in, batch, &b.out, NULL);
    CHECK(sc != FG_OK && sr == sc, "%s: cpu %s, reference %s (%s)", what, fg_status_name(sc),
          fg_status_name(sr), fg_last_error(ctx_ref));
    CHECK(strcmp(fg_last_error(ctx_cpu), fg_last_error(ctx_ref)) == 0,
          "%s: messages differ:\n  cpu:       %s\n  reference: %s", what, fg_last_error(ctx_cpu),
          fg_last_error(ctx_ref));
    CHECK(tu_linear_outs_are(&b, 0x5a), "%s: the reference backend wrote an output", what);
    tu_linear_outs_free(&a);
    tu_linear_outs_free(&b);
}

static void refusals(void)
{
    tu_problem prob;
    tu_problem_make(&prob, B, T, H, V, FG_DTYPE_F32, 1, 777u);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    int64_t n = 0;
    while (!prob.tb.mask[n])
        n++;
    const int64_t tok = prob.tb.token_ids[n];
    prob.tb.token_ids[n] = V;
    refusal("token id V", &prob, &cfg);
    prob.tb.token_ids[n] = tok;
    float *hs = prob.hidden_s, *ws = prob.weight_s, *bs = prob.bias_s;
    const float h0 = hs[n * prob.ldh + 5], w0 = ws[3 * prob.ldw + 2], b0 = bs[4];
    hs[n * prob.ldh + 5] = NAN;
    refusal("NaN in hidden", &prob, &cfg);
    hs[n * prob.ldh + 5] = h0;
    ws[3 * prob.ldw + 2] = INFINITY;
    refusal("Inf in weight", &prob, &cfg);
    ws[3 * prob.ldw + 2] = w0;
    bs[4] = NAN;
    refusal("NaN in bias", &prob, &cfg);
    bs[4] = b0;
    hs[n * prob.ldh + 1] = 1e37f;
    refusal("overflowing hidden row", &prob, &cfg);
    hs[n * prob.ldh + 1] = h0;
    cfg.epsilon_low = -0.5;
    refusal("epsilon_low < 0", &prob, &cfg);
    fg_loss_config_init(&cfg);

    /* The host-only entry points. */
    float logits[N * V];
    memset(logits, 0, sizeof logits);
    const fg_matrix lg = fg_matrix_make(logits, FG_DTYPE_F32, N, V);
    fg_logits_outputs lo;
    memset(&lo, 0, sizeof lo);
    const fg_status st = fg_logits_grpo(ctx_ref, &cfg, &lg, tu_batch_view(&prob.tb), &lo, NULL);
    CHECK(st == FG_ERR_UNSUPPORTED, "fg_logits_grpo on the reference backend: %s",
          fg_status_name(st));
    tu_problem_free(&prob);
}

/* Part 4: the phase API. */
enum { MAX_SHARDS = 3 };

/* A CHECK whose outcome is also and-ed into `ok`. */
#define CHECK_OK(ok, cond, ...)                                                                   \
    do {                                                                                          \
        const int c_ = (cond);                                                                    \
        (ok) &= c_;                                                                               \
        CHECK(c_, __VA_ARGS__);                                                                   \
    } while (0)

typedef struct shard {
    int64_t v0, v1;
    float *stats, *logp, *entropy, *gh, *gw, *gb;
} shard;

static float *falloc(int64_t n) { return tu_xmalloc((size_t)n * sizeof(float)); }

/* Shard s's view of the problem's weight and bias. */
static fg_linear_inputs shard_inputs(const tu_problem *p, const shard *s)
{
    return tu_problem_shard_inputs(p, s->v0, s->v1);
}

/* A framework's allreduce over the shards: MAX or SUM of stats[o, o + count). */
static void reduce(shard *sh, int P, int64_t o, int64_t count, int max)
{
    for (int64_t i = o; i < o + count; i++) {
        float r = sh[0].stats[i];
        for (int s = 1; s < P; s++)
            r = max ? (sh[s].stats[i] > r ? sh[s].stats[i] : r) : r + sh[s].stats[i];
        for (int s = 0; s < P; s++)
            sh[s].stats[i] = r;
    }
}

/* One shard's GEMM phase on one context. */
typedef struct phase_run {
    fg_context *ctx;
    const tu_problem *prob;
    const fg_tokens *tokens;
    shard *sh;
    const float *dlogp, *dent;
    int with_bias;
} phase_run;

static fg_status run_a(const phase_run *r, const fg_exec *ex)
{
    const fg_linear_inputs in = shard_inputs(r->prob, r->sh);
    return fg_linear_shard_stats(r->ctx, NULL, 0.8, &in, r->tokens, r->sh->stats, ex);
}

static fg_status run_d(const phase_run *r, const fg_exec *ex)
{
    const fg_linear_inputs in = shard_inputs(r->prob, r->sh);
    const int64_t Vs = r->sh->v1 - r->sh->v0;
    fg_linear_grads g = {fg_matrix_make(r->sh->gh, FG_DTYPE_F32, N, H),
                         fg_matrix_make(r->sh->gw, FG_DTYPE_F32, Vs, H),
                         fg_vector_make(r->with_bias ? r->sh->gb : NULL, FG_DTYPE_F32, Vs), 0};
    return fg_linear_shard_backward(r->ctx, NULL, 0.8, &in, r->tokens, r->sh->stats, r->dlogp,
                                    r->dent, &g, ex);
}

/* A GEMM phase; `chunked`: at the least budget (256-byte steps) it runs
 * within, where it walks the most chunks, and then it must walk several. */
static int run_gemm_phase(fg_status (*phase)(const phase_run *, const fg_exec *),
                          const phase_run *r, int chunked, const char *what, const char *tag,
                          int s)
{
    fg_exec ex;
    fg_exec_init(&ex);
    fg_status st = FG_OK;
    if (chunked)
        for (ex.memory_budget = 256; ex.memory_budget < ((size_t)1 << 24);
             ex.memory_budget += 256)
            if ((st = phase(r, &ex)) != FG_ERR_BUDGET_TOO_SMALL)
                break;
    if (!chunked)
        st = phase(r, &ex);
    int ok = 1;
    CHECK_OK(ok, st == FG_OK, "%s shard %d %s: %s", tag, s, what, fg_last_error(r->ctx));
    if (chunked && st == FG_OK) {
        fg_memory_stats ms;
        fg_get_memory_stats(r->ctx, &ms);
        CHECK_OK(ok, ms.chunks >= 2, "%s shard %d %s: %lld chunks at the least budget", tag, s,
                 what, (long long)ms.chunks);
    }
    return ok;
}

/* (a) -> MAX -> (b) -> SUM -> finish -> (d) on ctx over P shards. */
static int run_phases(fg_context *ctx, const tu_problem *prob, const fg_tokens *tokens,
                      shard *sh, int P, const float *dlogp, const float *dent, int with_bias,
                      int chunked, const char *tag)
{
    int ok = 1;
    for (int s = 0; s < P; s++) {
        const phase_run r = {ctx, prob, tokens, &sh[s], dlogp, dent, with_bias};
        ok &= run_gemm_phase(run_a, &r, chunked, "(a)", tag, s);
    }
    reduce(sh, P, 0, FG_SHARD_STATS_MAX_COUNT(N), 1);
    for (int s = 0; s < P; s++)
        CHECK_OK(ok, fg_shard_stats_rescale(ctx, tokens, sh[s].stats) == FG_OK, "%s (b): %s", tag,
                 fg_last_error(ctx));
    reduce(sh, P, FG_SHARD_STATS_SUM_OFFSET(N), FG_SHARD_STATS_SUM_COUNT(N), 0);
    for (int s = 0; s < P; s++)
        CHECK_OK(ok,
                 fg_shard_stats_finish(ctx, tokens, sh[s].stats, sh[s].logp, sh[s].entropy) ==
                     FG_OK,
                 "%s finish: %s", tag, fg_last_error(ctx));
    for (int s = 0; s < P && ok; s++) {
        const phase_run r = {ctx, prob, tokens, &sh[s], dlogp, dent, with_bias};
        ok &= run_gemm_phase(run_d, &r, chunked, "(d)", tag, s);
    }
    return ok;
}

/* P uneven shards of the vocabulary (the first ones short), their buffers. */
static void make_shards(shard *sh, int P)
{
    for (int s = 0; s < P; s++) {
        sh[s].v0 = s == 0 ? 0 : sh[s - 1].v1;
        sh[s].v1 = s == P - 1 ? V : V * (s + 1) / P - 5 * (P - 1 - s);
        const int64_t Vs = sh[s].v1 - sh[s].v0;
        sh[s].stats = falloc(FG_SHARD_STATS_FLOATS(N));
        sh[s].logp = falloc(N);
        sh[s].entropy = falloc(N);
        sh[s].gh = falloc(N * H);
        sh[s].gw = falloc(Vs * H);
        sh[s].gb = falloc(Vs);
    }
}

static void free_shards(shard *sh, int P)
{
    for (int s = 0; s < P; s++) {
        free(sh[s].stats);
        free(sh[s].logp);
        free(sh[s].entropy);
        free(sh[s].gh);
        free(sh[s].gw);
        free(sh[s].gb);
    }
}

/* The phases on the reference backend against the CPU context's. */
static void shard_phases_case(int P, fg_dtype dt)
{
    const int with_bias = P == 2;
    tu_problem prob;
    tu_problem_make(&prob, B, T, H, V, dt, with_bias, 5150u + 17u * (uint64_t)P + (uint64_t)dt);
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_tokens tokens = {B, T, batch->token_ids, batch->mask};
    char tag[64];
    snprintf(tag, sizeof tag, "[phases %d shards %s]", P, dt ? "bf16" : "f32");
    float dlogp[N], dent[N];
    int masked = 0;
    for (int64_t n = 0; n < N; n++) {
        dlogp[n] = batch->mask[n] ? (float)(0.3 * tu_normal(&prob.rng)) : 0.0f;
        dent[n] = batch->mask[n] ? (float)(0.1 * tu_normal(&prob.rng)) : 0.0f;
        masked += !batch->mask[n];
    }
    CHECK(masked > 0, "%s: no masked token", tag);
    shard cpu[MAX_SHARDS], ref[MAX_SHARDS];
    make_shards(cpu, P);
    make_shards(ref, P);
    for (int s = 0; s < P; s++) { /* each shard holds some tokens, and not all */
        int64_t held = 0;
        for (int64_t n = 0; n < N; n++)
            held += batch->mask[n] && batch->token_ids[n] >= ref[s].v0 &&
                    batch->token_ids[n] < ref[s].v1;
        CHECK(held > 0 && held < tu_batch_unmasked(&prob.tb), "%s: shard %d holds %lld tokens",
              tag, s, (long long)held);
    }
    const int ok = run_phases(ctx_cpu, &prob, &tokens, cpu, P, dlogp, dent, with_bias, 0, tag) &&
                   run_phases(ctx_ref, &prob, &tokens, ref, P, dlogp, dent, with_bias, 1, tag);
    if (ok) {
        int same = 1; /* every shard has the same log-probs, bit for bit */
        for (int s = 1; s < P; s++)
            same &= memcmp(ref[s].logp, ref[0].logp, sizeof dlogp) == 0 &&
                    memcmp(ref[s].entropy, ref[0].entropy, sizeof dlogp) == 0;
        CHECK(same, "%s: the shards' logp/entropy differ", tag);
        double lp = 0, ent = 0;
        int zero = 1;
        for (int64_t n = 0; n < N; n++) {
            if (!batch->mask[n]) {
                zero &= ref[0].logp[n] == 0.0f && ref[0].entropy[n] == 0.0f;
                continue;
            }
            lp = fmax(lp, fabs((double)ref[0].logp[n] - cpu[0].logp[n]) /
                              fmax(fabs((double)cpu[0].logp[n]), 1.0));
            ent = fmax(ent, fabs((double)ref[0].entropy[n] - cpu[0].entropy[n]) /
                                fmax(fabs((double)cpu[0].entropy[n]), 1.0));
        }
        CHECK(zero, "%s: logp or entropy not 0 at a masked token", tag);
        TOL_CHECK("backend phases logp/entropy", lp, TOL_TOKEN[di(dt)], "%s logp", tag);
        TOL_CHECK("backend phases logp/entropy", ent, TOL_TOKEN[di(dt)], "%s entropy", tag);
        float *gh_c = falloc(N * H), *gh_r = falloc(N * H);
        for (int64_t i = 0; i < N * H; i++) { /* the framework's SUM of grad_hidden */
            double a = 0, b = 0;
            for (int s = 0; s < P; s++) {
                a += cpu[s].gh[i];
                b += ref[s].gh[i];
            }
            gh_c[i] = (float)a;
            gh_r[i] = (float)b;
        }
        const char *gname = dt ? "backend phases bf16 gradients" : "backend phases f32 gradients";
        TOL_CHECK(gname, tu_rel_l2f(gh_r, gh_c, N * H), TOL_GRAD[di(dt)], "%s grad_hidden", tag);
        zero = 1;
        for (int64_t n = 0; n < N; n++)
            for (int s = 0; s < P && !batch->mask[n]; s++)
                for (int64_t h = 0; h < H; h++)
                    zero &= ref[s].gh[n * H + h] == 0.0f;
        CHECK(zero, "%s: grad_hidden not 0 at a masked token", tag);
        for (int s = 0; s < P; s++) {
            const int64_t Vs = ref[s].v1 - ref[s].v0;
            TOL_CHECK(gname, tu_rel_l2f(ref[s].gw, cpu[s].gw, Vs * H), TOL_GRAD[di(dt)],
                      "%s shard %d grad_weight", tag, s);
            if (with_bias)
                TOL_CHECK(gname, tu_rel_l2f(ref[s].gb, cpu[s].gb, Vs), TOL_GRAD[di(dt)],
                          "%s shard %d grad_bias", tag, s);
        }
        free(gh_c);
        free(gh_r);
    }
    free_shards(cpu, P);
    free_shards(ref, P);
    tu_problem_free(&prob);
}

/* Shard `bad` fails (a) with a token id past the vocabulary and writes
 * nothing; the caller raises its status slot, and after the MAX every
 * shard's (b), finish and (d) return that status, as on the CPU. */
static void shard_phases_failure(int P, int bad)
{
    tu_problem prob;
    tu_problem_make(&prob, B, T, H, V, FG_DTYPE_F32, 0, 6161u + (uint64_t)bad);
    const fg_batch *batch = tu_batch_view(&prob.tb);
    int64_t bad_ids[N];
    memcpy(bad_ids, batch->token_ids, sizeof bad_ids);
    int64_t first = 0;
    while (!batch->mask[first])
        first++;
    bad_ids[first] = V + 3;
    shard sh[MAX_SHARDS];
    make_shards(sh, P);
    const fg_status want = FG_ERR_TOKEN_OUT_OF_RANGE;
    for (int s = 0; s < P; s++) {
        tu_fill_nan(sh[s].stats, (size_t)FG_SHARD_STATS_FLOATS(N));
        const fg_linear_inputs in = shard_inputs(&prob, &sh[s]);
        const fg_tokens tokens = {B, T, s == bad ? bad_ids : batch->token_ids, batch->mask};
        const fg_status st =
            fg_linear_shard_stats(ctx_ref, NULL, 1.0, &in, &tokens, sh[s].stats, NULL);
        CHECK(st == (s == bad ? want : FG_OK), "phases failure P=%d bad=%d: shard %d (a) gave %s",
              P, bad, s, fg_status_name(st));
        if (st != FG_OK) {
            int untouched = 1;
            for (int64_t i = 0; i < FG_SHARD_STATS_FLOATS(N); i++)
                untouched &= isnan(sh[s].stats[i]);
            CHECK(untouched, "phases failure P=%d: the failed (a) wrote its stats", P);
            sh[s].stats[FG_SHARD_STATS_STATUS(N)] = (float)st; /* the caller's part */
        }
    }
    /* The status slot's MAX (NaN elsewhere in the failed shard's buffer is
     * the framework's business). */
    float slot = 0;
    for (int s = 0; s < P; s++)
        slot = sh[s].stats[FG_SHARD_STATS_STATUS(N)] > slot ? sh[s].stats[FG_SHARD_STATS_STATUS(N)]
                                                             : slot;
    const fg_tokens tokens = {B, T, batch->token_ids, batch->mask};
    float lp[N];
    for (int s = 0; s < P; s++) {
        sh[s].stats[FG_SHARD_STATS_STATUS(N)] = slot;
        fg_status st = fg_shard_stats_rescale(ctx_ref, &tokens, sh[s].stats);
        CHECK(st == want, "phases failure P=%d bad=%d: shard %d (b) gave %s (%s)", P, bad, s,
              fg_status_name(st), fg_last_error(ctx_ref));
        st = fg_shard_stats_finish(ctx_ref, &tokens, sh[s].stats, lp, NULL);
        CHECK(st == want, "phases failure P=%d: shard %d finish gave %s", P, s, fg_status_name(st));
        const fg_linear_inputs in = shard_inputs(&prob, &sh[s]);
        fg_linear_grads g = {fg_matrix_make(sh[s].gh, FG_DTYPE_F32, N, H), {0}, {0}, 0};
        st = fg_linear_shard_backward(ctx_ref, NULL, 1.0, &in, &tokens, sh[s].stats, lp, NULL, &g,
                                      NULL);
        CHECK(st == want, "phases failure P=%d: shard %d (d) gave %s", P, s, fg_status_name(st));
    }
    free_shards(sh, P);
    tu_problem_free(&prob);
}

/* The planner's choice for a bf16 grad_weight walked in chunks on a backend
 * whose products write bf16, with fast_chunk_rows 1024 (the reference
 * carries CUDA's; linear_plan.c, plan_grad_weight_sums): float32 sums whenever they fit beside chunks that are small
 * anyway (under 1024 rows without them); rounding per chunk where the sums
 * would push chunks of 1024 rows or more below 1024 and to under half. Plan
 * queries only, at V = H = 2048, where the sums take the bytes of ~680 rows:
 * every regime shows within the scan. */
static void grad_weight_sums_rule(void)
{
    enum { SB = 1, ST = 4001, SH = 2048, SV = 2048 };
    const tu_problem_opts po = {0, 0, 0, 0, 0, 0};
    tu_problem prob;
    tu_problem_make_opts(&prob, SB, ST, SH, SV, FG_DTYPE_BF16, 0, 977u, &po);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    uint16_t *gh = tu_xmalloc((size_t)SB * ST * SH * 2), *gw = tu_xmalloc((size_t)SV * SH * 2);
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    out.grad_hidden = fg_matrix_make(gh, FG_DTYPE_BF16, (int64_t)SB * ST, SH);
    out.grad_weight = fg_matrix_make(gw, FG_DTYPE_BF16, SV, SH);
    out.grad_bias = fg_vector_make(NULL, FG_DTYPE_BF16, SV);
    fg_exec ex;
    fg_exec_init(&ex);
    ex.memory_budget = 1;
    fg_linear_plan_info info;
    fg_linear_grpo_plan(ctx_ref, NULL, &cfg, &in, batch, &out, &ex, &info);
    /* A row's bytes: the plan's chunk bytes over its rows at some budget. */
    ex.memory_budget = info.min_budget_bytes + ((size_t)64 << 20);
    CHECK(fg_linear_grpo_plan(ctx_ref, NULL, &cfg, &in, batch, &out, &ex, &info) == FG_OK &&
              info.chunk_rows > 0,
          "sums rule: plan at %zu bytes: %s", ex.memory_budget, fg_last_error(ctx_ref));
    const size_t row = info.chunk_rows > 0 ? info.chunk_bytes / (size_t)info.chunk_rows : 1;
    int small_sums = 0, large_dropped = 0, large_sums = 0, misplaced = 0;
    for (ex.memory_budget = info.min_budget_bytes; ex.memory_budget < ((size_t)1 << 30);
         ex.memory_budget += row / 2) {
        if (fg_linear_grpo_plan(ctx_ref, NULL, &cfg, &in, batch, &out, &ex, &info) != FG_OK)
            continue;
        if (info.chunks < 2)
            break;
        const int sums = info.grad_weight_sum_bytes > 0;
        small_sums |= sums && info.chunk_rows < 1024;
        large_dropped |= !sums && info.chunk_rows >= 1024;
        large_sums |= sums && info.chunk_rows >= 1024;
        /* Rounded per chunk in chunks under 1024 rows only where the sums do
         * not fit beside a row (without them a chunk holds about their bytes
         * over a row's more rows). */
        if (!sums && info.chunk_rows < 1024 && !misplaced) {
            const size_t sum_rows = ((size_t)SV * SH * 4) / row; /* +- a few: pages */
            misplaced = (size_t)info.chunk_rows > sum_rows + 8;
            CHECK(!misplaced,
                  "sums rule: %lld-row chunks rounded per chunk at %zu bytes, where the sums fit",
                  (long long)info.chunk_rows, ex.memory_budget);
        }
    }
    printf("grad_weight sums rule (V = H = 2048): sums kept in small chunks %d, dropped from "
           "chunks of >= 1024 rows %d, kept in chunks of >= 1024 rows %d\n",
           small_sums, large_dropped, large_sums);
    CHECK(small_sums && large_dropped && large_sums,
          "sums rule: a regime did not show (small with sums %d, large dropped %d, large with "
          "sums %d)", small_sums, large_dropped, large_sums);
    free(gh);
    free(gw);
    tu_problem_free(&prob);
}

/* Gradient filtering on the reference backend (its filter op, the spec's
 * rule on its own dlogits, in place, in several chunks) against the CPU's
 * (one chunk, sparse or, with whole rows, dense over the zeroed entries):
 * the same kept entries (no entry lies within 1.1% of its row's threshold
 * in the first problem, measured; the two backends' dlogits differ by ~1e-7
 * relative) and the same gradients within float32 sums. A backend without
 * the op is refused by name (test_backend_cpu). */
static void filtering_like_cpu(void)
{
    /* Pass 0: the default problem at eps 0.3 (few entries a row); pass 1:
     * peaked logits with every third token's hidden row scaled by 1e-3 (a
     * near-uniform row, which keeps every entry at eps 1e-3), the rule
     * read row by row whatever the chunks. */
    for (int pass = 0; pass < 2; pass++) {
        tu_problem prob;
        tu_problem_opts po = {0};
        if (pass)
            po.weight_scale = 12.0 / sqrt((double)H);
        tu_problem_make_opts(&prob, B, T, H, V, FG_DTYPE_F32, 1, 4242u, &po);
        if (pass) {
            for (int64_t n = 0; n < N; n += 3)
                for (int64_t h = 0; h < H; h++)
                    prob.hidden[n * H + h] *= 1e-3;
            tu_problem_restore(&prob);
        }
        fg_loss_config cfg;
        fg_loss_config_init(&cfg);
        const fg_linear_inputs in = tu_problem_inputs(&prob);
        const fg_batch *batch = tu_batch_view(&prob.tb);
        tu_linear_outs a, b;
        tu_linear_outs_make(&a, N, H, V, 1);
        tu_linear_outs_make(&b, N, H, V, 1);
        const fg_linear_options opts = {FG_IMPL_FUSED, 0, pass ? 1e-3 : 0.3};
        fg_exec ex;
        fg_exec_init(&ex);
        fg_linear_plan_info info;
        ex.memory_budget = 1;
        fg_linear_grpo_plan(ctx_ref, &opts, &cfg, &in, batch, &b.out, &ex, &info);
        for (ex.memory_budget = info.min_budget_bytes; ex.memory_budget < ((size_t)1 << 24);
             ex.memory_budget += 256)
            if (fg_linear_grpo_plan(ctx_ref, &opts, &cfg, &in, batch, &b.out, &ex, &info) ==
                    FG_OK &&
                info.chunks <= 3)
                break;
        const fg_status sc = fg_linear_grpo(ctx_cpu, &opts, &cfg, &in, batch, &a.out, NULL);
        const fg_status sr = fg_linear_grpo(ctx_ref, &opts, &cfg, &in, batch, &b.out, &ex);
        fg_memory_stats mc, mr;
        fg_get_memory_stats(ctx_cpu, &mc);
        fg_get_memory_stats(ctx_ref, &mr);
        CHECK(sc == FG_OK && sr == FG_OK, "filtering %d: cpu %s, reference %s (%s)", pass,
              fg_status_name(sc), fg_status_name(sr), fg_last_error(ctx_ref));
        /* Pass 1: some rows whole (over V of them kept), not all. */
        CHECK(mc.chunks == 1 && mr.chunks > 1 && mc.dlogits_kept == mr.dlogits_kept &&
                  mr.dlogits_kept < mr.dlogits_entries && (!pass || mr.dlogits_kept > V),
              "filtering %d: kept %lld (cpu, %lld chunk) / %lld (reference, %lld chunks) of %lld",
              pass, (long long)mc.dlogits_kept, (long long)mc.chunks,
              (long long)mr.dlogits_kept, (long long)mr.chunks, (long long)mr.dlogits_entries);
        const double eh = tu_rel_l2f(a.grad_hidden, b.grad_hidden, (int64_t)N * H);
        const double ew = tu_rel_l2f(a.grad_weight, b.grad_weight, (int64_t)V * H);
        TOL_CHECK("backend filtered gradients", eh > ew ? eh : ew, 5e-7,
                  "pass %d: filtered grad_hidden %.2e, grad_weight %.2e", pass, eh, ew);
        tu_linear_outs_free(&a);
        tu_linear_outs_free(&b);
        tu_problem_free(&prob);
    }
}

/* A backend that filters in place keeps its products dense over the zeroed
 * entries, so it filters whatever grad_weight's dtype: a bf16 grad_weight
 * written once (one chunk) is filtered on the reference, with the kept set
 * of the float32-gradient call and its gradients rounded once; the CPU,
 * whose sparse grad_weight product writes float32, runs that call dense
 * unless it sums grad_weight in float32 anyway (products in float32). */
static void filtering_in_place_any_grad_dtype(void)
{
    tu_problem prob;
    tu_problem_make(&prob, B, T, H, V, FG_DTYPE_BF16, 0, 4243u);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_linear_options opts = {FG_IMPL_FUSED, 0, 0.3};
    tu_linear_outs f; /* float32 gradients */
    tu_linear_outs_make(&f, N, H, V, 0);
    uint16_t *gh = tu_xmalloc((size_t)N * H * 2), *gw = tu_xmalloc((size_t)V * H * 2);
    fg_linear_outputs bo = f.out;
    bo.grad_hidden = fg_matrix_make(gh, FG_DTYPE_BF16, N, H);
    bo.grad_weight = fg_matrix_make(gw, FG_DTYPE_BF16, V, H);
    fg_memory_stats mf, mb, mc;
    const fg_status sf = fg_linear_grpo(ctx_ref, &opts, &cfg, &in, batch, &f.out, NULL);
    fg_get_memory_stats(ctx_ref, &mf);
    const fg_status sb = fg_linear_grpo(ctx_ref, &opts, &cfg, &in, batch, &bo, NULL);
    fg_get_memory_stats(ctx_ref, &mb);
    CHECK(sf == FG_OK && sb == FG_OK && mb.chunks == 1, "in-place filter, bf16 grads: %s, %s (%s)",
          fg_status_name(sf), fg_status_name(sb), fg_last_error(ctx_ref));
    CHECK(mb.dlogits_kept == mf.dlogits_kept && mb.dlogits_kept < mb.dlogits_entries,
          "in-place filter, bf16 grads: kept %lld (bf16) / %lld (float32) of %lld",
          (long long)mb.dlogits_kept, (long long)mf.dlogits_kept, (long long)mb.dlogits_entries);
    double *dh = tu_xmalloc((size_t)N * H * sizeof(double));
    double *dw = tu_xmalloc((size_t)V * H * sizeof(double));
    for (int64_t i = 0; i < (int64_t)N * H; i++)
        dh[i] = f.grad_hidden[i];
    for (int64_t i = 0; i < (int64_t)V * H; i++)
        dw[i] = f.grad_weight[i];
    const double eh = tu_rel_l2(gh, FG_DTYPE_BF16, N, H, H, dh);
    const double ew = tu_rel_l2(gw, FG_DTYPE_BF16, V, H, H, dw);
    free(dh);
    free(dw);
    TOL_CHECK("in-place filter, bf16 gradients rounded once", eh > ew ? eh : ew, 4e-3,
              "grad_hidden %.2e, grad_weight %.2e", eh, ew);
    /* The CPU filters where it sums grad_weight in float32 (its products
     * widen bf16: AVX2), and runs dense where it writes bf16 at once. */
    fg_linear_plan_info ci;
    const fg_status sp = fg_linear_grpo_plan(ctx_cpu, &opts, &cfg, &in, batch, &bo, NULL, &ci);
    const fg_status sc = fg_linear_grpo(ctx_cpu, &opts, &cfg, &in, batch, &bo, NULL);
    fg_get_memory_stats(ctx_cpu, &mc);
    const int summed = ci.grad_weight_sum_bytes > 0;
    CHECK(sp == FG_OK && sc == FG_OK && mc.chunks == 1 &&
              (summed ? mc.dlogits_kept == mb.dlogits_kept
                      : mc.dlogits_kept == mc.dlogits_entries),
          "cpu, bf16 grad_weight in one chunk (%s): %s, kept %lld of %lld (reference %lld)",
          summed ? "summed in float32" : "written in bf16", fg_status_name(sc),
          (long long)mc.dlogits_kept, (long long)mc.dlogits_entries, (long long)mb.dlogits_kept);
    free(gh);
    free(gw);
    tu_linear_outs_free(&f);
    tu_problem_free(&prob);
}

/* grad_bias's float32 sums add each row's dlogits in token order, whatever
 * the chunks (backend.h): the same bits from one chunk and from the least
 * budget's, on the CPU and on the reference, f32 and accumulating. */
static void bias_bits_whatever_the_chunks(void)
{
    fg_context *ctxs[2] = {ctx_cpu, ctx_ref};
    for (int c = 0; c < 2; c++) {
        tu_problem prob;
        tu_problem_make(&prob, B, T, H, V, FG_DTYPE_F32, 1, 515u);
        fg_loss_config cfg;
        fg_loss_config_init(&cfg);
        const fg_linear_inputs in = tu_problem_inputs(&prob);
        const fg_batch *batch = tu_batch_view(&prob.tb);
        tu_linear_outs a, b;
        tu_linear_outs_make(&a, N, H, V, 1);
        tu_linear_outs_make(&b, N, H, V, 1);
        for (int64_t v = 0; v < V; v++) /* accumulate onto the same values */
            a.grad_bias[v] = b.grad_bias[v] = 0.01f * (float)(v % 13);
        a.out.accumulate = b.out.accumulate = 1;
        fg_linear_plan_info info;
        fg_exec ex;
        fg_exec_init(&ex);
        ex.memory_budget = 1;
        fg_linear_grpo_plan(ctxs[c], NULL, &cfg, &in, batch, &a.out, &ex, &info);
        ex.memory_budget = info.min_budget_bytes; /* one row a chunk */
        const fg_status s1 = fg_linear_grpo(ctxs[c], NULL, &cfg, &in, batch, &a.out, &ex);
        fg_memory_stats ms;
        fg_get_memory_stats(ctxs[c], &ms);
        const int64_t chunks = ms.chunks;
        const fg_status s2 = fg_linear_grpo(ctxs[c], NULL, &cfg, &in, batch, &b.out, NULL);
        CHECK(s1 == FG_OK && s2 == FG_OK && chunks > 1 &&
                  memcmp(a.grad_bias, b.grad_bias, (size_t)V * sizeof(float)) == 0,
              "%s: grad_bias bits differ between %lld chunks and one (%s)",
              c ? "reference" : "cpu", (long long)chunks, fg_last_error(ctxs[c]));
        tu_linear_outs_free(&a);
        tu_linear_outs_free(&b);
        tu_problem_free(&prob);
    }
}

int main(void)
{
    fg_context_options o;
    fg_context_options_init(&o);
    CHECK(fg_context_create(&o, &ctx_cpu) == FG_OK, "cpu context");
    o.backend = FG_BACKEND_REFERENCE;
    CHECK(fg_context_create(&o, &ctx_ref) == FG_OK, "reference context");
    if (!ctx_cpu || !ctx_ref)
        return tu_finish();
    for (int d = 0; d < 2; d++)
        for (int lt = 0; lt < FG_LOSS_TYPE_COUNT; lt++)
            for (int lvl = 0; lvl < FG_LEVEL_COUNT; lvl++)
                loss_case(lt, lvl, d ? FG_DTYPE_BF16 : FG_DTYPE_F32);
    head_case(FG_DTYPE_F32);
    head_case(FG_DTYPE_BF16);
    for (int d = 0; d < 2; d++)
        for (int P = 2; P <= MAX_SHARDS; P++)
            shard_phases_case(P, d ? FG_DTYPE_BF16 : FG_DTYPE_F32);
    shard_phases_failure(2, 1);
    shard_phases_failure(3, 0);
    refusals();
    grad_weight_sums_rule();
    filtering_like_cpu();
    filtering_in_place_any_grad_dtype();
    bias_bits_whatever_the_chunks();
    fg_context_destroy(ctx_cpu);
    fg_context_destroy(ctx_ref);
    return tu_finish();
}
