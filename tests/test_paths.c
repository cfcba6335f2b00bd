/*
 * test_paths: every path of the library against the float64 oracle.
 *
 * Paths: fg_linear_grpo FG_IMPL_MATERIALIZED, fg_linear_grpo FG_IMPL_FUSED
 * (with a memory budget small enough for several chunks), fg_logits_grpo
 * (logits computed here in double, stored as f32 / bf16; grad_logits in f32 or
 * bf16, sometimes in place), and for bf16 the plain framework baseline
 * (materialized with round_logits_to_input_dtype = 1).
 * dtypes f32 and bf16 (bf16 inputs are rounded and stored as uint16 bits; the
 * oracle runs on the rounded values). Every loss type x both levels x option
 * sets rotating bias, old_logp / on-policy, ref_logp with beta != 0 (with and
 * without the bias-corrected KL), delta, is_ratio [B, T] and [B],
 * entropy_coef != 0, temperature != 1, epsilon_high != epsilon_low, explicit
 * max_completion_length / num_items_in_batch, sapo temperatures, padded row
 * strides (ld > cols, padding NaN on inputs and a sentinel on outputs).
 * Shapes are odd: V prime, H not a multiple of 16, ragged masks with an all
 * masked sequence and a hole, masked token ids out of range and hostile values
 * at masked positions of old/ref/is_ratio, plus a single-token batch.
 *
 * Error measures:
 *  - loss: |a - b| / max(|b|, s), where s = the loss's own aggregation applied
 *    to |L_t| (plus |c| * mean entropy), i.e. the mean absolute per-token
 *    contribution (fg_oracle_loss_scale). A loss can cancel to ~0, and every
 *    path's rounding error is relative to the terms, not to their sum.
 *  - logp, entropy: max over unmasked tokens of |a - b| / max(|b|, 1).
 *  - kl and entropy metrics: |a - b| / max(|b|, 1), like logp (their error
 *    follows logp's); clip fractions may differ by one token (a ratio within
 *    rounding of a bound).
 *  - gradients: ||a - b||_2 / ||b||_2.
 * Masked rows of grad_hidden / grad_logits and masked logp / entropy must be
 * exactly 0.
 * Every error goes through TOL_CHECK under "paths <dtype> <path> <quantity>":
 * one tolerance per path, dtype and quantity (TOL below, with the worst error
 * measured for each), printed at the end next to the worst error seen.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "test_util.h"

enum { P_MAT, P_FUSED, P_LOGITS, P_BASE, P_COUNT };
static const char *PATH_NAME[P_COUNT] = {"materialized", "fused", "logits", "bf16-baseline"};
enum { Q_LOSS, Q_LOGP, Q_ENT, Q_METRIC, Q_CLIP, Q_GH, Q_GW, Q_GB, Q_GL, Q_GL16, Q_COUNT };
static const char *Q_NAME[Q_COUNT] = {"loss",          "logp",        "entropy",
                                      "kl/ent metric", "clip (tokens)", "grad_hidden",
                                      "grad_weight",   "grad_bias",   "grad_logits f32",
                                      "grad_logits bf16"};

/* Tolerances [path][dtype][quantity] (0 where a path has no such output;
 * clip is in tokens and must match exactly). Each is the smallest round
 * number >= 4x the worst error measured for it on either CPU kind, listed
 * above it in quantity order (loss logp entropy metric clip grad_hidden
 * grad_weight grad_bias grad_logits-f32 grad_logits-bf16): "Zen 5" (AVX-512
 * BF16: oneDNN multiplies bf16 natively, so dlogits are rounded to bf16 for
 * the gradient GEMMs: bf16 gradients ~3e-3) and "AVX2" (qemu -cpu Haswell,
 * and natively with DNNL_MAX_CPU_ISA=AVX2, which gives the same bits: the
 * bf16 weight is widened to f32 tiles and dlogits stay f32, so bf16
 * gradients are as close as f32 ones). A bf16 grad_logits output is rounded
 * to bf16 (2^-9 relative) on both. The bf16 gradient columns below are
 * Zen 5's; where the GEMMs run in f32, TOL_BF16_F32_GEMM applies instead.
 * vespo has the worst loss and f32 gradient errors:
 * its gamma weight exp(λ + k log w − λ w) multiplies a sequence's summed
 * log-prob error by |k − λ w|. Worst loss, Zen 5 / AVX2: f32 mat/fused
 * 3.3e-6 / 1.5e-6, logits 4.9e-6 / 4.9e-6; bf16 1.2e-6 / 1.4e-6, logits
 * 1.7e-6; f32 gradients 3.3e-6 / 2.9e-6, grad_logits 3.6e-6. */
static const double TOL[P_BASE][2][Q_COUNT] = {
    [P_MAT] = {
        /* f32: worst Zen 5  1.1e-06 5.0e-07 1.4e-06 7.9e-07 0.0e+00 1.7e-06 1.7e-06 1.7e-06 - - */
        /*      worst AVX2   1.1e-06 8.3e-07 2.4e-06 7.9e-07 0.0e+00 2.3e-06 2.2e-06 2.2e-06 - - */
        [0] = {1e-5, 4e-6, 1e-5, 4e-6, 0, 2e-5, 2e-5, 2e-5, 0, 0},
        /* bf16: worst Zen 5  1.2e-06 5.5e-07 8.6e-07 7.8e-07 0.0e+00 3.0e-03 2.6e-03 2.3e-03 - - */
        /*       worst AVX2   1.2e-06 5.5e-07 1.2e-06 7.8e-07 0.0e+00 1.6e-06 1.4e-06 1.4e-06 - - */
        [1] = {1e-5, 3e-6, 5e-6, 4e-6, 0, 1.5e-2, 1.5e-2, 1e-2, 0, 0},
    },
    [P_FUSED] = {
        /* f32: worst Zen 5  1.1e-06 5.0e-07 1.4e-06 7.9e-07 0.0e+00 1.7e-06 1.7e-06 1.7e-06 - - */
        /*      worst AVX2   1.1e-06 8.3e-07 2.4e-06 7.9e-07 0.0e+00 2.4e-06 2.3e-06 2.3e-06 - - */
        [0] = {1e-5, 4e-6, 1e-5, 4e-6, 0, 2e-5, 2e-5, 2e-5, 0, 0},
        /* bf16: worst Zen 5  1.2e-06 5.5e-07 8.6e-07 7.8e-07 0.0e+00 3.0e-03 2.6e-03 2.3e-03 - - */
        /*       worst AVX2   1.2e-06 5.5e-07 9.7e-07 7.8e-07 0.0e+00 1.6e-06 1.4e-06 1.4e-06 - - */
        [1] = {1e-5, 3e-6, 4e-6, 4e-6, 0, 1.5e-2, 1.5e-2, 1e-2, 0, 0},
    },
    [P_LOGITS] = {
        /* f32: worst Zen 5  1.2e-06 1.6e-07 5.4e-07 8.2e-07 0.0e+00 - - - 1.6e-06 - */
        /*      worst AVX2   1.2e-06 1.6e-07 5.4e-07 8.2e-07 0.0e+00 - - - 1.6e-06 - */
        [0] = {2e-5, 8e-7, 3e-6, 4e-6, 0, 0, 0, 0, 2e-5, 0},
        /* bf16: worst Zen 5  4.1e-07 2.0e-07 5.0e-07 3.3e-07 0.0e+00 - - - 5.7e-07 2.4e-03 */
        /*       worst AVX2   4.1e-07 2.0e-07 5.0e-07 3.3e-07 0.0e+00 - - - 5.7e-07 2.4e-03 */
        [1] = {1e-5, 8e-7, 3e-6, 1.5e-6, 0, 0, 0, 0, 1e-5, 1e-2},
    },
};

static double worst[P_COUNT][2][Q_COUNT];
static char worst_tag[P_COUNT][2][Q_COUNT][200];
/* sums over configs for the bf16 fused-vs-baseline comparison */
static double sum_err[P_COUNT][Q_COUNT];
static double max_err_bf16[P_COUNT][Q_COUNT];

typedef struct popt {
    int bias, old, beta, bias_kl, delta, is_mode, ent, temp, eh, mcl_nib, sapo_t, pad;
    int opm;  /* off-policy mask: 1 threshold -0.01 (on-policy: every A < 0 sequence
                 dropped), 2 threshold 0 with the sampler's log-probs             */
    int teq;  /* top_entropy_quantile: 1 -> 0.6, 2 -> 0.25                       */
    int vk;   /* vespo's k and lambda: 1 -> non-default values                   */
} popt;

static const popt SETS[] = {
    /* bias old beta bkl delta is ent temp eh mcl sapo pad opm teq vk */
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, /* plain on-policy                              */
    {1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0}, /* bias, off-policy, KL, T=0.7, padded strides  */
    {0, 1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0}, /* delta, is [B,T], entropy 0.3, eps_high 0.28  */
    {1, 0, 1, 1, 0, 2, 0, 1, 0, 1, 1, 1, 0, 0, 0}, /* on-policy, bias-corrected KL, is [B], mcl/nib */
    {1, 1, 1, 1, 1, 1, 2, 2, 1, 1, 0, 0, 0, 0, 0}, /* everything off-policy, T=1.3, entropy -0.1    */
    {0, 0, 1, 0, 1, 2, 1, 1, 1, 0, 1, 1, 0, 0, 0}, /* on-policy, KL, delta, is [B], entropy, pad     */
    /* TRL 1.16's options: the off-policy mask, the entropy quantile, vespo's k/λ */
    {1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 1, 2, 1, 1}, /* sampler's logp, q 0.6, entropy bonus  */
    {0, 0, 1, 1, 0, 2, 2, 1, 1, 0, 0, 0, 1, 2, 0}, /* on-policy drop, q 0.25, bkl, is [B]   */
};
#define NSETS ((int)(sizeof SETS / sizeof SETS[0]))

typedef struct shape {
    int64_t B, T, H, V;
} shape;
/* H = 1024: weight rows 4 KiB apart (the bf16 tile path's tiles restrided,
 * gemm_onednn.c, tile_ld; f32 at these sizes reads W in place: its
 * restrided tiles need half a chunk's logits to hold two K pieces, which
 * test_gemm_stride checks) */
static const shape SHAPES[] = {{3, 7, 37, 1009}, {1, 1, 37, 503}, {4, 5, 61, 503}, {2, 9, 1024, 503}};
#define NSHAPES ((int)(sizeof SHAPES / sizeof SHAPES[0]))

static fg_context *ctx_mat, *ctx_fused;

/* ---------------------------------------------------------------- outputs */

#define OUT_PAD_VALUE 7777.0f

typedef struct outbuf {
    int64_t N, H, V;
    float *logp, *ent, *gh, *gw, *gb;
    void *gl;
    int64_t ldgh, ldgw, ldgl;
    fg_dtype gl_dt;
    int logits;            /* which of the two below the call fills */
    fg_linear_outputs lin; /* fg_linear_grpo */
    fg_logits_outputs lgo; /* fg_logits_grpo */
} outbuf;

static double out_loss(const outbuf *o) { return o->logits ? o->lgo.loss : o->lin.loss; }
static const fg_metrics *out_metrics(const outbuf *o) {
    return o->logits ? &o->lgo.metrics : &o->lin.metrics;
}

static void fill_f32_matrix(float *p, int64_t rows, int64_t cols, int64_t ld) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < ld; c++) p[r * ld + c] = c < cols ? NAN : OUT_PAD_VALUE;
}

static int pad_untouched_f32(const float *p, int64_t rows, int64_t cols, int64_t ld) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = cols; c < ld; c++)
            if (p[r * ld + c] != OUT_PAD_VALUE) return 0;
    return 1;
}

/* Linear outputs (logits == NULL) or logits outputs. */
static void outbuf_init(outbuf *o, int64_t N, int64_t H, int64_t V, int bias, int pad, int logits,
                        fg_dtype gl_dt, void *alias, int64_t alias_ld) {
    memset(o, 0, sizeof(*o));
    o->N = N;
    o->H = H;
    o->V = V;
    o->logp = tu_xmalloc(sizeof(float) * N);
    o->ent = tu_xmalloc(sizeof(float) * N);
    tu_fill_nan(o->logp, (size_t)N);
    tu_fill_nan(o->ent, (size_t)N);
    o->logits = logits;
    o->lin.logp = o->lgo.logp = o->logp;
    o->lin.entropy = o->lgo.entropy = o->ent;
    if (!logits) {
        o->ldgh = H + (pad ? 2 : 0);
        o->ldgw = H + (pad ? 1 : 0);
        o->gh = tu_xmalloc(sizeof(float) * N * o->ldgh);
        o->gw = tu_xmalloc(sizeof(float) * V * o->ldgw);
        fill_f32_matrix(o->gh, N, H, o->ldgh);
        fill_f32_matrix(o->gw, V, H, o->ldgw);
        o->lin.grad_hidden = (fg_matrix){o->gh, FG_DTYPE_F32, N, H, o->ldgh};
        o->lin.grad_weight = (fg_matrix){o->gw, FG_DTYPE_F32, V, H, o->ldgw};
        if (bias) {
            o->gb = tu_xmalloc(sizeof(float) * V);
            tu_fill_nan(o->gb, (size_t)V);
            o->lin.grad_bias = fg_vector_make(o->gb, FG_DTYPE_F32, V);
        }
    } else if (alias) {
        o->gl_dt = gl_dt;
        o->ldgl = alias_ld;
        o->lgo.grad_logits = (fg_matrix){alias, gl_dt, N, V, alias_ld};
    } else {
        o->gl_dt = gl_dt;
        o->ldgl = V + (pad ? 4 : 0);
        o->gl = tu_xmalloc(tu_dtype_size(gl_dt) * N * o->ldgl);
        for (int64_t r = 0; r < N; r++)
            for (int64_t c = 0; c < o->ldgl; c++) {
                const float x = c < V ? NAN : OUT_PAD_VALUE;
                if (gl_dt == FG_DTYPE_BF16)
                    ((uint16_t *)o->gl)[r * o->ldgl + c] = fg_f32_to_bf16(x);
                else
                    ((float *)o->gl)[r * o->ldgl + c] = x;
            }
        o->lgo.grad_logits = (fg_matrix){o->gl, gl_dt, N, V, o->ldgl};
    }
}

static void outbuf_free(outbuf *o) {
    free(o->logp);
    free(o->ent);
    free(o->gh);
    free(o->gw);
    free(o->gb);
    free(o->gl);
}

/* ---------------------------------------------------------------- compare */

static void record(const char *tag, int path, fg_dtype dt, int q, double e) {
    const int d = dt == FG_DTYPE_BF16;
    if (isnan(e)) e = INFINITY;
    if (e > worst[path][d][q]) {
        worst[path][d][q] = e;
        snprintf(worst_tag[path][d][q], sizeof worst_tag[path][d][q], "%s", tag);
    }
    if (d) {
        sum_err[path][q] += e;
        if (e > max_err_bf16[path][q]) max_err_bf16[path][q] = e;
    }
}

/* bf16 gradients where the GEMMs run in f32 (tu_bf16_gemms_native() == 0):
 * grad_hidden, grad_weight, grad_bias of the materialized and fused paths.
 * worst AVX2: mat 1.6e-06 1.4e-06 1.4e-06, fused 1.6e-06 1.4e-06 1.4e-06 */
static const double TOL_BF16_F32_GEMM[3] = {8e-6, 6e-6, 6e-6};

static void check_q(const char *tag, int path, fg_dtype dt, int q, double e) {
    record(tag, path, dt, q, e);
    if (path == P_BASE) return; /* the baseline is only compared, not held to tolerances */
    const int d = dt == FG_DTYPE_BF16;
    const int f32_gemm_grad = d && (q == Q_GH || q == Q_GW || q == Q_GB) && !tu_bf16_gemms_native();
    char name[80];
    snprintf(name, sizeof name, "paths %s %s %s", d ? (f32_gemm_grad ? "bf16(f32 GEMMs)" : "bf16") : "f32",
             PATH_NAME[path], Q_NAME[q]);
    TOL_CHECK(name, e, f32_gemm_grad ? TOL_BF16_F32_GEMM[q - Q_GH] : TOL[path][d][q], "%s", tag);
}

static void compare(const char *tag, int path, fg_dtype dt, const fg_loss_config *cfg,
                    const tu_batch *tb, const fg_oracle_result *ref, const outbuf *o) {
    const int64_t N = o->N, H = o->H, V = o->V;
    const fg_batch *batch = &tb->view;
    const double M = (double)tu_batch_unmasked(tb);
    const double scale = fg_oracle_loss_scale(cfg, batch, ref->logp, ref->entropy);
    check_q(tag, path, dt, Q_LOSS, tu_rel_err(out_loss(o), ref->loss, scale));
    check_q(tag, path, dt, Q_LOGP, tu_max_rel(o->logp, ref->logp, N, tb->mask, 1.0));
    check_q(tag, path, dt, Q_ENT, tu_max_rel(o->ent, ref->entropy, N, tb->mask, 1.0));
    const fg_metrics *a = out_metrics(o), *b = &ref->metrics;
    double em = tu_rel_err(a->kl, b->kl, 1.0);
    const double ee = tu_rel_err(a->entropy, b->entropy, 1.0);
    if (ee > em) em = ee;
    const double ep = tu_rel_err(a->vespo_phi_seq_mean, b->vespo_phi_seq_mean, 1.0);
    if (ep > em) em = ep;
    check_q(tag, path, dt, Q_METRIC, em);
    check_q(tag, path, dt, Q_LOSS, tu_rel_err(a->policy_loss, b->policy_loss, scale));
    double ec = 0.0;
    const double dc[4] = {a->clip_ratio_low - b->clip_ratio_low,
                          a->clip_ratio_high - b->clip_ratio_high,
                          a->clip_ratio_region - b->clip_ratio_region,
                          a->cispo_clip_ratio - b->cispo_clip_ratio};
    for (int i = 0; i < 4; i++) {
        const double tokens = isnan(dc[i]) ? INFINITY : fabs(dc[i]) * (M > 1 ? M : 1);
        if (tokens > ec) ec = tokens;
    }
    /* per-sequence fractions (NaN when every sequence is masked): in tokens of a sequence */
    const double ds[2] = {a->clip_ratio_low_min - b->clip_ratio_low_min,
                          a->clip_ratio_high_max - b->clip_ratio_high_max};
    for (int i = 0; i < 2; i++) {
        const double av = i ? a->clip_ratio_high_max : a->clip_ratio_low_min;
        const double bv = i ? b->clip_ratio_high_max : b->clip_ratio_low_min;
        const double tokens = isnan(av) && isnan(bv) ? 0.0
                              : isnan(ds[i])         ? INFINITY
                                                     : fabs(ds[i]) * (double)tb->T;
        if (tokens > ec) ec = tokens;
    }
    check_q(tag, path, dt, Q_CLIP, ec);
    if (path != P_BASE) {
        if (cfg->beta == 0.0) CHECK(a->kl == 0.0, "%s kl metric %g with beta 0", tag, a->kl);
        if (cfg->loss_type != FG_LOSS_CISPO)
            CHECK(a->cispo_clip_ratio == 0.0, "%s cispo_clip_ratio %g for %s", tag,
                  a->cispo_clip_ratio, tu_loss_name(cfg->loss_type));
    }

    /* masked positions */
    int zero_ok = 1;
    for (int64_t n = 0; n < N; n++)
        if (!tb->mask[n]) zero_ok &= o->logp[n] == 0.0f && o->ent[n] == 0.0f;
    CHECK(zero_ok, "%s logp/entropy not exactly 0 at masked positions", tag);

    if (o->gh) {
        check_q(tag, path, dt, Q_GH, tu_rel_l2(o->gh, FG_DTYPE_F32, N, H, o->ldgh, ref->grad_hidden));
        check_q(tag, path, dt, Q_GW, tu_rel_l2(o->gw, FG_DTYPE_F32, V, H, o->ldgw, ref->grad_weight));
        if (o->gb) check_q(tag, path, dt, Q_GB, tu_rel_l2(o->gb, FG_DTYPE_F32, 1, V, V, ref->grad_bias));
        int z = 1;
        for (int64_t n = 0; n < N; n++)
            if (!tb->mask[n])
                for (int64_t h = 0; h < H; h++) z &= o->gh[n * o->ldgh + h] == 0.0f;
        CHECK(z, "%s grad_hidden masked rows not exactly 0", tag);
        CHECK(pad_untouched_f32(o->gh, N, H, o->ldgh) && pad_untouched_f32(o->gw, V, H, o->ldgw),
              "%s gradient row padding (ld > cols) was written", tag);
    }
    if (o->logits && o->lgo.grad_logits.data) {
        const fg_matrix *g = &o->lgo.grad_logits;
        check_q(tag, path, dt, g->dtype == FG_DTYPE_BF16 ? Q_GL16 : Q_GL,
                tu_rel_l2(g->data, g->dtype, N, V, g->ld, ref->grad_logits));
        int z = 1;
        for (int64_t n = 0; n < N; n++)
            if (!tb->mask[n])
                for (int64_t v = 0; v < V; v++) z &= tu_load(g->data, g->dtype, n * g->ld + v) == 0.0;
        CHECK(z, "%s grad_logits masked rows not exactly 0", tag);
        if (o->gl) {
            int p = 1;
            for (int64_t n = 0; n < N; n++)
                for (int64_t c = V; c < o->ldgl; c++)
                    p &= tu_load(o->gl, o->gl_dt, n * o->ldgl + c) == (double)OUT_PAD_VALUE ||
                         (o->gl_dt == FG_DTYPE_BF16 &&
                          tu_load(o->gl, o->gl_dt, n * o->ldgl + c) ==
                              tu_round_to(FG_DTYPE_BF16, OUT_PAD_VALUE));
            CHECK(p, "%s grad_logits row padding was written", tag);
        }
    }
}

/* ------------------------------------------------------------ fused runner */

static fg_status fused_call(const fg_loss_config *cfg, const fg_linear_inputs *in,
                            const fg_batch *batch, outbuf *o, size_t budget,
                            fg_memory_stats *st) {
    const fg_linear_options lo = {FG_IMPL_FUSED, 0, 0.0};
    fg_exec ex;
    fg_exec_init(&ex);
    ex.memory_budget = budget;
    fg_release_workspace(ctx_fused);
    fg_reset_peak_memory(ctx_fused);
    fg_status s = fg_linear_grpo(ctx_fused, &lo, cfg, in, batch, &o->lin, &ex);
    fg_get_memory_stats(ctx_fused, st);
    return s;
}

/* The budget for a fused call of these arguments from the library's planner
 * (fg_linear_grpo_plan): its smallest budget (one row a chunk) when want_rows
 * is 1, else the smallest budget (to 1/16) that gives chunks of >= want_rows
 * rows. Asked per call: GEMM scratch differs by CPU, dtype and options. */
static size_t planned_budget(const fg_loss_config *cfg, const fg_linear_inputs *in,
                             const fg_batch *batch, const fg_linear_outputs *out,
                             int64_t want_rows) {
    const fg_linear_options lo = {FG_IMPL_FUSED, 0, 0.0};
    fg_linear_plan_info info;
    fg_exec ex;
    fg_exec_init(&ex);
    ex.memory_budget = (size_t)1 << 40;
    fg_status s = fg_linear_grpo_plan(ctx_fused, &lo, cfg, in, batch, out, &ex, &info);
    CHECK(s == FG_OK && info.min_budget_bytes > 0, "plan: %s (%s)", fg_status_name(s),
          fg_last_error(ctx_fused));
    size_t b = info.min_budget_bytes;
    for (int it = 0; it < 200 && want_rows > 1; it++) {
        ex.memory_budget = b;
        s = fg_linear_grpo_plan(ctx_fused, &lo, cfg, in, batch, out, &ex, &info);
        CHECK(s == FG_OK, "plan at %zu: %s (%s)", b, fg_status_name(s), fg_last_error(ctx_fused));
        if (s != FG_OK || info.chunk_rows >= want_rows) break;
        b += b / 16;
    }
    return b;
}

/* ---------------------------------------------------------------- one case */

static void run_case(int si, int lt, int lvl, int set, fg_dtype dt, int case_idx) {
    const shape sh = SHAPES[si];
    const popt *op = &SETS[set];
    const int64_t B = sh.B, T = sh.T, H = sh.H, V = sh.V, N = B * T;
    const int bf = dt == FG_DTYPE_BF16;
    char tag[200];
    snprintf(tag, sizeof tag, "[%s/%s set %d shape %lldx%lldx%lldx%lld %s", tu_loss_name(lt),
             tu_level_name(lvl), set, (long long)B, (long long)T, (long long)H, (long long)V,
             bf ? "bf16" : "f32");

    /* same data for f32 and bf16 (the seed does not depend on dt) */
    const uint64_t seed = 7919u * (uint64_t)si + 131u * (uint64_t)lt + 17u * (uint64_t)lvl +
                          1000003u * (uint64_t)set;
    const tu_problem_opts po = {0, 0, 0, op->pad ? 3 : 0, op->pad ? 5 : 0, set + lt + lvl};
    tu_problem prob;
    tu_problem_make_opts(&prob, B, T, H, V, dt, op->bias, seed, &po);
    tu_batch *tb = &prob.tb;
    const int64_t ldl = V + (op->pad ? 7 : 0);

    /* logits in double from the stored (rounded) inputs, then stored */
    double *lg_r = tu_problem_logits(&prob);
    void *lg_s = tu_store_matrix(lg_r, N, V, ldl, dt); /* lg_r: now the stored values */

    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = (fg_loss_type)lt;
    cfg.importance_sampling_level = (fg_is_level)lvl;
    cfg.temperature = op->temp == 1 ? 0.7 : op->temp == 2 ? 1.3 : 1.0;

    /* old and ref are drawn around the current policy's log-probs */
    CHECK(tu_problem_fill_logp(&prob, cfg.temperature, 0.2, 0.3) == 0,
          "%s] oracle refused a valid batch", tag);
    tb->have_old = op->old;
    tb->have_ref = op->beta;
    tb->is_mode = op->is_mode;
    if (op->is_mode == 2) /* per-sequence is_ratio lives in [0, B) */
        for (int64_t b = 0; b < B; b++) tb->is_ratio[b] = (float)(0.5 + tu_uniform(&prob.rng));
    if (op->beta) cfg.beta = set == 3 ? 0.1 : 0.04;
    cfg.use_bias_correction_kl = op->bias_kl;
    if (op->delta) cfg.delta = 1.3;
    if (op->ent == 1) cfg.entropy_coef = 0.3;
    if (op->ent == 2) cfg.entropy_coef = -0.1;
    if (lt == FG_LOSS_CISPO) cfg.epsilon_high = op->eh ? 1.1 : -1.0; /* absolute cap */
    else if (op->eh) cfg.epsilon_high = 0.28;
    if (op->mcl_nib) {
        cfg.max_completion_length = T + 3;
        cfg.num_items_in_batch = 15.5;
    }
    if (op->sapo_t) {
        cfg.sapo_temperature_pos = 0.8;
        cfg.sapo_temperature_neg = 1.3;
    }
    if (op->opm) cfg.off_policy_mask_threshold = op->opm == 1 ? -0.01 : 0.0;
    tb->have_sampling = op->opm == 2;
    if (op->teq) cfg.top_entropy_quantile = op->teq == 1 ? 0.6 : 0.25;
    if (op->vk) {
        cfg.vespo_k_pos = 1.5;
        cfg.vespo_lambda_pos = 2.5;
        cfg.vespo_k_neg = 2.0;
        cfg.vespo_lambda_neg = 1.0;
    }
    const fg_batch *batch = tu_batch_view(tb);

    fg_oracle_result ref_lin, ref_log;
    if (fg_oracle_linear(&cfg, batch, prob.hidden, prob.weight, prob.bias, H, V, &ref_lin) != 0 ||
        fg_oracle_logits(&cfg, batch, lg_r, V, &ref_log) != 0) {
        CHECK(0, "%s] oracle failed", tag);
        goto out;
    }

    const fg_linear_inputs in = tu_problem_inputs(&prob);
    char t2[260];
    /* materialized */
    {
        outbuf o;
        outbuf_init(&o, N, H, V, op->bias, op->pad, 0, FG_DTYPE_F32, NULL, 0);
        const fg_linear_options lo = {FG_IMPL_MATERIALIZED, 0, 0.0};
        fg_status s = fg_linear_grpo(ctx_mat, &lo, &cfg, &in, batch, &o.lin, NULL);
        snprintf(t2, sizeof t2, "%s materialized]", tag);
        CHECK(s == FG_OK, "%s status %s: %s", t2, fg_status_name(s), fg_last_error(ctx_mat));
        if (s == FG_OK) compare(t2, P_MAT, dt, &cfg, tb, &ref_lin, &o);
        outbuf_free(&o);
    }
    /* fused, several chunks */
    {
        outbuf o;
        outbuf_init(&o, N, H, V, op->bias, op->pad, 0, FG_DTYPE_F32, NULL, 0);
        const size_t budget = planned_budget(&cfg, &in, batch, &o.lin, (case_idx & 1) ? 4 : 1);
        fg_linear_plan_info plan;
        const fg_linear_options flo = {FG_IMPL_FUSED, 0, 0.0};
        fg_exec ex;
        fg_exec_init(&ex);
        ex.memory_budget = budget;
        CHECK(fg_linear_grpo_plan(ctx_fused, &flo, &cfg, &in, batch, &o.lin, &ex, &plan) == FG_OK,
              "%s plan at %zu", tag, budget);
        if (!(case_idx & 1) && budget > 4096) {
            /* The planner's smallest budget is exact: a page less fails, with a
             * message naming every term. */
            outbuf o2;
            outbuf_init(&o2, N, H, V, op->bias, op->pad, 0, FG_DTYPE_F32, NULL, 0);
            fg_memory_stats st2;
            fg_status s2 = fused_call(&cfg, &in, batch, &o2, budget - 4096, &st2);
            CHECK(s2 == FG_ERR_BUDGET_TOO_SMALL && strstr(fg_last_error(ctx_fused), "GEMM scratch"),
                  "%s budget %zu (a page under the planned minimum): %s (%s)", tag, budget - 4096,
                  fg_status_name(s2), fg_last_error(ctx_fused));
            outbuf_free(&o2);
        }
        fg_memory_stats st;
        fg_status s = fused_call(&cfg, &in, batch, &o, budget, &st);
        snprintf(t2, sizeof t2, "%s fused budget %zu]", tag, budget);
        CHECK(s == FG_OK, "%s status %s: %s", t2, fg_status_name(s), fg_last_error(ctx_fused));
        if (s == FG_OK) {
            compare(t2, P_FUSED, dt, &cfg, tb, &ref_lin, &o);
            /* several chunks whenever the tokens do not fit in one */
            const int64_t M = tu_batch_unmasked(tb);
            if (N >= 8 && M > st.chunk_rows)
                CHECK(st.chunks > 1, "%s chunks %lld (chunk_rows %lld, %lld unmasked tokens)", t2,
                      (long long)st.chunks, (long long)st.chunk_rows, (long long)M);
            if (N >= 8) CHECK(st.chunk_rows < N, "%s budget %zu holds all %lld rows in one chunk",
                              t2, budget, (long long)N);
            CHECK(st.peak_bytes <= budget, "%s peak %zu > budget %zu", t2, st.peak_bytes, budget);
            CHECK(st.budget_bytes == budget, "%s stats budget %zu, the call's %zu", t2,
                  st.budget_bytes, budget);
            /* The planner told the truth: the counted peak and chunking are its own. */
            CHECK(st.peak_bytes == plan.working_bytes && st.chunk_rows == plan.chunk_rows,
                  "%s peak %zu / rows %lld, planned %zu / %lld", t2, st.peak_bytes,
                  (long long)st.chunk_rows, plan.working_bytes, (long long)plan.chunk_rows);
        }
        outbuf_free(&o);
    }
    /* logits path: grad_logits f32 / bf16, out of place or in place (a CPU
     * entry point: not on the reference backend) */
    if (!tu_on_reference()) {
        const int alias = case_idx % 3 == 2;
        const fg_dtype gdt = alias ? dt : (bf && (case_idx & 1)) ? FG_DTYPE_BF16 : FG_DTYPE_F32;
        void *lg_in = lg_s;
        void *copy = NULL;
        if (alias) {
            const size_t bytes = tu_dtype_size(dt) * (size_t)(N * ldl);
            copy = tu_xmalloc(bytes);
            memcpy(copy, lg_s, bytes);
            lg_in = copy;
        }
        outbuf o;
        outbuf_init(&o, N, H, V, 0, op->pad, 1, gdt, alias ? copy : NULL, ldl);
        const fg_matrix lm = {lg_in, dt, N, V, ldl};
        fg_status s = fg_logits_grpo(ctx_mat, &cfg, &lm, batch, &o.lgo, NULL);
        snprintf(t2, sizeof t2, "%s logits grad %s%s]", tag, gdt == FG_DTYPE_BF16 ? "bf16" : "f32",
                 alias ? " in place" : "");
        CHECK(s == FG_OK, "%s status %s: %s", t2, fg_status_name(s), fg_last_error(ctx_mat));
        if (s == FG_OK) compare(t2, P_LOGITS, dt, &cfg, tb, &ref_log, &o);
        outbuf_free(&o);
        free(copy);
    }
    /* the plain bf16 baseline: logits rounded to bf16 */
    if (bf) {
        outbuf o;
        outbuf_init(&o, N, H, V, op->bias, op->pad, 0, FG_DTYPE_F32, NULL, 0);
        const fg_linear_options lo = {FG_IMPL_MATERIALIZED, 1, 0.0};
        fg_status s = fg_linear_grpo(ctx_mat, &lo, &cfg, &in, batch, &o.lin, NULL);
        snprintf(t2, sizeof t2, "%s baseline]", tag);
        CHECK(s == FG_OK, "%s status %s: %s", t2, fg_status_name(s), fg_last_error(ctx_mat));
        if (s == FG_OK) compare(t2, P_BASE, dt, &cfg, tb, &ref_lin, &o);
        outbuf_free(&o);
    }
    fg_oracle_result_free(&ref_lin);
    fg_oracle_result_free(&ref_log);
out:
    tu_problem_free(&prob);
    free(lg_r);
    free(lg_s);
}

int main(void) {
    if (fg_context_create(NULL, &ctx_mat) != FG_OK || fg_context_create(NULL, &ctx_fused) != FG_OK) {
        CHECK(0, "%s", "context create failed");
        return tu_finish();
    }
    /* FG_TEST_QUICK=1 (set by scripts/qemu_test.sh, where each case runs ~200x
     * slower emulated): every path and dtype, every loss type, both levels,
     * every option set and every shape still run, in 32 cases instead of 352;
     * each (dtype, loss type) pair takes one level, one set and one shape
     * besides the first, rotating so that the pairs cover them all. */
    const char *quick_env = getenv("FG_TEST_QUICK");
    const int quick = quick_env && strcmp(quick_env, "0") != 0;
    int case_idx = 0;
    for (int dti = 0; dti < 2; dti++) {
        const fg_dtype dt = dti ? FG_DTYPE_BF16 : FG_DTYPE_F32;
        for (int lt = 0; lt < FG_LOSS_TYPE_COUNT; lt++) {
            if (quick) {
                const int lvl = (lt + dti) % FG_LEVEL_COUNT;
                run_case(0, lt, lvl, (lt + dti * 3) % NSETS, dt, case_idx++);
                run_case(1 + (lt + dti) % 3, lt, lvl, (lt + dti * 3 + 4) % NSETS, dt, case_idx++);
                continue;
            }
            for (int lvl = 0; lvl < FG_LEVEL_COUNT; lvl++) {
                for (int set = 0; set < NSETS; set++) run_case(0, lt, lvl, set, dt, case_idx++);
                run_case(1, lt, lvl, (lt + lvl) % NSETS, dt, case_idx++);
                run_case(2, lt, lvl, (2 * lt + lvl + 3) % NSETS, dt, case_idx++);
                run_case(3, lt, lvl, (lt + 2 * lvl + 1) % NSETS, dt, case_idx++);
            }
        }
    }
    if (quick)
        printf("FG_TEST_QUICK: %d of the %d cases\n", case_idx,
               2 * FG_LOSS_TYPE_COUNT * FG_LEVEL_COUNT * (NSETS + 3));

    /* The baseline is compared, not held to tolerances: its worst errors. */
    printf("\nbf16 baseline (logits rounded to bf16), worst errors vs the oracle:");
    for (int q = 0; q <= Q_GB; q++) printf(" %s %.2e", Q_NAME[q], worst[P_BASE][1][q]);
    printf("\n");

    if (getenv("FG_TEST_VERBOSE"))
        for (int d = 0; d < 2; d++)
            for (int p = 0; p < P_COUNT; p++)
                for (int q = 0; q < Q_COUNT; q++)
                    if (worst[p][d][q] > 0)
                        printf("worst %s %s %s %.3e at %s\n", d ? "bf16" : "f32", PATH_NAME[p],
                               Q_NAME[q], worst[p][d][q], worst_tag[p][d][q]);

    /* bf16: the fused path is at least as close to the oracle as the plain
     * baseline that rounds the logits to bf16 (summed over all configs). */
    printf("bf16 sums over configs (fused vs baseline): loss %.3e vs %.3e, logp %.3e vs %.3e, "
           "entropy %.3e vs %.3e, grad_hidden %.3e vs %.3e, grad_weight %.3e vs %.3e\n",
           sum_err[P_FUSED][Q_LOSS], sum_err[P_BASE][Q_LOSS], sum_err[P_FUSED][Q_LOGP],
           sum_err[P_BASE][Q_LOGP], sum_err[P_FUSED][Q_ENT], sum_err[P_BASE][Q_ENT],
           sum_err[P_FUSED][Q_GH], sum_err[P_BASE][Q_GH], sum_err[P_FUSED][Q_GW],
           sum_err[P_BASE][Q_GW]);
    CHECK(sum_err[P_FUSED][Q_LOSS] <= sum_err[P_BASE][Q_LOSS], "bf16 fused loss error %.3e > "
          "baseline %.3e", sum_err[P_FUSED][Q_LOSS], sum_err[P_BASE][Q_LOSS]);
    CHECK(sum_err[P_FUSED][Q_LOGP] <= sum_err[P_BASE][Q_LOGP] &&
              max_err_bf16[P_FUSED][Q_LOGP] <= max_err_bf16[P_BASE][Q_LOGP],
          "bf16 fused logp error sum %.3e max %.3e > baseline sum %.3e max %.3e",
          sum_err[P_FUSED][Q_LOGP], max_err_bf16[P_FUSED][Q_LOGP], sum_err[P_BASE][Q_LOGP],
          max_err_bf16[P_BASE][Q_LOGP]);
    CHECK(sum_err[P_FUSED][Q_ENT] <= sum_err[P_BASE][Q_ENT], "bf16 fused entropy error %.3e > "
          "baseline %.3e", sum_err[P_FUSED][Q_ENT], sum_err[P_BASE][Q_ENT]);
    for (int q = Q_GH; q <= Q_GB; q++)
        CHECK(sum_err[P_FUSED][q] <= 1.25 * sum_err[P_BASE][q],
              "bf16 fused %s error %.3e > 1.25 x baseline %.3e", Q_NAME[q], sum_err[P_FUSED][q],
              sum_err[P_BASE][q]);

    fg_context_destroy(ctx_mat);
    fg_context_destroy(ctx_fused);
    return tu_finish();
}
