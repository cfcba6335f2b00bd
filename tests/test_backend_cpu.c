/*
 * test_backend_cpu: the CPU backend's ops (src/backend_cpu.c: oneDNN, OpenMP)
 * against the seam's plain reference (src/backend_reference.c: loops in
 * double, the specification of each op), op by op, on one call in host
 * memory: f32 and bf16 inputs, H = 37, V = 1031 (a logits block and a
 * ragged one), a chunk of 150 rows starting at row 5 of the active list (a
 * whole logits block and a zero-padded one), a padded weight stride,
 * temperature 0.7, a bias.
 *
 *  1. logits, stats (each backend's statistics of the same logits, a target
 *     outside [0, V) flagged in row_check[0] by both), backward (the same
 *     statistics, g and e; dlogits and the bias sums), grads (grad_hidden's
 *     rows, grad_weight overwritten then added to), finish (float32 sums
 *     into a bf16 grad_weight and grad_bias, seeded or not; masked rows
 *     zeroed: elementwise, so bitwise equal), scan (a NaN's place; the
 *     largest magnitude and its row).
 *  2. The CPU backend's optional ops against its own seam ops: bitwise,
 *     stats_backward = stats, then g, e, then backward, and dhidden +
 *     put_grad_hidden = grads' GEMM 2; shard_stats of one shard, merged
 *     alone, = stats; filter, then grads (sparse) = the reference's grads
 *     of dlogits with the dropped entries zeroed.
 *  3. One seam, two walks: the device driver (src/linear_device.c, which
 *     asks nothing optional) over the CPU backend, in the chunks of the
 *     least budget its plan query gives three or fewer (several), against
 *     the float64 oracle and against the CPU driver's call: f32, a token-
 *     level loss with the KL and a bias (chunks walked once), and a
 *     sequence-level one (every log-prob first, then the gradient sweep).
 *
 * Tolerances: relative to the largest |value| of the reference, about 4x
 * the worst measured on AVX2 (2026-11-27): float32 roundings of sums over H
 * or V terms, the rows' maxima exact. A bf16 grad_hidden of float32 products
 * may round one bf16 ulp apart (2^-8; measured 0). With native bf16
 * products (an AVX-512 BF16 CPU) the backward reads dlogits rounded to bf16
 * on both sides, which may round one ulp apart: 8e-3 there (not measured on
 * the AVX2 machine the others were).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cpu.h"
#include "fg_oracle.h"
#include "linear_device.h"
#include "shard_stats.h"
#include "test_util.h"

enum { NTOK = 202, NACT = 160, R0 = 5, M = 150, H = 37, LDW = 40, V = 1031 };

static const float TEMPERATURE = 0.7f;

/* The largest |a - b| over the largest |b|, n floats (a, b of dtype dt). */
static double rel_max(const void *a, const void *b, fg_dtype dt, int64_t n)
{
    double d = 0.0, top = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double x = tu_load(a, dt, i), y = tu_load(b, dt, i);
        d = fmax(d, fabs(x - y));
        top = fmax(top, fabs(y));
    }
    return top > 0 ? d / top : d;
}

static void *zalloc(size_t n)
{
    void *p = tu_xmalloc_aligned(n ? n : 64);
    memset(p, 0, n ? n : 64);
    return p;
}

/* The loss's derivatives as stats_backward asks them (any function of the
 * token's index, log-prob and entropy serves). */
static float g_of(int64_t k, float logp, float entropy)
{
    return 0.3f * sinf((float)k) + 0.1f * logp - 0.02f * entropy;
}
static float e_of(int64_t k, float entropy) { return 0.05f * entropy - 0.01f * (float)(k % 3); }

static void derivs_at(const void *user, int64_t k, float logp, float entropy, float *g, float *e)
{
    (void)user;
    *g = g_of(k, logp, entropy);
    *e = e_of(k, entropy);
}

/* Workspace of one backend's call. */
static void carve(fg_backend_call *c, size_t scratch)
{
    const size_t dl = fg_dtype_size(c->dlogit_t);
    c->logits = zalloc((size_t)M * V * sizeof(float));
    c->dlogits = zalloc((size_t)M * V * dl);
    c->hbuf = zalloc((size_t)M * H * dl);
    c->ghbuf = zalloc((size_t)M * H * sizeof(float));
    float **arr[6] = {&c->zmax, &c->lsum, &c->entropy, &c->logp, &c->g, &c->e};
    for (int i = 0; i < 6; i++)
        *arr[i] = zalloc((size_t)M * sizeof(float));
    c->gb_sum = zalloc((size_t)V * sizeof(float));
    c->scratch = zalloc(scratch);
    c->row_check = zalloc(2 * sizeof(int));
}

static void uncarve(fg_backend_call *c)
{
    void *p[] = {c->logits, c->dlogits, c->hbuf, c->ghbuf, c->zmax, c->lsum, c->entropy,
                 c->logp, c->g, c->e, c->gb_sum, c->scratch, c->row_check};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        free(p[i]);
}

static void reset_check(fg_backend_call *c)
{
    c->row_check[0] = c->row_check[1] = FG_BACKEND_ROW_NONE;
}

#define OK(expr) CHECK((expr) == FG_OK, "%s", #expr)

static void compare_ops(fg_context *ctx, fg_dtype in_t)
{
    const char *dn = in_t == FG_DTYPE_BF16 ? "bf16" : "f32";
    char msg[256];
    tu_rng rng;
    tu_rng_seed(&rng, in_t == FG_DTYPE_BF16 ? 11 : 7);
    fg_call call;
    if (fg_call_begin(ctx, NULL, &call) != FG_OK) {
        CHECK(0, "%s", "fg_call_begin");
        return;
    }
    fg_cpu_backend cpu;
    fg_device dcpu, dref;
    fg_backend_cpu_init(&cpu, &call, 1, &dcpu);
    cpu.gemm_workers = call.threads;
    OK(fg_backend_reference_create(NULL, &dref, msg, sizeof msg));
    const fg_backend_ops *co = dcpu.ops, *ro = dref.ops;
    void *cs = dcpu.state, *rs = dref.state;

    /* Inputs: hidden [NTOK, H], weight [V, H] at stride LDW, bias [V]. */
    double *hv = tu_xmalloc((size_t)NTOK * H * sizeof(double));
    double *wv = tu_xmalloc((size_t)V * H * sizeof(double));
    double *bv = tu_xmalloc((size_t)V * sizeof(double));
    for (int64_t i = 0; i < (int64_t)NTOK * H; i++)
        hv[i] = 0.6 * tu_normal(&rng);
    for (int64_t i = 0; i < (int64_t)V * H; i++)
        wv[i] = 0.3 * tu_normal(&rng);
    for (int64_t i = 0; i < V; i++)
        bv[i] = 0.2 * tu_normal(&rng);
    void *hidden = tu_store_matrix(hv, NTOK, H, H, in_t);
    void *weight = tu_store_matrix(wv, V, H, LDW, in_t);
    void *bias = tu_store_matrix(bv, 1, V, V, in_t);
    uint8_t *mask = tu_xmalloc(NTOK);
    int64_t *rows = tu_xmalloc(NACT * sizeof(int64_t));
    int64_t *targets = tu_xmalloc(NACT * sizeof(int64_t));
    for (int64_t n = 0, k = 0; n < NTOK; n++) {
        mask[n] = k < NACT && (n % 5 != 3);
        if (mask[n]) {
            rows[k] = n;
            targets[k] = tu_randint(&rng, V);
            k++;
        }
    }
    targets[R0 + 7] = V + 3; /* another shard's token */
    float *gh_c = zalloc((size_t)NTOK * H * fg_dtype_size(in_t));
    float *gh_r = zalloc((size_t)NTOK * H * fg_dtype_size(in_t));
    float *gw_c = zalloc((size_t)V * H * sizeof(float));
    float *gw_r = zalloc((size_t)V * H * sizeof(float));

    fg_backend_call cc = {.N = NTOK, .H = H, .V = V, .n_active = NACT, .chunk_rows = M,
                          .in_t = in_t, .logit_t = FG_DTYPE_F32,
                          .dlogit_t = fg_cpu_gemm_dtype(&call, in_t), .inv_temp = 1.0f / TEMPERATURE,
                          .hidden = {hidden, in_t, NTOK, H, H},
                          .weight = {weight, in_t, V, H, LDW},
                          .bias = {bias, in_t, V},
                          .mask = mask,
                          .grad_hidden = {gh_c, in_t, NTOK, H, H},
                          .grad_weight = {gw_c, FG_DTYPE_F32, V, H, H},
                          .rows = rows, .targets = targets};
    fg_backend_call rc = cc;
    rc.grad_hidden.data = gh_r;
    rc.grad_weight.data = gw_r;
    const fg_dtype dl = cc.dlogit_t;
    fg_gemm_scratch need = {0, 0};
    OK(fg_cpu_prepare_chunk(&cpu, &cc, M, &need));
    carve(&cc, fg_gemm_scratch_bytes(&need, cpu.gemm_workers));
    carve(&rc, 0);
    CHECK(co->chunk_scratch_bytes(cs, &cc, M) == fg_gemm_scratch_bytes(&need, cpu.gemm_workers),
          "%s: chunk_scratch_bytes %zu", dn, co->chunk_scratch_bytes(cs, &cc, M));

    /* 1. logits */
    OK(co->logits(cs, &cc, R0, M, msg, sizeof msg));
    OK(ro->logits(rs, &rc, R0, M, msg, sizeof msg));
    char name[96];
    snprintf(name, sizeof name, "cpu backend logits %s", dn);
    TOL_CHECK(name, rel_max(cc.logits, rc.logits, FG_DTYPE_F32, (int64_t)M * V), 1e-6,
              "%s logits", dn);
    CHECK(memcmp(cc.hbuf, rc.hbuf, (size_t)M * H * fg_dtype_size(dl)) == 0,
          "%s: the gathered rows differ", dn);

    /* stats of the same logits */
    memcpy(rc.logits, cc.logits, (size_t)M * V * sizeof(float));
    reset_check(&cc);
    reset_check(&rc);
    OK(co->stats(cs, &cc, R0, M, msg, sizeof msg));
    OK(ro->stats(rs, &rc, R0, M, msg, sizeof msg));
    CHECK(cc.row_check[0] == 7 && rc.row_check[0] == 7, "%s: row_check[0] %d / %d, want 7", dn,
          cc.row_check[0], rc.row_check[0]);
    CHECK(cc.row_check[1] == FG_BACKEND_ROW_NONE && rc.row_check[1] == FG_BACKEND_ROW_NONE,
          "%s: row_check[1] %d / %d", dn, cc.row_check[1], rc.row_check[1]);
    CHECK(isnan(cc.logp[7]) && isnan(rc.logp[7]), "%s: logp of another shard's token", dn);
    cc.logp[7] = rc.logp[7] = 0.0f;
    float *cs_arr[4] = {cc.zmax, cc.lsum, cc.entropy, cc.logp};
    float *rs_arr[4] = {rc.zmax, rc.lsum, rc.entropy, rc.logp};
    static const char *const sname[4] = {"zmax", "lsum", "entropy", "logp"};
    static const double stol[4] = {0.0, 5e-7, 6e-7, 4e-7}; /* the max is exact */
    for (int i = 0; i < 4; i++) {
        snprintf(name, sizeof name, "cpu backend stats %s", sname[i]);
        TOL_CHECK(name, rel_max(cs_arr[i], rs_arr[i], FG_DTYPE_F32, M), stol[i], "%s %s", dn,
                  sname[i]);
    }

    /* shard_stats: one shard's own statistics, merged alone, are stats' */
    float *sbuf = tu_xmalloc((size_t)fg_shard_floats(M) * sizeof(float));
    OK(co->shard_stats(cs, &cc, R0, M, sbuf, M, 0, msg, sizeof msg));
    for (int64_t i = 0; i < M; i++)
        fg_shard_encode(sbuf, M, i);
    double sworst = 0.0;
    int decoded = 1;
    for (int64_t i = 0; i < M; i++) {
        float st[4];
        decoded &= fg_shard_decode(sbuf, M, i, &st[0], &st[1], &st[2], &st[3]) == 0;
        static const int order[4] = {0, 1, 3, 2}; /* decode: zmax, lsum, logp, entropy */
        for (int q = 0; q < 4 && i != 7; q++) /* row 7: another shard's token */
            sworst = fmax(sworst, fabs(st[q] - cs_arr[order[q]][i]) /
                                      fmax(fabs(cs_arr[order[q]][i]), 1.0));
    }
    CHECK(decoded, "%s: shard_stats did not decode", dn);
    snprintf(name, sizeof name, "cpu backend shard_stats merged alone");
    TOL_CHECK(name, sworst, 4e-7, "%s shard_stats vs stats", dn);
    free(sbuf);

    /* backward from the same statistics, g and e */
    for (int64_t i = 0; i < M; i++) {
        rc.g[i] = cc.g[i] = (float)(0.5 * tu_normal(&rng));
        rc.e[i] = cc.e[i] = (float)(0.1 * tu_normal(&rng));
        cc.zmax[i] = rc.zmax[i];
        cc.lsum[i] = rc.lsum[i];
        cc.entropy[i] = rc.entropy[i];
    }
    OK(co->backward(cs, &cc, R0, M, msg, sizeof msg));
    OK(ro->backward(rs, &rc, R0, M, msg, sizeof msg));
    snprintf(name, sizeof name, "cpu backend dlogits %s", dl == FG_DTYPE_BF16 ? "bf16" : "f32");
    TOL_CHECK(name, rel_max(cc.dlogits, rc.dlogits, dl, (int64_t)M * V),
              dl == FG_DTYPE_BF16 ? 8e-3 : 5e-7, "%s dlogits", dn);
    snprintf(name, sizeof name, "cpu backend bias sums %s", dl == FG_DTYPE_BF16 ? "bf16" : "f32");
    TOL_CHECK(name, rel_max(cc.gb_sum, rc.gb_sum, FG_DTYPE_F32, V),
              dl == FG_DTYPE_BF16 ? 1e-2 : 1e-6, "%s bias sums", dn);

    /* grads: GEMM 2 into the tokens' rows, GEMM 3 overwritten then added */
    memcpy(rc.dlogits, cc.dlogits, (size_t)M * V * fg_dtype_size(dl));
    for (int first = 1; first >= 0; first--) {
        OK(co->grads(cs, &cc, R0, M, first, msg, sizeof msg));
        OK(ro->grads(rs, &rc, R0, M, first, msg, sizeof msg));
        snprintf(name, sizeof name, "cpu backend grad_weight %s", dn);
        TOL_CHECK(name, rel_max(gw_c, gw_r, FG_DTYPE_F32, (int64_t)V * H),
                  dl == FG_DTYPE_BF16 ? 8e-3 : 1.5e-6, "%s grad_weight, first %d", dn, first);
    }
    snprintf(name, sizeof name, "cpu backend grad_hidden %s", dn);
    TOL_CHECK(name, rel_max(gh_c, gh_r, in_t, (int64_t)NTOK * H),
              dl == FG_DTYPE_BF16 ? 8e-3 : in_t == FG_DTYPE_BF16 ? 4e-3 : 2e-6, "%s grad_hidden",
              dn);

    /* 2. dhidden + put_grad_hidden = grads' GEMM 2, bitwise */
    void *gh_split = zalloc((size_t)NTOK * H * fg_dtype_size(in_t));
    fg_backend_call split = cc;
    split.grad_hidden.data = gh_split;
    OK(co->dhidden(cs, &split, R0, M, msg, sizeof msg));
    OK(co->put_grad_hidden(cs, &split, R0, M, msg, sizeof msg));
    CHECK(memcmp(gh_split, gh_c, (size_t)NTOK * H * fg_dtype_size(in_t)) == 0,
          "%s: dhidden + put_grad_hidden differ from grads", dn);
    free(gh_split);

    /* stats_backward = stats, g and e, backward, bitwise */
    const size_t dbytes = (size_t)M * V * fg_dtype_size(dl);
    void *dl_once = tu_xmalloc(dbytes);
    float *gb_once = tu_xmalloc((size_t)V * sizeof(float));
    memset(cc.gb_sum, 0, (size_t)V * sizeof(float));
    reset_check(&cc);
    const fg_backend_derivs d = {derivs_at, NULL};
    OK(co->stats_backward(cs, &cc, R0, M, &d, msg, sizeof msg));
    CHECK(cc.row_check[0] == 7, "%s: stats_backward row_check[0] %d", dn, cc.row_check[0]);
    memcpy(dl_once, cc.dlogits, dbytes);
    memcpy(gb_once, cc.gb_sum, (size_t)V * sizeof(float));
    memset(cc.gb_sum, 0, (size_t)V * sizeof(float));
    OK(co->stats(cs, &cc, R0, M, msg, sizeof msg));
    for (int64_t i = 0; i < M; i++) {
        cc.g[i] = g_of(R0 + i, cc.logp[i], cc.entropy[i]);
        cc.e[i] = e_of(R0 + i, cc.entropy[i]);
    }
    OK(co->backward(cs, &cc, R0, M, msg, sizeof msg));
    CHECK(memcmp(dl_once, cc.dlogits, dbytes) == 0 &&
              memcmp(gb_once, cc.gb_sum, (size_t)V * sizeof(float)) == 0,
          "%s: stats_backward differs from stats + backward", dn);
    free(dl_once);
    free(gb_once);

    /* filter, then grads as sparse products = the reference's grads of the
     * same dlogits with the entries the filter drops zeroed (filter's rule:
     * |d| > eps * the row's largest |d|, or the row's target). */
    const double eps = 0.3;
    cpu.filter_eps = eps;
    cpu.kept_cap = fg_kept_cap(V);
    cpu.kept_idx = tu_xmalloc((size_t)M * (size_t)cpu.kept_cap * sizeof(int32_t));
    cpu.kept_nnz = tu_xmalloc((size_t)M * sizeof(int32_t));
    cpu.kept_tgt = tu_xmalloc((size_t)M * sizeof(int64_t));
    memcpy(rc.dlogits, cc.dlogits, dbytes);
    int64_t kept_ref = 0;
    for (int64_t i = 0; i < M; i++) {
        double top = 0.0;
        for (int64_t v = 0; v < V; v++)
            top = fmax(top, fabs(tu_load(rc.dlogits, dl, i * V + v)));
        for (int64_t v = 0; v < V; v++) {
            const int keep = fabs(tu_load(rc.dlogits, dl, i * V + v)) > eps * top ||
                             v == targets[R0 + i];
            kept_ref += keep;
            if (!keep && dl == FG_DTYPE_BF16)
                ((uint16_t *)rc.dlogits)[i * V + v] = 0;
            else if (!keep)
                ((float *)rc.dlogits)[i * V + v] = 0.0f;
        }
    }
    OK(co->filter(cs, &cc, R0, M, msg, sizeof msg));
    CHECK(cpu.kept_total == kept_ref, "%s: filter kept %lld entries, the rule %lld", dn,
          (long long)cpu.kept_total, (long long)kept_ref);
    OK(co->grads(cs, &cc, R0, M, 1, msg, sizeof msg));
    OK(ro->grads(rs, &rc, R0, M, 1, msg, sizeof msg));
    snprintf(name, sizeof name, "cpu backend filtered grad_weight %s", dn);
    TOL_CHECK(name, rel_max(gw_c, gw_r, FG_DTYPE_F32, (int64_t)V * H), 2e-7,
              "%s filtered grad_weight", dn);
    snprintf(name, sizeof name, "cpu backend filtered grad_hidden %s", dn);
    TOL_CHECK(name, rel_max(gh_c, gh_r, in_t, (int64_t)NTOK * H),
              in_t == FG_DTYPE_BF16 ? 4e-3 : 2e-7, "%s filtered grad_hidden", dn);
    cpu.filter_eps = 0.0;
    free(cpu.kept_idx), free(cpu.kept_nnz), free(cpu.kept_tgt);

    /* finish: float32 sums into bf16 grad_weight and grad_bias, accumulating,
     * the bias sums seeded or not; masked rows of grad_hidden zeroed. */
    for (int seeded = 0; seeded < 2; seeded++) {
        float *gws = zalloc((size_t)V * H * sizeof(float));
        uint16_t *gw16[2] = {zalloc((size_t)V * H * 2), zalloc((size_t)V * H * 2)};
        uint16_t *gb16[2] = {zalloc((size_t)V * 2), zalloc((size_t)V * 2)};
        for (int64_t i = 0; i < (int64_t)V * H; i++) {
            gws[i] = (float)tu_normal(&rng);
            gw16[0][i] = gw16[1][i] = (uint16_t)(0x3f80 + (i % 97));
        }
        for (int64_t v = 0; v < V; v++) {
            cc.gb_sum[v] = rc.gb_sum[v] = (float)tu_normal(&rng);
            gb16[0][v] = gb16[1][v] = (uint16_t)(0xbf00 + (v % 31));
        }
        fg_backend_call *fc[2] = {&cc, &rc};
        for (int b = 0; b < 2; b++) {
            fg_backend_call f = *fc[b];
            f.accumulate = 1;
            f.gb_seeded = seeded;
            f.gw_sum = gws;
            f.grad_weight = (fg_matrix){gw16[b], FG_DTYPE_BF16, V, H, H};
            f.grad_bias = (fg_vector){gb16[b], FG_DTYPE_BF16, V};
            OK((b ? ro : co)->finish(b ? rs : cs, &f, msg, sizeof msg));
        }
        CHECK(memcmp(gw16[0], gw16[1], (size_t)V * H * 2) == 0 &&
                  memcmp(gb16[0], gb16[1], (size_t)V * 2) == 0,
              "%s: finish differs from the reference (seeded %d)", dn, seeded);
        free(gws);
        for (int b = 0; b < 2; b++) {
            free(gw16[b]);
            free(gb16[b]);
        }
    }
    int zero_rows = 1;
    for (int64_t n = 0; n < NTOK; n++)
        for (int64_t h = 0; h < H && !mask[n]; h++)
            zero_rows &= tu_load(gh_c, in_t, n * H + h) == 0.0;
    CHECK(zero_rows, "%s: finish left a masked row of grad_hidden", dn);

    /* scan: the largest magnitude's row, then a NaN's place */
    fg_backend_scan sc, sr;
    OK(co->scan(cs, &cc.hidden, mask, &sc, msg, sizeof msg));
    OK(ro->scan(rs, &rc.hidden, mask, &sr, msg, sizeof msg));
    CHECK(sc.top_bits == sr.top_bits && sc.top_row == sr.top_row && sc.bad_row == -1 &&
              sr.bad_row == -1,
          "%s: scan %08x row %lld / %08x row %lld", dn, sc.top_bits, (long long)sc.top_row,
          sr.top_bits, (long long)sr.top_row);
    const int64_t bad = 3 * H + 11; /* row 3, column 11 (unmasked: 3 % 5 == 3 is masked) */
    mask[3] = 1;
    if (in_t == FG_DTYPE_BF16)
        ((uint16_t *)hidden)[bad] = 0x7fc0;
    else
        ((float *)hidden)[bad] = NAN;
    OK(co->scan(cs, &cc.hidden, mask, &sc, msg, sizeof msg));
    OK(ro->scan(rs, &rc.hidden, mask, &sr, msg, sizeof msg));
    CHECK(sc.bad_row == 3 && sc.bad_col == 11 && sr.bad_row == 3 && sr.bad_col == 11 &&
              sc.top_bits >= 0x7f800000u,
          "%s: NaN at [3, 11] found at [%lld, %lld] / [%lld, %lld]", dn, (long long)sc.bad_row,
          (long long)sc.bad_col, (long long)sr.bad_row, (long long)sr.bad_col);

    uncarve(&cc);
    uncarve(&rc);
    free(hv), free(wv), free(bv), free(hidden), free(weight), free(bias), free(mask);
    free(rows), free(targets), free(gh_c), free(gh_r), free(gw_c), free(gw_r);
    fg_call_end(&call, FG_OK);
}

/* Part 3: the device walk over the CPU backend, one loss type and level. */
static void device_walk(fg_context *ctx, int lt, int lvl)
{
    enum { DB = 3, DT = 7, DH = 24, DV = 67, DN = DB * DT };
    tu_problem prob;
    tu_problem_make(&prob, DB, DT, DH, DV, FG_DTYPE_F32, 1, 977u + 13u * (uint64_t)lt);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = (fg_loss_type)lt;
    cfg.importance_sampling_level = (fg_is_level)lvl;
    cfg.temperature = 0.7;
    cfg.beta = 0.04;
    char tag[96];
    snprintf(tag, sizeof tag, "[device walk, cpu backend: %s %s]", tu_loss_name(lt),
             tu_level_name(lvl));
    fg_oracle_result ref;
    if (tu_problem_fill_logp(&prob, cfg.temperature, 0.2, 0.3) != 0 ||
        fg_oracle_linear(&cfg, tu_batch_view(&prob.tb), prob.hidden, prob.weight, prob.bias, DH,
                         DV, &ref) != 0) {
        CHECK(0, "%s oracle failed", tag);
        tu_problem_free(&prob);
        return;
    }
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    tu_linear_outs dev_out, cpu_out;
    tu_linear_outs_make(&dev_out, DN, DH, DV, 1);
    tu_linear_outs_make(&cpu_out, DN, DH, DV, 1);
    const linear_request req = {.kind = KIND_LOSS, .cfg = &cfg, .batch = batch};

    fg_call call;
    fg_status st = fg_call_begin(ctx, NULL, &call);
    CHECK(st == FG_OK, "%s: fg_call_begin", tag);
    fg_linear_plan_info info = {0};
    if (st == FG_OK) {
        fg_cpu_backend cpu;
        fg_device dev;
        fg_backend_cpu_init(&cpu, &call, 1, &dev);
        call.device = &dev;
        const size_t ws_bytes = (size_t)1 << 22;
        call.device_workspace = tu_xmalloc_aligned(ws_bytes);
        call.device_workspace_bytes = ws_bytes;
        /* The least budget (in 256-byte steps) of three chunks or fewer. */
        for (call.budget = 4096; call.budget < ws_bytes; call.budget += 256)
            if (fg_linear_device_plan(&call, NULL, &req, &in, &dev_out.out, &info) == FG_OK &&
                info.chunks <= 3)
                break;
        st = fg_linear_device_execute(&call, NULL, &req, &in, &dev_out.out);
        /* The chunks the plan query gave, several (the scratch oneDNN asks
         * for differs between CPUs, so the count comes from the plan). */
        CHECK(st == FG_OK && call.chunks == info.chunks && call.chunks >= 2,
              "%s: %s, %lld chunks, the plan %lld", tag, call.err->msg, (long long)call.chunks,
              (long long)info.chunks);
        free(call.device_workspace);
        fg_call_end(&call, st);
    }

    fg_exec ex;
    fg_exec_init(&ex);
    ex.memory_budget = 1;
    fg_linear_grpo_plan(ctx, NULL, &cfg, &in, batch, &cpu_out.out, &ex, &info);
    ex.memory_budget = info.min_budget_bytes;
    st = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &cpu_out.out, &ex);
    CHECK(st == FG_OK, "%s cpu driver: %s", tag, fg_last_error(ctx));

    const double scale = fg_oracle_loss_scale(&cfg, batch, ref.logp, ref.entropy);
    tu_linear_outs *o[2] = {&dev_out, &cpu_out};
    static const char *const walk[2] = {"device walk", "cpu driver"};
    for (int w = 0; w < 2; w++) {
        char name[64];
        snprintf(name, sizeof name, "cpu backend %s loss", walk[w]);
        TOL_CHECK(name, tu_rel_err(o[w]->out.loss, ref.loss, scale), 1e-6, "%s", tag);
        snprintf(name, sizeof name, "cpu backend %s logp", walk[w]);
        TOL_CHECK(name, tu_max_rel(o[w]->logp, ref.logp, DN, prob.tb.mask, 1.0), 1e-6, "%s",
                  tag);
        snprintf(name, sizeof name, "cpu backend %s gradients", walk[w]);
        TOL_CHECK(name, tu_rel_l2(o[w]->grad_hidden, FG_DTYPE_F32, DN, DH, DH, ref.grad_hidden),
                  2e-6, "%s grad_hidden", tag);
        TOL_CHECK(name, tu_rel_l2(o[w]->grad_weight, FG_DTYPE_F32, DV, DH, DH, ref.grad_weight),
                  2e-6, "%s grad_weight", tag);
        TOL_CHECK(name, tu_rel_l2(o[w]->grad_bias, FG_DTYPE_F32, 1, DV, DV, ref.grad_bias), 2e-6,
                  "%s grad_bias", tag);
    }
    /* Both walks read each token's row alone for its log-prob: the same bits. */
    CHECK(memcmp(dev_out.logp, cpu_out.logp, DN * sizeof(float)) == 0 &&
              memcmp(dev_out.entropy, cpu_out.entropy, DN * sizeof(float)) == 0,
          "%s: the walks' logp or entropy differ", tag);
    tu_linear_outs_free(&dev_out);
    tu_linear_outs_free(&cpu_out);
    fg_oracle_result_free(&ref);
    tu_problem_free(&prob);
}

int main(void)
{
    fg_context *ctx = NULL;
    if (fg_context_create(NULL, &ctx) != FG_OK) {
        CHECK(0, "%s", "context create");
        return tu_finish();
    }
    compare_ops(ctx, FG_DTYPE_F32);
    compare_ops(ctx, FG_DTYPE_BF16);
    device_walk(ctx, FG_LOSS_DAPO, FG_LEVEL_TOKEN);
    device_walk(ctx, FG_LOSS_GRPO, FG_LEVEL_SEQUENCE);
    fg_context_destroy(ctx);
    return tu_finish();
}
