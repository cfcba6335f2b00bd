/*
 * test_budget: the fused path keeps its counted working memory under the
 * budget at a size where the baseline's logits alone (N*V*4 bytes) exceed the
 * budget more than tenfold, and still computes the same loss, log-probs and
 * gradients as the float64 oracle (and the materialized path). A budget too
 * small for one token row is refused with FG_ERR_BUDGET_TOO_SMALL before
 * anything is written.
 *
 * Budget 1 MiB (the context's, fg_context_options.memory_budget), V = 4099,
 * H = 61, B*T = 8*100 = 800 token rows (ragged mask, one all-masked
 * sequence), f32 and bf16. Peak is measured with fg_reset_peak_memory after
 * fg_release_workspace (fresh workspace), and again on a second call that
 * reuses the workspace.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "test_util.h"

enum { B = 8, T = 100, H = 61, V = 4099, N = B * T };
static const size_t BUDGET = (size_t)1 << 20;

/* Tolerances [dtype]: errors against the oracle (loss relative to its scale,
 * logp max relative with floor 1, gradients relative L2) and the fused path's
 * gradients against the materialized path's. Each is the smallest round
 * number >= 4x the worst measured on either CPU kind, given in field order:
 * "Zen 5" (AVX-512 BF16: oneDNN multiplies bf16 natively, dlogits are rounded
 * to bf16 for the gradient GEMMs) and "AVX2" (DNNL_MAX_CPU_ISA=AVX2, which
 * gives the bits of qemu -cpu Haswell: bf16 weight widened to f32 tiles,
 * dlogits f32). */
typedef struct budget_tol {
    double loss, logp, grad_hidden, grad_weight, grad_bias;
    double vs_materialized_grad_hidden, vs_materialized_grad_weight;
} budget_tol;
static const budget_tol TOL[3] = {
    /* f32  worst Zen 5: 5.3e-9 3.3e-7 1.3e-6 1.2e-6 1.3e-6 0      2.2e-7
     *      worst AVX2:  1.4e-8 3.3e-7 1.2e-6 1.2e-6 1.3e-6 1.7e-7 2.2e-7 */
    {5e-8, 1.5e-6, 6e-6, 5e-6, 6e-6, 8e-7, 1e-6},
    /* bf16 worst Zen 5: 3.7e-8 1.6e-7 1.6e-3 1.7e-3 1.7e-3 0      2.3e-7
     *      worst AVX2:  4.7e-8 2.2e-7 8.6e-7 8.3e-7 9.5e-7 2.6e-7 2.2e-7 */
    {2e-7, 1e-6, 8e-3, 8e-3, 8e-3, 1.5e-6, 1e-6},
    /* bf16 where the GEMMs run in f32 (tu_bf16_gemms_native() == 0): the AVX2
     * figures above */
    {2e-7, 1e-6, 4e-6, 4e-6, 4e-6, 1.5e-6, 1e-6},
};

static double rel_l2_ff(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    const double e = den > 0 ? sqrt(num / den) : sqrt(num);
    return isnan(e) ? INFINITY : e;
}

int main(void) {
    CHECK((size_t)N * V * 4 >= 10 * BUDGET, "test size: logits %zu bytes vs budget %zu",
          (size_t)N * V * 4, BUDGET);
    /* one problem stored as f32 and as bf16; one batch (prob[0]'s), its
     * old / ref drawn around the f32 problem's log-probs */
    const tu_problem_opts po = {0, 0, 0, 0, 0, 2};
    tu_problem prob[2];
    for (int d = 0; d < 2; d++)
        tu_problem_make_opts(&prob[d], B, T, H, V, d ? FG_DTYPE_BF16 : FG_DTYPE_F32, 1, 99, &po);
    tu_batch *tb = &prob[0].tb;

    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = FG_LOSS_DAPO;
    cfg.temperature = 0.8;
    cfg.beta = 0.04;
    cfg.entropy_coef = 0.1;
    cfg.epsilon_high = 0.28;
    CHECK(tu_problem_fill_logp(&prob[0], cfg.temperature, 0.2, 0.3) == 0, "%s", "oracle (fill)");
    const fg_batch *batch = tu_batch_view(tb);

    fg_context *cf = NULL, *cm = NULL;
    fg_context_options opt;
    fg_context_options_init(&opt);
    opt.memory_budget = BUDGET;
    if (fg_context_create(&opt, &cf) != FG_OK || fg_context_create(NULL, &cm) != FG_OK) {
        CHECK(0, "%s", "context create");
        return tu_finish();
    }

    for (int dti = 0; dti < 2; dti++) {
        const tu_problem *p = &prob[dti];
        const char *dn = dti ? (tu_bf16_gemms_native() ? "bf16" : "bf16(f32 GEMMs)") : "f32";
        const fg_linear_inputs in = tu_problem_inputs(p);

        /* fused under the context's 1 MiB, fresh workspace */
        tu_linear_outs of;
        tu_linear_outs_make(&of, N, H, V, 1);
        const fg_linear_options fused = {FG_IMPL_FUSED, 0, 0.0};
        fg_release_workspace(cf);
        fg_reset_peak_memory(cf);
        fg_status s = fg_linear_grpo(cf, &fused, &cfg, &in, batch, &of.out, NULL);
        fg_memory_stats st;
        fg_get_memory_stats(cf, &st);
        CHECK(s == FG_OK, "%s fused: %s (%s)", dn, fg_status_name(s), fg_last_error(cf));
        printf("%s fused: peak %zu bytes, budget %zu, logits would be %zu; chunk_rows %lld, "
               "chunks %lld, gemm_flops %lld\n",
               dn, st.peak_bytes, st.budget_bytes, (size_t)N * V * 4, (long long)st.chunk_rows,
               (long long)st.chunks, (long long)st.gemm_flops);
        CHECK(st.peak_bytes <= BUDGET, "%s peak %zu > budget %zu", dn, st.peak_bytes, BUDGET);
        CHECK(st.peak_bytes > 0, "%s peak 0: nothing counted?", dn);
        CHECK(st.current_bytes <= BUDGET, "%s current %zu > budget", dn, st.current_bytes);
        CHECK(st.budget_bytes == BUDGET, "%s budget_bytes %zu", dn, st.budget_bytes);
        CHECK(st.chunks > 1, "%s chunks %lld", dn, (long long)st.chunks);
        /* second call reuses the workspace: same memory, same bits */
        tu_linear_outs of2;
        tu_linear_outs_make(&of2, N, H, V, 1);
        fg_reset_peak_memory(cf);
        s = fg_linear_grpo(cf, &fused, &cfg, &in, batch, &of2.out, NULL);
        fg_get_memory_stats(cf, &st);
        CHECK(s == FG_OK && st.peak_bytes <= BUDGET, "%s second call: %s peak %zu", dn,
              fg_status_name(s), st.peak_bytes);
        CHECK(tu_linear_outs_same(&of, &of2), "%s second call differs (loss %.17g vs %.17g)", dn,
              of2.out.loss, of.out.loss);
        tu_linear_outs_free(&of2);

        /* materialized reference */
        tu_linear_outs om;
        tu_linear_outs_make(&om, N, H, V, 1);
        const fg_linear_options mat = {FG_IMPL_MATERIALIZED, 0, 0.0};
        s = fg_linear_grpo(cm, &mat, &cfg, &in, batch, &om.out, NULL);
        CHECK(s == FG_OK, "%s materialized: %s (%s)", dn, fg_status_name(s), fg_last_error(cm));

        /* the oracle on the stored inputs */
        const budget_tol *t = &TOL[dti && !tu_bf16_gemms_native() ? 2 : dti];
        char name[96];
        fg_oracle_result r;
        if (fg_oracle_linear(&cfg, batch, p->hidden, p->weight, p->bias, H, V, &r) == 0) {
            const double scale = fg_oracle_loss_scale(&cfg, batch, r.logp, r.entropy);
            const double e_fo = tu_rel_err(of.out.loss, r.loss, scale);
            printf("%s loss fused %.10g materialized %.10g oracle %.10g\n", dn, of.out.loss,
                   om.out.loss, r.loss);
            snprintf(name, sizeof name, "budget %s fused loss", dn);
            TOL_CHECK(name, e_fo, t->loss, "%s fused vs oracle", dn);
            snprintf(name, sizeof name, "budget %s fused logp", dn);
            TOL_CHECK(name, tu_max_rel(of.logp, r.logp, N, tb->mask, 1.0), t->logp,
                      "%s fused vs oracle", dn);
            snprintf(name, sizeof name, "budget %s fused grad_hidden", dn);
            TOL_CHECK(name, tu_rel_l2(of.grad_hidden, FG_DTYPE_F32, N, H, H, r.grad_hidden),
                      t->grad_hidden, "%s vs oracle", dn);
            snprintf(name, sizeof name, "budget %s fused grad_weight", dn);
            TOL_CHECK(name, tu_rel_l2(of.grad_weight, FG_DTYPE_F32, V, H, H, r.grad_weight),
                      t->grad_weight, "%s vs oracle", dn);
            snprintf(name, sizeof name, "budget %s fused grad_bias", dn);
            TOL_CHECK(name, tu_rel_l2(of.grad_bias, FG_DTYPE_F32, 1, V, V, r.grad_bias),
                      t->grad_bias, "%s vs oracle", dn);
            fg_oracle_result_free(&r);
        } else {
            CHECK(0, "%s", "oracle failed");
        }
        /* the chunks change only the order of grad_weight's and grad_bias's
         * sums over tokens */
        snprintf(name, sizeof name, "budget %s fused vs materialized grad_hidden", dn);
        TOL_CHECK(name, rel_l2_ff(of.grad_hidden, om.grad_hidden, (int64_t)N * H),
                  t->vs_materialized_grad_hidden, "%s", dn);
        snprintf(name, sizeof name, "budget %s fused vs materialized grad_weight", dn);
        TOL_CHECK(name, rel_l2_ff(of.grad_weight, om.grad_weight, (int64_t)V * H),
                  t->vs_materialized_grad_weight, "%s", dn);
        tu_linear_outs_free(&om);
        tu_linear_outs_free(&of);

        /* a budget too small for one row (one row of logits alone is V*4 =
         * 16 KiB): refused, nothing written, the last call's figures stand */
        tu_linear_outs ob;
        tu_linear_outs_make(&ob, N, H, V, 1);
        tu_linear_outs_fill(&ob, 0xA5);
        fg_memory_stats before, after;
        fg_get_memory_stats(cf, &before);
        fg_exec tiny;
        fg_exec_init(&tiny);
        tiny.memory_budget = 4096;
        s = fg_linear_grpo(cf, &fused, &cfg, &in, batch, &ob.out, &tiny);
        fg_get_memory_stats(cf, &after);
        CHECK(s == FG_ERR_BUDGET_TOO_SMALL, "%s budget 4096: %s", dn, fg_status_name(s));
        CHECK(fg_last_error(cf)[0] != '\0', "%s empty last_error", dn);
        CHECK(tu_linear_outs_are(&ob, 0xA5), "%s outputs written on BUDGET_TOO_SMALL", dn);
        CHECK(after.budget_bytes == before.budget_bytes && after.chunks == before.chunks &&
                  after.chunk_rows == before.chunk_rows,
              "%s a refused call changed the last call's figures: budget %zu -> %zu, chunks "
              "%lld -> %lld", dn, before.budget_bytes, after.budget_bytes,
              (long long)before.chunks, (long long)after.chunks);
        tu_linear_outs_free(&ob);
    }
    fg_context_destroy(cf);
    fg_context_destroy(cm);
    tu_problem_free(&prob[0]);
    tu_problem_free(&prob[1]);
    return tu_finish();
}
