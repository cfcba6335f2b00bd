/*
 * test_budget: the fused path keeps its counted working memory under the
 * budget at a size where the baseline's logits alone (N*V*4 bytes) exceed the
 * budget more than tenfold, and still computes the same loss as the
 * materialized path and the oracle. A budget too small for one token row is
 * refused with FG_ERR_BUDGET_TOO_SMALL before anything is written.
 *
 * Budget 1 MiB, V = 4099, H = 61, B*T = 8*100 = 800 token rows (ragged mask,
 * one all-masked sequence), f32 and bf16. Peak is measured with
 * fg_reset_peak_memory after fg_release_workspace (fresh workspace), and again
 * on a second call that reuses the workspace.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "test_util.h"

enum { B = 8, T = 100, H = 61, V = 4099, N = B * T };
static const size_t BUDGET = (size_t)1 << 20;

typedef struct outs {
    float *logp, *ent, *gh, *gw, *gb;
    fg_outputs out;
} outs;

static void outs_init(outs *o) {
    memset(o, 0, sizeof(*o));
    o->logp = tu_xmalloc(sizeof(float) * N);
    o->ent = tu_xmalloc(sizeof(float) * N);
    o->gh = tu_xmalloc(sizeof(float) * N * H);
    o->gw = tu_xmalloc(sizeof(float) * V * H);
    o->gb = tu_xmalloc(sizeof(float) * V);
    o->out.logp = o->logp;
    o->out.entropy = o->ent;
    o->out.grad_hidden = fg_matrix_make(o->gh, FG_DTYPE_F32, N, H);
    o->out.grad_weight = fg_matrix_make(o->gw, FG_DTYPE_F32, V, H);
    o->out.grad_bias = fg_vector_make(o->gb, FG_DTYPE_F32, V);
}

static void outs_sentinel(outs *o) {
    tu_fill_bytes(o->logp, sizeof(float) * N, 0xA5);
    tu_fill_bytes(o->ent, sizeof(float) * N, 0xA5);
    tu_fill_bytes(o->gh, sizeof(float) * N * H, 0xA5);
    tu_fill_bytes(o->gw, sizeof(float) * V * H, 0xA5);
    tu_fill_bytes(o->gb, sizeof(float) * V, 0xA5);
    tu_fill_bytes(&o->out.loss, sizeof(double), 0xA5);
    tu_fill_bytes(&o->out.metrics, sizeof(fg_metrics), 0xA5);
}

static int outs_untouched(const outs *o) {
    return tu_bytes_are(o->logp, sizeof(float) * N, 0xA5) &&
           tu_bytes_are(o->ent, sizeof(float) * N, 0xA5) &&
           tu_bytes_are(o->gh, sizeof(float) * N * H, 0xA5) &&
           tu_bytes_are(o->gw, sizeof(float) * V * H, 0xA5) &&
           tu_bytes_are(o->gb, sizeof(float) * V, 0xA5) &&
           tu_bytes_are(&o->out.loss, sizeof(double), 0xA5) &&
           tu_bytes_are(&o->out.metrics, sizeof(fg_metrics), 0xA5);
}

static void outs_free(outs *o) {
    free(o->logp);
    free(o->ent);
    free(o->gh);
    free(o->gw);
    free(o->gb);
}

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
    tu_rng rng;
    tu_rng_seed(&rng, 99);
    double *hid = tu_xmalloc(sizeof(double) * N * H);
    double *wt = tu_xmalloc(sizeof(double) * V * H);
    double *bs = tu_xmalloc(sizeof(double) * V);
    for (int64_t i = 0; i < (int64_t)N * H; i++) hid[i] = tu_normal(&rng);
    for (int64_t i = 0; i < (int64_t)V * H; i++) wt[i] = tu_normal(&rng) * 3.0 / sqrt((double)H);
    for (int64_t i = 0; i < V; i++) bs[i] = 0.5 * tu_normal(&rng);

    tu_batch tb;
    tu_batch_make(&tb, B, T, V, 2, &rng);
    tb.have_old = tb.have_ref = 1;
    tb.is_mode = 1;

    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = FG_LOSS_DAPO;
    cfg.temperature = 0.8;
    cfg.beta = 0.04;
    cfg.entropy_coef = 0.1;
    cfg.epsilon_high = 0.28;

    fg_context *cf = NULL, *cm = NULL;
    fg_context_options opt;
    fg_context_options_init(&opt);
    opt.memory_budget = BUDGET;
    if (fg_context_create(&opt, &cf) != FG_OK || fg_context_create(NULL, &cm) != FG_OK) {
        CHECK(0, "%s", "context create");
        return tu_finish();
    }

    for (int dti = 0; dti < 2; dti++) {
        const fg_dtype dt = dti ? FG_DTYPE_BF16 : FG_DTYPE_F32;
        const char *dn = dti ? "bf16" : "f32";
        double *h2 = tu_xmalloc(sizeof(double) * N * H);
        double *w2 = tu_xmalloc(sizeof(double) * V * H);
        double *b2 = tu_xmalloc(sizeof(double) * V);
        memcpy(h2, hid, sizeof(double) * N * H);
        memcpy(w2, wt, sizeof(double) * V * H);
        memcpy(b2, bs, sizeof(double) * V);
        void *hs = tu_store_matrix(h2, N, H, H, dt);
        void *ws = tu_store_matrix(w2, V, H, H, dt);
        void *bss = tu_store_matrix(b2, 1, V, V, dt);
        fg_linear_inputs in;
        memset(&in, 0, sizeof in);
        in.hidden = fg_matrix_make(hs, dt, N, H);
        in.weight = fg_matrix_make(ws, dt, V, H);
        in.bias = fg_vector_make(bss, dt, V);

        /* old / ref around the current policy (oracle forward, plain config) */
        if (dti == 0) {
            fg_loss_config c0;
            tu_config_defaults(&c0);
            c0.temperature = cfg.temperature;
            tu_batch plain = tb;
            plain.have_old = plain.have_ref = 0;
            plain.is_mode = 0;
            fg_oracle_result r0;
            if (fg_oracle_linear(&c0, tu_batch_view(&plain), h2, w2, b2, H, V, &r0) == 0) {
                tu_batch_fill_logp(&tb, r0.logp, 0.2, 0.3, &rng);
                fg_oracle_result_free(&r0);
            }
        }
        const fg_batch *batch = tu_batch_view(&tb);

        /* fused under 1 MiB, fresh workspace */
        outs of;
        outs_init(&of);
        const fg_linear_options fused = {FG_IMPL_FUSED, 0};
        fg_context_set_memory_budget(cf, BUDGET);
        fg_release_workspace(cf);
        fg_reset_peak_memory(cf);
        fg_status s = fg_linear_grpo(cf, &fused, &cfg, &in, batch, &of.out);
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
        /* second call reuses the workspace */
        outs of2;
        outs_init(&of2);
        fg_reset_peak_memory(cf);
        s = fg_linear_grpo(cf, &fused, &cfg, &in, batch, &of2.out);
        fg_get_memory_stats(cf, &st);
        CHECK(s == FG_OK && st.peak_bytes <= BUDGET, "%s second call: %s peak %zu", dn,
              fg_status_name(s), st.peak_bytes);
        CHECK(of2.out.loss == of.out.loss, "%s second call loss %.17g vs %.17g", dn, of2.out.loss,
              of.out.loss);
        outs_free(&of2);

        /* materialized reference */
        outs om;
        outs_init(&om);
        const fg_linear_options mat = {FG_IMPL_MATERIALIZED, 0};
        s = fg_linear_grpo(cm, &mat, &cfg, &in, batch, &om.out);
        CHECK(s == FG_OK, "%s materialized: %s (%s)", dn, fg_status_name(s), fg_last_error(cm));

        /* oracle on the stored inputs (loss scale and loss) */
        fg_oracle_result r;
        if (fg_oracle_linear(&cfg, batch, h2, w2, b2, H, V, &r) == 0) {
            const double scale = fg_oracle_loss_scale(&cfg, batch, r.logp, r.entropy);
            const double e_fm = tu_rel_err(of.out.loss, om.out.loss, scale);
            const double e_fo = tu_rel_err(of.out.loss, r.loss, scale);
            printf("%s loss fused %.10g materialized %.10g oracle %.10g: rel err %.2e / %.2e\n", dn,
                   of.out.loss, om.out.loss, r.loss, e_fm, e_fo);
            CHECK(e_fm <= 1e-5, "%s fused vs materialized loss rel err %.3g", dn, e_fm);
            CHECK(e_fo <= 1e-5, "%s fused vs oracle loss rel err %.3g", dn, e_fo);
            const double el = tu_max_rel(of.logp, r.logp, N, tb.mask, 1.0);
            CHECK(el <= 1e-5, "%s fused logp vs oracle %.3g", dn, el);
            const double tol = dti ? 3e-2 : 1e-4;
            const double eh = tu_rel_l2(of.gh, FG_DTYPE_F32, N, H, H, r.grad_hidden);
            const double ew = tu_rel_l2(of.gw, FG_DTYPE_F32, V, H, H, r.grad_weight);
            const double eb = tu_rel_l2(of.gb, FG_DTYPE_F32, 1, V, V, r.grad_bias);
            printf("%s fused grads vs oracle: hidden %.2e weight %.2e bias %.2e\n", dn, eh, ew, eb);
            CHECK(eh <= tol && ew <= tol && eb <= tol, "%s fused grads %.3g %.3g %.3g > %.0e", dn,
                  eh, ew, eb, tol);
            fg_oracle_result_free(&r);
        } else {
            CHECK(0, "%s", "oracle failed");
        }
        const double gtol = dti ? 3e-2 : 1e-4;
        const double gh = rel_l2_ff(of.gh, om.gh, (int64_t)N * H);
        const double gw = rel_l2_ff(of.gw, om.gw, (int64_t)V * H);
        CHECK(gh <= gtol && gw <= gtol, "%s fused vs materialized grads %.3g %.3g", dn, gh, gw);
        outs_free(&om);
        outs_free(&of);

        /* a budget too small for one row */
        outs ob;
        outs_init(&ob);
        outs_sentinel(&ob);
        fg_context_set_memory_budget(cf, 4096); /* one row of logits alone is V*4 = 16 KiB */
        s = fg_linear_grpo(cf, &fused, &cfg, &in, batch, &ob.out);
        CHECK(s == FG_ERR_BUDGET_TOO_SMALL, "%s budget 4096: %s", dn, fg_status_name(s));
        CHECK(fg_last_error(cf)[0] != '\0', "%s empty last_error", dn);
        CHECK(outs_untouched(&ob), "%s outputs written on BUDGET_TOO_SMALL", dn);
        outs_free(&ob);

        free(hs);
        free(ws);
        free(bss);
        free(h2);
        free(w2);
        free(b2);
    }
    fg_context_destroy(cf);
    fg_context_destroy(cm);
    tu_batch_free(&tb);
    free(hid);
    free(wt);
    free(bs);
    return tu_finish();
}
