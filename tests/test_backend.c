/*
 * test_backend: the per-chunk seam's driver (src/linear_device.c) over the
 * seam's plain reference backend (FG_BACKEND_REFERENCE), the path a CUDA
 * context takes, on any machine.
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
 *  4. Refusals: the same status and the same message as the CPU backend for
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

/* Part 4: one bad input, refused by both backends alike. */
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

/* The seam's choice for a bf16 grad_weight walked in chunks (linear_device.c,
 * plan_device): float32 sums whenever they fit beside chunks that are small
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
    refusals();
    grad_weight_sums_rule();
    fg_context_destroy(ctx_cpu);
    fg_context_destroy(ctx_ref);
    return tu_finish();
}
