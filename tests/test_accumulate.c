/*
 * test_accumulate: gradient accumulation over micro-batches
 * (fg_linear_outputs.accumulate).
 *
 * A batch of B = 4 sequences (T = 9, H = 37, V = 1009, bias, ragged mask) is
 * run once whole and once as two micro-batches of 2 sequences, the second
 * call adding its grad_weight and grad_bias to the first's. With the DAPO
 * loss normalised by the whole batch's token count (num_items_in_batch, as
 * a trainer passes it), the two micro-batch losses sum to the whole loss,
 * their grad_hidden rows are the whole call's rows, and the accumulated
 * grad_weight / grad_bias are the whole call's. Fused (several chunks) and
 * materialized, f32. The accumulating call's counted peak must equal its
 * plan's working_bytes: no extra V x H buffer.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { B = 4, T = 9, H = 37, V = 1009, N = B * T, HALF = B / 2 };

static double rel_l2(const float *a, const float *b, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Sequences [b0, b0 + HALF) of the whole batch as their own batch. */
static fg_batch micro_batch(const fg_batch *whole, int64_t b0)
{
    fg_batch m = *whole;
    const int64_t t0 = b0 * T;
    m.batch = HALF;
    m.token_ids += t0;
    m.mask += t0;
    m.advantages += b0;
    m.old_logp = m.old_logp ? m.old_logp + t0 : NULL;
    m.ref_logp = m.ref_logp ? m.ref_logp + t0 : NULL;
    return m;
}

int main(void)
{
    tu_problem p;
    tu_problem_make(&p, B, T, H, V, FG_DTYPE_F32, 1, 4242);
    CHECK(tu_problem_fill_logp(&p, 1.0, 0.3, 0.3) == 0, "%s", "oracle log-probs");
    p.tb.is_mode = 0;
    const fg_batch *whole = tu_batch_view(&p.tb);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = FG_LOSS_DAPO;
    cfg.beta = 0.04; /* entropy_coef stays 0: its bonus is normalised by the
                        call's own token count (LOSS_SPEC.md), not the batch's */
    cfg.num_items_in_batch = (double)tu_batch_unmasked(&p.tb);
    const fg_linear_inputs in = tu_problem_inputs(&p);
    fg_context *ctx = NULL;
    if (fg_context_create(NULL, &ctx) != FG_OK) {
        CHECK(0, "%s", "context create");
        return tu_finish();
    }
    for (int impl = 0; impl < 2; impl++) {
        const fg_linear_options opts = {impl ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED, 0, 0.0};
        const char *name = impl ? "materialized" : "fused";
        /* Fused: the smallest budget, one token row a chunk, so every call
         * (whole or micro-batch) walks the rows alike on any CPU. */
        fg_exec exec = {0};
        fg_linear_plan_info whole_plan;
        tu_linear_outs all, acc;
        tu_linear_outs_make(&all, N, H, V, 1);
        tu_linear_outs_make(&acc, N, H, V, 1);
        CHECK(fg_linear_grpo_plan(ctx, &opts, &cfg, &in, whole, &all.out, NULL, &whole_plan) ==
                  FG_OK, "%s plan: %s", name, fg_last_error(ctx));
        if (!impl)
            exec.memory_budget = whole_plan.min_budget_bytes;
        tu_linear_outs_fill(&acc, 0x7f); /* garbage: the first call must overwrite */
        fg_status st = fg_linear_grpo(ctx, &opts, &cfg, &in, whole, &all.out, &exec);
        CHECK(st == FG_OK, "%s whole: %s", name, fg_last_error(ctx));

        double loss = 0;
        for (int k = 0; k < 2; k++) {
            const fg_batch mb = micro_batch(whole, k * HALF);
            fg_linear_inputs mi = in;
            mi.hidden.data = (unsigned char *)in.hidden.data +
                             (size_t)(k * HALF * T) * (size_t)in.hidden.ld * sizeof(float);
            mi.hidden.rows = HALF * T;
            fg_linear_outputs mo = acc.out;
            mo.logp += k * HALF * T;
            mo.entropy += k * HALF * T;
            mo.grad_hidden.data = acc.grad_hidden + (size_t)(k * HALF * T) * H;
            mo.grad_hidden.rows = HALF * T;
            mo.accumulate = k > 0;
            fg_linear_plan_info plan;
            st = fg_linear_grpo_plan(ctx, &opts, &cfg, &mi, &mb, &mo, &exec, &plan);
            CHECK(st == FG_OK, "%s plan %d: %s", name, k, fg_last_error(ctx));
            fg_release_workspace(ctx);
            fg_reset_peak_memory(ctx);
            st = fg_linear_grpo(ctx, &opts, &cfg, &mi, &mb, &mo, &exec);
            CHECK(st == FG_OK, "%s micro-batch %d: %s", name, k, fg_last_error(ctx));
            fg_memory_stats ms;
            fg_get_memory_stats(ctx, &ms);
            CHECK(ms.peak_bytes == plan.working_bytes,
                  "%s micro-batch %d: counted peak %zu, plan %zu (accumulating must hold nothing "
                  "more)", name, k, ms.peak_bytes, plan.working_bytes);
            CHECK(impl || (ms.chunks > 1 && plan.chunk_rows == 1),
                  "fused micro-batch %d: %lld chunk(s) of %lld rows, one-row chunks wanted "
                  "(the bitwise sums below rest on them)", k, (long long)ms.chunks,
                  (long long)plan.chunk_rows);
            loss += mo.loss;
        }
        /* Tolerances [impl]: loss, grad_weight, grad_bias, grad_hidden, logp.
         * Fused in one-row chunks: every call walks the same rows in the same
         * order, so the sums are the same: bitwise on Zen 5 and AVX2.
         * Materialized (one GEMM over each call's rows), measured 2026-11-23,
         * worst Zen 5 / AVX2 (DNNL_MAX_CPU_ISA=AVX2): loss 0 / 0, grad_weight
         * 7.4e-8 / 8.9e-8, grad_bias 0 / 6.2e-8, grad_hidden 0 / 1.4e-7, logp
         * 0 / 0. */
        static const double tol[2][5] = {{0, 0, 0, 0, 0}, {0, 4e-7, 4e-7, 6e-7, 0}};
        const double err[5] = {fabs(loss - all.out.loss) / fabs(all.out.loss),
                               rel_l2(acc.grad_weight, all.grad_weight, (int64_t)V * H),
                               rel_l2(acc.grad_bias, all.grad_bias, V),
                               rel_l2(acc.grad_hidden, all.grad_hidden, (int64_t)N * H),
                               rel_l2(acc.logp, all.logp, N)};
        static const char *const what[5] = {"loss", "grad_weight", "grad_bias", "grad_hidden",
                                            "logp"};
        for (int q = 0; q < 5; q++) {
            char tname[64];
            snprintf(tname, sizeof tname, "accumulate %s %s", name, what[q]);
            TOL_CHECK(tname, err[q], tol[impl][q], "%s, two micro-batches vs one call", name);
        }
        tu_linear_outs_free(&all);
        tu_linear_outs_free(&acc);
    }
    fg_context_destroy(ctx);
    tu_problem_free(&p);
    return tu_finish();
}
