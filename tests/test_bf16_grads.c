/*
 * test_bf16_grads: gradients written in bfloat16 for bfloat16 inputs
 * (fg_linear_outputs with grad_* dtype FG_DTYPE_BF16), against the float64
 * oracle and against the same call's float32 gradients rounded to bf16.
 *
 * Odd shapes (B = 3, T = 7, H = 45, V = 1013, ragged mask), fused over
 * several chunks and materialized, with a bias, grpo with KL. The acceptance
 * of issue 15: the bf16 gradient's error (relative L2 against the oracle) is
 * no worse than twice that of rounding the f32 gradient to bf16. Also:
 * accumulate adds to a bf16 grad_weight / grad_bias; masked grad_hidden rows
 * are bf16 zeros; float32 inputs refuse bf16 gradients; CPUs without bf16
 * GEMM kernels refuse a bf16 grad_weight (oneDNN 2.6 has no f32 -> bf16
 * product there) and still write grad_hidden / grad_bias in bf16.
 *
 * How (fusedgrpo.h): grad_hidden rows and grad_bias are summed in f32 and
 * rounded once; grad_weight is summed in f32 within a chunk's product and
 * rounded to bf16 after each chunk's product is added (oneDNN's sum post-op
 * on a bf16 destination), so its error grows with the number of chunks.
 * Issue 15's bound, "no worse than twice the error of rounding the f32
 * gradient to bf16", is checked both ways: against the same call's f32
 * gradient rounded (worst 1.06x here, 1.63x at 95 one-row chunks with
 * B = 3, T = 61) and against the exact (oracle) gradient rounded (1.34x
 * here; 2.24x at 95 one-row chunks: beyond 2x, the limit of rounding once
 * per chunk; a bf16 grad_weight over many chunks wants f32 accumulation).
 * Zen 5; on CPUs without bf16 GEMMs grad_weight stays f32.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "test_util.h"

enum { B = 3, T = 7, H = 45, V = 1013, N = B * T };

static double rel_l2_bf16(const uint16_t *a, int64_t n, const double *ref)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        const double d = (double)fg_bf16_to_f32(a[i]) - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The error of the exact (oracle) gradient rounded to bf16: the least any
 * bf16 gradient carries. */
static double exact_rounded_err(int64_t n, const double *ref)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        const double d = (double)fg_bf16_to_f32(fg_f32_to_bf16((float)ref[i])) - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The error of an f32 gradient rounded to bf16. */
static double rounded_err(const float *a, int64_t n, const double *ref)
{
    uint16_t *r = tu_xmalloc(sizeof(uint16_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) r[i] = fg_f32_to_bf16(a[i]);
    const double e = rel_l2_bf16(r, n, ref);
    free(r);
    return e;
}

int main(void)
{
    fg_context *ctx = NULL;
    if (fg_context_create(NULL, &ctx) != FG_OK) {
        CHECK(0, "%s", "context create");
        return tu_finish();
    }
    tu_problem p;
    tu_problem_make(&p, B, T, H, V, FG_DTYPE_BF16, 1, 31);
    CHECK(tu_problem_fill_logp(&p, 1.0, 0.2, 0.2) == 0, "%s", "oracle log-probs");
    p.tb.is_mode = 0;
    const fg_batch *batch = tu_batch_view(&p.tb);
    const fg_linear_inputs in = tu_problem_inputs(&p);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = FG_LOSS_GRPO;
    cfg.beta = 0.04;
    fg_oracle_result ref;
    CHECK(fg_oracle_linear(&cfg, batch, p.hidden, p.weight, p.bias, H, V, &ref) == 0, "%s",
          "oracle");
    /* A bf16 grad_weight needs bf16 GEMM kernels: elsewhere it is refused
     * and the test takes it in f32 (grad_hidden and grad_bias stay bf16). */
    const int native = tu_bf16_gemms_native();
    float *gw32 = tu_xmalloc(sizeof(float) * V * H);
    uint16_t *gh = tu_xmalloc(sizeof(uint16_t) * N * H), *gw = tu_xmalloc(sizeof(uint16_t) * V * H);
    uint16_t *gb = tu_xmalloc(sizeof(uint16_t) * V);
    for (int impl = 0; impl < 2; impl++) {
        const fg_linear_options opts = {impl ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED, 0};
        const char *name = impl ? "materialized" : "fused";
        /* f32 gradients of the same call */
        tu_linear_outs o32;
        tu_linear_outs_make(&o32, N, H, V, 1);
        fg_linear_outputs o;
        memset(&o, 0, sizeof o);
        o.grad_hidden = fg_matrix_make(gh, FG_DTYPE_BF16, N, H);
        o.grad_weight = fg_matrix_make(gw, FG_DTYPE_BF16, V, H);
        o.grad_bias = fg_vector_make(gb, FG_DTYPE_BF16, V);
        if (!native) {
            CHECK(fg_linear_grpo_plan(ctx, &opts, &cfg, &in, batch, &o, NULL, &(fg_linear_plan_info){0}) ==
                      FG_ERR_UNSUPPORTED,
                  "%s: a bf16 grad_weight without bf16 GEMMs not refused", name);
            o.grad_weight = fg_matrix_make(gw32, FG_DTYPE_F32, V, H);
        }
        fg_linear_plan_info plan;
        CHECK(fg_linear_grpo_plan(ctx, &opts, &cfg, &in, batch, &o, NULL, &plan) == FG_OK,
              "plan: %s", fg_last_error(ctx));
        fg_exec exec;
        fg_exec_init(&exec);
        if (!impl) /* the smallest budget: one token row a chunk, the most roundings */
            exec.memory_budget = plan.min_budget_bytes;
        CHECK(fg_linear_grpo(ctx, &opts, &cfg, &in, batch, &o32.out, &exec) == FG_OK, "%s f32: %s",
              name, fg_last_error(ctx));
        fg_memory_stats ms;
        fg_get_memory_stats(ctx, &ms);
        const int64_t chunks = ms.chunks;

        tu_fill_bytes(gh, sizeof(uint16_t) * N * H, 0x5a);
        CHECK(fg_linear_grpo(ctx, &opts, &cfg, &in, batch, &o, &exec) == FG_OK, "%s bf16: %s", name,
              fg_last_error(ctx));
        CHECK(o.loss == o32.out.loss, "%s: loss %g vs f32-gradient call %g", name, o.loss,
              o32.out.loss);
        struct {
            const char *what;
            const uint16_t *got;
            const float *f32;
            int64_t n;
            const double *ref;
        } g[3] = {{"grad_hidden", gh, o32.grad_hidden, (int64_t)N * H, ref.grad_hidden},
                  {"grad_weight", gw, o32.grad_weight, (int64_t)V * H, ref.grad_weight},
                  {"grad_bias", gb, o32.grad_bias, V, ref.grad_bias}};
        for (int k = 0; k < 3; k++) {
            if (k == 1 && !native)
                continue;
            const double e = rel_l2_bf16(g[k].got, g[k].n, g[k].ref);
            const double r = rounded_err(g[k].f32, g[k].n, g[k].ref);
            /* the acceptance bound; worst measured ratio: see the table */
            TOL_CHECK("bf16 grad / rounded f32 grad", e / r, 2.0, "%s %s (%lld chunks): %.3g vs %.3g",
                      name, g[k].what, (long long)chunks, e, r);
            const double x = exact_rounded_err(g[k].n, g[k].ref);
            TOL_CHECK("bf16 grad / rounded exact grad", e / x, 2.0,
                      "%s %s (%lld chunks): %.3g vs %.3g", name, g[k].what, (long long)chunks, e, x);
        }
        int masked_zero = 1;
        for (int n = 0; n < N; n++)
            if (!p.tb.mask[n])
                for (int h = 0; h < H; h++) masked_zero &= gh[n * H + h] == 0;
        CHECK(masked_zero, "%s: masked grad_hidden rows not bf16 zeros", name);

        if (!native) {
            tu_linear_outs_free(&o32);
            continue;
        }
        /* accumulate: a second call adds the same gradient */
        uint16_t *gw1 = tu_xmalloc(sizeof(uint16_t) * V * H), *gb1 = tu_xmalloc(sizeof(uint16_t) * V);
        memcpy(gw1, gw, sizeof(uint16_t) * V * H);
        memcpy(gb1, gb, sizeof(uint16_t) * V);
        o.accumulate = 1;
        CHECK(fg_linear_grpo(ctx, &opts, &cfg, &in, batch, &o, &exec) == FG_OK, "%s accumulate: %s",
              name, fg_last_error(ctx));
        double num = 0, den = 0;
        for (int i = 0; i < V * H; i++) {
            const double want = 2.0 * fg_bf16_to_f32(gw1[i]), d = fg_bf16_to_f32(gw[i]) - want;
            num += d * d;
            den += want * want;
        }
        for (int v = 0; v < V; v++) {
            const double want = 2.0 * fg_bf16_to_f32(gb1[v]), d = fg_bf16_to_f32(gb[v]) - want;
            num += d * d;
            den += want * want;
        }
        /* x + x is exact in bf16 for one chunk; with several, each chunk's sum is rounded */
        TOL_CHECK("bf16 accumulate", sqrt(num / den), 1e-2, "%s (%lld chunks)", name,
                  (long long)chunks);
        free(gw1);
        free(gb1);
        tu_linear_outs_free(&o32);
    }
    /* float32 inputs: bf16 gradients refused */
    {
        tu_problem q;
        tu_problem_make(&q, B, T, H, V, FG_DTYPE_F32, 0, 32);
        const fg_linear_inputs qin = tu_problem_inputs(&q);
        cfg.beta = 0.0; /* q has no reference log-probs */
        fg_linear_outputs o;
        memset(&o, 0, sizeof o);
        o.grad_weight = fg_matrix_make(gw, FG_DTYPE_BF16, V, H);
        CHECK(fg_linear_grpo(ctx, NULL, &cfg, &qin, tu_batch_view(&q.tb), &o, NULL) ==
                  FG_ERR_UNSUPPORTED,
              "%s", "f32 inputs with a bf16 grad_weight accepted");
        tu_problem_free(&q);
    }
    free(gh);
    free(gw);
    free(gw32);
    free(gb);
    fg_oracle_result_free(&ref);
    tu_problem_free(&p);
    fg_context_destroy(ctx);
    return tu_finish();
}
