/*
 * test_refusals: what the C API refuses that a front end could pass through,
 * and that a refused call changes no output.
 *
 *  1. Threads: a context or an fg_exec asking for more than FG_MAX_THREADS
 *     is refused (FG_ERR_BAD_HYPERPARAMETER, the value and the cap named)
 *     before anything runs.
 *  2. The option ranges (docs/LOSS_SPEC.md "Option ranges and overflow"):
 *     every option outside its range is refused with a message naming it and
 *     the value; the sentinels only as their exact values; the range's edges
 *     are accepted.
 *  3. Overflow from finite inputs (FG_ERR_OVERFLOW, never a non-finite
 *     success): a hidden row of 1e38 in an accumulating
 *     fg_linear_logprobs_backward; a caller's grad_logp too large for the
 *     gradients; a hidden row of 1e10 with beta = 0.04 (the KL's exp) and the
 *     whole hidden times 60 with beta, through the fused path (one chunk,
 *     several chunks accumulating, several overwriting), the materialized
 *     path, the logits path (in place) and fg_grpo_loss_from_logp; logits
 *     beyond float range once divided by the temperature. Every output
 *     buffer, grad_weight and grad_bias holding earlier sums included, must
 *     be bitwise unchanged (the one documented exception: grad_hidden and
 *     grad_weight of a non-accumulating call of several chunks).
 *  4. The messages: an overflow says so and names the row or token; "the
 *     finite check was off" only when it was.
 */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { B = 3, T = 6, H = 16, V = 64, N = B * T };

static fg_context *ctx;

/* ------------------------------------------------------------ snapshots */

/* Copies of a call's output buffers, to compare bit for bit afterwards. */
typedef struct snapshot {
    int k;
    const void *at[8];
    void *copy[8];
    size_t bytes[8];
} snapshot;

static void snap_add(snapshot *s, const void *p, size_t bytes)
{
    if (!p)
        return;
    s->at[s->k] = p;
    s->bytes[s->k] = bytes;
    s->copy[s->k] = tu_xmalloc(bytes);
    memcpy(s->copy[s->k], p, bytes);
    s->k++;
}

/* Index of the first buffer that changed, or -1; frees the copies. */
static int snap_changed(snapshot *s)
{
    int changed = -1;
    for (int i = 0; i < s->k; i++) {
        if (changed < 0 && memcmp(s->at[i], s->copy[i], s->bytes[i]) != 0)
            changed = i;
        free(s->copy[i]);
    }
    s->k = 0;
    return changed;
}

/* Outputs holding "earlier sums": finite, distinct values, as an
 * accumulating caller's buffers would. */
static void fill_earlier(tu_linear_outs *o)
{
    for (int64_t i = 0; i < V * H; i++)
        o->grad_weight[i] = 0.125f * (float)(i % 13) - 0.75f;
    for (int64_t i = 0; i < V; i++)
        o->grad_bias[i] = 0.25f * (float)(i % 7) - 0.5f;
    for (int64_t i = 0; i < N * H; i++)
        o->grad_hidden[i] = 0.5f * (float)(i % 5);
    for (int64_t i = 0; i < N; i++)
        o->logp[i] = o->entropy[i] = -1.0f - (float)i;
    o->out.loss = 12.5;
    memset(&o->out.metrics, 0x5A, sizeof o->out.metrics);
}

/* The linear outputs; `partial_ok`: grad_hidden and grad_weight may change
 * (a non-accumulating call of several chunks). */
static void snap_linear(snapshot *s, tu_linear_outs *o, int partial_ok)
{
    snap_add(s, &o->out.loss, sizeof o->out.loss);
    snap_add(s, &o->out.metrics, sizeof o->out.metrics);
    snap_add(s, o->logp, sizeof(float) * N);
    snap_add(s, o->entropy, sizeof(float) * N);
    snap_add(s, o->grad_bias, sizeof(float) * V);
    if (!partial_ok) {
        snap_add(s, o->grad_hidden, sizeof(float) * N * H);
        snap_add(s, o->grad_weight, sizeof(float) * V * H);
    }
}

static int has(const char *msg, const char *part) { return strstr(msg, part) != NULL; }

/* ---------------------------------------------------------------- setup */

static tu_problem prob;

static void make_problem(void)
{
    tu_problem_make(&prob, B, T, H, V, FG_DTYPE_F32, 1, 3636);
    CHECK(tu_problem_fill_logp(&prob, 1.0, 0.2, 0.2) == 0, "%s", "oracle log-probs");
    prob.tb.is_mode = 0;
    tu_batch_view(&prob.tb);
}

/* The last unmasked token: in the last chunk of a one-row-a-chunk call. */
static int64_t last_unmasked(void)
{
    for (int64_t n = N - 1; n >= 0; n--)
        if (prob.tb.mask[n])
            return n;
    return -1;
}

static fg_exec budget_exec(size_t budget)
{
    fg_exec e;
    fg_exec_init(&e);
    e.memory_budget = budget;
    return e;
}

/* The smallest budget of this loss call: one token row a chunk. */
static size_t min_budget(const fg_loss_config *cfg, const fg_linear_outputs *out)
{
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    fg_linear_plan_info info;
    fg_status st = fg_linear_grpo_plan(ctx, NULL, cfg, &in, &prob.tb.view, out, NULL, &info);
    CHECK(st == FG_OK, "plan: %s", fg_last_error(ctx));
    return info.min_budget_bytes;
}

/* -------------------------------------------------------------- threads */

static void check_threads(void)
{
    fg_context_options o;
    fg_context_options_init(&o);
    o.threads = FG_MAX_THREADS + 1;
    fg_context *c = NULL;
    CHECK(fg_context_create(&o, &c) == FG_ERR_BAD_HYPERPARAMETER && c == NULL,
          "context threads %d accepted", o.threads);
    o.threads = FG_MAX_THREADS;
    CHECK(fg_context_create(&o, &c) == FG_OK, "context threads %d refused", o.threads);
    fg_context_destroy(c);

    const int asks[] = {FG_MAX_THREADS + 1, 100000, INT_MAX};
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    tu_linear_outs o2;
    tu_linear_outs_make(&o2, N, H, V, 1);
    for (size_t i = 0; i < sizeof asks / sizeof asks[0]; i++) {
        fg_exec e;
        fg_exec_init(&e);
        e.threads = asks[i];
        char want[32];
        snprintf(want, sizeof want, "%d", asks[i]);
        fill_earlier(&o2);
        snapshot s = {0};
        snap_linear(&s, &o2, 0);
        fg_status st = fg_linear_grpo(ctx, NULL, &cfg, &in, &prob.tb.view, &o2.out, &e);
        const char *msg = fg_last_error(ctx);
        CHECK(st == FG_ERR_BAD_HYPERPARAMETER && has(msg, want) && has(msg, "4096"),
              "fg_linear_grpo threads %d: %s (%s)", asks[i], fg_status_name(st), msg);
        CHECK(snap_changed(&s) < 0, "threads %d: an output changed", asks[i]);
        float logp[N];
        st = fg_linear_logprobs(ctx, NULL, 1.0, &in,
                                &(fg_tokens){B, T, prob.tb.token_ids, prob.tb.mask}, logp, NULL, &e);
        CHECK(st == FG_ERR_BAD_HYPERPARAMETER, "fg_linear_logprobs threads %d: %s", asks[i],
              fg_status_name(st));
    }
    tu_linear_outs_free(&o2);
}

/* --------------------------------------------------------------- ranges */

typedef struct range_case {
    const char *name;
    size_t offset;
    int is_int; /* int64_t field, else double */
    double bad[6];
    int n_bad;
    double good[4];
    int n_good;
} range_case;

#define OFF(f) offsetof(fg_loss_config, f)

static void set_field(fg_loss_config *c, const range_case *r, double v)
{
    if (r->is_int)
        *(int64_t *)((char *)c + r->offset) = (int64_t)v;
    else
        *(double *)((char *)c + r->offset) = v;
}

static fg_status loss_from_logp(const fg_loss_config *cfg, fg_logp_outputs *out)
{
    static float logp[N], ent[N];
    for (int64_t n = 0; n < N; n++) {
        logp[n] = -0.5f - 0.01f * (float)n;
        ent[n] = 1.0f + 0.02f * (float)n;
    }
    return fg_grpo_loss_from_logp(ctx, cfg, &prob.tb.view, logp, ent, out, NULL);
}

static void check_ranges(void)
{
    const double inf = INFINITY, nan = NAN;
    const range_case cases[] = {
        {"temperature", OFF(temperature), 0, {0, -1, nan, inf, 1e-300}, 5, {1e-3, 0.7}, 2},
        {"epsilon_low", OFF(epsilon_low), 0, {-0.1, nan, inf, -inf}, 4, {0, 0.2}, 2},
        {"epsilon_high", OFF(epsilon_high), 0, {-0.3, -2, nan, inf}, 4, {-1, 0, 0.28}, 3},
        {"delta", OFF(delta), 0, {-1, -0.5, nan, inf}, 4, {0, 1.5}, 2},
        {"beta", OFF(beta), 0, {-0.04, nan, inf}, 3, {0, 0.04}, 2},
        {"max_completion_length", OFF(max_completion_length), 1, {-1, -4, -9.2e18}, 3,
         {0, 1, 9}, 3},
        {"num_items_in_batch", OFF(num_items_in_batch), 0, {0, -5, -0.5, -1.5, nan, inf}, 6,
         {-1, 0.5, 100}, 3},
        {"sapo_temperature_pos", OFF(sapo_temperature_pos), 0, {0, -1, nan, inf, 1e-310}, 5,
         {0.5}, 1},
        {"sapo_temperature_neg", OFF(sapo_temperature_neg), 0, {0, -1, nan, inf}, 4, {0.5}, 1},
        {"entropy_coef", OFF(entropy_coef), 0, {nan, inf, -inf}, 3, {-0.1, 0, 0.1}, 3},
        {"vespo_k_pos", OFF(vespo_k_pos), 0, {0, -1, nan, inf}, 4, {0.5}, 1},
        {"vespo_lambda_pos", OFF(vespo_lambda_pos), 0, {0, -1, nan, inf}, 4, {0.5}, 1},
        {"vespo_k_neg", OFF(vespo_k_neg), 0, {0, -1, nan, inf}, 4, {0.5}, 1},
        {"vespo_lambda_neg", OFF(vespo_lambda_neg), 0, {0, -1, nan, inf}, 4, {0.5}, 1},
        {"off_policy_mask_threshold", OFF(off_policy_mask_threshold), 0, {nan, -inf}, 2,
         {inf, -1, 0.5}, 3},
        {"top_entropy_quantile", OFF(top_entropy_quantile), 0, {-0.1, 1.1, nan}, 3,
         {0, 0.5, 1}, 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const range_case *r = &cases[i];
        const fg_status refusal =
            strcmp(r->name, "temperature") == 0 ? FG_ERR_BAD_TEMPERATURE : FG_ERR_BAD_HYPERPARAMETER;
        for (int k = 0; k < r->n_bad; k++) {
            fg_loss_config cfg;
            fg_loss_config_init(&cfg);
            set_field(&cfg, r, r->bad[k]);
            char value[64];
            if (r->is_int)
                snprintf(value, sizeof value, "%lld", (long long)(int64_t)r->bad[k]);
            else
                snprintf(value, sizeof value, "%g", r->bad[k]);
            fg_logp_outputs out;
            memset(&out, 0xA5, sizeof out);
            out.grad_logp = out.grad_entropy = NULL;
            const fg_logp_outputs before = out;
            const fg_status st = loss_from_logp(&cfg, &out);
            const char *msg = fg_last_error(ctx);
            CHECK(st == refusal && has(msg, r->name) && has(msg, value),
                  "%s = %s: %s (%s)", r->name, value, fg_status_name(st), msg);
            CHECK(memcmp(&out, &before, sizeof out) == 0, "%s = %s: the loss was written",
                  r->name, value);
        }
        for (int k = 0; k < r->n_good; k++) {
            fg_loss_config cfg;
            fg_loss_config_init(&cfg);
            set_field(&cfg, r, r->good[k]);
            fg_logp_outputs out;
            memset(&out, 0, sizeof out);
            const fg_status st = loss_from_logp(&cfg, &out);
            CHECK(st == FG_OK && isfinite(out.loss), "%s = %g refused: %s", r->name, r->good[k],
                  fg_last_error(ctx));
        }
    }
    /* The sentinels are the values fg_loss_config_init sets. */
    fg_loss_config c;
    fg_loss_config_init(&c);
    CHECK(c.epsilon_high == FG_EPSILON_HIGH_SAME_AS_LOW && c.delta == FG_DELTA_OFF &&
              c.max_completion_length == FG_MAX_COMPLETION_LENGTH_T &&
              c.num_items_in_batch == FG_NUM_ITEMS_UNMASKED,
          "%s", "fg_loss_config_init's sentinels are not the header's");
}

/* ------------------------------------------------------------- overflow */

/* One overflow case of the linear loss: the status, a message naming the
 * token and "overflow", and the outputs bitwise unchanged. */
static void expect_linear_overflow(const char *what, const fg_linear_options *opts,
                                   const fg_loss_config *cfg, const fg_linear_inputs *in,
                                   int accumulate, size_t budget, const char *token)
{
    tu_linear_outs o;
    tu_linear_outs_make(&o, N, H, V, 1);
    o.out.accumulate = accumulate;
    fill_earlier(&o);
    const fg_exec e = budget_exec(budget);
    fg_memory_stats ms;
    snapshot s = {0};
    const int several = budget > 0; /* min_budget: one row a chunk */
    snap_linear(&s, &o, several && !accumulate);
    const fg_status st = fg_linear_grpo(ctx, opts, cfg, in, &prob.tb.view, &o.out, &e);
    const char *msg = fg_last_error(ctx);
    CHECK(st == FG_ERR_OVERFLOW && has(msg, "overflow") && (!token || has(msg, token)) &&
              !has(msg, "check was off"),
          "%s: %s (%s), want FG_ERR_OVERFLOW naming %s", what, fg_status_name(st), msg,
          token ? token : "-");
    const int changed = snap_changed(&s);
    CHECK(changed < 0, "%s: output %d changed on refusal", what, changed);
    fg_get_memory_stats(ctx, &ms);
    printf("%-45s %lld chunks: %s\n", what, (long long)ms.chunks, msg);
    if (several)
        CHECK(ms.chunks > 1, "%s: %lld chunks, several wanted", what, (long long)ms.chunks);
    tu_linear_outs_free(&o);
}

static void check_loss_overflow(void)
{
    const int64_t n0 = last_unmasked();
    char token[32];
    snprintf(token, sizeof token, "token [%lld, %lld]", (long long)(n0 / T), (long long)(n0 % T));
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.beta = 0.04;
    const fg_linear_options mat = {FG_IMPL_MATERIALIZED, 0, 0.0};

    /* A hidden row of 1e10: the logits stay far inside the float range (the
     * up-front bound passes), the KL's exp(ref - logp) does not. */
    double *saved = tu_xmalloc(sizeof(double) * N * H);
    memcpy(saved, prob.hidden, sizeof(double) * N * H);
    for (int64_t h = 0; h < H; h++)
        prob.hidden[n0 * H + h] *= 1e10;
    tu_problem_restore(&prob);
    fg_linear_inputs in = tu_problem_inputs(&prob);
    tu_linear_outs probe;
    tu_linear_outs_make(&probe, N, H, V, 1);
    const size_t smallest = min_budget(&cfg, &probe.out);
    tu_linear_outs_free(&probe);
    expect_linear_overflow("row 1e10, fused, one chunk", NULL, &cfg, &in, 0, 0, token);
    expect_linear_overflow("row 1e10, fused, one chunk, accumulating", NULL, &cfg, &in, 1, 0,
                           token);
    expect_linear_overflow("row 1e10, materialized", &mat, &cfg, &in, 1, 0, token);
    expect_linear_overflow("row 1e10, fused, chunks, accumulating", NULL, &cfg, &in, 1, smallest,
                           token);
    expect_linear_overflow("row 1e10, fused, chunks, overwriting", NULL, &cfg, &in, 0, smallest,
                           token);
    {   /* the loss alone, no gradient: its loss terms are checked all the same */
        tu_linear_outs o;
        tu_linear_outs_make(&o, N, H, V, 1);
        fill_earlier(&o);
        fg_linear_outputs only_loss = {0};
        only_loss.logp = o.logp;
        snapshot s = {0};
        snap_add(&s, o.logp, sizeof(float) * N);
        snap_add(&s, &only_loss.loss, sizeof only_loss.loss);
        const fg_status st = fg_linear_grpo(ctx, NULL, &cfg, &in, &prob.tb.view, &only_loss, NULL);
        CHECK(st == FG_ERR_OVERFLOW && has(fg_last_error(ctx), token),
              "row 1e10, loss alone: %s (%s)", fg_status_name(st), fg_last_error(ctx));
        CHECK(snap_changed(&s) < 0, "%s", "row 1e10, loss alone: an output changed");
        tu_linear_outs_free(&o);
    }

    /* The logits level, in place: the logits themselves are outputs. */
    double *z = tu_problem_logits(&prob);
    float *logits = tu_xmalloc(sizeof(float) * N * V);
    for (int64_t i = 0; i < N * V; i++)
        logits[i] = (float)z[i];
    free(z);
    fg_matrix lm = fg_matrix_make(logits, FG_DTYPE_F32, N, V);
    fg_logits_outputs lo;
    float logp[N], ent[N];
    memset(&lo, 0xA5, sizeof lo);
    lo.logp = logp;
    lo.entropy = ent;
    lo.grad_logits = lm;
    memset(logp, 0xA5, sizeof logp);
    memset(ent, 0xA5, sizeof ent);
    snapshot s = {0};
    snap_add(&s, &lo.loss, sizeof lo.loss);
    snap_add(&s, &lo.metrics, sizeof lo.metrics);
    snap_add(&s, logp, sizeof logp);
    snap_add(&s, ent, sizeof ent);
    snap_add(&s, logits, sizeof(float) * N * V);
    fg_status st = fg_logits_grpo(ctx, &cfg, &lm, &prob.tb.view, &lo, NULL);
    CHECK(st == FG_ERR_OVERFLOW && has(fg_last_error(ctx), token),
          "logits path, row 1e10: %s (%s)", fg_status_name(st), fg_last_error(ctx));
    CHECK(snap_changed(&s) < 0, "%s", "logits path: an output (or the logits) changed");

    /* Logits beyond float range once divided by the temperature: refused
     * with the arguments. */
    logits[n0 * V + 3] = 1e38f;
    fg_loss_config hot = cfg;
    hot.temperature = 0.05;
    snap_add(&s, logits, sizeof(float) * N * V);
    st = fg_logits_grpo(ctx, &hot, &lm, &prob.tb.view, &lo, NULL);
    CHECK(st == FG_ERR_OVERFLOW && has(fg_last_error(ctx), "logits row"),
          "logits 1e38 / 0.05: %s (%s)", fg_status_name(st), fg_last_error(ctx));
    CHECK(snap_changed(&s) < 0, "%s", "logits 1e38: the logits changed");
    free(logits);

    /* The loss from log-probs (the phase API's (c)): a log-prob of -1e10. */
    float lp[N], en[N], gl[N], ge[N];
    for (int64_t n = 0; n < N; n++) {
        lp[n] = n == n0 ? -1e10f : -1.0f;
        en[n] = 1.0f;
        gl[n] = ge[n] = 7.0f;
    }
    fg_logp_outputs po;
    memset(&po, 0xA5, sizeof po);
    po.grad_logp = gl;
    po.grad_entropy = ge;
    snap_add(&s, &po, sizeof po);
    snap_add(&s, gl, sizeof gl);
    snap_add(&s, ge, sizeof ge);
    st = fg_grpo_loss_from_logp(ctx, &cfg, &prob.tb.view, lp, en, &po, NULL);
    CHECK(st == FG_ERR_OVERFLOW && has(fg_last_error(ctx), token),
          "loss from logp -1e10: %s (%s)", fg_status_name(st), fg_last_error(ctx));
    CHECK(snap_changed(&s) < 0, "%s", "loss from logp: an output changed");

    /* The whole hidden times 60, beta 0.04: log-probs of hundreds, the KL's
     * exp beyond float range (a finite loss of ~1e120 with Inf gradients
     * before this check existed). */
    memcpy(prob.hidden, saved, sizeof(double) * N * H);
    for (int64_t i = 0; i < N * H; i++)
        prob.hidden[i] *= 60;
    tu_problem_restore(&prob);
    in = tu_problem_inputs(&prob);
    expect_linear_overflow("hidden x 60, fused", NULL, &cfg, &in, 1, 0, NULL);
    expect_linear_overflow("hidden x 60, materialized", &mat, &cfg, &in, 0, 0, NULL);
    expect_linear_overflow("hidden x 60, fused, chunks, accumulating", NULL, &cfg, &in, 1,
                           smallest, NULL);

    /* Control: the same calls on the problem as made succeed, finite. */
    memcpy(prob.hidden, saved, sizeof(double) * N * H);
    tu_problem_restore(&prob);
    in = tu_problem_inputs(&prob);
    tu_linear_outs o;
    tu_linear_outs_make(&o, N, H, V, 1);
    fill_earlier(&o);
    o.out.accumulate = 1;
    const fg_exec e = budget_exec(smallest);
    st = fg_linear_grpo(ctx, NULL, &cfg, &in, &prob.tb.view, &o.out, &e);
    CHECK(st == FG_OK && isfinite(o.out.loss), "control: %s", fg_last_error(ctx));
    fg_linear_outputs only_loss = {0};
    st = fg_linear_grpo(ctx, NULL, &cfg, &in, &prob.tb.view, &only_loss, &e);
    CHECK(st == FG_OK && only_loss.loss == o.out.loss &&
              memcmp(&only_loss.metrics, &o.out.metrics, sizeof only_loss.metrics) == 0,
          "control, loss alone: %s, loss %.17g against %.17g", fg_status_name(st),
          only_loss.loss, o.out.loss);
    tu_linear_outs_free(&o);
    free(saved);
}

/* The cost of keeping accumulated sums: an accumulating call of several
 * chunks computes every log-prob first (one more logits product per token)
 * only where a token could still be refused once the chunks run: with the
 * KL (beta != 0), not for a token-level loss without it, whose bound the
 * inputs alone give. Counted in GEMM flops. */
static void check_accumulate_schedule(void)
{
    tu_linear_outs o;
    tu_linear_outs_make(&o, N, H, V, 1);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    for (int kl = 0; kl <= 1; kl++) {
        fg_loss_config cfg;
        fg_loss_config_init(&cfg);
        cfg.beta = kl ? 0.04 : 0.0;
        const fg_exec e = budget_exec(min_budget(&cfg, &o.out));
        int64_t flops[2];
        for (int acc = 0; acc <= 1; acc++) {
            fill_earlier(&o);
            o.out.accumulate = acc;
            fg_memory_stats ms;
            const fg_status st = fg_linear_grpo(ctx, NULL, &cfg, &in, &prob.tb.view, &o.out, &e);
            fg_get_memory_stats(ctx, &ms);
            CHECK(st == FG_OK && ms.chunks > 1, "beta %g accumulate %d: %s, %lld chunks", cfg.beta,
                  acc, fg_last_error(ctx), (long long)ms.chunks);
            flops[acc] = ms.gemm_flops;
        }
        printf("beta %-4g %lld GEMM flops overwriting, %lld accumulating\n", cfg.beta,
               (long long)flops[0], (long long)flops[1]);
        CHECK(kl ? flops[1] > flops[0] : flops[1] == flops[0],
              "beta %g: %lld GEMM flops accumulating, %lld overwriting", cfg.beta,
              (long long)flops[1], (long long)flops[0]);
    }
    tu_linear_outs_free(&o);
}

/* fg_linear_logprobs_backward accumulating into earlier sums. */
static fg_status backward(const fg_linear_inputs *in, const float *dlogp, tu_linear_outs *o,
                          int with_gh, int with_gw)
{
    fg_linear_grads g = {with_gh ? o->out.grad_hidden : (fg_matrix){0},
                         with_gw ? o->out.grad_weight : (fg_matrix){0}, o->out.grad_bias, 1};
    const fg_tokens tok = {B, T, prob.tb.token_ids, prob.tb.mask};
    return fg_linear_logprobs_backward(ctx, NULL, 1.0, in, &tok, dlogp, NULL, &g, NULL);
}

static void check_backward_overflow(void)
{
    const int64_t n0 = last_unmasked();
    float dlogp[N];
    for (int64_t n = 0; n < N; n++)
        dlogp[n] = 0.1f * (float)((n % 3) - 1);
    tu_linear_outs o;
    tu_linear_outs_make(&o, N, H, V, 1);

    /* A hidden row of 1e38: finite, but its logits are not. */
    double *saved = tu_xmalloc(sizeof(double) * N * H);
    memcpy(saved, prob.hidden, sizeof(double) * N * H);
    for (int64_t h = 0; h < H; h++)
        prob.hidden[n0 * H + h] = h == 0 ? 1e38 : prob.hidden[n0 * H + h];
    tu_problem_restore(&prob);
    fg_linear_inputs in = tu_problem_inputs(&prob);
    char row[48];
    snprintf(row, sizeof row, "hidden row %lld", (long long)n0);
    for (int check = 1; check >= 0; check--) {
        fg_context_set_check_finite(ctx, check);
        fill_earlier(&o);
        snapshot s = {0};
        snap_linear(&s, &o, 0);
        const fg_status st = backward(&in, dlogp, &o, 1, 1);
        const char *msg = fg_last_error(ctx);
        if (check)
            CHECK(st == FG_ERR_OVERFLOW && has(msg, row) && !has(msg, "check was off"),
                  "row 1e38, backward: %s (%s)", fg_status_name(st), msg);
        else /* not scanned: found at the row's statistics, before any write */
            CHECK(st == FG_ERR_NONFINITE_INPUT && has(msg, "finite check was off"),
                  "row 1e38, check off: %s (%s)", fg_status_name(st), msg);
        CHECK(snap_changed(&s) < 0, "row 1e38 (check %d): earlier sums changed", check);
    }
    fg_context_set_check_finite(ctx, 1);
    memcpy(prob.hidden, saved, sizeof(double) * N * H);
    tu_problem_restore(&prob);
    in = tu_problem_inputs(&prob);
    free(saved);

    /* The caller's d L/d logp: one token's too large for its grad_hidden row;
     * every token's large enough that grad_bias's sums would overflow. */
    char token[32];
    snprintf(token, sizeof token, "token [%lld, %lld]", (long long)(n0 / T), (long long)(n0 % T));
    const float keep = dlogp[n0];
    dlogp[n0] = 3e38f;
    fill_earlier(&o);
    snapshot s = {0};
    snap_linear(&s, &o, 0);
    fg_status st = backward(&in, dlogp, &o, 1, 1);
    CHECK(st == FG_ERR_OVERFLOW && has(fg_last_error(ctx), token) &&
              has(fg_last_error(ctx), "grad_hidden"),
          "grad_logp 3e38: %s (%s)", fg_status_name(st), fg_last_error(ctx));
    CHECK(snap_changed(&s) < 0, "%s", "grad_logp 3e38: an output changed");
    dlogp[n0] = keep;
    for (int64_t n = 0; n < N; n++)
        dlogp[n] = 1e37f;
    snap_linear(&s, &o, 0);
    st = backward(&in, dlogp, &o, 0, 0);
    CHECK(st == FG_ERR_OVERFLOW && has(fg_last_error(ctx), "grad_bias"),
          "grad_logp 1e37 everywhere: %s (%s)", fg_status_name(st), fg_last_error(ctx));
    CHECK(snap_changed(&s) < 0, "%s", "grad_logp 1e37: an output changed");

    /* Control: an ordinary grad_logp accumulates, finite. */
    for (int64_t n = 0; n < N; n++)
        dlogp[n] = 0.1f;
    fill_earlier(&o);
    st = backward(&in, dlogp, &o, 1, 1);
    int finite = 1;
    for (int64_t i = 0; i < V * H; i++)
        finite &= isfinite(o.grad_weight[i]);
    CHECK(st == FG_OK && finite, "control backward: %s", fg_last_error(ctx));
    tu_linear_outs_free(&o);
}

int main(void)
{
    fg_context_options opts;
    fg_context_options_init(&opts);
    opts.threads = 2;
    if (fg_context_create(&opts, &ctx) != FG_OK)
        return 1;
    make_problem();
    check_threads();
    check_ranges();
    check_backward_overflow();
    check_loss_overflow();
    check_accumulate_schedule();
    tu_problem_free(&prob);
    fg_context_destroy(ctx);
    return tu_finish();
}
