/*
 * fg_oracle: float64 reference of docs/LOSS_SPEC.md. Plain loops, everything in
 * double, written from the spec alone (independent of src/).
 *
 * The gradient of the loss with respect to the per-token log-prob and entropy
 * is taken by central finite differences of fg_oracle_loss_from_logp, so the
 * oracle depends on no hand-derived derivative of the policy loss. Only the
 * softmax chain rule (spec "Gradient") is analytic.
 */
#include "fg_oracle.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ loss from logp */

static int tok_masked(const fg_batch *b, int64_t n) { return b->mask[n] == 0; }

/* The entropy threshold of top_entropy_quantile q < 1 over the unmasked
 * tokens' detached entropies: the (1 − q) quantile with linear interpolation
 * between order statistics (torch.quantile); +inf when no token is unmasked. */
static double entropy_threshold(const fg_batch *bt, const double *ent, double q) {
    const int64_t N = bt->batch * bt->seq_len;
    double *v = malloc((size_t)(N > 0 ? N : 1) * sizeof(double));
    if (!v) return NAN;
    int64_t m = 0;
    for (int64_t n = 0; n < N; n++)
        if (!tok_masked(bt, n)) v[m++] = ent[n];
    double thr = INFINITY;
    if (m > 0) {
        for (int64_t i = 1; i < m; i++) { /* insertion sort: the oracle is small */
            const double x = v[i];
            int64_t j = i - 1;
            while (j >= 0 && v[j] > x) {
                v[j + 1] = v[j];
                j--;
            }
            v[j + 1] = x;
        }
        const double pos = (1.0 - q) * (double)(m - 1);
        const int64_t lo = (int64_t)floor(pos);
        const int64_t hi = lo + 1 < m ? lo + 1 : m - 1;
        thr = v[lo] + (pos - (double)lo) * (v[hi] - v[lo]);
    }
    free(v);
    return thr;
}

static double clamp(double x, double lo, double hi) { return x < lo ? lo : (x > hi ? hi : x); }

/*
 * The spec's loss from per-token values. logp_det and ent_det are the
 * stop-gradient copies of logp and entropy: logp_det stands for `old` when
 * there is no old_logp and feeds every stop_gradient quantity (cispo's
 * weight, vespo's gamma weight, the off-policy mask); ent_det decides the
 * high-entropy mask. absval != 0: aggregate |L_t| and |c|*entropy instead
 * (the loss's natural scale, used by the tests' relative error when the loss
 * cancels). token_loss (may be NULL): L_t per token.
 */
static double loss_impl(const fg_loss_config *cfg, const fg_batch *bt,
                        const double *logp, const double *logp_det,
                        const double *entropy, const double *ent_det, fg_metrics *metrics,
                        int absval, double *token_loss) {
    const int64_t B = bt->batch, T = bt->seq_len;
    const double el = cfg->epsilon_low;
    const double eh = cfg->epsilon_high < 0 ? cfg->epsilon_low : cfg->epsilon_high;
    const int delta_on = cfg->delta > 0;
    const int seq_level = cfg->importance_sampling_level == FG_LEVEL_SEQUENCE;
    const int clipped = cfg->loss_type != FG_LOSS_CISPO && cfg->loss_type != FG_LOSS_SAPO &&
                        cfg->loss_type != FG_LOSS_VESPO;
    const int off_policy = !isinf(cfg->off_policy_mask_threshold);
    const int ent_mask_on = cfg->top_entropy_quantile < 1.0;
    const double mcl = cfg->max_completion_length <= 0 ? (double)T
                                                         : (double)cfg->max_completion_length;
    double total_m = 0.0;
    for (int64_t n = 0; n < B * T; n++)
        if (!tok_masked(bt, n)) total_m += 1.0;
    const double nib = cfg->num_items_in_batch < 0 ? total_m : cfg->num_items_in_batch;
    const double thr = ent_mask_on ? entropy_threshold(bt, ent_det, cfg->top_entropy_quantile)
                                   : -INFINITY;

    double loss_sum_all = 0.0;  /* sum m*L over the batch                  */
    double loss_seq_mean = 0.0; /* sum over b of (sum_t m*L)/max(cnt_b, 1) */
    double loss_seq_sum = 0.0;  /* sum over b of sum_t m*L                 */
    double kl_sum = 0.0, ent_sum = 0.0, ent_eff_sum = 0.0, n_eff = 0.0, phi_sum = 0.0;
    double n_low = 0.0, n_high = 0.0, n_region = 0.0, n_cispo = 0.0;
    double low_min = NAN, high_max = NAN;

    for (int64_t b = 0; b < B; b++) {
        const double A = (double)bt->advantages[b];
        double cnt = 0.0, lr_seq = 0.0, lr_seq_det = 0.0, lr_vespo = 0.0, log_is = 0.0, kl_op = 0.0;
        for (int64_t t = 0; t < T; t++) {
            const int64_t n = b * T + t;
            if (tok_masked(bt, n)) continue;
            const double old = bt->old_logp ? (double)bt->old_logp[n] : logp_det[n];
            cnt += 1.0;
            lr_seq += logp[n] - old;
            lr_seq_det += logp_det[n] - old;
            lr_vespo += clamp(logp_det[n] - old, -20.0, 20.0);
            if (bt->is_ratio && !bt->is_ratio_per_sequence)
                log_is += clamp(log((double)bt->is_ratio[n]), log(1e-8), 20.0);
            const double samp = bt->sampling_logp ? (double)bt->sampling_logp[n] : old;
            const double k = samp - logp_det[n];
            kl_op += isnan(k) ? 0.0 : k;
        }
        const double denom_b = cnt > 1.0 ? cnt : 1.0;
        lr_seq /= denom_b;
        lr_seq_det /= denom_b;
        /* the off-policy sequence mask (DeepSeek-V3.2, TRL's get_off_policy_mask) */
        const double keep =
            !off_policy || A >= 0 || kl_op / denom_b <= cfg->off_policy_mask_threshold ? 1.0 : 0.0;
        /* vespo's gamma weight φ(w) = exp(λ + k log w − λ w), detached */
        double phi = 1.0;
        if (cfg->loss_type == FG_LOSS_VESPO) {
            if (bt->is_ratio && bt->is_ratio_per_sequence)
                log_is = clamp(log((double)bt->is_ratio[b]), log(1e-8), 20.0);
            const double lw = clamp(lr_vespo + log_is, log(1e-8), 20.0);
            const double k = A >= 0 ? cfg->vespo_k_pos : cfg->vespo_k_neg;
            double lam = A >= 0 ? cfg->vespo_lambda_pos : cfg->vespo_lambda_neg;
            if (lam < 1e-4) lam = 1e-4;
            phi = exp(lam + k * lw - lam * exp(lw));
            if (!isfinite(phi)) phi = 0.0;
            phi_sum += phi;
        }

        double seq_L = 0.0, s_low = 0.0, s_high = 0.0;
        for (int64_t t = 0; t < T; t++) {
            const int64_t n = b * T + t;
            if (token_loss) token_loss[n] = 0.0;
            if (tok_masked(bt, n)) continue;
            const double old = bt->old_logp ? (double)bt->old_logp[n] : logp_det[n];
            double ratio, ratio_det;
            if (seq_level) {
                ratio = exp(lr_seq);
                ratio_det = exp(lr_seq_det);
            } else {
                ratio = exp(logp[n] - old);
                ratio_det = exp(logp_det[n] - old);
            }
            double L;
            switch (cfg->loss_type) {
            case FG_LOSS_CISPO: {
                const double w = ratio_det < eh ? ratio_det : eh; /* stop_gradient */
                L = -w * A * logp[n];
                break;
            }
            case FG_LOSS_VESPO:
                L = -phi * A * logp[n];
                break;
            case FG_LOSS_SAPO: {
                const double tau = A > 0 ? cfg->sapo_temperature_pos : cfg->sapo_temperature_neg;
                const double sig = 1.0 / (1.0 + exp(-tau * (ratio - 1.0)));
                L = -(4.0 / tau) * sig * A;
                break;
            }
            default: { /* grpo, bnpo, dr_grpo, dapo, luspo */
                double clipped_r = ratio;
                if (clipped_r < 1.0 - el) clipped_r = 1.0 - el;
                if (clipped_r > 1.0 + eh) clipped_r = 1.0 + eh;
                double rt = ratio;
                if (delta_on && rt > cfg->delta) rt = cfg->delta;
                const double l1 = rt * A, l2 = clipped_r * A;
                L = -(l1 < l2 ? l1 : l2);
                break;
            }
            }
            const int eff = ent_det[n] >= thr;
            L *= keep * (eff ? 1.0 : 0.0);
            if (bt->is_ratio && cfg->loss_type != FG_LOSS_VESPO)
                L *= (double)(bt->is_ratio_per_sequence ? bt->is_ratio[b] : bt->is_ratio[n]);
            if (cfg->beta != 0.0) {
                const double d = (double)bt->ref_logp[n] - logp[n];
                double kl = exp(d) - d - 1.0;
                if (cfg->use_bias_correction_kl) kl *= ratio; /* the level's ratio */
                L += cfg->beta * kl;
                kl_sum += kl;
            }
            if (token_loss) token_loss[n] = L;
            seq_L += absval ? fabs(L) : L;
            ent_sum += entropy[n];
            if (eff) {
                ent_eff_sum += entropy[n];
                n_eff += 1.0;
            }
            if (!seq_level) {
                /* the clip metrics see TRL's coef_1 after the two-sided clip */
                const double rm = clipped && delta_on && ratio > cfg->delta ? cfg->delta : ratio;
                const int low = rm < 1.0 - el && A < 0;
                const int high = rm > 1.0 + eh && A > 0;
                s_low += low;
                s_high += high;
                n_region += (low || high);
                n_cispo += rm > eh && A > 0;
            }
        }
        if (seq_level) { /* one ratio per sequence: every sequence counts once */
            double r = exp(lr_seq);
            if (clipped && delta_on && r > cfg->delta) r = cfg->delta;
            s_low = r < 1.0 - el && A < 0;
            s_high = r > 1.0 + eh && A > 0;
            n_region += s_low || s_high;
            n_cispo += r > eh && A > 0;
            if (isnan(low_min) || s_low < low_min) low_min = s_low;
            if (isnan(high_max) || s_high > high_max) high_max = s_high;
        } else if (cnt > 0) {
            if (isnan(low_min) || s_low / cnt < low_min) low_min = s_low / cnt;
            if (isnan(high_max) || s_high / cnt > high_max) high_max = s_high / cnt;
        }
        n_low += s_low;
        n_high += s_high;
        loss_sum_all += seq_L;
        loss_seq_mean += seq_L / denom_b;
        loss_seq_sum += seq_L;
    }

    double loss;
    switch (cfg->loss_type) {
    case FG_LOSS_GRPO:
    case FG_LOSS_SAPO: loss = loss_seq_mean / (double)B; break;
    case FG_LOSS_BNPO: loss = loss_sum_all / (total_m > 1.0 ? total_m : 1.0); break;
    case FG_LOSS_DR_GRPO: loss = loss_sum_all / ((double)B * mcl); break;
    case FG_LOSS_LUSPO: loss = loss_seq_sum / (double)B; break;
    default: /* dapo, cispo, vespo */ loss = loss_sum_all / (nib > 1.0 ? nib : 1.0); break;
    }
    const double policy = loss;
    const double mden = total_m > 1.0 ? total_m : 1.0;
    /* the entropy bonus: a mean over the effective mask (mask · high-entropy mask) */
    const double ent_bonus = ent_eff_sum / (n_eff > 1.0 ? n_eff : 1.0);
    if (cfg->entropy_coef != 0.0) {
        if (absval)
            loss += fabs(cfg->entropy_coef) * fabs(ent_bonus);
        else
            loss -= cfg->entropy_coef * ent_bonus;
    }
    if (metrics) {
        const double cden = seq_level ? (double)B : mden;
        memset(metrics, 0, sizeof *metrics);
        metrics->policy_loss = policy;
        metrics->kl = cfg->beta != 0.0 ? kl_sum / mden : 0.0;
        metrics->entropy = ent_sum / mden;
        if (clipped) {
            metrics->clip_ratio_low = n_low / cden;
            metrics->clip_ratio_high = n_high / cden;
            metrics->clip_ratio_region = n_region / cden;
            metrics->clip_ratio_low_min = low_min;
            metrics->clip_ratio_high_max = high_max;
        }
        if (cfg->loss_type == FG_LOSS_CISPO) metrics->cispo_clip_ratio = n_cispo / cden;
        if (cfg->loss_type == FG_LOSS_VESPO) metrics->vespo_phi_seq_mean = phi_sum / (double)B;
    }
    return loss;
}

double fg_oracle_loss_from_logp(const fg_loss_config *cfg, const fg_batch *batch,
                                const double *logp, const double *logp_detached,
                                const double *entropy, fg_metrics *metrics) {
    return loss_impl(cfg, batch, logp, logp_detached, entropy, entropy, metrics, 0, NULL);
}

double fg_oracle_loss_scale(const fg_loss_config *cfg, const fg_batch *batch,
                            const double *logp, const double *entropy) {
    return loss_impl(cfg, batch, logp, logp, entropy, entropy, NULL, 1, NULL);
}

void fg_oracle_token_loss(const fg_loss_config *cfg, const fg_batch *batch,
                          const double *logp, const double *entropy, double *token_loss) {
    (void)loss_impl(cfg, batch, logp, logp, entropy, entropy, NULL, 0, token_loss);
}

/* d loss / d logp_t and d loss / d entropy_t by central differences, with the
 * stop-gradient copy (logp_det) held fixed. */
static int fd_token_grads(const fg_loss_config *cfg, const fg_batch *bt, const double *logp,
                          const double *entropy, double *dlogp, double *dent) {
    const int64_t N = bt->batch * bt->seq_len;
    double *lp = malloc((size_t)N * sizeof(double));
    double *en = malloc((size_t)N * sizeof(double));
    if (!lp || !en) {
        free(lp);
        free(en);
        return -1;
    }
    memcpy(lp, logp, (size_t)N * sizeof(double));
    memcpy(en, entropy, (size_t)N * sizeof(double));
    for (int64_t n = 0; n < N; n++) {
        dlogp[n] = 0.0;
        dent[n] = 0.0;
        if (tok_masked(bt, n)) continue;
        double h = 1e-6 * (fabs(logp[n]) > 1.0 ? fabs(logp[n]) : 1.0);
        lp[n] = logp[n] + h;
        double fp = loss_impl(cfg, bt, lp, logp, en, entropy, NULL, 0, NULL);
        lp[n] = logp[n] - h;
        double fm = loss_impl(cfg, bt, lp, logp, en, entropy, NULL, 0, NULL);
        lp[n] = logp[n];
        dlogp[n] = (fp - fm) / (2.0 * h);

        h = 1e-6 * (fabs(entropy[n]) > 1.0 ? fabs(entropy[n]) : 1.0);
        en[n] = entropy[n] + h;
        fp = loss_impl(cfg, bt, lp, logp, en, entropy, NULL, 0, NULL);
        en[n] = entropy[n] - h;
        fm = loss_impl(cfg, bt, lp, logp, en, entropy, NULL, 0, NULL);
        en[n] = entropy[n];
        dent[n] = (fp - fm) / (2.0 * h);
    }
    free(lp);
    free(en);
    return 0;
}

/* ---------------------------------------------------------------- validation */

static int config_ok(const fg_loss_config *cfg, const fg_batch *bt, int64_t V) {
    if (!cfg || !bt || V <= 0) return 0;
    if (bt->batch <= 0 || bt->seq_len <= 0) return 0;
    if (!bt->token_ids || !bt->mask || !bt->advantages) return 0;
    if (!(cfg->temperature > 0) || !isfinite(cfg->temperature)) return 0;
    if ((int)cfg->loss_type < 0 || cfg->loss_type >= FG_LOSS_TYPE_COUNT) return 0;
    if ((int)cfg->importance_sampling_level < 0 ||
        cfg->importance_sampling_level >= FG_LEVEL_COUNT)
        return 0;
    if (cfg->beta != 0.0 && !bt->ref_logp) return 0;
    const int64_t N = bt->batch * bt->seq_len;
    for (int64_t n = 0; n < N; n++) {
        if (tok_masked(bt, n)) continue;
        if (bt->token_ids[n] < 0 || bt->token_ids[n] >= V) return 0;
    }
    return 1;
}

/* ------------------------------------------------------- per-token forward */

/* logp and entropy of one row of logits (before the temperature). */
static void row_forward(const double *logits_row, int64_t V, double temperature, int64_t tok,
                        double *logp, double *entropy, double *lse_out) {
    double mx = -INFINITY;
    for (int64_t v = 0; v < V; v++) {
        const double z = logits_row[v] / temperature;
        if (z > mx) mx = z;
    }
    double s = 0.0;
    for (int64_t v = 0; v < V; v++) s += exp(logits_row[v] / temperature - mx);
    const double lse = mx + log(s);
    double pz = 0.0;
    for (int64_t v = 0; v < V; v++) {
        const double z = logits_row[v] / temperature;
        pz += exp(z - lse) * z;
    }
    *logp = logits_row[tok] / temperature - lse;
    *entropy = lse - pz;
    *lse_out = lse;
}

/* Forward over all tokens: logp, entropy, lse (masked: 0). */
static void all_forward(const fg_loss_config *cfg, const fg_batch *bt, const double *logits,
                        int64_t V, double *logp, double *entropy, double *lse) {
    const int64_t N = bt->batch * bt->seq_len;
    for (int64_t n = 0; n < N; n++) {
        logp[n] = entropy[n] = lse[n] = 0.0;
        if (tok_masked(bt, n)) continue;
        row_forward(logits + n * V, V, cfg->temperature, bt->token_ids[n], &logp[n], &entropy[n],
                    &lse[n]);
    }
}

static double *linear_logits(const double *hidden, const double *weight, const double *bias,
                             int64_t N, int64_t H, int64_t V) {
    double *lg = malloc((size_t)N * (size_t)V * sizeof(double));
    if (!lg) return NULL;
    for (int64_t n = 0; n < N; n++)
        for (int64_t v = 0; v < V; v++) {
            double s = bias ? bias[v] : 0.0;
            for (int64_t h = 0; h < H; h++) s += hidden[n * H + h] * weight[v * H + h];
            lg[n * V + v] = s;
        }
    return lg;
}

/* ---------------------------------------------------------------- backward */

/* d loss / d logits [N, V] from each token's d loss / d logp (g) and
 * d loss / d entropy (e), through the softmax at this temperature. */
static void chain_logits(const fg_batch *bt, const double *logits, int64_t V, double temperature,
                         const double *lse, const double *entropy, const double *g,
                         const double *e, double *grad_logits) {
    const int64_t N = bt->batch * bt->seq_len;
    for (int64_t n = 0; n < N; n++) {
        if (tok_masked(bt, n)) continue;
        const double H = entropy[n];
        const int64_t tok = bt->token_ids[n];
        for (int64_t v = 0; v < V; v++) {
            const double logpv = logits[n * V + v] / temperature - lse[n];
            const double p = exp(logpv);
            const double dz = g[n] * ((v == tok ? 1.0 : 0.0) - p) - e[n] * p * (logpv + H);
            grad_logits[n * V + v] = dz / temperature;
        }
    }
}

/* grad_hidden, grad_weight, grad_bias (when bias) from d loss / d logits. */
static int chain_linear(const fg_batch *batch, const double *hidden, const double *weight,
                        const double *bias, int64_t H, int64_t V, fg_oracle_result *out) {
    const int64_t N = batch->batch * batch->seq_len;
    out->grad_hidden = calloc((size_t)N * (size_t)H, sizeof(double));
    out->grad_weight = calloc((size_t)V * (size_t)H, sizeof(double));
    if (bias) out->grad_bias = calloc((size_t)V, sizeof(double));
    if (!out->grad_hidden || !out->grad_weight || (bias && !out->grad_bias)) return -1;
    const double *gl = out->grad_logits;
    for (int64_t n = 0; n < N; n++) {
        if (batch->mask[n] == 0) continue;
        for (int64_t v = 0; v < V; v++) {
            const double d = gl[n * V + v];
            for (int64_t h = 0; h < H; h++) {
                out->grad_hidden[n * H + h] += d * weight[v * H + h];
                out->grad_weight[v * H + h] += d * hidden[n * H + h];
            }
            if (bias) out->grad_bias[v] += d;
        }
    }
    return 0;
}

static int logits_core(const fg_loss_config *cfg, const fg_batch *bt, const double *logits,
                       int64_t V, fg_oracle_result *out) {
    const int64_t N = bt->batch * bt->seq_len;
    memset(out, 0, sizeof(*out));
    out->logp = calloc((size_t)N, sizeof(double));
    out->entropy = calloc((size_t)N, sizeof(double));
    out->dlogp = calloc((size_t)N, sizeof(double));
    out->dentropy = calloc((size_t)N, sizeof(double));
    out->grad_logits = calloc((size_t)N * (size_t)V, sizeof(double));
    double *lse = calloc((size_t)N, sizeof(double));
    if (!out->logp || !out->entropy || !out->dlogp || !out->dentropy || !out->grad_logits ||
        !lse) {
        free(lse);
        fg_oracle_result_free(out);
        return -1;
    }
    all_forward(cfg, bt, logits, V, out->logp, out->entropy, lse);
    out->loss = fg_oracle_loss_from_logp(cfg, bt, out->logp, out->logp, out->entropy,
                                         &out->metrics);
    if (fd_token_grads(cfg, bt, out->logp, out->entropy, out->dlogp, out->dentropy) != 0) {
        free(lse);
        fg_oracle_result_free(out);
        return -1;
    }
    chain_logits(bt, logits, V, cfg->temperature, lse, out->entropy, out->dlogp, out->dentropy,
                 out->grad_logits);
    free(lse);
    return 0;
}

int fg_oracle_logits(const fg_loss_config *cfg, const fg_batch *batch, const double *logits,
                     int64_t V, fg_oracle_result *out) {
    if (!out) return -1;
    memset(out, 0, sizeof(*out));
    if (!logits || !config_ok(cfg, batch, V)) return -1;
    return logits_core(cfg, batch, logits, V, out);
}

int fg_oracle_linear(const fg_loss_config *cfg, const fg_batch *batch, const double *hidden,
                     const double *weight, const double *bias, int64_t H, int64_t V,
                     fg_oracle_result *out) {
    if (!out) return -1;
    memset(out, 0, sizeof(*out));
    if (!hidden || !weight || H <= 0 || !config_ok(cfg, batch, V)) return -1;
    const int64_t N = batch->batch * batch->seq_len;
    double *lg = linear_logits(hidden, weight, bias, N, H, V);
    if (!lg) return -1;
    if (logits_core(cfg, batch, lg, V, out) != 0) {
        free(lg);
        return -1;
    }
    free(lg);
    if (chain_linear(batch, hidden, weight, bias, H, V, out) != 0) {
        fg_oracle_result_free(out);
        return -1;
    }
    return 0;
}

int fg_oracle_linear_head(const fg_batch *batch, const double *hidden, const double *weight,
                          const double *bias, int64_t H, int64_t V, double temperature,
                          const double *dlogp, const double *dentropy, fg_oracle_result *out) {
    if (!out) return -1;
    memset(out, 0, sizeof(*out));
    if (!batch || !hidden || !weight || H <= 0 || V <= 0 || !(temperature > 0) ||
        batch->batch <= 0 || batch->seq_len <= 0 || !batch->token_ids || !batch->mask)
        return -1;
    const int64_t N = batch->batch * batch->seq_len;
    for (int64_t n = 0; n < N; n++)
        if (!tok_masked(batch, n) && (batch->token_ids[n] < 0 || batch->token_ids[n] >= V))
            return -1;
    fg_loss_config cfg; /* all_forward reads the temperature only */
    memset(&cfg, 0, sizeof cfg);
    cfg.temperature = temperature;
    double *lg = linear_logits(hidden, weight, bias, N, H, V);
    double *lse = calloc((size_t)N, sizeof(double));
    out->logp = calloc((size_t)N, sizeof(double));
    out->entropy = calloc((size_t)N, sizeof(double));
    out->dlogp = calloc((size_t)N, sizeof(double));
    out->dentropy = calloc((size_t)N, sizeof(double));
    int rc = -1;
    if (lg && lse && out->logp && out->entropy && out->dlogp && out->dentropy) {
        all_forward(&cfg, batch, lg, V, out->logp, out->entropy, lse);
        rc = 0;
        if (dlogp) {
            for (int64_t n = 0; n < N; n++) {
                out->dlogp[n] = tok_masked(batch, n) ? 0.0 : dlogp[n];
                out->dentropy[n] = tok_masked(batch, n) || !dentropy ? 0.0 : dentropy[n];
            }
            out->grad_logits = calloc((size_t)N * (size_t)V, sizeof(double));
            rc = out->grad_logits ? 0 : -1;
            if (rc == 0) {
                chain_logits(batch, lg, V, temperature, lse, out->entropy, out->dlogp,
                             out->dentropy, out->grad_logits);
                rc = chain_linear(batch, hidden, weight, bias, H, V, out);
            }
        }
    }
    free(lg);
    free(lse);
    if (rc != 0) fg_oracle_result_free(out);
    return rc;
}

static double linear_loss_impl(const fg_loss_config *cfg, const fg_batch *batch,
                               const double *hidden, const double *weight, const double *bias,
                               int64_t H, int64_t V, const double *logp_detached) {
    if (!hidden || !weight || H <= 0 || !config_ok(cfg, batch, V)) return NAN;
    const int64_t N = batch->batch * batch->seq_len;
    double *lg = linear_logits(hidden, weight, bias, N, H, V);
    double *logp = calloc((size_t)N, sizeof(double));
    double *ent = calloc((size_t)N, sizeof(double));
    double *lse = calloc((size_t)N, sizeof(double));
    double loss = NAN;
    if (lg && logp && ent && lse) {
        all_forward(cfg, batch, lg, V, logp, ent, lse);
        loss = fg_oracle_loss_from_logp(cfg, batch, logp, logp_detached ? logp_detached : logp,
                                        ent, NULL);
    }
    free(lg);
    free(logp);
    free(ent);
    free(lse);
    return loss;
}

double fg_oracle_linear_loss(const fg_loss_config *cfg, const fg_batch *batch,
                             const double *hidden, const double *weight, const double *bias,
                             int64_t H, int64_t V) {
    return linear_loss_impl(cfg, batch, hidden, weight, bias, H, V, NULL);
}

double fg_oracle_linear_loss_sg(const fg_loss_config *cfg, const fg_batch *batch,
                                const double *hidden, const double *weight, const double *bias,
                                int64_t H, int64_t V, const double *logp_detached) {
    return linear_loss_impl(cfg, batch, hidden, weight, bias, H, V, logp_detached);
}

void fg_oracle_result_free(fg_oracle_result *r) {
    if (!r) return;
    free(r->logp);
    free(r->entropy);
    free(r->dlogp);
    free(r->dentropy);
    free(r->grad_logits);
    free(r->grad_hidden);
    free(r->grad_weight);
    free(r->grad_bias);
    memset(r, 0, sizeof(*r));
}
