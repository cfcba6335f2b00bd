/*
 * test_oracle_fd: the float64 oracle's analytic chain (dlogp/dentropy by
 * finite differences of the per-token loss, then the softmax chain rule and
 * the LM-head products) against central finite differences of the oracle's
 * own forward loss with respect to hidden, weight and bias.
 *
 * Every loss type x both levels x option sets covering temperature != 1,
 * beta != 0 (with and without the bias-corrected KL), entropy_coef != 0,
 * delta, is_ratio [B, T] and [B], off- and on-policy. For on-policy losses
 * (and cispo's stop_gradient weight) the finite difference holds the
 * stop-gradient copy of logp fixed at the unperturbed logp
 * (fg_oracle_linear_loss_sg), which is what old = stop_gradient(logp) means.
 *
 * Also a few closed-form sanity values of dlogp / dentropy.
 *
 * Needs nothing from the library but the header's types.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "test_util.h"

enum { B_ = 3, T_ = 5, H_ = 7, V_ = 31 };

typedef struct fd_opts {
    int bias, old, beta, bias_kl, delta, is_mode, ent, temp;
} fd_opts;

static const fd_opts SETS[] = {
    /* bias old beta bkl delta is ent temp */
    {1, 0, 1, 1, 0, 1, 1, 1}, /* on-policy, bias-corrected KL, entropy, T=0.7, is [B,T] */
    {0, 1, 1, 0, 1, 2, 2, 2}, /* off-policy, delta, is [B], entropy<0, T=1.3     */
    {1, 1, 0, 0, 0, 0, 0, 0}, /* plain off-policy                                 */
    {0, 0, 0, 0, 1, 0, 0, 0}, /* plain on-policy with delta                       */
};

/* Central differences with step 1e-5 in double: truncation error ~h^2 times
 * the third derivative, rounding ~1e-16 / h. Tolerances: the smallest round
 * number >= 4x the worst measured (the oracle is plain double C, the same on
 * both CPU kinds). The analytic chain itself uses finite differences of the
 * per-token loss for dlogp / dentropy, hence errors above 1e-10. */
static const double TOL_FD_GRAD_HIDDEN = 6e-8; /* worst 1.4e-8 */
static const double TOL_FD_GRAD_WEIGHT = 5e-7; /* worst 1.1e-7 */
static const double TOL_FD_GRAD_BIAS = 2e-7;   /* worst 3.9e-8 */
/* The oracle's forward-only loss against the loss of its full result, relative
 * to 1 + |loss|: the same double arithmetic in the same order, so exact
 * (worst 0). */
static const double TOL_FORWARD_LOSS = 0;
/* Closed forms (on-policy dapo / cispo with an entropy bonus): dlogp and
 * dentropy relative to the exact value (the oracle's are finite differences
 * of the per-token loss), the loss relative to 1 + |loss| (the same sums:
 * exact). */
static const double TOL_CLOSED_DLOGP = 4e-8;    /* worst 8.7e-9 */
static const double TOL_CLOSED_DENTROPY = 3e-8; /* worst 5.7e-9 */
static const double TOL_CLOSED_LOSS = 0;        /* worst 0 */

/* |fd - an| against max(|an|, 1e-3 * gmax), under "oracle fd <what>". */
static void compare(const char *what, double tol, const char *tag, int64_t idx, double fd,
                    double an, double gmax) {
    const double floor = 1e-3 * gmax > 1e-12 ? 1e-3 * gmax : 1e-12;
    const double e = tu_rel_err(fd, an, floor);
    char name[64];
    snprintf(name, sizeof name, "oracle fd %s", what);
    TOL_CHECK(name, e, tol, "%s %s[%lld]: finite difference %.12g analytic %.12g", tag, what,
              (long long)idx, fd, an);
}

static double maxabs(const double *x, int64_t n) {
    double m = 0.0;
    for (int64_t i = 0; i < n; i++)
        if (fabs(x[i]) > m) m = fabs(x[i]);
    return m;
}

static void run_case(int lt, int lvl, int si, uint64_t seed) {
    const fd_opts *o = &SETS[si];
    const int64_t N = (int64_t)B_ * T_;
    char tag[160];
    snprintf(tag, sizeof tag, "[%s/%s set %d]", tu_loss_name(lt), tu_level_name(lvl), si);

    /* the oracle perturbs these double arrays in place */
    const tu_problem_opts po = {1.0, 2.0 / sqrt(H_), 0.5, 0, 0, si + lt};
    tu_problem prob;
    tu_problem_make_opts(&prob, B_, T_, H_, V_, FG_DTYPE_F32, o->bias, seed, &po);
    double *hidden = prob.hidden, *weight = prob.weight, *bias = prob.bias;
    const double *bp = bias;
    tu_batch *tbp = &prob.tb;
    tu_rng *rng = &prob.rng;

    fg_loss_config cfg;
    tu_config_defaults(&cfg);
    cfg.loss_type = (fg_loss_type)lt;
    cfg.importance_sampling_level = (fg_is_level)lvl;
    cfg.temperature = o->temp == 1 ? 0.7 : o->temp == 2 ? 1.3 : 1.0;

    /* old / ref near the logp at the unperturbed point */
    if (tu_problem_fill_logp(&prob, cfg.temperature, 0.25, 0.3) != 0) {
        CHECK(0, "%s oracle failed on a valid batch", tag);
        goto done_nores;
    }
    tbp->have_old = o->old;
    tbp->have_ref = o->beta;
    tbp->is_mode = o->is_mode;
    if (o->is_mode == 2) /* per-sequence is_ratio lives in [0, B) */
        for (int64_t b = 0; b < B_; b++) tbp->is_ratio[b] = (float)(0.5 + tu_uniform(rng));

    if (o->beta) cfg.beta = 0.07;
    cfg.use_bias_correction_kl = o->bias_kl;
    if (o->delta) cfg.delta = 1.3;
    if (o->ent == 1) cfg.entropy_coef = 0.3;
    if (o->ent == 2) cfg.entropy_coef = -0.1;
    if (si == 1) {
        cfg.epsilon_high = lt == FG_LOSS_CISPO ? 1.1 : 0.28;
        cfg.max_completion_length = 9;
        cfg.num_items_in_batch = 12.5;
        cfg.sapo_temperature_pos = 0.8;
        cfg.sapo_temperature_neg = 1.3;
    } else if (lt == FG_LOSS_CISPO && si == 2) {
        cfg.epsilon_high = 1.05;
    }
    const fg_batch *batch = tu_batch_view(tbp);

    fg_oracle_result r;
    if (fg_oracle_linear(&cfg, batch, hidden, weight, bp, H_, V_, &r) != 0) {
        CHECK(0, "%s oracle failed on a valid batch", tag);
        goto done_nores;
    }
    CHECK(isfinite(r.loss), "%s loss %g", tag, r.loss);
    /* plain forward agrees with the result's loss */
    {
        const double l2 = fg_oracle_linear_loss(&cfg, batch, hidden, weight, bp, H_, V_);
        TOL_CHECK("oracle forward-only loss vs full", fabs(l2 - r.loss) / (1 + fabs(r.loss)),
                  TOL_FORWARD_LOSS, "%s forward %.17g vs %.17g", tag, l2, r.loss);
    }
    /* masked rows: zero */
    for (int64_t n = 0; n < N; n++) {
        if (tbp->mask[n]) continue;
        int z = r.logp[n] == 0 && r.entropy[n] == 0 && r.dlogp[n] == 0 && r.dentropy[n] == 0;
        for (int64_t h = 0; h < H_; h++) z &= r.grad_hidden[n * H_ + h] == 0;
        for (int64_t v = 0; v < V_; v++) z &= r.grad_logits[n * V_ + v] == 0;
        CHECK(z, "%s masked row %lld not zero", tag, (long long)n);
    }

    const double *det = r.logp; /* stop-gradient copy, fixed */
    const double gh = maxabs(r.grad_hidden, N * H_), gw = maxabs(r.grad_weight, V_ * H_);
    /* hidden entries: some in every row */
    for (int64_t n = 0; n < N; n++) {
        const int64_t i = n * H_ + tu_randint(rng, H_);
        const double x = hidden[i], h = 1e-5;
        hidden[i] = x + h;
        const double fp = fg_oracle_linear_loss_sg(&cfg, batch, hidden, weight, bp, H_, V_, det);
        hidden[i] = x - h;
        const double fm = fg_oracle_linear_loss_sg(&cfg, batch, hidden, weight, bp, H_, V_, det);
        hidden[i] = x;
        compare("grad_hidden", TOL_FD_GRAD_HIDDEN, tag, i, (fp - fm) / (2 * h), r.grad_hidden[i],
                gh);
    }
    /* weight entries: rows of sampled tokens and random rows */
    for (int k = 0; k < 12; k++) {
        int64_t v;
        if (k < 6) {
            int64_t n;
            do n = tu_randint(rng, N);
            while (!tbp->mask[n]);
            v = tbp->token_ids[n];
        } else {
            v = tu_randint(rng, V_);
        }
        const int64_t i = v * H_ + tu_randint(rng, H_);
        const double x = weight[i], h = 1e-5;
        weight[i] = x + h;
        const double fp = fg_oracle_linear_loss_sg(&cfg, batch, hidden, weight, bp, H_, V_, det);
        weight[i] = x - h;
        const double fm = fg_oracle_linear_loss_sg(&cfg, batch, hidden, weight, bp, H_, V_, det);
        weight[i] = x;
        compare("grad_weight", TOL_FD_GRAD_WEIGHT, tag, i, (fp - fm) / (2 * h), r.grad_weight[i],
                gw);
    }
    if (bp) {
        const double gb = maxabs(r.grad_bias, V_);
        for (int k = 0; k < 6; k++) {
            int64_t v = tu_randint(rng, V_);
            if (k < 3) { /* the row of a sampled token */
                int64_t n;
                do n = tu_randint(rng, N);
                while (!tbp->mask[n]);
                v = tbp->token_ids[n];
            }
            const double x = bias[v], h = 1e-5;
            bias[v] = x + h;
            const double fp = fg_oracle_linear_loss_sg(&cfg, batch, hidden, weight, bp, H_, V_, det);
            bias[v] = x - h;
            const double fm = fg_oracle_linear_loss_sg(&cfg, batch, hidden, weight, bp, H_, V_, det);
            bias[v] = x;
            compare("grad_bias", TOL_FD_GRAD_BIAS, tag, v, (fp - fm) / (2 * h), r.grad_bias[v], gb);
        }
    } else {
        CHECK(r.grad_bias == NULL, "%s grad_bias without a bias", tag);
    }
    fg_oracle_result_free(&r);
done_nores:
    tu_problem_free(&prob);
}

/* Closed forms: on-policy dapo (token level, inside the clip range, ratio 1):
 * g_t = -A_b / M; cispo on-policy with eps_high > 1: g_t = -A_b / M (the
 * weight min(ratio, eps_high) = 1 is stop_gradient); entropy bonus: e_t = -c / M. */
static void closed_forms(void) {
    tu_rng rng;
    tu_rng_seed(&rng, 77);
    const int64_t B = 4, T = 6, V = 11, N = B * T;
    tu_batch tb;
    tu_batch_make(&tb, B, T, V, 1, &rng);
    const fg_batch *batch = tu_batch_view(&tb);
    const double M = (double)tu_batch_unmasked(&tb);
    double *logits = tu_xmalloc(sizeof(double) * N * V);
    for (int64_t i = 0; i < N * V; i++) logits[i] = 2.0 * tu_normal(&rng);
    for (int lt = 0; lt < 2; lt++) {
        fg_loss_config cfg;
        tu_config_defaults(&cfg);
        cfg.loss_type = lt ? FG_LOSS_CISPO : FG_LOSS_DAPO;
        cfg.epsilon_high = lt ? 1.5 : -1.0; /* cispo: weight = sg(ratio) = 1 */
        cfg.entropy_coef = 0.25;
        fg_oracle_result r;
        if (fg_oracle_logits(&cfg, batch, logits, V, &r) != 0) {
            CHECK(0, "oracle failed");
            continue;
        }
        double want_loss = 0.0, ent = 0.0;
        for (int64_t n = 0; n < N; n++) {
            if (!tb.mask[n]) continue;
            const double A = tb.advantages[n / T];
            const double g = lt ? -A / M : -A / M;
            TOL_CHECK("oracle closed form dlogp", fabs(r.dlogp[n] - g) / fabs(g),
                      TOL_CLOSED_DLOGP, "%s dlogp[%lld] %.12g want %.12g",
                      tu_loss_name(cfg.loss_type), (long long)n, r.dlogp[n], g);
            TOL_CHECK("oracle closed form dentropy", fabs(r.dentropy[n] + 0.25 / M) / (0.25 / M),
                      TOL_CLOSED_DENTROPY, "%s dentropy[%lld] %.12g want %.12g",
                      tu_loss_name(cfg.loss_type), (long long)n, r.dentropy[n], -0.25 / M);
            want_loss += lt ? -A * r.logp[n] / M : -A / M;
            ent += r.entropy[n] / M;
        }
        want_loss -= 0.25 * ent;
        TOL_CHECK("oracle closed form loss", fabs(r.loss - want_loss) / (1 + fabs(want_loss)),
                  TOL_CLOSED_LOSS, "%s loss %.15g want %.15g", tu_loss_name(cfg.loss_type),
                  r.loss, want_loss);
        CHECK(r.metrics.clip_ratio_region == 0 && r.metrics.kl == 0,
              "on-policy metrics region %g kl %g", r.metrics.clip_ratio_region, r.metrics.kl);
        CHECK(r.metrics.cispo_clip_ratio == 0.0,
              "cispo_clip_ratio %g", r.metrics.cispo_clip_ratio);
        fg_oracle_result_free(&r);
    }
    /* bad input is refused */
    {
        fg_loss_config cfg;
        tu_config_defaults(&cfg);
        fg_oracle_result r;
        int64_t save = tb.token_ids[0];
        tb.token_ids[0] = V;
        CHECK(fg_oracle_logits(&cfg, batch, logits, V, &r) == -1, "token id V accepted");
        tb.token_ids[0] = save;
        cfg.beta = 0.1;
        CHECK(fg_oracle_logits(&cfg, batch, logits, V, &r) == -1, "beta without ref accepted");
    }
    free(logits);
    tu_batch_free(&tb);
}

int main(void) {
    closed_forms();
    uint64_t seed = 1000;
    for (int lt = 0; lt < FG_LOSS_TYPE_COUNT; lt++)
        for (int lvl = 0; lvl < FG_LEVEL_COUNT; lvl++)
            for (int si = 0; si < (int)(sizeof SETS / sizeof SETS[0]); si++)
                run_case(lt, lvl, si, seed++);
    return tu_finish();
}
