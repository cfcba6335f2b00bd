/*
 * test_bf16_products: the CPU's choice, for bf16 inputs, between bf16 products
 * (oneDNN's bf16 kernels, where it has them) and f32 products on widened bf16
 * weight tiles. The library measures which is faster once per process
 * (gemm_onednn.c, bf16_products_chosen); FUSEDGRPO_BF16_PRODUCTS = native or
 * f32, read when a context is created, forces it. Each choice is forced here
 * on its own context and runs the fused bf16 call (several chunks, grpo with
 * KL and a bias, odd shapes) against the float64 oracle:
 *   - f32 products on every CPU: the plan's gemm_dtype is f32, and the
 *     gradients are as close as f32 inputs' (dlogits stay f32);
 *   - native products: the plan's gemm_dtype is bf16 on a CPU with bf16
 *     kernels (dlogits rounded to bf16: ~2^-9 relative) and f32 elsewhere;
 *   - the measured choice is one of the two, and a context made without the
 *     variable multiplies as it says.
 * The loss and log-probs do not depend on the choice beyond f32 rounding
 * (the logits product sums in f32 either way).
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "test_util.h"

enum { B = 3, T = 37, H = 45, V = 1013, N = B * T };

typedef struct arm {
    const char *name, *env; /* FUSEDGRPO_BF16_PRODUCTS, NULL: unset (measured) */
    fg_dtype gemm_dtype;
    double loss_err, logp_err, gh_err, gw_err, gb_err;
} arm;

static fg_context *context_with(const char *env)
{
    if (env)
        setenv("FUSEDGRPO_BF16_PRODUCTS", env, 1);
    else
        unsetenv("FUSEDGRPO_BF16_PRODUCTS");
    fg_context *ctx = NULL;
    const fg_status s = fg_context_create(NULL, &ctx);
    unsetenv("FUSEDGRPO_BF16_PRODUCTS");
    CHECK(s == FG_OK, "context with FUSEDGRPO_BF16_PRODUCTS=%s: %s", env ? env : "(unset)",
          fg_context_create_error());
    return s == FG_OK ? ctx : NULL;
}

static void run_arm(arm *a, const fg_loss_config *cfg, const fg_linear_inputs *in,
                    const fg_batch *batch, const fg_oracle_result *ref, const uint8_t *mask)
{
    fg_context *ctx = context_with(a->env);
    if (!ctx)
        return;
    const fg_linear_options fused = {FG_IMPL_FUSED, 0, 0.0};
    tu_linear_outs o;
    tu_linear_outs_make(&o, N, H, V, 1);
    /* several chunks: a third of the way from the smallest budget to one chunk */
    fg_exec exec;
    fg_exec_init(&exec);
    exec.memory_budget = (size_t)1 << 40;
    fg_linear_plan_info whole, plan;
    CHECK(fg_linear_grpo_plan(ctx, &fused, cfg, in, batch, &o.out, &exec, &whole) == FG_OK,
          "%s plan: %s", a->name, fg_last_error(ctx));
    exec.memory_budget = whole.min_budget_bytes + whole.chunk_bytes / 3;
    CHECK(fg_linear_grpo_plan(ctx, &fused, cfg, in, batch, &o.out, &exec, &plan) == FG_OK,
          "%s plan: %s", a->name, fg_last_error(ctx));
    CHECK(plan.chunks > 1, "%s: %lld chunks", a->name, (long long)plan.chunks);
    a->gemm_dtype = (fg_dtype)plan.gemm_dtype;
    CHECK(fg_linear_grpo(ctx, &fused, cfg, in, batch, &o.out, &exec) == FG_OK, "%s: %s", a->name,
          fg_last_error(ctx));
    a->loss_err = fabs(o.out.loss - ref->loss) / fmax(fabs(ref->loss), 1e-3);
    a->logp_err = tu_max_rel(o.logp, ref->logp, N, mask, 1.0);
    a->gh_err = tu_rel_l2(o.grad_hidden, FG_DTYPE_F32, N, H, H, ref->grad_hidden);
    a->gw_err = tu_rel_l2(o.grad_weight, FG_DTYPE_F32, V, H, H, ref->grad_weight);
    a->gb_err = tu_rel_l2(o.grad_bias, FG_DTYPE_F32, 1, V, V, ref->grad_bias);
    printf("%-22s gemm %s: loss %.2e logp %.2e grad_hidden %.2e grad_weight %.2e grad_bias "
           "%.2e (%lld chunks)\n",
           a->name, a->gemm_dtype == FG_DTYPE_BF16 ? "bf16" : "f32 ", a->loss_err, a->logp_err,
           a->gh_err, a->gw_err, a->gb_err, (long long)plan.chunks);
    tu_linear_outs_free(&o);
    fg_context_destroy(ctx);
}

/* Tolerances, 4-6x the worst measured on an AVX-512 BF16 Zen 4 (native:
 * bf16 products) and with the f32 choice; the bf16 products' gradients carry
 * the rounding of dlogits to bf16. */
static void check_arm(const arm *a)
{
    const int bf = a->gemm_dtype == FG_DTYPE_BF16;
    TOL_CHECK("bf16 products loss", a->loss_err, 4e-6, "%s", a->name);
    TOL_CHECK("bf16 products logp", a->logp_err, 5e-7, "%s", a->name);
    TOL_CHECK(bf ? "bf16 products grad (bf16 gemm)" : "bf16 products grad (f32 gemm)",
              fmax(a->gh_err, fmax(a->gw_err, a->gb_err)), bf ? 1e-2 : 3e-6, "%s", a->name);
}

int main(void)
{
    tu_problem p;
    tu_problem_make(&p, B, T, H, V, FG_DTYPE_BF16, 1, 77);
    CHECK(tu_problem_fill_logp(&p, 1.0, 0.2, 0.2) == 0, "%s", "oracle log-probs");
    p.tb.is_mode = 0;
    const fg_batch *batch = tu_batch_view(&p.tb);
    const fg_linear_inputs in = tu_problem_inputs(&p);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = FG_LOSS_GRPO;
    cfg.beta = 0.04;
    cfg.epsilon_low = cfg.epsilon_high = 1e3; /* no clip branch flips (test_bf16_grads) */
    fg_oracle_result ref;
    CHECK(fg_oracle_linear(&cfg, batch, p.hidden, p.weight, p.bias, H, V, &ref) == 0, "%s",
          "oracle");

    arm arms[3] = {{"forced f32 products", "f32", 0, 0, 0, 0, 0, 0},
                   {"forced native", "native", 0, 0, 0, 0, 0, 0},
                   {"measured", NULL, 0, 0, 0, 0, 0, 0}};
    for (int i = 0; i < 3; i++) {
        run_arm(&arms[i], &cfg, &in, batch, &ref, p.tb.mask);
        check_arm(&arms[i]);
    }
    CHECK(arms[0].gemm_dtype == FG_DTYPE_F32, "%s", "FUSEDGRPO_BF16_PRODUCTS=f32 multiplied bf16");
    /* a misspelt value is refused, not left to the measurement */
    setenv("FUSEDGRPO_BF16_PRODUCTS", "bf16", 1);
    fg_context *bad = NULL;
    const fg_status st = fg_context_create(NULL, &bad);
    unsetenv("FUSEDGRPO_BF16_PRODUCTS");
    CHECK(st == FG_ERR_BAD_HYPERPARAMETER && bad == NULL &&
              strstr(fg_context_create_error(), "FUSEDGRPO_BF16_PRODUCTS") != NULL,
          "FUSEDGRPO_BF16_PRODUCTS=bf16: %s: %s", fg_status_name(st), fg_context_create_error());
    fg_context_destroy(bad);
    CHECK(arms[2].gemm_dtype == arms[0].gemm_dtype || arms[2].gemm_dtype == arms[1].gemm_dtype,
          "%s", "the measured choice is neither f32 nor the native products");
    /* f32 products are the more accurate where the two differ */
    if (arms[1].gemm_dtype == FG_DTYPE_BF16)
        CHECK(arms[0].gw_err < arms[1].gw_err, "f32 products' grad_weight error %.2e >= bf16's %.2e",
              arms[0].gw_err, arms[1].gw_err);
    printf("bf16 kernels: %s; the measured choice: %s products\n",
           arms[1].gemm_dtype == FG_DTYPE_BF16 ? "yes" : "no",
           arms[2].gemm_dtype == FG_DTYPE_BF16 ? "bf16" : "f32");
    fg_oracle_result_free(&ref);
    tu_problem_free(&p);
    return tu_finish();
}
