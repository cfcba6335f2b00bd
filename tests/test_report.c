/*
 * test_report: device-reported calls (fusedgrpo.h; exec.device_report) on
 * the seam's reference backend, against the same backend's host-checked
 * calls:
 *
 *  1. Losses of every type (token level; GSPO and sapo at the sequence
 *     level, vespo with old_logp, the off-policy mask and the entropy
 *     quantile, which read every token's log-prob or entropy first: a
 *     forward sweep, report_prepare, the gradient sweep; the KL, the
 *     entropy bonus, a bias,
 *     filtering, f32 and bf16 inputs, odd sizes: B = 3, T = 11, H = 20,
 *     V = 53, a ragged mask whose masked ids lie out of range and whose
 *     masked hidden rows hold NaN) in several chunks: no host
 *     synchronisation at all; a clean record; the record's loss and
 *     metrics, logp, entropy and grad_hidden bitwise the host-checked
 *     call's (the same loss math, per sequence in the same order), and
 *     grad_bias (one addition a row, in order); grad_weight within 1e-6 of
 *     its largest entry (or of 1; other chunks: other sums); the entropy
 *     quantile also with equal entropies at its order statistics, one
 *     token and none;
 *     the record's kept count the context's. Sequences of three of the
 *     loss's segments (T = 2500): the loss and metrics bitwise the host's,
 *     and so of GSPO there without gradients.
 *  2. fg_linear_logprobs and fg_linear_logprobs_backward: the same.
 *  3. Refusals: each failure the host's checks find (an id out of range,
 *     NaN advantages, old_logp, ref_logp, per-sequence is_ratio, grad_logp,
 *     NaN in hidden, weight and bias, a token's KL overflowing), alone and
 *     two at once: fg_device_report_status gives the host-checked call's
 *     status and message; the call itself returned FG_OK with no sync.
 *     Gradients that overflow from finite inputs: FG_ERR_OVERFLOW naming
 *     the output.
 *  4. What is refused at once: the CPU backend,
 *     accumulating into grad_bias, the record over an output, the phase
 *     API, a host-only entry point (fg_logits_grpo).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "loss_sequence.h"
#include "test_util.h"

enum { B = 3, T = 11, H = 20, V = 53, N = B * T };

/* A 3-chunk budget on the reference backend for this shape (planned). */
static size_t budget_chunks(fg_context *ctx, const fg_linear_options *o,
                            const fg_loss_config *cfg, const fg_linear_inputs *in,
                            const fg_batch *batch, const fg_linear_outputs *out,
                            fg_device_report *rep, int64_t want)
{
    for (size_t budget = 4096; budget < ((size_t)1 << 24); budget += 256) {
        fg_exec ex;
        fg_exec_init(&ex);
        ex.memory_budget = budget;
        ex.device_report = rep;
        fg_linear_plan_info info;
        if (fg_linear_grpo_plan(ctx, o, cfg, in, batch, out, &ex, &info) == FG_OK &&
            info.chunks <= want)
            return budget;
    }
    return 0;
}

static fg_loss_config config(fg_loss_type lt, double beta, double entropy_coef)
{
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = lt;
    cfg.temperature = 0.8;
    cfg.beta = beta;
    cfg.entropy_coef = entropy_coef;
    return cfg;
}

static int make(tu_problem *prob, fg_dtype dt, int with_bias, uint64_t seed)
{
    tu_problem_make(prob, B, T, H, V, dt, with_bias, seed);
    if (tu_problem_fill_logp(prob, 0.8, 0.2, 0.3) != 0) {
        CHECK(0, "the oracle refused the batch (seed %llu)", (unsigned long long)seed);
        tu_problem_free(prob);
        return 0;
    }
    return 1;
}

/* NaN in the stored hidden rows of masked tokens (never read). */
static void poison_masked_rows(tu_problem *prob)
{
    for (int64_t n = 0; n < N; n++) {
        if (prob->tb.mask[n])
            continue;
        for (int64_t h = 0; h < H; h++) {
            const size_t i = (size_t)(n * prob->ldh + h);
            if (prob->dtype == FG_DTYPE_BF16)
                ((uint16_t *)prob->hidden_s)[i] = 0x7FC0u;
            else
                ((float *)prob->hidden_s)[i] = NAN;
        }
    }
}

static double max_abs_diff(const float *a, const float *b, size_t n)
{
    double d = 0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - (double)b[i]);
        d = isnan(e) ? INFINITY : (e > d ? e : d);
    }
    return d;
}

static int metrics_same(const fg_metrics *a, const fg_metrics *b)
{
    return memcmp(a, b, sizeof *a) == 0;
}

/* The batches the entropy quantile's edges need (loss_case's `tokens`). */
enum tokens_kind {
    TOKENS_RAGGED,  /* the problem's mask                                        */
    TOKENS_TIES,    /* sequences 1 and 2 each a copy of one hidden row: equal
                       entropies across the quantile's two order statistics  */
    TOKENS_ONE,     /* a single unmasked token                                   */
    TOKENS_NONE     /* no unmasked token                                         */
};

static void shape_tokens(tu_problem *prob, enum tokens_kind kind)
{
    const size_t es = prob->dtype == FG_DTYPE_BF16 ? 2 : 4, row = (size_t)prob->ldh * es;
    unsigned char *h = prob->hidden_s;
    for (int64_t n = 0; n < N; n++) {
        if (kind == TOKENS_TIES && n >= T)
            memcpy(h + (size_t)n * row, h + (size_t)(n < 2 * T ? T : 2 * T) * row, row);
        if (kind == TOKENS_ONE || kind == TOKENS_NONE)
            prob->tb.mask[n] = kind == TOKENS_ONE && n == T + 3;
    }
}

/* Part 1: one loss, host-checked and device-reported, in several chunks. */
static void loss_case(fg_context *ctx, const char *tag, const fg_loss_config *cfg, fg_dtype dt,
                      int with_bias, double filter_eps, int no_old, uint64_t seed,
                      enum tokens_kind tokens)
{
    tu_problem prob;
    if (!make(&prob, dt, with_bias, seed))
        return;
    shape_tokens(&prob, tokens);
    poison_masked_rows(&prob);
    if (no_old) /* on-policy: vespo needs no token first */
        prob.tb.have_old = 0;
    prob.tb.have_sampling = !isinf(cfg->off_policy_mask_threshold);
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    const fg_linear_options o = {FG_IMPL_FUSED, 0, filter_eps};
    tu_linear_outs a, b;
    tu_linear_outs_make(&a, N, H, V, with_bias);
    tu_linear_outs_make(&b, N, H, V, with_bias);
    if (!with_bias)
        a.out.grad_bias.data = b.out.grad_bias.data = NULL;
    if (dt == FG_DTYPE_BF16) /* float32 gradients of bf16 inputs: the f32 views */
        a.out.grad_hidden.dtype = b.out.grad_hidden.dtype = FG_DTYPE_F32;
    fg_device_report rep;
    memset(&rep, 0xA5, sizeof rep);
    const size_t budget = budget_chunks(ctx, &o, cfg, &in, batch, &b.out, &rep, 3);
    fg_exec host_ex, dev_ex;
    fg_exec_init(&host_ex);
    host_ex.memory_budget = budget;
    dev_ex = host_ex;
    dev_ex.device_report = &rep;
    const fg_status sa = fg_linear_grpo(ctx, &o, cfg, &in, batch, &a.out, &host_ex);
    fg_memory_stats ma;
    fg_get_memory_stats(ctx, &ma);
    const long before = fg_backend_reference_syncs();
    b.out.loss = -7.0;
    const fg_status sb = fg_linear_grpo(ctx, &o, cfg, &in, batch, &b.out, &dev_ex);
    const long syncs = fg_backend_reference_syncs() - before;
    fg_memory_stats mb;
    fg_get_memory_stats(ctx, &mb);
    char msg[512];
    const fg_status rs = fg_device_report_status(&rep, msg, sizeof msg);
    CHECK(sa == FG_OK && sb == FG_OK && rs == FG_OK, "%s: host %s, reported %s, record %s: %s",
          tag, fg_status_name(sa), fg_status_name(sb), fg_status_name(rs), msg);
    CHECK(syncs == 0, "%s: %ld host synchronisations in a device-reported call", tag, syncs);
    CHECK(mb.chunks >= 2 || tokens == TOKENS_ONE || tokens == TOKENS_NONE,
          "%s: %lld chunks at %zu bytes", tag, (long long)mb.chunks, budget);
    CHECK(b.out.loss == -7.0, "%s: out->loss written (%g)", tag, b.out.loss);
    CHECK(rep.loss == a.out.loss && metrics_same(&rep.metrics, &a.out.metrics),
          "%s: loss %.17g / %.17g, or a metric differs", tag, rep.loss, a.out.loss);
    CHECK(memcmp(a.logp, b.logp, N * sizeof(float)) == 0 &&
              memcmp(a.entropy, b.entropy, N * sizeof(float)) == 0,
          "%s: logp or entropy differ", tag);
    CHECK(memcmp(a.grad_hidden, b.grad_hidden, (size_t)N * H * sizeof(float)) == 0,
          "%s: grad_hidden differs (%g)", tag,
          max_abs_diff(a.grad_hidden, b.grad_hidden, (size_t)N * H));
    /* float32 sums in another order: relative to the largest entry */
    double top = 1.0;
    for (size_t i = 0; i < (size_t)V * H; i++)
        top = fabs((double)a.grad_weight[i]) > top ? fabs((double)a.grad_weight[i]) : top;
    const double dw = max_abs_diff(a.grad_weight, b.grad_weight, (size_t)V * H) / top;
    TOL_CHECK("grad_weight, another chunking", dw, 1e-6, "%s", tag);
    if (with_bias) /* one float32 addition a row, in order: masked rows add 0 */
        CHECK(memcmp(a.grad_bias, b.grad_bias, (size_t)V * sizeof(float)) == 0,
              "%s: grad_bias differs (%g)", tag, max_abs_diff(a.grad_bias, b.grad_bias, (size_t)V));
    if (filter_eps > 0)
        CHECK(rep.dlogits_kept == ma.dlogits_kept && rep.dlogits_kept > 0,
              "%s: kept %lld, host-checked %lld", tag, (long long)rep.dlogits_kept,
              (long long)ma.dlogits_kept);
    printf("%-36s %lld chunks, 0 syncs; loss %.9g; |dW| %.2g\n", tag, (long long)mb.chunks,
           rep.loss, dw);
    tu_linear_outs_free(&a);
    tu_linear_outs_free(&b);
    tu_problem_free(&prob);
}

/* Part 1b: sequences of several of the loss's segments (T = 2500: three of
 * FG_EVAL_SEGMENT = 1024 tokens), the entropy bonus and the KL: the record's
 * loss and metrics bitwise the host's (the same segments, in order). */
static void long_sequences_case(fg_context *ctx)
{
    enum { LB = 2, LT = 2500, LH = 8, LV = 17 };
    tu_problem prob;
    tu_problem_make(&prob, LB, LT, LH, LV, FG_DTYPE_F32, 1, 2500u);
    if (tu_problem_fill_logp(&prob, 0.8, 0.2, 0.3) != 0) {
        CHECK(0, "long sequences: the oracle refused the batch");
        tu_problem_free(&prob);
        return;
    }
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    const fg_loss_config cfg = config(FG_LOSS_GRPO, 0.04, 0.02);
    tu_linear_outs a, b;
    tu_linear_outs_make(&a, LB * LT, LH, LV, 1);
    tu_linear_outs_make(&b, LB * LT, LH, LV, 1);
    fg_device_report rep;
    fg_exec ex;
    fg_exec_init(&ex);
    const fg_status sa = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &a.out, &ex);
    ex.device_report = &rep;
    const fg_status sb = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &b.out, &ex);
    char msg[512];
    const fg_status rs = fg_device_report_status(&rep, msg, sizeof msg);
    CHECK(sa == FG_OK && sb == FG_OK && rs == FG_OK, "long sequences: %s %s %s %s",
          fg_status_name(sa), fg_status_name(sb), fg_status_name(rs), msg);
    CHECK(rep.loss == a.out.loss && metrics_same(&rep.metrics, &a.out.metrics),
          "long sequences: loss %.17g / %.17g, or a metric differs", rep.loss, a.out.loss);
    CHECK(memcmp(a.logp, b.logp, (size_t)LB * LT * sizeof(float)) == 0,
          "long sequences: logp differ");
    /* GSPO without gradients: the forward sweep and the sequences' constants
     * alone, then the loss. */
    fg_loss_config gspo = cfg;
    gspo.importance_sampling_level = FG_LEVEL_SEQUENCE;
    a.out.grad_hidden.data = a.out.grad_weight.data = a.out.grad_bias.data = NULL;
    b.out.grad_hidden.data = b.out.grad_weight.data = b.out.grad_bias.data = NULL;
    ex.device_report = NULL;
    const fg_status sc = fg_linear_grpo(ctx, NULL, &gspo, &in, batch, &a.out, &ex);
    ex.device_report = &rep;
    const fg_status sd = fg_linear_grpo(ctx, NULL, &gspo, &in, batch, &b.out, &ex);
    CHECK(sc == FG_OK && sd == FG_OK && fg_device_report_status(&rep, NULL, 0) == FG_OK &&
              rep.loss == a.out.loss && metrics_same(&rep.metrics, &a.out.metrics),
          "GSPO without gradients: %s %s, loss %.17g / %.17g", fg_status_name(sc),
          fg_status_name(sd), rep.loss, a.out.loss);
    printf("%-36s %d segments a sequence; loss %.9g, bitwise the host's\n", "T = 2500",
           (LT + FG_EVAL_SEGMENT - 1) / FG_EVAL_SEGMENT, rep.loss);
    tu_linear_outs_free(&a);
    tu_linear_outs_free(&b);
    tu_problem_free(&prob);
}

/* Part 2: the head's calls. */
static void head_case(fg_context *ctx, fg_dtype dt)
{
    tu_problem prob;
    if (!make(&prob, dt, 1, 91u + (uint64_t)dt))
        return;
    poison_masked_rows(&prob);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    const fg_tokens tok = {B, T, prob.tb.token_ids, prob.tb.mask};
    float lp[2][N], en[2][N], dlogp[N], dent[N];
    for (int64_t n = 0; n < N; n++) {
        dlogp[n] = (float)(0.1 * (double)(n % 7) - 0.3);
        dent[n] = (float)(0.02 * (double)(n % 3));
    }
    fg_device_report rep;
    fg_exec ex;
    fg_exec_init(&ex);
    for (int k = 0; k < 2; k++) {
        ex.device_report = k ? &rep : NULL;
        const long before = fg_backend_reference_syncs();
        const fg_status st = fg_linear_logprobs(ctx, NULL, 0.8, &in, &tok, lp[k], en[k], &ex);
        const long syncs = fg_backend_reference_syncs() - before;
        CHECK(st == FG_OK, "logprobs %d: %s", k, fg_last_error(ctx));
        if (k)
            CHECK(syncs == 0 && fg_device_report_status(&rep, NULL, 0) == FG_OK,
                  "logprobs: %ld syncs", syncs);
    }
    CHECK(memcmp(lp[0], lp[1], sizeof lp[0]) == 0 && memcmp(en[0], en[1], sizeof en[0]) == 0,
          "logprobs: device-reported logp or entropy differ");
    float *gh[2], *gw[2], *gb[2];
    for (int k = 0; k < 2; k++) {
        gh[k] = tu_xmalloc((size_t)N * H * sizeof(float));
        gw[k] = tu_xmalloc((size_t)V * H * sizeof(float));
        gb[k] = tu_xmalloc((size_t)V * sizeof(float));
        fg_linear_grads g = {{gh[k], FG_DTYPE_F32, N, H, H},
                             {gw[k], FG_DTYPE_F32, V, H, H},
                             {gb[k], FG_DTYPE_F32, V},
                             0};
        ex.device_report = k ? &rep : NULL;
        const long before = fg_backend_reference_syncs();
        const fg_status st =
            fg_linear_logprobs_backward(ctx, NULL, 0.8, &in, &tok, dlogp, dent, &g, &ex);
        const long syncs = fg_backend_reference_syncs() - before;
        CHECK(st == FG_OK, "logprobs_backward %d: %s", k, fg_last_error(ctx));
        if (k)
            CHECK(syncs == 0 && fg_device_report_status(&rep, NULL, 0) == FG_OK,
                  "logprobs_backward: %ld syncs", syncs);
    }
    CHECK(memcmp(gh[0], gh[1], (size_t)N * H * sizeof(float)) == 0,
          "logprobs_backward: grad_hidden differs");
    TOL_CHECK("grad_weight, another chunking", max_abs_diff(gw[0], gw[1], (size_t)V * H), 1e-6,
              "logprobs_backward, dtype %d", (int)dt);
    CHECK(memcmp(gb[0], gb[1], (size_t)V * sizeof(float)) == 0,
          "logprobs_backward: grad_bias differs");
    /* A NaN derivative at an unmasked token: the host's refusal, reported. */
    int64_t at = 0;
    while (!prob.tb.mask[at])
        at++;
    dlogp[at + 1 < N && prob.tb.mask[at + 1] ? at + 1 : at] = NAN;
    char host_msg[512] = "", dev_msg[512] = "";
    fg_status hs = FG_OK, ds = FG_OK, cs = FG_OK;
    for (int k = 0; k < 2; k++) {
        fg_linear_grads g = {{gh[k], FG_DTYPE_F32, N, H, H}, {gw[k], FG_DTYPE_F32, V, H, H},
                             {NULL, FG_DTYPE_F32, 0}, 0};
        ex.device_report = k ? &rep : NULL;
        const fg_status st =
            fg_linear_logprobs_backward(ctx, NULL, 0.8, &in, &tok, dlogp, dent, &g, &ex);
        if (k) {
            cs = st;
            ds = fg_device_report_status(&rep, dev_msg, sizeof dev_msg);
        } else {
            hs = st;
            snprintf(host_msg, sizeof host_msg, "%s", fg_last_error(ctx));
        }
    }
    CHECK(cs == FG_OK && hs != FG_OK && ds == hs && strcmp(host_msg, dev_msg) == 0,
          "grad_logp NaN: host %s \"%s\", reported %s \"%s\" (call %s)", fg_status_name(hs),
          host_msg, fg_status_name(ds), dev_msg, fg_status_name(cs));
    for (int k = 0; k < 2; k++) {
        free(gh[k]);
        free(gw[k]);
        free(gb[k]);
    }
    tu_problem_free(&prob);
}

/* Part 3: one refusal, host-checked and reported. */
typedef void (*spoil_fn)(tu_problem *prob, fg_loss_config *cfg);

/* The `which`-th unmasked token (counted around the batch's). */
static int64_t unmasked(const tu_problem *prob, int64_t which)
{
    which %= tu_batch_unmasked(&prob->tb);
    for (int64_t n = 0, k = 0; n < N; n++)
        if (prob->tb.mask[n] && k++ == which)
            return n;
    return 0;
}

static void bad_id(tu_problem *p, fg_loss_config *c) { (void)c; p->tb.token_ids[unmasked(p, 9)] = V + 2; }
static void bad_adv(tu_problem *p, fg_loss_config *c) { (void)c; p->tb.advantages[2] = NAN; }
static void bad_old(tu_problem *p, fg_loss_config *c) { (void)c; p->tb.old_logp[unmasked(p, 4)] = INFINITY; }
static void bad_ref(tu_problem *p, fg_loss_config *c)
{
    c->beta = 0.04;
    p->tb.ref_logp[unmasked(p, 6)] = NAN;
}
static void bad_is_seq(tu_problem *p, fg_loss_config *c)
{
    (void)c;
    p->tb.is_mode = 2;
    p->tb.is_ratio[1] = NAN;
}
static void bad_hidden(tu_problem *p, fg_loss_config *c)
{
    (void)c;
    const int64_t n = unmasked(p, 3);
    if (p->dtype == FG_DTYPE_BF16)
        ((uint16_t *)p->hidden_s)[n * p->ldh + 5] = 0x7F80u;
    else
        ((float *)p->hidden_s)[n * p->ldh + 5] = NAN;
}
static void bad_weight(tu_problem *p, fg_loss_config *c)
{
    (void)c;
    if (p->dtype == FG_DTYPE_BF16)
        ((uint16_t *)p->weight_s)[17 * p->ldw + 3] = 0xFFC0u;
    else
        ((float *)p->weight_s)[17 * p->ldw + 3] = -INFINITY;
}
static void bad_bias(tu_problem *p, fg_loss_config *c)
{
    (void)c;
    if (p->dtype == FG_DTYPE_BF16)
        ((uint16_t *)p->bias_s)[40] = 0x7FC0u;
    else
        ((float *)p->bias_s)[40] = NAN;
}
static void kl_overflow(tu_problem *p, fg_loss_config *c)
{
    c->beta = 0.04;
    p->tb.ref_logp[unmasked(p, 5)] = 800.0f; /* exp(ref - logp) overflows */
}
static void two_at_once(tu_problem *p, fg_loss_config *c)
{
    bad_weight(p, c); /* the scan runs after the batch's checks */
    bad_old(p, c);
}
static void two_tokens(tu_problem *p, fg_loss_config *c)
{
    kl_overflow(p, c);
    p->tb.ref_logp[unmasked(p, 9)] = 900.0f; /* a later token: the earlier one is named */
}

static void refusal_case(fg_context *ctx, const char *tag, spoil_fn spoil, fg_dtype dt)
{
    tu_problem prob;
    if (!make(&prob, dt, 1, 123u))
        return;
    fg_loss_config cfg = config(FG_LOSS_DAPO, 0.0, 0.01);
    spoil(&prob, &cfg);
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    const fg_linear_options o = {FG_IMPL_FUSED, 0, 0.0};
    tu_linear_outs a;
    tu_linear_outs_make(&a, N, H, V, 1);
    if (dt == FG_DTYPE_BF16)
        a.out.grad_hidden.dtype = FG_DTYPE_F32;
    fg_device_report rep;
    const size_t budget = budget_chunks(ctx, &o, &cfg, &in, batch, &a.out, &rep, 3);
    fg_exec ex;
    fg_exec_init(&ex);
    ex.memory_budget = budget;
    const fg_status hs = fg_linear_grpo(ctx, &o, &cfg, &in, batch, &a.out, &ex);
    char host_msg[512];
    snprintf(host_msg, sizeof host_msg, "%s", fg_last_error(ctx));
    ex.device_report = &rep;
    const long before = fg_backend_reference_syncs();
    const fg_status cs = fg_linear_grpo(ctx, &o, &cfg, &in, batch, &a.out, &ex);
    const long syncs = fg_backend_reference_syncs() - before;
    char dev_msg[512];
    const fg_status ds = fg_device_report_status(&rep, dev_msg, sizeof dev_msg);
    CHECK(hs != FG_OK, "%s: the host-checked call passed", tag);
    CHECK(cs == FG_OK && syncs == 0, "%s: the reported call returned %s (%s) with %ld syncs",
          tag, fg_status_name(cs), fg_last_error(ctx), syncs);
    CHECK(ds == hs && strcmp(host_msg, dev_msg) == 0, "%s: host %s \"%s\", reported %s \"%s\"",
          tag, fg_status_name(hs), host_msg, fg_status_name(ds), dev_msg);
    printf("%-36s %s: %s\n", tag, fg_status_name(ds), dev_msg);
    tu_linear_outs_free(&a);
    tu_problem_free(&prob);
}

/* Part 3: gradients that leave the float range from finite inputs. */
static void gradient_overflow_case(fg_context *ctx)
{
    tu_problem prob;
    if (!make(&prob, FG_DTYPE_F32, 0, 321u))
        return;
    const int64_t n = unmasked(&prob, 2);
    for (int64_t h = 0; h < H; h++) /* grad_weight's row of n's target grows with |hidden| */
        ((float *)prob.hidden_s)[n * prob.ldh + h] = 3e37f;
    for (int64_t v = 0; v < V; v++)
        for (int64_t h = 0; h < H; h++)
            ((float *)prob.weight_s)[v * prob.ldw + h] = 0.0f;
    fg_loss_config cfg = config(FG_LOSS_DAPO, 0.0, 0.0);
    cfg.num_items_in_batch = 1e-30; /* items < 1 count as 1: the weight is 1 */
    const fg_batch *batch = tu_batch_view(&prob.tb);
    for (int64_t b = 0; b < B; b++)
        prob.tb.advantages[b] = 1e6f;
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    tu_linear_outs a;
    tu_linear_outs_make(&a, N, H, V, 0);
    a.out.grad_bias.data = NULL;
    fg_device_report rep;
    fg_exec ex;
    fg_exec_init(&ex);
    ex.device_report = &rep;
    const fg_status cs = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &a.out, &ex);
    char msg[512];
    const fg_status ds = fg_device_report_status(&rep, msg, sizeof msg);
    CHECK(cs == FG_OK && ds == FG_ERR_OVERFLOW && strstr(msg, "grad_"),
          "gradient overflow: call %s, reported %s \"%s\"", fg_status_name(cs),
          fg_status_name(ds), msg);
    printf("%-36s %s: %s\n", "gradients out of range", fg_status_name(ds), msg);
    tu_linear_outs_free(&a);
    tu_problem_free(&prob);
}

/* Part 4. */
static void refused_at_once(fg_context *ctx, fg_context *cpu)
{
    tu_problem prob;
    if (!make(&prob, FG_DTYPE_F32, 1, 5u))
        return;
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    tu_linear_outs a;
    tu_linear_outs_make(&a, N, H, V, 1);
    fg_device_report rep;
    fg_exec ex;
    fg_exec_init(&ex);
    ex.device_report = &rep;
    fg_loss_config cfg = config(FG_LOSS_GRPO, 0.0, 0.0);
    fg_status st = fg_linear_grpo(cpu, NULL, &cfg, &in, batch, &a.out, &ex);
    CHECK(st == FG_ERR_UNSUPPORTED && strstr(fg_last_error(cpu), "behind the seam"),
          "CPU backend: %s %s", fg_status_name(st), fg_last_error(cpu));
    a.out.accumulate = 1;
    st = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &a.out, &ex);
    CHECK(st == FG_ERR_UNSUPPORTED && strstr(fg_last_error(ctx), "grad_bias"),
          "accumulate grad_bias: %s %s", fg_status_name(st), fg_last_error(ctx));
    a.out.accumulate = 0;
    ex.device_report = a.grad_weight + 8; /* inside an output */
    st = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &a.out, &ex);
    CHECK(st == FG_ERR_ALIASED_OUTPUT && strstr(fg_last_error(ctx), "device_report"),
          "record over grad_weight: %s %s", fg_status_name(st), fg_last_error(ctx));
    ex.device_report = &rep;
    const fg_tokens tok = {B, T, prob.tb.token_ids, prob.tb.mask};
    float stats[13 * N + 1];
    st = fg_linear_shard_stats(ctx, NULL, 1.0, &in, &tok, stats, &ex);
    CHECK(st == FG_ERR_UNSUPPORTED && strstr(fg_last_error(ctx), "phase API"),
          "the phase API: %s %s", fg_status_name(st), fg_last_error(ctx));
    fg_logits_outputs lo;
    memset(&lo, 0, sizeof lo);
    st = fg_logits_grpo(cpu, &cfg, NULL, batch, &lo, &ex);
    CHECK(st == FG_ERR_UNSUPPORTED && strstr(fg_last_error(cpu), "fg_logits_grpo"),
          "fg_logits_grpo: %s %s", fg_status_name(st), fg_last_error(cpu));
    memset(&rep, 0, sizeof rep);
    CHECK(fg_device_report_status(&rep, NULL, 0) == FG_OK, "a zero record is not FG_OK");
    tu_linear_outs_free(&a);
    tu_problem_free(&prob);
}

int main(void)
{
    fg_context_options co;
    fg_context_options_init(&co);
    co.backend = FG_BACKEND_REFERENCE;
    fg_context *ctx = NULL, *cpu = NULL;
    if (fg_context_create(&co, &ctx) != FG_OK || tu_host_context_create(&cpu) != FG_OK) {
        CHECK(0, "contexts");
        return tu_finish();
    }
    const struct {
        const char *tag;
        fg_loss_type lt;
        double beta, ent, eps;
        fg_dtype dt;
        int bias;
        fg_is_level level;   /* 0: token */
        double off_policy;   /* 0: off */
        int no_old;          /* no old_logp (on-policy) */
        double quantile;     /* top_entropy_quantile; 0: 1 (off) */
    } cases[] = {
        {"grpo f32", FG_LOSS_GRPO, 0.0, 0.0, 0.0, FG_DTYPE_F32, 0, FG_LEVEL_TOKEN, 0.0, 0, 0},
        {"dapo + entropy bonus, bias, f32", FG_LOSS_DAPO, 0.0, 0.05, 0.0, FG_DTYPE_F32, 1,
         FG_LEVEL_TOKEN, 0.0, 0, 0},
        {"dr_grpo + KL, bf16", FG_LOSS_DR_GRPO, 0.04, 0.0, 0.0, FG_DTYPE_BF16, 1,
         FG_LEVEL_TOKEN, 0.0, 0, 0},
        {"bnpo bf16", FG_LOSS_BNPO, 0.0, 0.0, 0.0, FG_DTYPE_BF16, 0, FG_LEVEL_TOKEN, 0.0, 0, 0},
        {"cispo f32", FG_LOSS_CISPO, 0.0, 0.01, 0.0, FG_DTYPE_F32, 1, FG_LEVEL_TOKEN, 0.0, 0, 0},
        {"sapo f32", FG_LOSS_SAPO, 0.0, 0.0, 0.0, FG_DTYPE_F32, 0, FG_LEVEL_TOKEN, 0.0, 0, 0},
        {"luspo + KL f32", FG_LOSS_LUSPO, 0.04, 0.0, 0.0, FG_DTYPE_F32, 0, FG_LEVEL_TOKEN, 0.0, 0, 0},
        {"vespo on-policy (no old_logp) f32", FG_LOSS_VESPO, 0.0, 0.0, 0.0, FG_DTYPE_F32, 0,
         FG_LEVEL_TOKEN, 0.0, 1, 0},
        {"grpo filtered 1e-3, bias, f32", FG_LOSS_GRPO, 0.0, 0.0, 1e-3, FG_DTYPE_F32, 1,
         FG_LEVEL_TOKEN, 0.0, 0, 0},
        {"dapo filtered 1e-2, bf16", FG_LOSS_DAPO, 0.0, 0.0, 1e-2, FG_DTYPE_BF16, 0,
         FG_LEVEL_TOKEN, 0.0, 0, 0},
        /* every token's log-prob first: a forward sweep, report_prepare */
        {"gspo (grpo, sequence) + KL, f32", FG_LOSS_GRPO, 0.04, 0.01, 0.0, FG_DTYPE_F32, 1,
         FG_LEVEL_SEQUENCE, 0.0, 0, 0},
        {"sapo sequence bf16", FG_LOSS_SAPO, 0.0, 0.0, 0.0, FG_DTYPE_BF16, 0,
         FG_LEVEL_SEQUENCE, 0.0, 0, 0},
        {"vespo off-policy f32", FG_LOSS_VESPO, 0.0, 0.0, 0.0, FG_DTYPE_F32, 0,
         FG_LEVEL_TOKEN, 0.0, 0, 0},
        {"dapo + off-policy mask, f32", FG_LOSS_DAPO, 0.0, 0.0, 0.0, FG_DTYPE_F32, 1,
         FG_LEVEL_TOKEN, 0.05, 0, 0},
        /* the entropy quantile: its threshold over every unmasked entropy */
        {"dapo + entropy quantile 0.8 + entropy bonus, f32", FG_LOSS_DAPO, 0.0, 0.05, 0.0,
         FG_DTYPE_F32, 1, FG_LEVEL_TOKEN, 0.0, 0, 0.8},
        {"gspo + entropy quantile 0.5, bf16", FG_LOSS_GRPO, 0.0, 0.0, 0.0, FG_DTYPE_BF16, 0,
         FG_LEVEL_SEQUENCE, 0.0, 0, 0.5},
        {"grpo + entropy quantile 0.3, filtered 1e-2, f32", FG_LOSS_GRPO, 0.04, 0.0, 1e-2,
         FG_DTYPE_F32, 0, FG_LEVEL_TOKEN, 0.0, 0, 0.3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fg_loss_config cfg = config(cases[i].lt, cases[i].beta, cases[i].ent);
        cfg.importance_sampling_level = cases[i].level;
        if (cases[i].off_policy != 0)
            cfg.off_policy_mask_threshold = cases[i].off_policy;
        if (cases[i].quantile != 0)
            cfg.top_entropy_quantile = cases[i].quantile;
        loss_case(ctx, cases[i].tag, &cfg, cases[i].dt, cases[i].bias, cases[i].eps,
                  cases[i].no_old, 40u + i, TOKENS_RAGGED);
    }
    /* The entropy quantile's edges: equal entropies at its order statistics,
     * one token, none. */
    const struct {
        const char *tag;
        enum tokens_kind tokens;
        double quantile;
    } edges[] = {{"dapo + entropy quantile 0.5, ties, f32", TOKENS_TIES, 0.5},
                 {"dapo + entropy quantile 0.2, ties, f32", TOKENS_TIES, 0.2},
                 {"dapo + entropy quantile 0.5, one token, f32", TOKENS_ONE, 0.5},
                 {"dapo + entropy quantile 0.5, no token, f32", TOKENS_NONE, 0.5}};
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++) {
        fg_loss_config cfg = config(FG_LOSS_DAPO, 0.0, 0.05);
        cfg.top_entropy_quantile = edges[i].quantile;
        loss_case(ctx, edges[i].tag, &cfg, FG_DTYPE_F32, 1, 0.0, 0, 90u + i, edges[i].tokens);
    }
    long_sequences_case(ctx);
    head_case(ctx, FG_DTYPE_F32);
    head_case(ctx, FG_DTYPE_BF16);
    const struct {
        const char *tag;
        spoil_fn f;
    } spoils[] = {
        {"token id out of range", bad_id},       {"advantages NaN", bad_adv},
        {"old_logp Inf", bad_old},               {"ref_logp NaN (beta)", bad_ref},
        {"per-sequence is_ratio NaN", bad_is_seq}, {"hidden NaN", bad_hidden},
        {"weight -Inf", bad_weight},             {"bias NaN", bad_bias},
        {"the KL overflows", kl_overflow},       {"weight and old_logp", two_at_once},
        {"two tokens' KL", two_tokens},
    };
    for (size_t i = 0; i < sizeof spoils / sizeof spoils[0]; i++) {
        refusal_case(ctx, spoils[i].tag, spoils[i].f, FG_DTYPE_F32);
        refusal_case(ctx, spoils[i].tag, spoils[i].f, FG_DTYPE_BF16);
    }
    gradient_overflow_case(ctx);
    refused_at_once(ctx, cpu);
    fg_context_destroy(ctx);
    fg_context_destroy(cpu);
    return tu_finish();
}
