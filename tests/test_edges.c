/*
 * test_edges: numerics at the edges, against the float64 oracle.
 *
 * Each case runs fg_linear_grpo fused (small budget: several chunks) and
 * materialized, and fg_logits_grpo on the same logits (computed here in
 * double from the stored inputs, stored as f32), and compares with the
 * oracle run on exactly the stored values:
 *   - logits near +-1e4 (a large weight scale) and logits given directly at
 *     +-1e4 to the logits path;
 *   - temperature 1e-3 and 1e3;
 *   - advantages all zero (with and without KL / entropy terms);
 *   - a one-token vocabulary (V = 1): logp = entropy = 0, zero gradient;
 *   - V = 262147 (> 2^18) with small H and N;
 *   - a chosen token whose probability underflows (logp < -100);
 *   - a batch with every token masked, and a single-token batch.
 * Error measures (as in test_paths): loss |a-b| / max(|b|, scale) with the
 * oracle's loss scale; logp and entropy max |a-b| / max(|b|, 1) over
 * unmasked tokens; gradients ||a-b||_2 / ||b||_2 (||a||_2 when b = 0).
 * Tolerances are per case (TOL_* below, stated with the numbers they guard)
 * and the worst error of every case is printed.
 *
 * Non-finite inputs: NaN, +Inf and -Inf in hidden, weight, bias and logits
 * (f32 and bf16 encodings) are refused with FG_ERR_NONFINITE_INPUT before any
 * output is written; at masked rows / padding columns they are not read.
 * With fg_context_set_check_finite(ctx, 0), NaN in an unmasked hidden row (or
 * in the weight, the bias, the logits) still yields FG_ERR_NONFINITE_INPUT,
 * detected after the computation (outputs then hold garbage: documented).
 * A positive temperature whose reciprocal overflows float (1e-320) must not
 * return FG_OK (see docs/ROBUSTNESS.md, finding F1).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "test_util.h"

static fg_context *ctx;

typedef struct tol {
    double loss, logp, ent, grad;
} tol;

/* f32 everywhere: errors are f32 rounding of the logits (GEMM over H terms)
 * and of the row reductions over V terms. */
static const tol TOL_DEFAULT = {1e-5, 1e-5, 1e-5, 1e-4};

static double worst_case[4];

static void note(const char *tag, const char *what, double e, double t, int slot)
{
    CHECK(e <= t, "%s %s: error %.3g > tolerance %.3g", tag, what, e, t);
    if (e > worst_case[slot])
        worst_case[slot] = e;
}

typedef struct outs {
    int64_t N, H, V;
    float *logp, *ent, *gh, *gw, *gb, *gl;
    fg_outputs o;
} outs;

static void outs_alloc(outs *w, int64_t N, int64_t H, int64_t V, int linear)
{
    memset(w, 0, sizeof *w);
    w->N = N;
    w->H = H;
    w->V = V;
    w->logp = tu_xmalloc((size_t)N * sizeof(float));
    w->ent = tu_xmalloc((size_t)N * sizeof(float));
    w->o.logp = w->logp;
    w->o.entropy = w->ent;
    if (linear) {
        w->gh = tu_xmalloc((size_t)N * (size_t)H * sizeof(float));
        w->gw = tu_xmalloc((size_t)V * (size_t)H * sizeof(float));
        w->gb = tu_xmalloc((size_t)V * sizeof(float));
        w->o.grad_hidden = fg_matrix_make(w->gh, FG_DTYPE_F32, N, H);
        w->o.grad_weight = fg_matrix_make(w->gw, FG_DTYPE_F32, V, H);
        w->o.grad_bias = fg_vector_make(w->gb, FG_DTYPE_F32, V);
    } else {
        w->gl = tu_xmalloc((size_t)N * (size_t)V * sizeof(float));
        w->o.grad_logits = fg_matrix_make(w->gl, FG_DTYPE_F32, N, V);
    }
}

static void outs_free(outs *w)
{
    free(w->logp);
    free(w->ent);
    free(w->gh);
    free(w->gw);
    free(w->gb);
    free(w->gl);
}

/* Everything finite, masked logp/entropy exactly 0. */
static void check_finite_outs(const char *tag, const outs *w, const fg_batch *b)
{
    int ok = isfinite(w->o.loss) && isfinite(w->o.metrics.entropy) && isfinite(w->o.metrics.kl);
    for (int64_t n = 0; n < w->N; n++) {
        ok = ok && isfinite(w->logp[n]) && isfinite(w->ent[n]);
        if (!b->mask[n])
            CHECK(w->logp[n] == 0.0f && w->ent[n] == 0.0f, "%s: masked logp/entropy not 0", tag);
    }
    const float *gs[4] = {w->gh, w->gw, w->gb, w->gl};
    const int64_t ns[4] = {w->N * w->H, w->V * w->H, w->V, w->N * w->V};
    for (int k = 0; k < 4; k++)
        for (int64_t i = 0; gs[k] && i < ns[k]; i++)
            ok = ok && isfinite(gs[k][i]);
    CHECK(ok, "%s: a result is not finite (loss %g)", tag, w->o.loss);
}

static void compare(const char *tag, const fg_loss_config *cfg, const fg_batch *b,
                    const fg_oracle_result *ref, const outs *w, tol t)
{
    check_finite_outs(tag, w, b);
    const double scale = fg_oracle_loss_scale(cfg, b, ref->logp, ref->entropy);
    note(tag, "loss", tu_rel_err(w->o.loss, ref->loss, fmax(scale, 1e-12)), t.loss, 0);
    note(tag, "logp", tu_max_rel(w->logp, ref->logp, w->N, b->mask, 1.0), t.logp, 1);
    note(tag, "entropy", tu_max_rel(w->ent, ref->entropy, w->N, b->mask, 1.0), t.ent, 2);
    if (w->gh) {
        note(tag, "grad_hidden", tu_rel_l2(w->gh, FG_DTYPE_F32, w->N, w->H, w->H, ref->grad_hidden),
             t.grad, 3);
        note(tag, "grad_weight", tu_rel_l2(w->gw, FG_DTYPE_F32, w->V, w->H, w->H, ref->grad_weight),
             t.grad, 3);
        /* grad_bias = column sums of the oracle's grad_logits */
        double *gb = calloc((size_t)w->V, sizeof(double));
        for (int64_t n = 0; n < w->N; n++)
            for (int64_t v = 0; v < w->V; v++)
                gb[v] += ref->grad_logits[n * w->V + v];
        note(tag, "grad_bias", tu_rel_l2(w->gb, FG_DTYPE_F32, 1, w->V, w->V, gb), t.grad, 3);
        free(gb);
    }
    if (w->gl)
        note(tag, "grad_logits", tu_rel_l2(w->gl, FG_DTYPE_F32, w->N, w->V, w->V, ref->grad_logits),
             t.grad, 3);
}

/* Runs fused, materialized and logits on hidden [N,H], weight [V,H], bias [V]
 * (doubles, rounded to f32 in place) and compares all with the oracle. */
/* budget BUDGET_MIN: the planner's smallest budget for the call (one token
 * row a chunk, the most chunks), whatever the CPU's GEMM scratch. */
#define BUDGET_MIN ((size_t)1)

static void run_case(const char *name, const fg_loss_config *cfg, tu_batch *tb, int64_t H,
                     int64_t V, double *hid, double *wt, double *bias, tol t, size_t budget)
{
    const int64_t N = tb->B * tb->T;
    const fg_batch *b = tu_batch_view(tb);
    float *h32 = tu_store_matrix(hid, N, H, H, FG_DTYPE_F32);
    float *w32 = tu_store_matrix(wt, V, H, H, FG_DTYPE_F32);
    float *b32 = bias ? tu_store_matrix(bias, 1, V, V, FG_DTYPE_F32) : NULL;
    fg_oracle_result ref;
    CHECK(fg_oracle_linear(cfg, b, hid, wt, bias, H, V, &ref) == 0, "%s: oracle failed", name);
    char tag[160];
    for (int impl = 0; impl < 2; impl++) {
        outs w;
        outs_alloc(&w, N, H, V, 1);
        fg_linear_inputs in;
        memset(&in, 0, sizeof in);
        in.hidden = fg_matrix_make(h32, FG_DTYPE_F32, N, H);
        in.weight = fg_matrix_make(w32, FG_DTYPE_F32, V, H);
        in.bias = fg_vector_make(b32, FG_DTYPE_F32, V);
        const fg_linear_options lo = {impl ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED, 0};
        size_t use = impl ? 0 : budget;
        if (use == BUDGET_MIN) {
            fg_linear_plan_info plan;
            fg_context_set_memory_budget(ctx, 0);
            CHECK(fg_linear_grpo_plan(ctx, &lo, cfg, &in, b, &w.o, &plan) == FG_OK, "%s: plan (%s)",
                  name, fg_last_error(ctx));
            use = plan.min_budget_bytes;
        }
        fg_context_set_memory_budget(ctx, use);
        snprintf(tag, sizeof tag, "%s [%s]", name, impl ? "materialized" : "fused");
        fg_status st = fg_linear_grpo(ctx, &lo, cfg, &in, b, &w.o);
        CHECK(st == FG_OK, "%s: %s (%s)", tag, fg_status_name(st), fg_last_error(ctx));
        if (st == FG_OK)
            compare(tag, cfg, b, &ref, &w, t);
        outs_free(&w);
    }
    fg_context_set_memory_budget(ctx, 0);
    /* The logits path on the oracle's logits (z * temperature), stored as f32. */
    double *lg = tu_xmalloc((size_t)N * (size_t)V * sizeof(double));
    for (int64_t n = 0; n < N; n++)
        for (int64_t v = 0; v < V; v++) {
            double s = bias ? bias[v] : 0.0;
            for (int64_t k = 0; k < H; k++)
                s += hid[n * H + k] * wt[v * H + k];
            lg[n * V + v] = s;
        }
    float *l32 = tu_store_matrix(lg, N, V, V, FG_DTYPE_F32);
    fg_oracle_result lref;
    CHECK(fg_oracle_logits(cfg, b, lg, V, &lref) == 0, "%s: oracle (logits) failed", name);
    outs w;
    outs_alloc(&w, N, H, V, 0);
    fg_matrix lm = fg_matrix_make(l32, FG_DTYPE_F32, N, V);
    snprintf(tag, sizeof tag, "%s [logits]", name);
    fg_status st = fg_logits_grpo(ctx, cfg, &lm, b, &w.o);
    CHECK(st == FG_OK, "%s: %s (%s)", tag, fg_status_name(st), fg_last_error(ctx));
    if (st == FG_OK)
        compare(tag, cfg, b, &lref, &w, t);
    outs_free(&w);
    fg_oracle_result_free(&lref);
    fg_oracle_result_free(&ref);
    free(lg);
    free(l32);
    free(h32);
    free(w32);
    free(b32);
}

/* Random inputs with the given scales; returns the batch filled with old/ref
 * log-probs near the oracle's own log-probs. */
typedef struct prob {
    tu_batch tb;
    int64_t H, V;
    double *hid, *wt, *bias;
} prob;

static void prob_make(prob *p, int64_t B, int64_t T, int64_t H, int64_t V, double hs, double ws,
                      int pattern, uint64_t seed, const fg_loss_config *cfg)
{
    tu_rng rng;
    tu_rng_seed(&rng, seed);
    p->H = H;
    p->V = V;
    tu_batch_make(&p->tb, B, T, V, pattern, &rng);
    const int64_t N = B * T;
    p->hid = tu_xmalloc((size_t)N * (size_t)H * sizeof(double));
    p->wt = tu_xmalloc((size_t)V * (size_t)H * sizeof(double));
    p->bias = tu_xmalloc((size_t)V * sizeof(double));
    for (int64_t i = 0; i < N * H; i++) p->hid[i] = tu_round_to(FG_DTYPE_F32, hs * tu_normal(&rng));
    for (int64_t i = 0; i < V * H; i++) p->wt[i] = tu_round_to(FG_DTYPE_F32, ws * tu_normal(&rng));
    for (int64_t i = 0; i < V; i++) p->bias[i] = tu_round_to(FG_DTYPE_F32, 0.1 * tu_normal(&rng));
    /* old/ref near the true log-probs so ratios straddle the clip bounds */
    fg_oracle_result r;
    fg_loss_config c0 = *cfg;
    c0.beta = 0;
    p->tb.have_old = p->tb.have_ref = 0;
    p->tb.is_mode = 0;
    double *lp = calloc((size_t)N, sizeof(double));
    if (fg_oracle_linear(&c0, tu_batch_view(&p->tb), p->hid, p->wt, p->bias, H, V, &r) == 0) {
        memcpy(lp, r.logp, (size_t)N * sizeof(double));
        fg_oracle_result_free(&r);
    }
    p->tb.have_old = p->tb.have_ref = 1;
    p->tb.is_mode = 1;
    tu_batch_fill_logp(&p->tb, lp, 0.2, 0.2, &rng);
    free(lp);
}

static void prob_free(prob *p)
{
    tu_batch_free(&p->tb);
    free(p->hid);
    free(p->wt);
    free(p->bias);
}

static void base_cfg(fg_loss_config *cfg)
{
    fg_loss_config_init(cfg);
    cfg->loss_type = FG_LOSS_GRPO;
    cfg->beta = 0.04;
    cfg->entropy_coef = 0.01;
    cfg->epsilon_high = 0.28;
}

/* ------------------------------------------------------------- the cases */

static void case_large_logits(void)
{
    fg_loss_config cfg;
    base_cfg(&cfg);
    cfg.beta = 0; /* exp(ref - logp) overflows for logp ~ -1e4: the k3 KL is not finite there */
    prob p;
    /* logits = hidden . weight with |logit| up to ~1e4 */
    prob_make(&p, 3, 5, 16, 97, 1.0, 1e4 / 4.0 / 4.0, 1, 11, &cfg);
    double mx = 0;
    for (int64_t n = 0; n < 15; n++)
        for (int64_t v = 0; v < 97; v++) {
            double s = p.bias[v];
            for (int64_t k = 0; k < 16; k++) s += p.hid[n * 16 + k] * p.wt[v * 16 + k];
            mx = fmax(mx, fabs(s));
        }
    printf("large logits: max |logit| = %.0f\n", mx);
    CHECK(mx > 5e3 && mx < 5e4, "large logits: max |logit| %g not near 1e4", mx);
    /* One ulp of a float near 1e4 is ~1e-3: the GEMM's f32 logits carry that
     * much absolute error, and so does the library's row lse (stored as one
     * float, max + log(sum)), hence logp = z - lse and p = exp(z - lse):
     * tolerances of 1e-3 (finding F3 in docs/ROBUSTNESS.md: keeping max and
     * log(sum) apart would bring the logits-path error back to ~1e-7). */
    const tol t = {1e-3, 1e-3, 1e-2, 1e-3};
    run_case("logits ~1e4 (weight scale)", &cfg, &p.tb, p.H, p.V, p.hid, p.wt, p.bias, t, BUDGET_MIN);
    prob_free(&p);

    /* logits given directly, exactly representable, at +-1e4 */
    tu_rng rng;
    tu_rng_seed(&rng, 12);
    tu_batch tb;
    const int64_t B = 2, T = 3, V = 64, N = B * T;
    tu_batch_make(&tb, B, T, V, 0, &rng);
    double *lg = tu_xmalloc((size_t)N * V * sizeof(double));
    for (int64_t i = 0; i < N * V; i++)
        lg[i] = (tu_uniform(&rng) < 0.5 ? -1e4 : 1e4) + (double)tu_randint(&rng, 64) / 8.0;
    tb.have_old = 1;
    for (int64_t n = 0; n < N; n++) tb.old_logp[n] = -(float)(tu_uniform(&rng) * 3);
    float *l32 = tu_store_matrix(lg, N, V, V, FG_DTYPE_F32);
    fg_oracle_result ref;
    const fg_batch *b = tu_batch_view(&tb);
    CHECK(fg_oracle_logits(&cfg, b, lg, V, &ref) == 0, "%s", "oracle +-1e4");
    outs w;
    outs_alloc(&w, N, 1, V, 0);
    fg_matrix lm = fg_matrix_make(l32, FG_DTYPE_F32, N, V);
    fg_status st = fg_logits_grpo(ctx, &cfg, &lm, b, &w.o);
    CHECK(st == FG_OK, "logits +-1e4: %s", fg_status_name(st));
    if (st == FG_OK)
        compare("logits exactly +-1e4 [logits]", &cfg, b, &ref, &w, t);
    outs_free(&w);
    fg_oracle_result_free(&ref);
    free(lg);
    free(l32);
    tu_batch_free(&tb);
}

static void case_temperature(double temp)
{
    fg_loss_config cfg;
    base_cfg(&cfg);
    cfg.temperature = temp;
    /* temperature 1e-3 turns O(1) logits into O(1e3) scaled logits: log-probs
     * of unlikely tokens reach ~ -3e3 and exp(ref - logp) overflows, so the
     * KL term is off there (it is not finite in exact arithmetic either). */
    if (temp < 1)
        cfg.beta = 0;
    prob p;
    prob_make(&p, 3, 6, 12, 101, 1.0, 0.3, 2, 21, &cfg);
    char name[64];
    snprintf(name, sizeof name, "temperature %g", temp);
    /* 1e-3: the scaled logits carry 1e3x the f32 rounding of the raw logits */
    const tol t = temp < 1 ? (tol){1e-4, 1e-5, 1e-3, 1e-3} : TOL_DEFAULT;
    run_case(name, &cfg, &p.tb, p.H, p.V, p.hid, p.wt, p.bias, t, BUDGET_MIN);
    prob_free(&p);
}

static void case_zero_advantages(void)
{
    for (int k = 0; k < 2; k++) {
        fg_loss_config cfg;
        base_cfg(&cfg);
        if (k == 0) {
            cfg.beta = 0;
            cfg.entropy_coef = 0;
        }
        prob p;
        prob_make(&p, 3, 5, 10, 53, 1.0, 0.4, 0, 31, &cfg);
        for (int64_t b = 0; b < 3; b++) p.tb.advantages[b] = 0.0f;
        run_case(k ? "advantages 0 with KL and entropy" : "advantages 0", &cfg, &p.tb, p.H, p.V,
                 p.hid, p.wt, p.bias, TOL_DEFAULT, BUDGET_MIN);
        if (k == 0) { /* the loss is exactly zero and so is every gradient */
            outs w;
            outs_alloc(&w, 15, 10, 53, 1);
            float *h32 = tu_store_matrix(p.hid, 15, 10, 10, FG_DTYPE_F32);
            float *w32 = tu_store_matrix(p.wt, 53, 10, 10, FG_DTYPE_F32);
            fg_linear_inputs in;
            memset(&in, 0, sizeof in);
            in.hidden = fg_matrix_make(h32, FG_DTYPE_F32, 15, 10);
            in.weight = fg_matrix_make(w32, FG_DTYPE_F32, 53, 10);
            fg_status st = fg_linear_grpo(ctx, NULL, &cfg, &in, tu_batch_view(&p.tb), &w.o);
            CHECK(st == FG_OK, "zero advantages: %s", fg_status_name(st));
            int zero = w.o.loss == 0.0;
            for (int64_t i = 0; i < 15 * 10; i++) zero = zero && w.gh[i] == 0.0f;
            for (int64_t i = 0; i < 53 * 10; i++) zero = zero && w.gw[i] == 0.0f;
            CHECK(zero, "zero advantages, no KL/entropy: loss %g, gradients not all 0", w.o.loss);
            outs_free(&w);
            free(h32);
            free(w32);
        }
        prob_free(&p);
    }
}

static void case_vocab_one(void)
{
    fg_loss_config cfg;
    base_cfg(&cfg);
    prob p;
    prob_make(&p, 2, 4, 7, 1, 1.0, 1.0, 0, 41, &cfg);
    /* logp = entropy = 0 exactly in exact arithmetic; the gradient is 0. The
     * library's f32 row statistics leave |logp| <= ~1e-7, inside TOL_DEFAULT
     * with its floor of 1; gradients are compared in absolute terms (the
     * oracle's are 0, so the relative measure returns ||a||). */
    const tol t = {1e-5, 1e-5, 1e-5, 1e-5};
    run_case("V = 1", &cfg, &p.tb, p.H, p.V, p.hid, p.wt, p.bias, t, 0);
    prob_free(&p);
}

static void case_huge_vocab(void)
{
    fg_loss_config cfg;
    base_cfg(&cfg);
    prob p;
    const int64_t V = 262147; /* > 2^18, prime */
    prob_make(&p, 2, 2, 8, V, 1.0, 0.5, 0, 51, &cfg);
    /* Row reductions over 2.6e5 terms: f32 sums lose ~log2(V) bits more. */
    const tol t = {1e-5, 1e-5, 1e-4, 1e-4};
    run_case("V = 262147", &cfg, &p.tb, p.H, p.V, p.hid, p.wt, p.bias, t, 4u << 20);
    prob_free(&p);
}

static void case_underflow(void)
{
    fg_loss_config cfg;
    base_cfg(&cfg);
    prob p;
    const int64_t H = 6, V = 40, B = 2, T = 3, N = B * T;
    prob_make(&p, B, T, H, V, 1.0, 0.3, 0, 61, &cfg);
    /* Weight row 0 points along hidden row n (scaled), row 1 against it: the
     * chosen token 1 has a logit ~130 below the best one. */
    for (int64_t n = 0; n < N; n++) {
        p.tb.mask[n] = 1;
        p.tb.token_ids[n] = 1;
    }
    double hn = 0;
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < H; k++) p.hid[n * H + k] = tu_round_to(FG_DTYPE_F32, 1.0 + 0.01 * (double)k);
    for (int64_t k = 0; k < H; k++) hn += p.hid[k] * p.hid[k];
    for (int64_t k = 0; k < H; k++) {
        p.wt[0 * H + k] = tu_round_to(FG_DTYPE_F32, 65.0 * p.hid[k] / hn);
        p.wt[1 * H + k] = tu_round_to(FG_DTYPE_F32, -65.0 * p.hid[k] / hn);
    }
    for (int64_t v = 0; v < V; v++) p.bias[v] = 0.0;
    /* old/ref near the (tiny) log-probs so ratios and KL stay moderate */
    for (int64_t n = 0; n < N; n++) {
        p.tb.old_logp[n] = -130.0f + 0.1f * (float)n;
        p.tb.ref_logp[n] = -130.0f - 0.1f * (float)n;
    }
    fg_oracle_result r;
    CHECK(fg_oracle_linear(&cfg, tu_batch_view(&p.tb), p.hid, p.wt, p.bias, H, V, &r) == 0, "%s",
          "oracle underflow");
    printf("underflow: chosen-token logp = %.3f (p = %.3g)\n", r.logp[0], exp(r.logp[0]));
    CHECK(r.logp[0] < -100, "underflow case: logp %g not < -100", r.logp[0]);
    fg_oracle_result_free(&r);
    run_case("logp < -100", &cfg, &p.tb, p.H, p.V, p.hid, p.wt, p.bias, TOL_DEFAULT, 0);
    prob_free(&p);
}

static void case_masks(void)
{
    fg_loss_config cfg;
    base_cfg(&cfg);
    prob p;
    prob_make(&p, 3, 4, 5, 31, 1.0, 0.5, 0, 71, &cfg);
    for (int64_t n = 0; n < 12; n++) p.tb.mask[n] = 0;
    run_case("every token masked", &cfg, &p.tb, p.H, p.V, p.hid, p.wt, p.bias, TOL_DEFAULT, 0);
    prob_free(&p);
    prob_make(&p, 1, 1, 5, 31, 1.0, 0.5, 0, 72, &cfg);
    p.tb.mask[0] = 1;
    p.tb.token_ids[0] = 30;
    run_case("single token", &cfg, &p.tb, p.H, p.V, p.hid, p.wt, p.bias, TOL_DEFAULT, 0);
    prob_free(&p);
}

/* ---------------------------------------------------------- non-finite */

enum { NB = 2, NT = 3, NH = 7, NV = 23, NN = NB * NT, LDH = NH + 1 };

typedef struct nf {
    tu_batch tb;
    float hid[NN * LDH], wt[NV * NH], bias[NV], lg[NN * NV];
    uint16_t hid16[NN * LDH], wt16[NV * NH], bias16[NV], lg16[NN * NV];
    float logp[NN], ent[NN], gh[NN * NH], gw[NV * NH], gb[NV], gl[NN * NV];
} nf;

static nf g_nf;

static void nf_reset(nf *s)
{
    tu_batch_free(&s->tb);
    tu_rng rng;
    tu_rng_seed(&rng, 99);
    tu_batch_make(&s->tb, NB, NT, NV, 0, &rng);
    s->tb.mask[1] = 0; /* row 1 masked */
    s->tb.have_old = s->tb.have_ref = 1; /* neutral -1 from tu_batch_make */
    for (int i = 0; i < NN * LDH; i++)
        s->hid[i] = (i % LDH) < NH ? (float)tu_normal(&rng) : 0.0f; /* padding column: finite */
    for (int i = 0; i < NV * NH; i++) s->wt[i] = (float)(0.3 * tu_normal(&rng));
    for (int i = 0; i < NV; i++) s->bias[i] = (float)(0.1 * tu_normal(&rng));
    for (int i = 0; i < NN * NV; i++) s->lg[i] = (float)tu_normal(&rng);
    for (int i = 0; i < NN * LDH; i++) s->hid16[i] = fg_f32_to_bf16(s->hid[i]);
    for (int i = 0; i < NV * NH; i++) s->wt16[i] = fg_f32_to_bf16(s->wt[i]);
    for (int i = 0; i < NV; i++) s->bias16[i] = fg_f32_to_bf16(s->bias[i]);
    for (int i = 0; i < NN * NV; i++) s->lg16[i] = fg_f32_to_bf16(s->lg[i]);
    tu_fill_bytes(s->logp, sizeof s->logp + sizeof s->ent + sizeof s->gh + sizeof s->gw +
                               sizeof s->gb + sizeof s->gl, 0xA5);
}

static int nf_untouched(const nf *s)
{
    return tu_bytes_are(s->logp, sizeof s->logp + sizeof s->ent + sizeof s->gh + sizeof s->gw +
                                     sizeof s->gb + sizeof s->gl, 0xA5);
}

/* path 0 fused, 1 materialized, 2 logits. */
static fg_status nf_call(nf *s, int path, fg_dtype dt, fg_outputs *out)
{
    fg_loss_config cfg;
    base_cfg(&cfg);
    memset(out, 0, sizeof *out);
    out->logp = s->logp;
    out->entropy = s->ent;
    const int bf = dt == FG_DTYPE_BF16;
    if (path == 2) {
        out->grad_logits = fg_matrix_make(s->gl, FG_DTYPE_F32, NN, NV);
        fg_matrix lm = fg_matrix_make(bf ? (void *)s->lg16 : (void *)s->lg, dt, NN, NV);
        return fg_logits_grpo(ctx, &cfg, &lm, tu_batch_view(&s->tb), out);
    }
    out->grad_hidden = fg_matrix_make(s->gh, FG_DTYPE_F32, NN, NH);
    out->grad_weight = fg_matrix_make(s->gw, FG_DTYPE_F32, NV, NH);
    out->grad_bias = fg_vector_make(s->gb, FG_DTYPE_F32, NV);
    fg_linear_inputs in;
    memset(&in, 0, sizeof in);
    in.hidden = (fg_matrix){bf ? (void *)s->hid16 : (void *)s->hid, dt, NN, NH, LDH};
    in.weight = fg_matrix_make(bf ? (void *)s->wt16 : (void *)s->wt, dt, NV, NH);
    in.bias = fg_vector_make(bf ? (void *)s->bias16 : (void *)s->bias, dt, NV);
    const fg_linear_options lo = {path ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED, 0};
    return fg_linear_grpo(ctx, &lo, &cfg, &in, tu_batch_view(&s->tb), out);
}

/* Puts x at element i of the input `which` (0 hidden, 1 weight, 2 bias, 3 logits). */
static void nf_poke(nf *s, int which, int i, float x)
{
    float *f[4] = {s->hid, s->wt, s->bias, s->lg};
    uint16_t *h[4] = {s->hid16, s->wt16, s->bias16, s->lg16};
    f[which][i] = x;
    h[which][i] = fg_f32_to_bf16(x);
}

static void case_nonfinite(void)
{
    const float vals[3] = {NAN, INFINITY, -INFINITY};
    const char *vn[3] = {"NaN", "+Inf", "-Inf"};
    const char *wn[4] = {"hidden", "weight", "bias", "logits"};
    const int idx[4] = {2 * LDH + 3, 5 * NH + 2, 7, 3 * NV + 4}; /* unmasked row 2 / 3 */
    nf *s = &g_nf;
    int n = 0;
    for (int dt = 0; dt < 2; dt++)
        for (int w = 0; w < 4; w++)
            for (int v = 0; v < 3; v++)
                for (int path = 0; path < 3; path++) {
                    if ((w == 3) != (path == 2))
                        continue;
                    nf_reset(s);
                    nf_poke(s, w, idx[w], vals[v]);
                    fg_outputs out;
                    fg_status st = nf_call(s, path, (fg_dtype)dt, &out);
                    CHECK(st == FG_ERR_NONFINITE_INPUT, "%s in %s (%s, path %d): %s", vn[v], wn[w],
                          dt ? "bf16" : "f32", path, fg_status_name(st));
                    CHECK(nf_untouched(s), "%s in %s (%s, path %d): outputs written", vn[v], wn[w],
                          dt ? "bf16" : "f32", path);
                    n++;
                }
    /* bf16 NaN payloads other than the canonical one, and a signalling-NaN pattern */
    const uint16_t nan_bits[3] = {0x7fc1, 0xffff, 0x7f81};
    for (int k = 0; k < 3; k++) {
        nf_reset(s);
        s->wt16[9] = nan_bits[k];
        fg_outputs out;
        fg_status st = nf_call(s, 0, FG_DTYPE_BF16, &out);
        CHECK(st == FG_ERR_NONFINITE_INPUT, "bf16 NaN bits 0x%04x in weight: %s", nan_bits[k],
              fg_status_name(st));
    }
    /* not read: a masked hidden row, the padding column, a masked logits row */
    for (int path = 0; path < 3; path++) {
        nf_reset(s);
        if (path == 2) {
            nf_poke(s, 3, 1 * NV + 5, NAN);
        } else {
            nf_poke(s, 0, 1 * LDH + 2, NAN);          /* masked row 1 */
            nf_poke(s, 0, 4 * LDH + NH, INFINITY);    /* padding column of row 4 */
        }
        fg_outputs out;
        fg_status st = nf_call(s, path, FG_DTYPE_F32, &out);
        CHECK(st == FG_OK, "NaN where it is not read (path %d): %s (%s)", path, fg_status_name(st),
              fg_last_error(ctx));
        CHECK(st != FG_OK || isfinite(out.loss), "NaN not read (path %d): loss %g", path, out.loss);
    }
    /* finite check off: NaN in an unmasked row is still reported, after the computation */
    fg_context_set_check_finite(ctx, 0);
    for (int dt = 0; dt < 2; dt++)
        for (int w = 0; w < 4; w++)
            for (int path = 0; path < 3; path++) {
                if ((w == 3) != (path == 2))
                    continue;
                nf_reset(s);
                nf_poke(s, w, idx[w], NAN);
                fg_outputs out;
                fg_status st = nf_call(s, path, (fg_dtype)dt, &out);
                CHECK(st == FG_ERR_NONFINITE_INPUT,
                      "check_finite off, NaN in %s (%s, path %d): %s, want FG_ERR_NONFINITE_INPUT",
                      wn[w], dt ? "bf16" : "f32", path, fg_status_name(st));
                CHECK(strstr(fg_last_error(ctx), "invalid") != NULL,
                      "check_finite off: message '%s' does not say the results are invalid",
                      fg_last_error(ctx));
                n++;
            }
    fg_context_set_check_finite(ctx, 1);
    printf("non-finite inputs: %d refused calls checked\n", n);

    /* F1: a positive temperature whose reciprocal overflows float */
    const double tiny[2] = {1e-320, 1e-40};
    for (int k = 0; k < 2; k++)
        for (int path = 0; path < 3; path++) {
            nf_reset(s);
            fg_loss_config cfg;
            base_cfg(&cfg);
            cfg.temperature = tiny[k];
            fg_outputs out;
            memset(&out, 0, sizeof out);
            out.logp = s->logp;
            fg_status st;
            if (path == 2) {
                fg_matrix lm = fg_matrix_make(s->lg, FG_DTYPE_F32, NN, NV);
                st = fg_logits_grpo(ctx, &cfg, &lm, tu_batch_view(&s->tb), &out);
            } else {
                fg_linear_inputs in;
                memset(&in, 0, sizeof in);
                in.hidden = (fg_matrix){s->hid, FG_DTYPE_F32, NN, NH, LDH};
                in.weight = fg_matrix_make(s->wt, FG_DTYPE_F32, NV, NH);
                const fg_linear_options lo = {path ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED, 0};
                st = fg_linear_grpo(ctx, &lo, &cfg, &in, tu_batch_view(&s->tb), &out);
            }
            CHECK(st != FG_OK, "temperature %g (path %d) accepted with loss %g", tiny[k], path,
                  out.loss);
            printf("temperature %g (path %d): %s%s\n", tiny[k], path, fg_status_name(st),
                   nf_untouched(s) ? " (outputs untouched)" : " (outputs written)");
        }
    tu_batch_free(&s->tb);
}

int main(void)
{
    fg_context_options o;
    fg_context_options_init(&o);
    o.threads = 2;
    fg_status cs = fg_context_create(&o, &ctx);
    if (cs != FG_OK) {
        CHECK(0, "context: %s", fg_status_name(cs));
        return tu_finish();
    }
    case_large_logits();
    case_temperature(1e-3);
    case_temperature(1e3);
    case_zero_advantages();
    case_vocab_one();
    case_huge_vocab();
    case_underflow();
    case_masks();
    case_nonfinite();
    printf("worst errors: loss %.3g, logp %.3g, entropy %.3g, gradients %.3g\n", worst_case[0],
           worst_case[1], worst_case[2], worst_case[3]);
    fg_context_destroy(ctx);
    return tu_finish();
}
