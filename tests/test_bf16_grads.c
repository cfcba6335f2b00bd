/*
 * test_bf16_grads: gradients written in bfloat16 for bfloat16 inputs
 * (fg_linear_outputs with grad_* dtype FG_DTYPE_BF16), against the float64
 * oracle and against the same call's float32 gradients rounded to bf16.
 *
 * Odd shapes (B = 7, T = 101, H = 45, V = 1013, ragged mask), grpo with KL and
 * a bias. The bound: the bf16 gradient's error (relative L2
 * against the oracle) is no worse than twice that of rounding the f32
 * gradient to bf16, checked both against the same call's f32 gradient
 * rounded and against the exact (oracle) gradient rounded, for:
 *   - materialized, and fused in one chunk (one product, one rounding);
 *   - fused over several chunks with grad_weight summed in float32 in the
 *     workspace (plan.grad_weight_sum_bytes > 0), rounded once;
 *   - fused at a budget without room for the float32 sums: on CPUs with bf16
 *     GEMM kernels grad_weight is then rounded once per chunk, the
 *     documented exception, held to its own bound; without bf16 kernels
 *     the sums are required, and the smallest budget includes them.
 * Also: accumulate adds to a bf16 grad_weight / grad_bias; masked grad_hidden
 * rows are bf16 zeros; float32 inputs refuse bf16 gradients.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "test_util.h"

enum { B = 7, T = 101, H = 45, V = 1013, N = B * T };

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

typedef struct bf16_case {
    fg_context *ctx;
    const fg_loss_config *cfg;
    const fg_linear_inputs *in;
    const fg_batch *batch;
    const fg_oracle_result *ref;
    const uint8_t *mask;
    uint16_t *gh, *gw, *gb;
} bf16_case;

/* The plan of the bf16-gradient call at `budget` (0: the default). */
static fg_linear_plan_info plan_at(const bf16_case *c, const fg_linear_options *opts,
                                   fg_linear_outputs *o, size_t budget)
{
    fg_linear_plan_info plan;
    memset(&plan, 0, sizeof plan);
    fg_exec exec;
    fg_exec_init(&exec);
    exec.memory_budget = budget;
    CHECK(fg_linear_grpo_plan(c->ctx, opts, c->cfg, c->in, c->batch, o, &exec, &plan) == FG_OK,
          "plan at %zu: %s", budget, fg_last_error(c->ctx));
    return plan;
}

static void bf16_outputs(const bf16_case *c, fg_linear_outputs *o)
{
    memset(o, 0, sizeof *o);
    o->grad_hidden = fg_matrix_make(c->gh, FG_DTYPE_BF16, N, H);
    o->grad_weight = fg_matrix_make(c->gw, FG_DTYPE_BF16, V, H);
    o->grad_bias = fg_vector_make(c->gb, FG_DTYPE_BF16, V);
}

/* One case: the bf16 call against the f32 call at the same budget and the
 * oracle; `bound` for grad_weight against the rounded exact gradient (2 by
 * the acceptance, or the per-chunk-rounding exception's measured bound). */
static void run_case(const bf16_case *c, const char *name, const fg_linear_options *opts,
                     size_t budget, const char *wname, double wbound, int check_accumulate)
{
    fg_exec exec;
    fg_exec_init(&exec);
    exec.memory_budget = budget;
    tu_linear_outs o32;
    tu_linear_outs_make(&o32, N, H, V, 1);
    CHECK(fg_linear_grpo(c->ctx, opts, c->cfg, c->in, c->batch, &o32.out, &exec) == FG_OK,
          "%s f32: %s", name, fg_last_error(c->ctx));
    fg_linear_outputs o;
    bf16_outputs(c, &o);
    const fg_linear_plan_info plan = plan_at(c, opts, &o, budget);
    tu_fill_bytes(c->gh, sizeof(uint16_t) * N * H, 0x5a);
    CHECK(fg_linear_grpo(c->ctx, opts, c->cfg, c->in, c->batch, &o, &exec) == FG_OK, "%s bf16: %s",
          name, fg_last_error(c->ctx));
    /* The forward is the f32-gradient call's when the chunks are; the float32
     * sums of a bf16 grad_weight take budget, so they may not be (GEMM 1's
     * kernels at another row count round differently). */
    fg_linear_plan_info plan32;
    memset(&plan32, 0, sizeof plan32);
    CHECK(fg_linear_grpo_plan(c->ctx, opts, c->cfg, c->in, c->batch, &o32.out, &exec, &plan32) ==
              FG_OK, "%s", "plan");
    if (plan32.chunk_rows == plan.chunk_rows && plan32.chunks == plan.chunks)
        CHECK(o.loss == o32.out.loss, "%s: loss %g vs f32-gradient call %g", name, o.loss,
              o32.out.loss);
    else
        TOL_CHECK("bf16-gradient call's loss at other chunks", fabs(o.loss / o32.out.loss - 1),
                  5e-6, "%s: %lld vs %lld rows a chunk", name, (long long)plan.chunk_rows,
                  (long long)plan32.chunk_rows);
    struct {
        const char *what;
        const uint16_t *got;
        const float *f32;
        int64_t n;
        const double *ref;
    } g[3] = {{"grad_hidden", c->gh, o32.grad_hidden, (int64_t)N * H, c->ref->grad_hidden},
              {"grad_weight", c->gw, o32.grad_weight, (int64_t)V * H, c->ref->grad_weight},
              {"grad_bias", c->gb, o32.grad_bias, V, c->ref->grad_bias}};
    for (int k = 0; k < 3; k++) {
        const double e = rel_l2_bf16(g[k].got, g[k].n, g[k].ref);
        const double r = rounded_err(g[k].f32, g[k].n, g[k].ref);
        const double x = exact_rounded_err(g[k].n, g[k].ref);
        const int per_chunk = k == 1 && wname;
        /* the acceptance bound (2); worst measured ratios: see the table
         * (1.000 on AVX2: one rounding of float32 sums everywhere) */
        TOL_CHECK(per_chunk ? wname : "bf16 grad / rounded exact grad", e / x,
                  per_chunk ? wbound : 2.0, "%s %s (%lld chunks of %lld rows): %.3g vs %.3g",
                  name, g[k].what, (long long)plan.chunks, (long long)plan.chunk_rows, e, x);
        if (!per_chunk)
            TOL_CHECK("bf16 grad / rounded f32 grad", e / r, 2.0,
                      "%s %s (%lld chunks): %.3g vs %.3g", name, g[k].what,
                      (long long)plan.chunks, e, r);
    }
    int masked_zero = 1;
    for (int n = 0; n < N; n++)
        if (!c->mask[n])
            for (int h = 0; h < H; h++) masked_zero &= c->gh[n * H + h] == 0;
    CHECK(masked_zero, "%s: masked grad_hidden rows not bf16 zeros", name);

    if (check_accumulate) { /* a second call adds the same gradient */
        uint16_t *gw1 = tu_xmalloc(sizeof(uint16_t) * V * H), *gb1 = tu_xmalloc(sizeof(uint16_t) * V);
        memcpy(gw1, c->gw, sizeof(uint16_t) * V * H);
        memcpy(gb1, c->gb, sizeof(uint16_t) * V);
        o.accumulate = 1;
        CHECK(fg_linear_grpo(c->ctx, opts, c->cfg, c->in, c->batch, &o, &exec) == FG_OK,
              "%s accumulate: %s", name, fg_last_error(c->ctx));
        double num = 0, den = 0;
        for (int i = 0; i < V * H; i++) {
            const double want = 2.0 * fg_bf16_to_f32(gw1[i]), d = fg_bf16_to_f32(c->gw[i]) - want;
            num += d * d;
            den += want * want;
        }
        for (int v = 0; v < V; v++) {
            const double want = 2.0 * fg_bf16_to_f32(gb1[v]), d = fg_bf16_to_f32(c->gb[v]) - want;
            num += d * d;
            den += want * want;
        }
        /* One product, or float32 sums + the bf16 values rounded once: x + x,
         * exact in bf16. Rounded per chunk (bf16 GEMM kernels, smallest
         * budget): each chunk's sum is rounded, so about a bf16 half-ulp
         * (2^-9) relative per element; 1e-2 was the bound before float32 sums. */
        if (wname)
            TOL_CHECK("bf16 accumulate, rounded per chunk", sqrt(num / den), 1e-2,
                      "%s (%lld chunks)", name, (long long)plan.chunks);
        else
            CHECK(num == 0, "%s: accumulate is not x + x: relative error %.3g", name,
                  sqrt(num / den));
        free(gw1);
        free(gb1);
    }
    tu_linear_outs_free(&o32);
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
    /* No clipping: a ratio within float rounding of a clip bound takes the
     * other branch in float32 than in the oracle's float64 and moves the
     * exact gradient by ~2e-3 at this size (measured), which is not the
     * rounding this test measures. The clip paths are the oracle tests'. */
    cfg.epsilon_low = cfg.epsilon_high = 1e3;
    fg_oracle_result ref;
    CHECK(fg_oracle_linear(&cfg, batch, p.hidden, p.weight, p.bias, H, V, &ref) == 0, "%s",
          "oracle");
    const int native = tu_bf16_gemms_native();
    uint16_t *gh = tu_xmalloc(sizeof(uint16_t) * N * H), *gw = tu_xmalloc(sizeof(uint16_t) * V * H);
    uint16_t *gb = tu_xmalloc(sizeof(uint16_t) * V);
    const bf16_case c = {ctx, &cfg, &in, batch, &ref, p.tb.mask, gh, gw, gb};
    const fg_linear_options fused = {FG_IMPL_FUSED, 0, 0.0}, mat = {FG_IMPL_MATERIALIZED, 0, 0.0};
    fg_linear_outputs o;
    bf16_outputs(&c, &o);

    run_case(&c, "materialized", &mat, 0, NULL, 0, 1);
    const fg_linear_plan_info one = plan_at(&c, &fused, &o, 0);
    CHECK(one.chunks == 1, "default budget: %lld chunks", (long long)one.chunks);
    CHECK((one.grad_weight_sum_bytes > 0) == !native,
          "one chunk: float32 sums %zu bytes (bf16 GEMM kernels: %d)", one.grad_weight_sum_bytes,
          native);
    run_case(&c, "fused, one chunk", &fused, 0, NULL, 0, 1);

    /* Several chunks with float32 sums: the budget found by plan queries
     * (no CPU's scratch sizes assumed), growing from the smallest. */
    const size_t least = one.min_budget_bytes;
    size_t budget = 0;
    for (size_t b = least; b < one.working_bytes + (size_t)V * H * 4; b += b / 8) {
        const fg_linear_plan_info pl = plan_at(&c, &fused, &o, b);
        if (pl.chunks >= 2 && pl.chunk_rows >= 16 && pl.grad_weight_sum_bytes > 0) {
            budget = b;
            break;
        }
    }
    CHECK(budget > 0, "%s", "no budget gives several chunks with float32 sums");
    if (budget)
        run_case(&c, "fused, float32 sums over chunks", &fused, budget, NULL, 0, 1);

    /* The smallest budget: one-row chunks; with bf16 kernels no room for the
     * sums. The per-chunk case runs at half the sums' bytes above it (chunks
     * of ~20 rows here) to keep its chunk count near what was measured. */
    const fg_linear_plan_info small = plan_at(&c, &fused, &o, least);
    CHECK(small.chunk_rows <= 2 && small.chunks > 1, "smallest budget: %lld rows x %lld",
          (long long)small.chunk_rows, (long long)small.chunks);
    CHECK((small.grad_weight_sum_bytes > 0) == !native,
          "smallest budget: float32 sums %zu bytes (bf16 GEMM kernels: %d)",
          small.grad_weight_sum_bytes, native);
    const size_t per_chunk_budget = native ? least + (size_t)V * H * 2 : least;
    if (native) {
        const fg_linear_plan_info pc = plan_at(&c, &fused, &o, per_chunk_budget);
        CHECK(pc.chunks > 1 && pc.grad_weight_sum_bytes == 0, "per-chunk case: %lld chunks, "
              "sums %zu bytes", (long long)pc.chunks, pc.grad_weight_sum_bytes);
    }
    /* With bf16 kernels: one rounding per chunk, the documented exception:
     * 1.34x measured at ~15 one-row chunks, 2.24x at 95 (Zen 5, before the
     * float32 sums existed); this case's ~13 chunks have not been measured on
     * an AVX-512 BF16 CPU: 3 leaves room, to be tightened. */
    run_case(&c, native ? "fused, rounded per chunk" : "fused, smallest budget", &fused,
             per_chunk_budget, native ? "bf16 grad_weight rounded per chunk / rounded exact" : NULL,
             3.0, 1);

    /* float32 inputs: bf16 gradients refused */
    {
        tu_problem q;
        tu_problem_make(&q, B, T, H, V, FG_DTYPE_F32, 0, 32);
        const fg_linear_inputs qin = tu_problem_inputs(&q);
        cfg.beta = 0.0; /* q has no reference log-probs */
        fg_linear_outputs of;
        memset(&of, 0, sizeof of);
        of.grad_weight = fg_matrix_make(gw, FG_DTYPE_BF16, V, H);
        CHECK(fg_linear_grpo(ctx, NULL, &cfg, &qin, tu_batch_view(&q.tb), &of, NULL) ==
                  FG_ERR_UNSUPPORTED,
              "%s", "f32 inputs with a bf16 grad_weight accepted");
        tu_problem_free(&q);
    }
    free(gh);
    free(gw);
    free(gb);
    fg_oracle_result_free(&ref);
    tu_problem_free(&p);
    fg_context_destroy(ctx);
    return tu_finish();
}
