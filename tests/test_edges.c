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
 * Tolerances are per case and quantity (the edge_tol tables below, each with
 * the worst error measured for it) and go through TOL_CHECK, so the suite
 * prints every one next to the worst error it saw.
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

/* One case's tolerances, each the largest error any of the three paths may
 * show for that quantity. Errors are f32 rounding of the logits (a GEMM over
 * H terms) and of the row reductions over V terms; the GEMM kernels (and so
 * the rounding) differ between AVX-512 and AVX2 CPUs. Each tolerance is the
 * smallest round number >= 4x the worst error measured on either CPU kind,
 * which the comment at each table gives in field order (loss logp entropy
 * grad_hidden grad_weight grad_bias grad_logits): "Zen 5" (AVX-512) and
 * "AVX2" (qemu -cpu Haswell; natively with DNNL_MAX_CPU_ISA=AVX2 the same
 * bits). A worst of 0 is exact on both, and so is its tolerance: no rounding
 * touches that result. */
typedef struct edge_tol {
    double loss, logp, entropy, grad_hidden, grad_weight, grad_bias, grad_logits;
} edge_tol;

/* Measures one error against the case's tolerance for it, under the
 * tolerance name "edges <case>: <quantity>". */
static void tol(const char *case_name, const char *path, const char *quantity, double err,
                double t)
{
    char name[96];
    snprintf(name, sizeof name, "edges %s: %s", case_name, quantity);
    TOL_CHECK(name, err, t, "%s [%s]", case_name, path);
}

/* Logits-path outputs (the linear ones are tu_linear_outs). */
typedef struct logit_outs {
    int64_t N, V;
    float *logp, *ent, *gl;
    fg_logits_outputs o;
} logit_outs;

static void logit_outs_alloc(logit_outs *w, int64_t N, int64_t V)
{
    memset(w, 0, sizeof *w);
    w->N = N;
    w->V = V;
    w->logp = tu_xmalloc((size_t)N * sizeof(float));
    w->ent = tu_xmalloc((size_t)N * sizeof(float));
    w->gl = tu_xmalloc((size_t)N * (size_t)V * sizeof(float));
    w->o.logp = w->logp;
    w->o.entropy = w->ent;
    w->o.grad_logits = fg_matrix_make(w->gl, FG_DTYPE_F32, N, V);
}

static void logit_outs_free(logit_outs *w)
{
    free(w->logp);
    free(w->ent);
    free(w->gl);
}

/* Everything finite, masked logp/entropy exactly 0. */
static void check_finite_outs(const char *tag, double loss, const fg_metrics *m, const float *logp,
                              const float *ent, int64_t N, const float *const grads[4],
                              const int64_t counts[4], const fg_batch *b)
{
    int ok = isfinite(loss) && isfinite(m->entropy) && isfinite(m->kl);
    for (int64_t n = 0; n < N; n++) {
        ok = ok && isfinite(logp[n]) && isfinite(ent[n]);
        if (!b->mask[n])
            CHECK(logp[n] == 0.0f && ent[n] == 0.0f, "%s: masked logp/entropy not 0", tag);
    }
    for (int k = 0; k < 4; k++)
        for (int64_t i = 0; grads[k] && i < counts[k]; i++)
            ok = ok && isfinite(grads[k][i]);
    CHECK(ok, "%s: a result is not finite (loss %g)", tag, loss);
}

static void compare_common(const char *name, const char *path, const fg_loss_config *cfg,
                           const fg_batch *b, const fg_oracle_result *ref, double loss,
                           const float *logp, const float *ent, int64_t N, const edge_tol *t)
{
    const double scale = fg_oracle_loss_scale(cfg, b, ref->logp, ref->entropy);
    tol(name, path, "loss", tu_rel_err(loss, ref->loss, fmax(scale, 1e-12)), t->loss);
    tol(name, path, "logp", tu_max_rel(logp, ref->logp, N, b->mask, 1.0), t->logp);
    tol(name, path, "entropy", tu_max_rel(ent, ref->entropy, N, b->mask, 1.0), t->entropy);
}

static void compare_linear(const char *name, const char *path, const fg_loss_config *cfg,
                           const fg_batch *b, const fg_oracle_result *ref, const tu_linear_outs *w,
                           const edge_tol *t)
{
    char tag[160];
    snprintf(tag, sizeof tag, "%s [%s]", name, path);
    const float *const grads[4] = {w->grad_hidden, w->grad_weight, w->grad_bias, NULL};
    const int64_t counts[4] = {w->N * w->H, w->V * w->H, w->V, 0};
    check_finite_outs(tag, w->out.loss, &w->out.metrics, w->logp, w->entropy, w->N, grads, counts,
                      b);
    compare_common(name, path, cfg, b, ref, w->out.loss, w->logp, w->entropy, w->N, t);
    tol(name, path, "grad_hidden",
        tu_rel_l2(w->grad_hidden, FG_DTYPE_F32, w->N, w->H, w->H, ref->grad_hidden),
        t->grad_hidden);
    tol(name, path, "grad_weight",
        tu_rel_l2(w->grad_weight, FG_DTYPE_F32, w->V, w->H, w->H, ref->grad_weight),
        t->grad_weight);
    tol(name, path, "grad_bias",
        tu_rel_l2(w->grad_bias, FG_DTYPE_F32, 1, w->V, w->V, ref->grad_bias), t->grad_bias);
}

static void compare_logits(const char *name, const fg_loss_config *cfg, const fg_batch *b,
                           const fg_oracle_result *ref, const logit_outs *w, const edge_tol *t)
{
    char tag[160];
    snprintf(tag, sizeof tag, "%s [logits]", name);
    const float *const grads[4] = {w->gl, NULL, NULL, NULL};
    const int64_t counts[4] = {w->N * w->V, 0, 0, 0};
    check_finite_outs(tag, w->o.loss, &w->o.metrics, w->logp, w->ent, w->N, grads, counts, b);
    compare_common(name, "logits", cfg, b, ref, w->o.loss, w->logp, w->ent, w->N, t);
    tol(name, "logits", "grad_logits",
        tu_rel_l2(w->gl, FG_DTYPE_F32, w->N, w->V, w->V, ref->grad_logits), t->grad_logits);
}

/* budget BUDGET_MIN: the planner's smallest budget for the call (one token
 * row a chunk, the most chunks), whatever the CPU's GEMM scratch. Any other
 * nonzero budget is raised to that smallest one where this CPU's scratch
 * needs more. */
#define BUDGET_MIN ((size_t)1)

/* Runs fused (at `budget`), materialized and logits on the f32 problem p and
 * compares all with the oracle. */
static void run_case(const char *name, const fg_loss_config *cfg, tu_problem *p, const edge_tol *t,
                     size_t budget)
{
    const int64_t N = p->N, H = p->H, V = p->V;
    const fg_batch *b = tu_batch_view(&p->tb);
    fg_oracle_result ref;
    CHECK(fg_oracle_linear(cfg, b, p->hidden, p->weight, p->bias, H, V, &ref) == 0,
          "%s: oracle failed", name);
    const fg_linear_inputs in = tu_problem_inputs(p);
    for (int impl = 0; impl < 2; impl++) {
        tu_linear_outs w;
        tu_linear_outs_make(&w, N, H, V, 1);
        const fg_linear_options lo = {impl ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED, 0, 0.0};
        fg_exec ex;
        fg_exec_init(&ex);
        ex.memory_budget = impl ? 0 : budget;
        if (ex.memory_budget) {
            fg_linear_plan_info plan;
            CHECK(fg_linear_grpo_plan(ctx, &lo, cfg, &in, b, &w.out, NULL, &plan) == FG_OK,
                  "%s: plan (%s)", name, fg_last_error(ctx));
            if (ex.memory_budget < plan.min_budget_bytes) /* BUDGET_MIN among them */
                ex.memory_budget = plan.min_budget_bytes;
        }
        const char *path = impl ? "materialized" : "fused";
        fg_status st = fg_linear_grpo(ctx, &lo, cfg, &in, b, &w.out, &ex);
        CHECK(st == FG_OK, "%s [%s]: %s (%s)", name, path, fg_status_name(st), fg_last_error(ctx));
        if (st == FG_OK)
            compare_linear(name, path, cfg, b, &ref, &w, t);
        tu_linear_outs_free(&w);
    }
    /* The logits path on the oracle's logits (z * temperature), stored as f32. */
    double *lg = tu_problem_logits(p);
    float *l32 = tu_store_matrix(lg, N, V, V, FG_DTYPE_F32);
    fg_oracle_result lref;
    CHECK(fg_oracle_logits(cfg, b, lg, V, &lref) == 0, "%s: oracle (logits) failed", name);
    logit_outs w;
    logit_outs_alloc(&w, N, V);
    fg_matrix lm = fg_matrix_make(l32, FG_DTYPE_F32, N, V);
    fg_status st = fg_logits_grpo(ctx, cfg, &lm, b, &w.o, NULL);
    CHECK(st == FG_OK, "%s [logits]: %s (%s)", name, fg_status_name(st), fg_last_error(ctx));
    if (st == FG_OK)
        compare_logits(name, cfg, b, &lref, &w, t);
    logit_outs_free(&w);
    fg_oracle_result_free(&lref);
    fg_oracle_result_free(&ref);
    free(lg);
    free(l32);
}

/* An f32 problem with the given scales (bias 0.1), old/ref drawn near the
 * oracle's own log-probs at cfg's temperature (old: N(0, s_old) away). */
static void prob_make_spread(tu_problem *p, int64_t B, int64_t T, int64_t H, int64_t V, double hs,
                             double ws, int pattern, uint64_t seed, const fg_loss_config *cfg,
                             double s_old)
{
    const tu_problem_opts o = {hs, ws, 0.1, 0, 0, pattern};
    tu_problem_make_opts(p, B, T, H, V, FG_DTYPE_F32, 1, seed, &o);
    CHECK(tu_problem_fill_logp(p, cfg->temperature, s_old, 0.2) == 0, "oracle on seed %llu",
          (unsigned long long)seed);
}

static void prob_make(tu_problem *p, int64_t B, int64_t T, int64_t H, int64_t V, double hs,
                      double ws, int pattern, uint64_t seed, const fg_loss_config *cfg)
{
    prob_make_spread(p, B, T, H, V, hs, ws, pattern, seed, cfg, 0.2);
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
    tu_problem p;
    /* logits = hidden . weight with |logit| up to ~1e4. Ratios stay well
     * inside the clip range (old = logp + N(0, 0.05)): the oracle's d loss /
     * d logp is a finite difference with a step of 1e-6 |logp| (~0.01 here),
     * which would straddle a clip bound a ratio sits within 1% of. */
    prob_make_spread(&p, 3, 5, 16, 97, 1.0, 1e4 / 4.0 / 4.0, 1, 11, &cfg, 0.05);
    double *z = tu_problem_logits(&p);
    double mx = 0;
    for (int64_t i = 0; i < p.N * p.V; i++)
        mx = fmax(mx, fabs(z[i]));
    free(z);
    printf("large logits: max |logit| = %.0f\n", mx);
    CHECK(mx > 5e3 && mx < 5e4, "large logits: max |logit| %g not near 1e4", mx);
    /* One ulp of a float near 1e4 is ~1e-3: the GEMM's f32 logits carry that
     * much absolute error, so logp = z - lse does too (~1e-7 relative to
     * |logp| ~ 1e4), and the ratios exp(logp - old) ~1e-3 relative: the loss
     * and the linear paths' gradients follow. The logits path gets exact
     * logits. Rows are one-hot to f32: entropy ~1e-30. The row statistics
     * keep max and log(sum) apart (finding F3, fixed), so they add nothing.
     * worst Zen 5: 5.1e-4 1.2e-7 1.0e-30 1.1e-3 1.1e-3 1.0e-3 5.5e-5
     * worst AVX2:  4.4e-4 1.2e-7 1.0e-30 1.1e-3 1.1e-3 1.0e-3 5.5e-5 */
    static const edge_tol t = {3e-3, 5e-7, 5e-30, 5e-3, 5e-3, 5e-3, 3e-4};
    run_case("logits ~1e4 (weight scale)", &cfg, &p, &t, BUDGET_MIN);
    tu_problem_free(&p);

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
    logit_outs w;
    logit_outs_alloc(&w, N, V);
    fg_matrix lm = fg_matrix_make(l32, FG_DTYPE_F32, N, V);
    fg_status st = fg_logits_grpo(ctx, &cfg, &lm, b, &w.o, NULL);
    CHECK(st == FG_OK, "logits +-1e4: %s", fg_status_name(st));
    /* Exact logits: only the row statistics round (F3 fixed: it was 4.2e-4).
     * worst (Zen 5 = AVX2): 4.0e-9 3.1e-8 2.8e-8 - - - 3.3e-8 */
    static const edge_tol exact_t = {2e-8, 1.5e-7, 1.5e-7, 0, 0, 0, 1.5e-7};
    if (st == FG_OK)
        compare_logits("logits exactly +-1e4", &cfg, b, &ref, &w, &exact_t);
    logit_outs_free(&w);
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
    tu_problem p;
    prob_make(&p, 3, 6, 12, 101, 1.0, 0.3, 2, 21, &cfg);
    char name[64];
    snprintf(name, sizeof name, "temperature %g", temp);
    /* 1e-3: the scaled logits carry 1e3x the f32 rounding of the raw logits;
     * worst (Zen 5 = AVX2): 8.0e-5 3.3e-7 7.5e-9 1.7e-4 1.8e-4 1.8e-4 1.1e-4 */
    static const edge_tol cold = {4e-4, 1.5e-6, 3e-8, 8e-4, 8e-4, 8e-4, 5e-4};
    /* 1e3: nearly uniform rows;
     * worst (Zen 5 = AVX2): 1.6e-7 6.6e-8 4.5e-8 3.6e-7 3.1e-7 3.1e-7 3.1e-7 */
    static const edge_tol hot = {8e-7, 3e-7, 2e-7, 1.5e-6, 1.5e-6, 1.5e-6, 1.5e-6};
    run_case(name, &cfg, &p, temp < 1 ? &cold : &hot, BUDGET_MIN);
    tu_problem_free(&p);
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
        tu_problem p;
        prob_make(&p, 3, 5, 10, 53, 1.0, 0.4, 0, 31, &cfg);
        for (int64_t b = 0; b < 3; b++) p.tb.advantages[b] = 0.0f;
        /* without KL / entropy terms the loss and every gradient are exactly
         * 0; worst (Zen 5 = AVX2): 0 5.3e-8 4.7e-8 0 0 0 0 */
        static const edge_tol no_terms = {0, 3e-7, 2e-7, 0, 0, 0, 0};
        /* worst (Zen 5 = AVX2): 3.2e-8 5.3e-8 4.7e-8 4.8e-7 3.1e-7 3.5e-7 3.9e-7 */
        static const edge_tol with_terms = {1.5e-7, 3e-7, 2e-7, 2e-6, 1.5e-6, 1.5e-6, 2e-6};
        run_case(k ? "advantages 0 with KL and entropy" : "advantages 0", &cfg, &p,
                 k ? &with_terms : &no_terms, BUDGET_MIN);
        if (k == 0) { /* the loss is exactly zero and so is every gradient */
            tu_linear_outs w;
            tu_linear_outs_make(&w, p.N, p.H, p.V, 0);
            fg_linear_inputs in = tu_problem_inputs(&p);
            in.bias = fg_vector_make(NULL, FG_DTYPE_F32, 0);
            fg_status st = fg_linear_grpo(ctx, NULL, &cfg, &in, tu_batch_view(&p.tb), &w.out, NULL);
            CHECK(st == FG_OK, "zero advantages: %s", fg_status_name(st));
            int zero = w.out.loss == 0.0;
            for (int64_t i = 0; i < p.N * p.H; i++) zero = zero && w.grad_hidden[i] == 0.0f;
            for (int64_t i = 0; i < p.V * p.H; i++) zero = zero && w.grad_weight[i] == 0.0f;
            CHECK(zero, "zero advantages, no KL/entropy: loss %g, gradients not all 0", w.out.loss);
            tu_linear_outs_free(&w);
        }
        tu_problem_free(&p);
    }
}

static void case_vocab_one(void)
{
    fg_loss_config cfg;
    base_cfg(&cfg);
    tu_problem p;
    prob_make(&p, 2, 4, 7, 1, 1.0, 1.0, 0, 41, &cfg);
    /* logp = entropy = 0 and a zero gradient, and the library gets them
     * exactly (its one-term row sums are exact); gradients are compared in
     * absolute terms (the oracle's are 0, so the relative measure returns
     * ||a||). worst (Zen 5 = AVX2): 0 0 0 0 0 0 0 */
    static const edge_tol t = {0, 0, 0, 0, 0, 0, 0};
    run_case("V = 1", &cfg, &p, &t, 0);
    tu_problem_free(&p);
}

static void case_huge_vocab(void)
{
    fg_loss_config cfg;
    base_cfg(&cfg);
    tu_problem p;
    const int64_t V = 262147; /* > 2^18, prime */
    prob_make(&p, 2, 2, 8, V, 1.0, 0.5, 0, 51, &cfg);
    /* Row reductions over 2.6e5 terms: f32 sums lose ~log2(V) bits more.
     * worst Zen 5: 7.9e-8 4.4e-8 4.8e-7 9.3e-7 5.7e-7 5.3e-7 5.4e-7
     * worst AVX2:  8.1e-8 4.4e-8 3.9e-7 9.3e-7 5.7e-7 5.3e-7 5.4e-7 */
    static const edge_tol t = {4e-7, 2e-7, 2e-6, 4e-6, 3e-6, 3e-6, 3e-6};
    run_case("V = 262147", &cfg, &p, &t, 4u << 20); /* 4 MiB: several chunks */
    tu_problem_free(&p);
}

static void case_underflow(void)
{
    fg_loss_config cfg;
    base_cfg(&cfg);
    tu_problem p;
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
        for (int64_t k = 0; k < H; k++) p.hidden[n * H + k] = 1.0 + 0.01 * (double)k;
    for (int64_t k = 0; k < H; k++) hn += p.hidden[k] * p.hidden[k];
    for (int64_t k = 0; k < H; k++) {
        p.weight[0 * H + k] = 65.0 * p.hidden[k] / hn;
        p.weight[1 * H + k] = -65.0 * p.hidden[k] / hn;
    }
    for (int64_t v = 0; v < V; v++) p.bias[v] = 0.0;
    tu_problem_restore(&p); /* rounds the doubles to the stored f32 values */
    /* old/ref near the (tiny) log-probs so ratios and KL stay moderate, and
     * is_ratio moderate at the tokens that were masked before (the hostile
     * 1e30 there would make the loss ~1e29, beyond the oracle's finite
     * differences of d loss / d logp) */
    for (int64_t n = 0; n < N; n++) {
        p.tb.old_logp[n] = -130.0f + 0.1f * (float)n;
        p.tb.ref_logp[n] = -130.0f - 0.1f * (float)n;
        p.tb.is_ratio[n] = 0.75f + 0.1f * (float)n;
    }
    fg_oracle_result r;
    CHECK(fg_oracle_linear(&cfg, tu_batch_view(&p.tb), p.hidden, p.weight, p.bias, H, V, &r) == 0,
          "%s", "oracle underflow");
    printf("underflow: chosen-token logp = %.3f (p = %.3g)\n", r.logp[0], exp(r.logp[0]));
    CHECK(r.logp[0] < -100, "underflow case: logp %g not < -100", r.logp[0]);
    fg_oracle_result_free(&r);
    /* Rows one-hot to f32 (entropy ~1e-25, 0 in the oracle).
     * worst Zen 5: 1.5e-7 3.7e-9 2.2e-25 5.0e-7 5.0e-7 5.3e-7 3.4e-8
     * worst AVX2:  1.5e-7 3.7e-9 2.2e-25 5.0e-7 4.8e-7 5.3e-7 3.4e-8 */
    static const edge_tol t = {6e-7, 1.5e-8, 1e-24, 3e-6, 3e-6, 3e-6, 1.5e-7};
    run_case("logp < -100", &cfg, &p, &t, 0);
    tu_problem_free(&p);
}

static void case_masks(void)
{
    fg_loss_config cfg;
    base_cfg(&cfg);
    tu_problem p;
    prob_make(&p, 3, 4, 5, 31, 1.0, 0.5, 0, 71, &cfg);
    for (int64_t n = 0; n < 12; n++) p.tb.mask[n] = 0;
    /* nothing to round: loss, logp, entropy and every gradient are exactly 0 */
    static const edge_tol exact = {0, 0, 0, 0, 0, 0, 0};
    run_case("every token masked", &cfg, &p, &exact, 0);
    tu_problem_free(&p);
    prob_make(&p, 1, 1, 5, 31, 1.0, 0.5, 0, 72, &cfg);
    p.tb.mask[0] = 1;
    p.tb.token_ids[0] = 30;
    /* worst Zen 5: 8.1e-10 5.4e-8 5.9e-8 2.2e-8 3.6e-8 3.4e-8 3.3e-8
     * worst AVX2:  8.1e-10 5.4e-8 5.9e-8 4.5e-8 5.1e-8 4.7e-8 3.3e-8 */
    static const edge_tol single = {4e-9, 3e-7, 3e-7, 2e-7, 3e-7, 2e-7, 1.5e-7};
    run_case("single token", &cfg, &p, &single, 0);
    tu_problem_free(&p);
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

/* path 0 fused, 1 materialized, 2 logits; the loss goes to *loss. */
static fg_status nf_call(nf *s, int path, fg_dtype dt, double *loss)
{
    fg_loss_config cfg;
    base_cfg(&cfg);
    const int bf = dt == FG_DTYPE_BF16;
    fg_status st;
    if (path == 2) {
        fg_logits_outputs out;
        memset(&out, 0, sizeof out);
        out.logp = s->logp;
        out.entropy = s->ent;
        out.grad_logits = fg_matrix_make(s->gl, FG_DTYPE_F32, NN, NV);
        fg_matrix lm = fg_matrix_make(bf ? (void *)s->lg16 : (void *)s->lg, dt, NN, NV);
        st = fg_logits_grpo(ctx, &cfg, &lm, tu_batch_view(&s->tb), &out, NULL);
        *loss = out.loss;
        return st;
    }
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    out.logp = s->logp;
    out.entropy = s->ent;
    out.grad_hidden = fg_matrix_make(s->gh, FG_DTYPE_F32, NN, NH);
    out.grad_weight = fg_matrix_make(s->gw, FG_DTYPE_F32, NV, NH);
    out.grad_bias = fg_vector_make(s->gb, FG_DTYPE_F32, NV);
    fg_linear_inputs in;
    memset(&in, 0, sizeof in);
    in.hidden = (fg_matrix){bf ? (void *)s->hid16 : (void *)s->hid, dt, NN, NH, LDH};
    in.weight = fg_matrix_make(bf ? (void *)s->wt16 : (void *)s->wt, dt, NV, NH);
    in.bias = fg_vector_make(bf ? (void *)s->bias16 : (void *)s->bias, dt, NV);
    const fg_linear_options lo = {path ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED, 0, 0.0};
    st = fg_linear_grpo(ctx, &lo, &cfg, &in, tu_batch_view(&s->tb), &out, NULL);
    *loss = out.loss;
    return st;
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
    double loss;
    for (int dt = 0; dt < 2; dt++)
        for (int w = 0; w < 4; w++)
            for (int v = 0; v < 3; v++)
                for (int path = 0; path < 3; path++) {
                    if ((w == 3) != (path == 2))
                        continue;
                    nf_reset(s);
                    nf_poke(s, w, idx[w], vals[v]);
                    fg_status st = nf_call(s, path, (fg_dtype)dt, &loss);
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
        fg_status st = nf_call(s, 0, FG_DTYPE_BF16, &loss);
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
        fg_status st = nf_call(s, path, FG_DTYPE_F32, &loss);
        CHECK(st == FG_OK, "NaN where it is not read (path %d): %s (%s)", path, fg_status_name(st),
              fg_last_error(ctx));
        CHECK(st != FG_OK || isfinite(loss), "NaN not read (path %d): loss %g", path, loss);
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
                fg_status st = nf_call(s, path, (fg_dtype)dt, &loss);
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
            fg_status st;
            if (path == 2) {
                fg_logits_outputs out;
                memset(&out, 0, sizeof out);
                out.logp = s->logp;
                fg_matrix lm = fg_matrix_make(s->lg, FG_DTYPE_F32, NN, NV);
                st = fg_logits_grpo(ctx, &cfg, &lm, tu_batch_view(&s->tb), &out, NULL);
                loss = out.loss;
            } else {
                fg_linear_outputs out;
                memset(&out, 0, sizeof out);
                out.logp = s->logp;
                fg_linear_inputs in;
                memset(&in, 0, sizeof in);
                in.hidden = (fg_matrix){s->hid, FG_DTYPE_F32, NN, NH, LDH};
                in.weight = fg_matrix_make(s->wt, FG_DTYPE_F32, NV, NH);
                const fg_linear_options lo = {path ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED, 0, 0.0};
                st = fg_linear_grpo(ctx, &lo, &cfg, &in, tu_batch_view(&s->tb), &out, NULL);
                loss = out.loss;
            }
            CHECK(st != FG_OK, "temperature %g (path %d) accepted with loss %g", tiny[k], path,
                  loss);
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
    fg_context_destroy(ctx);
    return tu_finish();
}
