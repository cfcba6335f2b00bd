/*
 * test_backend_cpu: the CPU backend's ops (src/backends/cpu/backend_cpu.c: oneDNN, OpenMP)
 * against the seam's plain reference (src/backends/reference/backend_reference.c: loops in
 * double, the specification of each op), op by op, on one call in host
 * memory; then the one driver (src/driver/linear_grpo.c) over the CPU backend, in
 * place and staged as a device backend's memory is.
 *
 *  1. Ops against the reference: f32 and bf16 inputs, H = 37, V = 1031 (a
 *     logits block and a ragged one), a chunk of 150 rows starting at row 5
 *     of the active list (a whole logits block and a zero-padded one), a
 *     padded weight stride, temperature 0.7, a bias. Planning:
 *     compute_dtype (float32 for f32 inputs; for bf16 whatever this CPU
 *     gives, never assumed), supports (that dtype's dlogits accepted, the
 *     other refused), chunk_scratch (shared bytes plus bytes per worker:
 *     affine in c->workers; chunks of m rows and a last one covered
 *     together). logits (the gathered rows bitwise), stats (each backend's
 *     statistics of the same logits; a target outside [0, V) flagged in the
 *     one row_check int by both, which stats only lowers and leaves at
 *     FG_BACKEND_ROW_NONE when every target is inside), shard_stats (the
 *     reference's maxima and target logits bitwise, merged statistics within
 *     float roundings), backward (the same statistics, g and e; dlogits and
 *     the bias sums), grads (grad_hidden's rows, grad_weight overwritten
 *     then added to), dhidden (the reference's of the same dlogits), and
 *     put_grad_hidden (bitwise the reference's from the same float32 rows),
 *     finish (float32 sums into a bf16 grad_weight, over the caller's values
 *     or not; grad_bias = gb_sum, which the driver seeds with the caller's
 *     values when accumulating, rounded once for bf16 and copied for f32;
 *     grad_weight zeroed when no token is unmasked; masked rows of
 *     grad_hidden zeroed; bitwise the reference's), scan (a NaN's place; the
 *     largest magnitude and its row).
 *  2. The CPU backend's optional ops against its own seam ops: bitwise,
 *     stats_backward = stats, then g, e, then backward, and dhidden +
 *     put_grad_hidden = grads' GEMM 2; shard_stats of one shard, merged
 *     alone, = stats, and its by-token layout = its by-row one; filter where
 *     every row keeps more than kept_cap (each keeps every entry):
 *     *kept_count += m * V, dlogits untouched, then grads bitwise the
 *     unfiltered ones; filter where every row keeps few:
 *     *kept_count += the entries the rule keeps, then grads (sparse) = the
 *     reference's grads of dlogits with the dropped entries zeroed.
 *  3. One driver, two memories: fg_linear_run and fg_linear_plan_request
 *     with the backend given (B = 3, T = 23, H = 24, V = 67, a ragged mask,
 *     temperature 0.7 or 0.9), over (host) the CPU backend as it is: its
 *     buffers used in place; (staged) its ops table with
 *     FG_BACKEND_HOST_MEMORY cleared: the token arrays staged to the host,
 *     each chunk's statistics copied out and g, e in, the workspace from the
 *     backend's alloc (counted: one alloc and one release a call, copies both
 *     ways; none by the plan query); (staged without fusion) that without
 *     stats_backward, dhidden and put_grad_hidden (the driver's stats, loss
 *     math and backward); and the public entry point at the host walk's
 *     budget. Each walk at the least budget whose plan gives the host walk's
 *     chunks, the least of 2 or 3 (else the fewest of several: the host
 *     arena grows in whole pages, several rows each; at T = 7 no budget gave
 *     2 or 3); every walk's outputs (loss, metrics, logp,
 *     entropy, gradients, the phase API's stats) bitwise the host walk's:
 *     the same ops on the same chunks, staging only moves bytes; and each
 *     against the float64 oracle. Requests: f32 and bf16 inputs (products in
 *     this CPU's compute dtype), a token-level loss with the KL and a bias
 *     (chunks walked once), a sequence-level one (every log-prob first, then
 *     the gradient sweep), bf16 gradients (grad_weight's float32 sums),
 *     accumulate = 1 into the first call's gradients (grad_weight and
 *     grad_bias twice the gradient, grad_hidden overwritten),
 *     fg_linear_logprobs, fg_linear_logprobs_backward, the phase API's
 *     fg_linear_shard_stats of one shard (rescaled and finished: the oracle's
 *     log-probs) and fg_linear_shard_backward from its merged statistics;
 *     gradient filtering (the walks keep the same entries; the forward and
 *     grad_bias bitwise the unfiltered call's in the same chunks); no token
 *     unmasked (every output zero). Refusals: the ops table without filter
 *     (filter_eps 1e-3) or without shard_stats (fg_linear_shard_stats), host
 *     and staged: FG_ERR_UNSUPPORTED naming the op from the plan query (info
 *     not written) and from the call (the call's and the context's message),
 *     every output bitwise unchanged.
 *
 * Tolerances: relative to the largest |value| of the reference, about 4x
 * the worst measured on AVX2 (2026-11-27): float32 roundings of sums over H
 * or V terms, the rows' maxima exact. A bf16 grad_hidden of float32 products
 * may round one bf16 ulp apart (2^-8; measured 0). With native bf16
 * products (an AVX-512 BF16 CPU) the backward reads dlogits rounded to bf16
 * on both sides, which may round one ulp apart: 8e-3 there (measured 3e-6
 * for dlogits, 4e-7 for grad_weight on an AVX-512 BF16 Zen 4, 2026-12-03).
 * Added 2026-12-03 (that Zen 4, and it with DNNL_MAX_CPU_ISA=AVX2):
 * shard_stats and dhidden against the reference, 6e-7 and 2e-6 (measured
 * 2.1e-7 and 5.4e-7); part 3's entropy against the oracle, 4e-6 (1.1e-6 at
 * T = 7, 7.8e-7 here); gradients with bf16 products or stored in bf16, 6e-3
 * and 8e-3 as test_backend's (dlogits or the gradients rounded to bf16:
 * measured 2.2e-3 and 2.6e-3). Part 3's f32 loss, logp and gradients keep
 * 1e-6, 1e-6 and 2e-6 (measured 1.8e-7, 3.3e-7 and 1.3e-6: the token-level
 * loss's derivatives, float32 exp of the ratio and the KL).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cpu.h"
#include "fg_oracle.h"
#include "linear_request.h"
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

static const char *dtype_name(fg_dtype t) { return t == FG_DTYPE_BF16 ? "bf16" : "f32"; }

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
    c->row_check = zalloc(sizeof(int));
}

static void uncarve(fg_backend_call *c)
{
    void *p[] = {c->logits, c->dlogits, c->hbuf, c->ghbuf, c->zmax, c->lsum, c->entropy,
                 c->logp, c->g, c->e, c->gb_sum, c->scratch, c->row_check};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        free(p[i]);
}

static void reset_check(fg_backend_call *c) { *c->row_check = FG_BACKEND_ROW_NONE; }

#define OK(expr) CHECK((expr) == FG_OK, "%s", #expr)

/* Whether token ia of the shard statistics a (ca tokens) and token ib of b
 * (cb tokens) hold the same own statistics, bitwise: the max, the target's
 * logit, m_s, S_s, D_s (shard_stats.h's layout). */
static int same_local(const float *a, int64_t ca, int64_t ia, const float *b, int64_t cb,
                      int64_t ib)
{
    const float x[5] = {a[ia], a[ca + ia], a[fg_shard_local_offset(ca) + ia],
                        a[fg_shard_local_offset(ca) + ca + ia],
                        a[fg_shard_local_offset(ca) + 2 * ca + ia]};
    const float y[5] = {b[ib], b[cb + ib], b[fg_shard_local_offset(cb) + ib],
                        b[fg_shard_local_offset(cb) + cb + ib],
                        b[fg_shard_local_offset(cb) + 2 * cb + ib]};
    return memcmp(x, y, sizeof x) == 0;
}

/* chunk_scratch's bytes for chunks of m rows (the last `last`) on w workers. */
static size_t scratch_of(const fg_backend_ops *co, void *cs, const fg_backend_call *c, int64_t m,
                         int64_t last, int w)
{
    fg_backend_call x = *c;
    x.workers = w;
    size_t bytes = 0;
    char msg[256];
    const fg_status st = co->chunk_scratch(cs, &x, m, last, &bytes, msg, sizeof msg);
    CHECK(st == FG_OK, "chunk_scratch(m %lld, last %lld, workers %d): %s", (long long)m,
          (long long)last, w, msg);
    return bytes;
}

static void compare_ops(fg_context *ctx, fg_dtype in_t)
{
    const char *dn = dtype_name(in_t);
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
    fg_backend_cpu_init(&cpu, &call, &dcpu);
    OK(fg_backend_reference_create(NULL, &dref, msg, sizeof msg));
    const fg_backend_ops *co = dcpu.ops, *ro = dref.ops;
    void *cs = dcpu.state, *rs = dref.state;
    CHECK(co->abi == FG_BACKEND_ABI && ro->abi == FG_BACKEND_ABI, "abi %d / %d", co->abi,
          ro->abi);
    CHECK((co->caps & FG_BACKEND_HOST_MEMORY) && !(ro->caps & FG_BACKEND_HOST_MEMORY),
          "caps %#x / %#x", co->caps, ro->caps);

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

    /* Planning: the products' dtype (for bf16 inputs whatever this CPU
     * gives), and the backend accepting it and refusing another. */
    const fg_dtype dl = co->compute_dtype(cs, in_t);
    CHECK(co->compute_dtype(cs, FG_DTYPE_F32) == FG_DTYPE_F32 &&
              (dl == FG_DTYPE_F32 || dl == FG_DTYPE_BF16),
          "%s: compute dtype %d", dn, (int)dl);
    printf("[ops %s] the CPU's compute dtype: %s\n", dn, dtype_name(dl));
    fg_backend_call cc = {.N = NTOK, .H = H, .V = V, .n_active = NACT, .chunk_rows = M,
                          .in_t = in_t, .logit_t = FG_DTYPE_F32,
                          .dlogit_t = dl, .inv_temp = 1.0f / TEMPERATURE,
                          .workers = call.threads,
                          .hidden = {hidden, in_t, NTOK, H, H},
                          .weight = {weight, in_t, V, H, LDW},
                          .bias = {bias, in_t, V},
                          .mask = mask,
                          .grad_hidden = {gh_c, in_t, NTOK, H, H},
                          .grad_weight = {gw_c, FG_DTYPE_F32, V, H, H},
                          .rows = rows, .targets = targets};
    OK(co->supports(cs, &cc, msg, sizeof msg));
    fg_backend_call other = cc;
    other.dlogit_t = dl == FG_DTYPE_BF16 ? FG_DTYPE_F32 : FG_DTYPE_BF16;
    const fg_status sup = co->supports(cs, &other, msg, sizeof msg);
    CHECK(sup == FG_ERR_UNSUPPORTED && strstr(msg, "dlogits"),
          "%s: supports with %s dlogits: %s (%s)", dn, dtype_name(other.dlogit_t),
          fg_status_name(sup), msg);

    /* chunk_scratch: shared bytes and per-worker bytes (affine in the
     * workers); a chunk size and a last one covered together. */
    const size_t s1 = scratch_of(co, cs, &cc, M, M, 1), s2 = scratch_of(co, cs, &cc, M, M, 2);
    const size_t s3 = scratch_of(co, cs, &cc, M, M, 3);
    CHECK(s2 >= s1 && s3 - s2 == s2 - s1, "%s: chunk_scratch %zu, %zu, %zu for 1, 2, 3 workers",
          dn, s1, s2, s3);
    const size_t s_last = scratch_of(co, cs, &cc, 37, 37, 2);
    const size_t s_both = scratch_of(co, cs, &cc, M, 37, 2);
    CHECK(s_both >= s2 && s_both >= s_last && s_both <= s2 + s_last,
          "%s: chunk_scratch %zu for chunks of %d and 37 rows, %zu and %zu alone", dn, s_both,
          M, s2, s_last);
    const size_t scratch = scratch_of(co, cs, &cc, M, M, cc.workers);
    fg_backend_call rc = cc;
    rc.grad_hidden.data = gh_r;
    rc.grad_weight.data = gw_r;
    carve(&cc, scratch);
    carve(&rc, 0);

    /* 1. logits */
    OK(co->logits(cs, &cc, R0, M, msg, sizeof msg));
    OK(ro->logits(rs, &rc, R0, M, msg, sizeof msg));
    char name[96];
    snprintf(name, sizeof name, "cpu backend logits %s", dn);
    TOL_CHECK(name, rel_max(cc.logits, rc.logits, FG_DTYPE_F32, (int64_t)M * V), 1e-6,
              "%s logits", dn);
    CHECK(memcmp(cc.hbuf, rc.hbuf, (size_t)M * H * fg_dtype_size(dl)) == 0,
          "%s: the gathered rows differ", dn);

    /* row_check: only lowered; untouched when every target is inside. */
    memcpy(rc.logits, cc.logits, (size_t)M * V * sizeof(float));
    *cc.row_check = *rc.row_check = 3;
    OK(co->stats(cs, &cc, R0, M, msg, sizeof msg));
    OK(ro->stats(rs, &rc, R0, M, msg, sizeof msg));
    CHECK(*cc.row_check == 3 && *rc.row_check == 3, "%s: row_check raised to %d / %d", dn,
          *cc.row_check, *rc.row_check);
    targets[R0 + 7] = 1;
    reset_check(&cc);
    reset_check(&rc);
    OK(co->stats(cs, &cc, R0, M, msg, sizeof msg));
    OK(ro->stats(rs, &rc, R0, M, msg, sizeof msg));
    CHECK(*cc.row_check == FG_BACKEND_ROW_NONE && *rc.row_check == FG_BACKEND_ROW_NONE &&
              isfinite(cc.logp[7]) && isfinite(rc.logp[7]),
          "%s: every target inside: row_check %d / %d", dn, *cc.row_check, *rc.row_check);
    targets[R0 + 7] = V + 3;

    /* stats of the same logits */
    reset_check(&cc);
    reset_check(&rc);
    OK(co->stats(cs, &cc, R0, M, msg, sizeof msg));
    OK(ro->stats(rs, &rc, R0, M, msg, sizeof msg));
    CHECK(*cc.row_check == 7 && *rc.row_check == 7, "%s: row_check %d / %d, want 7", dn,
          *cc.row_check, *rc.row_check);
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

    /* shard_stats: one shard's own statistics, merged alone, are stats';
     * the by-token layout is the by-row one at each row's token; the
     * reference's of the same logits have the same maxima and target
     * logits, and merged, its statistics within float roundings. */
    const int64_t sfl = fg_shard_floats(M);
    float *sbuf = tu_xmalloc((size_t)sfl * sizeof(float));
    float *rbuf = tu_xmalloc((size_t)sfl * sizeof(float));
    float *tbuf = tu_xmalloc((size_t)fg_shard_floats(NTOK) * sizeof(float));
    OK(co->shard_stats(cs, &cc, R0, M, sbuf, M, 0, msg, sizeof msg));
    OK(co->shard_stats(cs, &cc, R0, M, tbuf, NTOK, 1, msg, sizeof msg));
    OK(ro->shard_stats(rs, &rc, R0, M, rbuf, M, 0, msg, sizeof msg));
    int by_token = 1;
    for (int64_t i = 0; i < M; i++)
        by_token &= same_local(sbuf, M, i, tbuf, NTOK, rows[R0 + i]);
    CHECK(by_token, "%s: shard_stats by token differs from by row", dn);
    CHECK(memcmp(sbuf, rbuf, 2 * M * sizeof(float)) == 0,
          "%s: shard_stats' maxima or target logits differ from the reference's", dn);
    for (int64_t i = 0; i < M; i++) {
        fg_shard_encode(sbuf, M, i);
        fg_shard_encode(rbuf, M, i);
    }
    double sworst = 0.0, rworst = 0.0;
    int decoded = 1;
    for (int64_t i = 0; i < M; i++) {
        float st[4], rt[4];
        decoded &= fg_shard_decode(sbuf, M, i, &st[0], &st[1], &st[2], &st[3]) == 0;
        decoded &= fg_shard_decode(rbuf, M, i, &rt[0], &rt[1], &rt[2], &rt[3]) == 0;
        static const int order[4] = {0, 1, 3, 2}; /* decode: zmax, lsum, logp, entropy */
        for (int q = 0; q < 4 && i != 7; q++) { /* row 7: another shard's token */
            sworst = fmax(sworst, fabs(st[q] - cs_arr[order[q]][i]) /
                                      fmax(fabs(cs_arr[order[q]][i]), 1.0));
            rworst = fmax(rworst, fabs(st[q] - rt[q]) / fmax(fabs(rt[q]), 1.0));
        }
    }
    CHECK(decoded, "%s: shard_stats did not decode", dn);
    snprintf(name, sizeof name, "cpu backend shard_stats merged alone");
    TOL_CHECK(name, sworst, 4e-7, "%s shard_stats vs stats", dn);
    TOL_CHECK("cpu backend shard_stats vs reference", rworst, 6e-7, "%s shard_stats", dn);
    free(sbuf);
    free(rbuf);
    free(tbuf);

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
    snprintf(name, sizeof name, "cpu backend dlogits %s", dtype_name(dl));
    TOL_CHECK(name, rel_max(cc.dlogits, rc.dlogits, dl, (int64_t)M * V),
              dl == FG_DTYPE_BF16 ? 8e-3 : 5e-7, "%s dlogits", dn);
    snprintf(name, sizeof name, "cpu backend bias sums %s", dtype_name(dl));
    TOL_CHECK(name, rel_max(cc.gb_sum, rc.gb_sum, FG_DTYPE_F32, V),
              dl == FG_DTYPE_BF16 ? 1e-2 : 1e-6, "%s bias sums", dn);

    /* grads: GEMM 2 into the tokens' rows, GEMM 3 overwritten then added */
    const size_t dbytes = (size_t)M * V * fg_dtype_size(dl);
    const size_t ghbytes = (size_t)NTOK * H * fg_dtype_size(in_t);
    float *gw_first = tu_xmalloc((size_t)V * H * sizeof(float));
    memcpy(rc.dlogits, cc.dlogits, dbytes);
    for (int first = 1; first >= 0; first--) {
        OK(co->grads(cs, &cc, R0, M, first, msg, sizeof msg));
        OK(ro->grads(rs, &rc, R0, M, first, msg, sizeof msg));
        if (first)
            memcpy(gw_first, gw_c, (size_t)V * H * sizeof(float));
        snprintf(name, sizeof name, "cpu backend grad_weight %s", dn);
        TOL_CHECK(name, rel_max(gw_c, gw_r, FG_DTYPE_F32, (int64_t)V * H),
                  dl == FG_DTYPE_BF16 ? 8e-3 : 1.5e-6, "%s grad_weight, first %d", dn, first);
    }
    snprintf(name, sizeof name, "cpu backend grad_hidden %s", dn);
    TOL_CHECK(name, rel_max(gh_c, gh_r, in_t, (int64_t)NTOK * H),
              dl == FG_DTYPE_BF16 ? 8e-3 : in_t == FG_DTYPE_BF16 ? 4e-3 : 2e-6, "%s grad_hidden",
              dn);

    /* 2. dhidden + put_grad_hidden = grads' GEMM 2, bitwise; dhidden against
     * the reference's of the same dlogits, and put_grad_hidden of the same
     * float32 rows bitwise the reference's. */
    void *gh_split = zalloc(ghbytes), *gh_rsplit = zalloc(ghbytes);
    fg_backend_call split = cc, rsplit = rc;
    split.grad_hidden.data = gh_split;
    rsplit.grad_hidden.data = gh_rsplit;
    OK(co->dhidden(cs, &split, R0, M, msg, sizeof msg));
    OK(co->put_grad_hidden(cs, &split, R0, M, msg, sizeof msg));
    CHECK(memcmp(gh_split, gh_c, ghbytes) == 0, "%s: dhidden + put_grad_hidden differ from grads",
          dn);
    OK(ro->dhidden(rs, &rsplit, R0, M, msg, sizeof msg));
    TOL_CHECK("cpu backend dhidden vs reference",
              rel_max(split.ghbuf, rsplit.ghbuf, FG_DTYPE_F32, (int64_t)M * H), 2e-6,
              "%s dhidden (%s dlogits)", dn, dtype_name(dl));
    memcpy(rsplit.ghbuf, split.ghbuf, (size_t)M * H * sizeof(float));
    OK(ro->put_grad_hidden(rs, &rsplit, R0, M, msg, sizeof msg));
    CHECK(memcmp(gh_split, gh_rsplit, ghbytes) == 0,
          "%s: put_grad_hidden differs from the reference's", dn);
    free(gh_split);
    free(gh_rsplit);

    /* filter where every row keeps more than kept_cap (each keeps every
     * entry): *kept_count += m * V, dlogits untouched, grads (dense) bitwise
     * the unfiltered ones. */
    cc.kept_cap = fg_kept_cap(V);
    cc.kept_idx = tu_xmalloc((size_t)M * (size_t)cc.kept_cap * sizeof(int32_t));
    cc.kept_nnz = tu_xmalloc((size_t)M * sizeof(int32_t));
    cc.kept_tgt = tu_xmalloc((size_t)M * sizeof(int64_t));
    void *dl_keep = tu_xmalloc(dbytes), *gh_keep = tu_xmalloc(ghbytes);
    memcpy(dl_keep, cc.dlogits, dbytes);
    memcpy(gh_keep, gh_c, ghbytes);
    cc.filter_eps = 1e-12;
    int64_t kept = 0; /* filter adds to it */
    cc.kept_count = &kept;
    OK(co->filter(cs, &cc, R0, M, msg, sizeof msg));
    CHECK(kept == (int64_t)M * V && cpu.kept_total == -1 &&
              memcmp(dl_keep, cc.dlogits, dbytes) == 0,
          "%s: a dense filter reported %lld entries (kept_total %lld), want %lld", dn,
          (long long)kept, (long long)cpu.kept_total, (long long)M * V);
    OK(co->grads(cs, &cc, R0, M, 1, msg, sizeof msg));
    CHECK(memcmp(gw_c, gw_first, (size_t)V * H * sizeof(float)) == 0 &&
              memcmp(gh_c, gh_keep, ghbytes) == 0,
          "%s: grads after a dense filter differ from the unfiltered grads", dn);
    free(dl_keep);
    free(gh_keep);
    free(gw_first);

    /* stats_backward = stats, g and e, backward, bitwise */
    void *dl_once = tu_xmalloc(dbytes);
    float *gb_once = tu_xmalloc((size_t)V * sizeof(float));
    memset(cc.gb_sum, 0, (size_t)V * sizeof(float));
    reset_check(&cc);
    const fg_backend_derivs d = {derivs_at, NULL};
    OK(co->stats_backward(cs, &cc, R0, M, &d, msg, sizeof msg));
    CHECK(*cc.row_check == 7, "%s: stats_backward row_check %d", dn, *cc.row_check);
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
    cc.filter_eps = eps;
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
    kept = 0;
    OK(co->filter(cs, &cc, R0, M, msg, sizeof msg));
    CHECK(kept == kept_ref && cpu.kept_total == kept_ref,
          "%s: filter kept %lld entries (kept_total %lld), the rule %lld", dn, (long long)kept,
          (long long)cpu.kept_total, (long long)kept_ref);
    OK(co->grads(cs, &cc, R0, M, 1, msg, sizeof msg));
    OK(ro->grads(rs, &rc, R0, M, 1, msg, sizeof msg));
    snprintf(name, sizeof name, "cpu backend filtered grad_weight %s", dn);
    TOL_CHECK(name, rel_max(gw_c, gw_r, FG_DTYPE_F32, (int64_t)V * H), 2e-7,
              "%s filtered grad_weight", dn);
    snprintf(name, sizeof name, "cpu backend filtered grad_hidden %s", dn);
    TOL_CHECK(name, rel_max(gh_c, gh_r, in_t, (int64_t)NTOK * H),
              in_t == FG_DTYPE_BF16 ? 4e-3 : 2e-7, "%s filtered grad_hidden", dn);
    cc.filter_eps = 0.0;
    cc.kept_cap = 0;
    free(cc.kept_idx), free(cc.kept_nnz), free(cc.kept_tgt);
    cc.kept_idx = cc.kept_nnz = NULL;
    cc.kept_tgt = NULL;

    /* finish: float32 sums into a bf16 grad_weight, over the caller's values
     * (accumulating) or not; grad_bias = the bias sums, which the driver
     * seeded with the caller's values when accumulating (here the test
     * does), rounded once to bf16 or copied to a float32 one; with no token
     * unmasked and not accumulating, grad_weight zeroed. Masked rows of
     * grad_hidden zeroed. Elementwise: bitwise the reference's. */
    for (int acc = 0; acc < 3; acc++) {
        const int accumulate = acc == 1, none = acc == 2;
        float *gws = zalloc((size_t)V * H * sizeof(float));
        float *gbs = zalloc((size_t)V * sizeof(float));
        uint16_t *gw16[2] = {zalloc((size_t)V * H * 2), zalloc((size_t)V * H * 2)};
        uint16_t *gb16[2] = {zalloc((size_t)V * 2), zalloc((size_t)V * 2)};
        float *gb32[2] = {zalloc((size_t)V * 4), zalloc((size_t)V * 4)};
        for (int64_t i = 0; i < (int64_t)V * H; i++) {
            gws[i] = (float)tu_normal(&rng);
            gw16[0][i] = gw16[1][i] = (uint16_t)(0x3f80 + (i % 97));
        }
        for (int64_t v = 0; v < V; v++) {
            gb16[0][v] = gb16[1][v] = (uint16_t)(0xbf00 + (v % 31));
            gbs[v] = (accumulate ? fg_bf16_to_f32(gb16[0][v]) : 0.0f) +
                     (none ? 0.0f : (float)tu_normal(&rng));
        }
        const fg_backend_call *fc[2] = {&cc, &rc};
        for (int b = 0; b < 2; b++) {
            fg_backend_call f = *fc[b];
            f.accumulate = accumulate;
            f.n_active = none ? 0 : NACT;
            f.gw_sum = gws;
            f.gb_sum = gbs;
            f.grad_weight = (fg_matrix){gw16[b], FG_DTYPE_BF16, V, H, H};
            f.grad_bias = (fg_vector){gb16[b], FG_DTYPE_BF16, V};
            OK((b ? ro : co)->finish(b ? rs : cs, &f, msg, sizeof msg));
            f.grad_hidden.data = NULL; /* a float32 grad_bias */
            f.grad_weight.data = NULL;
            f.grad_bias = (fg_vector){gb32[b], FG_DTYPE_F32, V};
            OK((b ? ro : co)->finish(b ? rs : cs, &f, msg, sizeof msg));
        }
        CHECK(memcmp(gw16[0], gw16[1], (size_t)V * H * 2) == 0 &&
                  memcmp(gb16[0], gb16[1], (size_t)V * 2) == 0 &&
                  memcmp(gb32[0], gb32[1], (size_t)V * 4) == 0,
              "%s: finish differs from the reference (accumulate %d, n_active %d)", dn,
              accumulate, none ? 0 : NACT);
        int gw_ok = 1, gb_ok = memcmp(gb32[0], gbs, (size_t)V * 4) == 0;
        for (int64_t v = 0; v < V; v++)
            gb_ok &= gb16[0][v] == fg_f32_to_bf16(gbs[v]);
        for (int64_t i = 0; i < (int64_t)V * H; i++) {
            const uint16_t was = (uint16_t)(0x3f80 + (i % 97));
            const uint16_t want = none ? 0
                                       : fg_f32_to_bf16(gws[i] +
                                                        (accumulate ? fg_bf16_to_f32(was) : 0.0f));
            gw_ok &= gw16[0][i] == want;
        }
        CHECK(gw_ok && gb_ok,
              "%s: finish's grad_weight %s, grad_bias %s (accumulate %d, n_active %d)", dn,
              gw_ok ? "ok" : "wrong", gb_ok ? "ok" : "not the bias sums", accumulate,
              none ? 0 : NACT);
        free(gws);
        free(gbs);
        for (int b = 0; b < 2; b++) {
            free(gw16[b]);
            free(gb16[b]);
            free(gb32[b]);
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

/* ------------------------------------------------------------------ part 3 */

enum { DB = 3, DT = 23, DH = 24, DV = 67, DN = DB * DT };

/* How a walk sees the CPU backend: as it is (host memory, used in place);
 * without FG_BACKEND_HOST_MEMORY (the staged path); staged and without the
 * optional ops that the driver can do without here (stats_backward; dhidden
 * and put_grad_hidden, which only the communicator hook needs). */
enum walk { WALK_HOST, WALK_STAGED, WALK_BARE, WALKS };
static const char *const walk_name[WALKS + 1] = {"host", "staged", "staged without fusion",
                                                 "public entry"};

/* An optional op taken away from the ops table (the refusals). */
enum drop { DROP_NONE, DROP_FILTER, DROP_SHARD_STATS };

/* What one call did: its chunks, the dlogits entries its products used
 * and kept, and (a walk without FG_BACKEND_HOST_MEMORY) the backend memory
 * ops it made. */
typedef struct call_report {
    int64_t chunks, entries, kept;
    int64_t allocs, releases, to_host, to_device, waits;
    char msg[sizeof ((fg_error *)0)->msg];
} call_report;

/* The staged walks' memory ops, counted on their way to the CPU's own. */
static struct {
    const fg_backend_ops *ops;
    int64_t allocs, releases, to_host, to_device, waits;
} counted;

static fg_status count_alloc(void *be, size_t bytes, void **ptr, char *msg, size_t n)
{
    counted.allocs++;
    return counted.ops->alloc(be, bytes, ptr, msg, n);
}
static void count_release(void *be, void *ptr)
{
    counted.releases++;
    counted.ops->release(be, ptr);
}
static fg_status count_to_host(void *be, void *host, const void *src, size_t bytes, char *msg,
                               size_t n)
{
    counted.to_host++;
    return counted.ops->to_host(be, host, src, bytes, msg, n);
}
static fg_status count_to_device(void *be, void *dst, const void *host, size_t bytes, char *msg,
                                 size_t n)
{
    counted.to_device++;
    return counted.ops->to_device(be, dst, host, bytes, msg, n);
}
static fg_status count_wait(void *be, char *msg, size_t n)
{
    counted.waits++;
    return counted.ops->wait(be, msg, n);
}

/* One request through the one driver on the CPU backend of a fresh call at
 * `budget`, seen as walk w with op d taken away: planned (info non-NULL)
 * or run. */
static fg_status on_cpu(fg_context *ctx, enum walk w, enum drop d, size_t budget,
                        const fg_linear_options *o, const linear_request *req,
                        const fg_linear_inputs *in, fg_linear_outputs *out,
                        fg_linear_plan_info *info, call_report *rep)
{
    fg_exec ex;
    fg_exec_init(&ex);
    ex.memory_budget = budget;
    fg_call call;
    fg_status st = fg_call_begin(ctx, &ex, &call);
    if (st != FG_OK) {
        if (rep)
            snprintf(rep->msg, sizeof rep->msg, "fg_call_begin: %s", fg_last_error(ctx));
        return st;
    }
    fg_cpu_backend cpu;
    fg_device dev;
    fg_backend_cpu_init(&cpu, &call, &dev);
    fg_backend_ops ops = *dev.ops;
    memset(&counted, 0, sizeof counted);
    counted.ops = dev.ops;
    if (w != WALK_HOST) {
        ops.caps &= ~(unsigned)FG_BACKEND_HOST_MEMORY;
        ops.alloc = count_alloc;
        ops.release = count_release;
        ops.to_host = count_to_host;
        ops.to_device = count_to_device;
        ops.wait = count_wait;
    }
    if (w == WALK_BARE) {
        ops.stats_backward = NULL;
        ops.dhidden = NULL;
        ops.put_grad_hidden = NULL;
    }
    if (d == DROP_FILTER)
        ops.filter = NULL;
    if (d == DROP_SHARD_STATS)
        ops.shard_stats = NULL;
    const fg_device copy = {&ops, dev.state};
    const fg_device *be = w == WALK_HOST && d == DROP_NONE ? &dev : &copy;
    st = info ? fg_linear_plan_request(&call, be, o, req, in, out, info)
              : fg_linear_run(&call, be, o, req, in, out);
    if (rep) {
        rep->chunks = call.chunks;
        rep->entries = call.dlogits_entries;
        rep->kept = call.dlogits_kept;
        rep->allocs = counted.allocs;
        rep->releases = counted.releases;
        rep->to_host = counted.to_host;
        rep->to_device = counted.to_device;
        rep->waits = counted.waits;
        snprintf(rep->msg, sizeof rep->msg, "%s", st == FG_OK ? "" : call.err->msg);
    }
    return fg_call_end(&call, st);
}

/* The chunks every walk must walk alike (a bf16 grad_weight's float32 sums
 * too: they set the order of its additions). */
static int same_plan(const fg_linear_plan_info *a, const fg_linear_plan_info *b)
{
    return a->chunks == b->chunks && a->chunk_rows == b->chunk_rows &&
           a->later_chunk_rows == b->later_chunk_rows && a->gemm_dtype == b->gemm_dtype &&
           (a->grad_weight_sum_bytes != 0) == (b->grad_weight_sum_bytes != 0);
}

/* The least budget, in 256-byte steps from the least the plan query gives,
 * whose plan on walk w walks want's chunks; want NULL: 2 or 3 chunks, else
 * (a host backend's arena grows in whole pages, several rows here) the
 * fewest of 2 or more. 0 when none does. */
static size_t budget_for(fg_context *ctx, enum walk w, const fg_linear_options *o,
                         const linear_request *req, const fg_linear_inputs *in,
                         fg_linear_outputs *out, const fg_linear_plan_info *want,
                         fg_linear_plan_info *info)
{
    fg_linear_plan_info p;
    memset(&p, 0, sizeof p);
    if (on_cpu(ctx, w, DROP_NONE, 1, o, req, in, out, &p, NULL) != FG_ERR_BUDGET_TOO_SMALL)
        return 0;
    size_t several = 0;
    for (size_t b = p.min_budget_bytes; b > 0 && b < ((size_t)1 << 24); b += 256) {
        if (on_cpu(ctx, w, DROP_NONE, b, o, req, in, out, &p, NULL) != FG_OK)
            continue;
        if (want ? same_plan(&p, want) : p.chunks >= 2 && p.chunks <= 3) {
            *info = p;
            return b;
        }
        if (!want && p.chunks >= 2 && (!several || p.chunks < info->chunks)) {
            several = b;
            *info = p;
        }
        if (p.chunks < (want ? want->chunks : 2))
            break;
    }
    return several;
}

/* The outputs of one walk: gradients of dtype gt, the phase API's stats. */
typedef struct outs {
    fg_dtype gt;
    float *logp, *entropy, *stats;
    void *gh, *gw, *gb;
    fg_linear_outputs out;
} outs;

static const size_t STATS_BYTES = (size_t)FG_SHARD_STATS_FLOATS(DN) * sizeof(float);

static void outs_make(outs *o, fg_dtype gt, int with_grad_bias)
{
    memset(o, 0, sizeof *o);
    const size_t g = fg_dtype_size(gt);
    o->gt = gt;
    o->logp = tu_xmalloc(DN * sizeof(float));
    o->entropy = tu_xmalloc(DN * sizeof(float));
    o->stats = tu_xmalloc(STATS_BYTES);
    o->gh = tu_xmalloc((size_t)DN * DH * g);
    o->gw = tu_xmalloc((size_t)DV * DH * g);
    o->gb = tu_xmalloc((size_t)DV * g);
    o->out.logp = o->logp;
    o->out.entropy = o->entropy;
    o->out.grad_hidden = fg_matrix_make(o->gh, gt, DN, DH);
    o->out.grad_weight = fg_matrix_make(o->gw, gt, DV, DH);
    o->out.grad_bias = fg_vector_make(with_grad_bias ? o->gb : NULL, gt, DV);
}

static void outs_free(outs *o)
{
    free(o->logp), free(o->entropy), free(o->stats), free(o->gh), free(o->gw), free(o->gb);
}

/* Every output byte (loss and metrics too): set to v, equal to v, equal. */
static void outs_fill(outs *o, unsigned char v)
{
    const size_t g = fg_dtype_size(o->gt);
    memset(&o->out.loss, v, sizeof o->out.loss);
    memset(&o->out.metrics, v, sizeof o->out.metrics);
    memset(o->logp, v, DN * sizeof(float));
    memset(o->entropy, v, DN * sizeof(float));
    memset(o->stats, v, STATS_BYTES);
    memset(o->gh, v, (size_t)DN * DH * g);
    memset(o->gw, v, (size_t)DV * DH * g);
    memset(o->gb, v, (size_t)DV * g);
}

static int outs_are(const outs *o, unsigned char v)
{
    const size_t g = fg_dtype_size(o->gt);
    return tu_bytes_are(&o->out.loss, sizeof o->out.loss, v) &&
           tu_bytes_are(&o->out.metrics, sizeof o->out.metrics, v) &&
           tu_bytes_are(o->logp, DN * sizeof(float), v) &&
           tu_bytes_are(o->entropy, DN * sizeof(float), v) &&
           tu_bytes_are(o->stats, STATS_BYTES, v) &&
           tu_bytes_are(o->gh, (size_t)DN * DH * g, v) &&
           tu_bytes_are(o->gw, (size_t)DV * DH * g, v) && tu_bytes_are(o->gb, (size_t)DV * g, v);
}

static int outs_same(const outs *a, const outs *b)
{
    const size_t g = fg_dtype_size(a->gt);
    return memcmp(&a->out.loss, &b->out.loss, sizeof a->out.loss) == 0 &&
           memcmp(&a->out.metrics, &b->out.metrics, sizeof a->out.metrics) == 0 &&
           memcmp(a->logp, b->logp, DN * sizeof(float)) == 0 &&
           memcmp(a->entropy, b->entropy, DN * sizeof(float)) == 0 &&
           memcmp(a->stats, b->stats, STATS_BYTES) == 0 &&
           memcmp(a->gh, b->gh, (size_t)DN * DH * g) == 0 &&
           memcmp(a->gw, b->gw, (size_t)DV * DH * g) == 0 &&
           memcmp(a->gb, b->gb, (size_t)DV * g) == 0;
}

static void outs_copy(outs *dst, const outs *src)
{
    const size_t g = fg_dtype_size(src->gt);
    dst->out.loss = src->out.loss;
    dst->out.metrics = src->out.metrics;
    memcpy(dst->logp, src->logp, DN * sizeof(float));
    memcpy(dst->entropy, src->entropy, DN * sizeof(float));
    memcpy(dst->stats, src->stats, STATS_BYTES);
    memcpy(dst->gh, src->gh, (size_t)DN * DH * g);
    memcpy(dst->gw, src->gw, (size_t)DV * DH * g);
    memcpy(dst->gb, src->gb, (size_t)DV * g);
}

/* What a request of kind k writes of o (the loss kind: all of o->out). */
static fg_linear_outputs *outs_for(outs *o, enum call_kind k, fg_linear_outputs *view)
{
    if (k == KIND_LOSS)
        return &o->out;
    *view = o->out;
    if (k == KIND_LOGPROBS || k == KIND_SHARD_STATS) {
        view->grad_hidden.data = NULL;
        view->grad_weight.data = NULL;
        view->grad_bias.data = NULL;
    }
    if (k != KIND_LOGPROBS)
        view->logp = view->entropy = NULL;
    return view;
}

/* The request through its public entry point at `budget`. */
static fg_status public_call(fg_context *ctx, const fg_linear_options *o,
                             const linear_request *req, const fg_linear_inputs *in,
                             fg_linear_outputs *out, size_t budget)
{
    fg_exec ex;
    fg_exec_init(&ex);
    ex.memory_budget = budget;
    const double t = req->cfg->temperature;
    fg_linear_grads g = {out->grad_hidden, out->grad_weight, out->grad_bias, out->accumulate};
    switch (req->kind) {
    case KIND_LOSS:
        return fg_linear_grpo(ctx, o, req->cfg, in, req->batch, out, &ex);
    case KIND_LOGPROBS:
        return fg_linear_logprobs(ctx, o, t, in, req->tokens, out->logp, out->entropy, &ex);
    case KIND_LOGPROBS_BACKWARD:
        return fg_linear_logprobs_backward(ctx, o, t, in, req->tokens, req->dlogp, req->dentropy,
                                           &g, &ex);
    case KIND_SHARD_STATS:
        return fg_linear_shard_stats(ctx, o, t, in, req->tokens, req->stats_out, &ex);
    case KIND_SHARD_BACKWARD:
        return fg_linear_shard_backward(ctx, o, t, in, req->tokens, req->stats_in, req->dlogp,
                                        req->dentropy, &g, &ex);
    }
    return FG_ERR_UNSUPPORTED;
}

/* Runs req on every walk, each in the same chunks (the least budget its
 * plan query gives the host walk's plan for, the host walk's the least of
 * 2 or 3 chunks), and through the public entry point at the host walk's
 * budget, into ov[0 .. WALKS]: every output bitwise the host walk's.
 * accumulate: ov[0] holds the gradients to add to, copied to the others
 * first; else every output byte starts as 0x5a. *info: the host walk's
 * plan; rep[w]: what each walk did. Returns 1 when every call ran. */
static int walks(fg_context *ctx, const char *tag, const fg_linear_options *o,
                 const linear_request *req, const fg_linear_inputs *in, outs *ov, int accumulate,
                 fg_linear_plan_info *info, call_report *rep)
{
    linear_request r[WALKS + 1];
    fg_linear_outputs view[WALKS + 1], *out[WALKS + 1];
    for (int w = 0; w <= WALKS; w++) {
        r[w] = *req;
        if (req->kind == KIND_SHARD_STATS)
            r[w].stats_out = ov[w].stats;
        if (w > 0 && accumulate)
            outs_copy(&ov[w], &ov[0]);
        else if (!accumulate)
            outs_fill(&ov[w], 0x5a);
        out[w] = outs_for(&ov[w], req->kind, &view[w]);
    }
    fg_linear_plan_info plan[WALKS];
    size_t budget[WALKS];
    budget[WALK_HOST] = budget_for(ctx, WALK_HOST, o, &r[0], in, out[0], NULL, &plan[0]);
    CHECK(budget[WALK_HOST] > 0, "%s: no budget plans 2 or 3 chunks", tag);
    if (!budget[WALK_HOST])
        return 0;
    *info = plan[0];
    int ran = 1;
    for (int w = 0; w < WALKS; w++) {
        if (w > 0) {
            budget[w] = budget_for(ctx, (enum walk)w, o, &r[w], in, out[w], &plan[0], &plan[w]);
            call_report q;
            fg_linear_plan_info qi;
            on_cpu(ctx, (enum walk)w, DROP_NONE, budget[w], o, &r[w], in, out[w], &qi, &q);
            CHECK(q.allocs == 0 && q.releases == 0 && q.to_device == 0,
                  "%s %s walk: the plan query allocated %lld times, copied in %lld", tag,
                  walk_name[w], (long long)q.allocs, (long long)q.to_device);
        }
        CHECK(budget[w] > 0, "%s %s walk: no budget plans the host walk's %lld chunks of %lld "
              "rows", tag, walk_name[w], (long long)plan[0].chunks, (long long)plan[0].chunk_rows);
        if (!budget[w]) {
            ran = 0;
            continue;
        }
        const fg_status st =
            on_cpu(ctx, (enum walk)w, DROP_NONE, budget[w], o, &r[w], in, out[w], NULL, &rep[w]);
        CHECK(st == FG_OK && rep[w].chunks == plan[0].chunks && rep[w].chunks >= 2,
              "%s %s walk: %s (%s), %lld chunks, the plan %lld", tag, walk_name[w],
              fg_status_name(st), rep[w].msg, (long long)rep[w].chunks,
              (long long)plan[0].chunks);
        ran &= st == FG_OK;
        /* Staged: the workspace from the backend's alloc, released; bytes
         * copied both ways. */
        if (w != WALK_HOST)
            CHECK(rep[w].allocs == 1 && rep[w].releases == 1 && rep[w].to_host > 0 &&
                      rep[w].to_device > 0 && rep[w].waits > 0,
                  "%s %s walk: %lld allocs, %lld releases, %lld copies out, %lld in, %lld "
                  "waits", tag, walk_name[w], (long long)rep[w].allocs,
                  (long long)rep[w].releases, (long long)rep[w].to_host,
                  (long long)rep[w].to_device, (long long)rep[w].waits);
    }
    const fg_status st = public_call(ctx, o, &r[WALKS], in, out[WALKS], budget[WALK_HOST]);
    fg_memory_stats ms;
    fg_get_memory_stats(ctx, &ms);
    CHECK(st == FG_OK && ms.chunks == plan[0].chunks, "%s public entry: %s (%s), %lld chunks",
          tag, fg_status_name(st), fg_last_error(ctx), (long long)ms.chunks);
    ran &= st == FG_OK;
    for (int w = 1; w <= WALKS && ran; w++)
        CHECK(outs_same(&ov[0], &ov[w]), "%s: the %s walk's outputs differ from the host walk's",
              tag, walk_name[w]);
    printf("%s %s products, %lld chunks of %lld rows (later %lld)%s; budgets host %zu, "
           "staged %zu, bare %zu\n",
           tag, dtype_name(plan[0].gemm_dtype), (long long)plan[0].chunks,
           (long long)plan[0].chunk_rows, (long long)plan[0].later_chunk_rows,
           plan[0].grad_weight_sum_bytes ? ", grad_weight summed in float32" : "",
           budget[WALK_HOST], budget[WALK_STAGED], budget[WALK_BARE]);
    return ran;
}

/* Gradient tolerances against the oracle (relative L2 over the array):
 * float32 products and gradients; the products' dlogits rounded to bf16;
 * gradients stored in bf16. */
static const char *grad_tol(fg_dtype gt, fg_dtype cmp, double *tol)
{
    if (gt == FG_DTYPE_BF16) {
        *tol = 8e-3;
        return "cpu backend walk gradients stored in bf16";
    }
    if (cmp == FG_DTYPE_BF16) {
        *tol = 6e-3;
        return "cpu backend walk gradients, bf16 products";
    }
    *tol = 2e-6;
    return "cpu backend walk gradients";
}

/* times x a double array of n. */
static double *scaled(const double *x, int64_t n, double times)
{
    double *y = tu_xmalloc((size_t)n * sizeof(double));
    for (int64_t i = 0; i < n; i++)
        y[i] = times * x[i];
    return y;
}

/* One walk's outputs against the oracle's: the loss and metrics (cfg:
 * the loss kind), logp and entropy (tokens), the gradients times `times`
 * (grads: calls accumulated); 0 at masked tokens. */
static void against_oracle(const char *tag, const char *walk, const fg_loss_config *cfg,
                           const tu_batch *tb, const fg_oracle_result *ref, const outs *o,
                           fg_dtype cmp, int tokens, int grads, double times, int with_bias)
{
    if (cfg) {
        const double scale = fg_oracle_loss_scale(cfg, &tb->view, ref->logp, ref->entropy);
        TOL_CHECK("cpu backend walk loss", tu_rel_err(o->out.loss, ref->loss, scale), 1e-6,
                  "%s %s", tag, walk);
        TOL_CHECK("cpu backend walk loss",
                  tu_rel_err(o->out.metrics.policy_loss, ref->metrics.policy_loss, scale), 1e-6,
                  "%s %s policy_loss", tag, walk);
        TOL_CHECK("cpu backend walk logp", tu_rel_err(o->out.metrics.kl, ref->metrics.kl, 1.0),
                  1e-6, "%s %s kl metric", tag, walk);
        TOL_CHECK("cpu backend walk entropy",
                  tu_rel_err(o->out.metrics.entropy, ref->metrics.entropy, 1.0), 4e-6,
                  "%s %s entropy metric", tag, walk);
    }
    int zero = 1;
    if (tokens) {
        TOL_CHECK("cpu backend walk logp", tu_max_rel(o->logp, ref->logp, DN, tb->mask, 1.0),
                  1e-6, "%s %s logp", tag, walk);
        TOL_CHECK("cpu backend walk entropy",
                  tu_max_rel(o->entropy, ref->entropy, DN, tb->mask, 1.0), 4e-6,
                  "%s %s entropy", tag, walk);
        for (int64_t n = 0; n < DN; n++)
            zero &= tb->mask[n] || (o->logp[n] == 0.0f && o->entropy[n] == 0.0f);
    }
    if (grads) {
        double tol;
        const char *name = grad_tol(o->gt, cmp, &tol);
        double *gh = scaled(ref->grad_hidden, DN * DH, 1.0); /* overwritten, never added to */
        double *gw = scaled(ref->grad_weight, DV * DH, times);
        TOL_CHECK(name, tu_rel_l2(o->gh, o->gt, DN, DH, DH, gh), tol, "%s %s grad_hidden", tag,
                  walk);
        TOL_CHECK(name, tu_rel_l2(o->gw, o->gt, DV, DH, DH, gw), tol, "%s %s grad_weight", tag,
                  walk);
        if (with_bias) {
            double *gb = scaled(ref->grad_bias, DV, times);
            TOL_CHECK(name, tu_rel_l2(o->gb, o->gt, 1, DV, DV, gb), tol, "%s %s grad_bias", tag,
                      walk);
            free(gb);
        }
        for (int64_t n = 0; n < DN; n++)
            for (int64_t h = 0; h < DH && !tb->mask[n]; h++)
                zero &= tu_load(o->gh, o->gt, n * DH + h) == 0.0;
        free(gh);
        free(gw);
    }
    CHECK(zero, "%s %s: an output not 0 at a masked token", tag, walk);
}

static fg_loss_config walk_config(int lt, int lvl)
{
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = (fg_loss_type)lt;
    cfg.importance_sampling_level = (fg_is_level)lvl;
    cfg.temperature = 0.7;
    cfg.beta = 0.04;
    return cfg;
}

/* A loss of type lt at level lvl, inputs of dtype dt, gradients of gt; then
 * a second call accumulating into the first's gradients. */
static void loss_case(fg_context *ctx, int lt, int lvl, fg_dtype dt, fg_dtype gt)
{
    tu_problem prob;
    tu_problem_make(&prob, DB, DT, DH, DV, dt, 1, 977u + 13u * (uint64_t)lt);
    fg_loss_config cfg = walk_config(lt, lvl);
    char tag[128];
    snprintf(tag, sizeof tag, "[walk %s %s, %s inputs, %s gradients]", tu_loss_name(lt),
             tu_level_name(lvl), dtype_name(dt), dtype_name(gt));
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
    const linear_request req = {.kind = KIND_LOSS, .cfg = &cfg, .batch = batch};
    outs ov[WALKS + 1];
    for (int w = 0; w <= WALKS; w++)
        outs_make(&ov[w], gt, 1);
    fg_linear_plan_info info;
    call_report rep[WALKS];
    if (walks(ctx, tag, NULL, &req, &in, ov, 0, &info, rep)) {
        CHECK(dt == FG_DTYPE_BF16 || info.gemm_dtype == FG_DTYPE_F32, "%s: %s products", tag,
              dtype_name(info.gemm_dtype));
        for (int w = 0; w <= WALKS; w++)
            against_oracle(tag, walk_name[w], &cfg, &prob.tb, &ref, &ov[w], info.gemm_dtype, 1, 1,
                           1.0, 1);
    }
    /* accumulate = 1 into the first call's gradients: twice the gradient */
    char acc[160];
    snprintf(acc, sizeof acc, "%s accumulate", tag);
    for (int w = 0; w <= WALKS; w++)
        ov[w].out.accumulate = 1;
    if (walks(ctx, acc, NULL, &req, &in, ov, 1, &info, rep))
        for (int w = 0; w <= WALKS; w++)
            against_oracle(acc, walk_name[w], &cfg, &prob.tb, &ref, &ov[w], info.gemm_dtype, 1, 1,
                           2.0, 1);
    for (int w = 0; w <= WALKS; w++)
        outs_free(&ov[w]);
    fg_oracle_result_free(&ref);
    tu_problem_free(&prob);
}

/* The head's requests: fg_linear_logprobs, fg_linear_logprobs_backward;
 * the phase API's (a) fg_linear_shard_stats of one shard (rescaled and
 * finished: the log-probs) and (d) fg_linear_shard_backward from them. */
static void head_case(fg_context *ctx, fg_dtype dt)
{
    const double temperature = 0.9;
    tu_problem prob;
    tu_problem_make(&prob, DB, DT, DH, DV, dt, 1, 99u + (uint64_t)dt);
    const fg_batch *pb = tu_batch_view(&prob.tb);
    const fg_tokens tokens = {DB, DT, pb->token_ids, pb->mask};
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    double dlogp_d[DN], dent_d[DN];
    float dlogp[DN], dent[DN];
    for (int64_t n = 0; n < DN; n++) {
        dlogp[n] = (float)(0.3 * tu_normal(&prob.rng));
        dent[n] = (float)(0.1 * tu_normal(&prob.rng));
        dlogp_d[n] = dlogp[n];
        dent_d[n] = dent[n];
    }
    fg_oracle_result ref;
    if (fg_oracle_linear_head(pb, prob.hidden, prob.weight, prob.bias, DH, DV, temperature,
                              dlogp_d, dent_d, &ref) != 0) {
        CHECK(0, "%s", "head oracle failed");
        tu_problem_free(&prob);
        return;
    }
    outs ov[WALKS + 1];
    for (int w = 0; w <= WALKS; w++)
        outs_make(&ov[w], FG_DTYPE_F32, 1);
    fg_linear_plan_info info;
    call_report rep[WALKS];
    fg_loss_config cfg;
    fg_batch batch;
    linear_request req;
    char tag[96];

    snprintf(tag, sizeof tag, "[walk logprobs, %s inputs]", dtype_name(dt));
    fg_linear_head_request(&req, KIND_LOGPROBS, &cfg, &batch, temperature, &tokens, NULL,
                           NULL);
    if (walks(ctx, tag, NULL, &req, &in, ov, 0, &info, rep))
        for (int w = 0; w <= WALKS; w++)
            against_oracle(tag, walk_name[w], NULL, &prob.tb, &ref, &ov[w], info.gemm_dtype, 1,
                           0, 1.0, 1);

    snprintf(tag, sizeof tag, "[walk logprobs_backward, %s inputs]", dtype_name(dt));
    fg_linear_head_request(&req, KIND_LOGPROBS_BACKWARD, &cfg, &batch, temperature, &tokens,
                           dlogp, dent);
    if (walks(ctx, tag, NULL, &req, &in, ov, 0, &info, rep))
        for (int w = 0; w <= WALKS; w++)
            against_oracle(tag, walk_name[w], NULL, &prob.tb, &ref, &ov[w], info.gemm_dtype, 0,
                           1, 1.0, 1);

    /* (a), then one shard's reductions (the identity), (b) and finish */
    snprintf(tag, sizeof tag, "[walk shard_stats, %s inputs]", dtype_name(dt));
    fg_linear_head_request(&req, KIND_SHARD_STATS, &cfg, &batch, temperature, &tokens, NULL,
                           NULL);
    float *merged = tu_xmalloc(STATS_BYTES);
    outs fin;
    outs_make(&fin, FG_DTYPE_F32, 1);
    outs_fill(&fin, 0);
    int merged_ok = 0;
    if (walks(ctx, tag, NULL, &req, &in, ov, 0, &info, rep)) {
        memcpy(merged, ov[WALK_HOST].stats, STATS_BYTES);
        fg_status st = fg_shard_stats_rescale(ctx, &tokens, merged);
        if (st == FG_OK)
            st = fg_shard_stats_finish(ctx, &tokens, merged, fin.logp, fin.entropy);
        CHECK(st == FG_OK, "%s rescale and finish: %s", tag, fg_last_error(ctx));
        if (st == FG_OK)
            against_oracle(tag, "finished", NULL, &prob.tb, &ref, &fin, info.gemm_dtype, 1, 0,
                           1.0, 1);
        merged_ok = st == FG_OK;
    }
    /* (d) from the merged statistics */
    if (merged_ok) {
        snprintf(tag, sizeof tag, "[walk shard_backward, %s inputs]", dtype_name(dt));
        fg_linear_head_request(&req, KIND_SHARD_BACKWARD, &cfg, &batch, temperature, &tokens,
                               dlogp, dent);
        req.stats_in = merged;
        if (walks(ctx, tag, NULL, &req, &in, ov, 0, &info, rep))
            for (int w = 0; w <= WALKS; w++)
                against_oracle(tag, walk_name[w], NULL, &prob.tb, &ref, &ov[w], info.gemm_dtype,
                               0, 1, 1.0, 1);
    }
    free(merged);
    outs_free(&fin);
    for (int w = 0; w <= WALKS; w++)
        outs_free(&ov[w]);
    fg_oracle_result_free(&ref);
    tu_problem_free(&prob);
}

/* Gradient filtering on every walk: the same entries kept, the outputs
 * bitwise alike; the forward (loss, metrics, logp, entropy) and grad_bias
 * bitwise the unfiltered call's in the same chunks. */
static void filter_case(fg_context *ctx)
{
    tu_problem prob;
    tu_problem_make(&prob, DB, DT, DH, DV, FG_DTYPE_F32, 1, 977u + 13u * FG_LOSS_DAPO);
    fg_loss_config cfg = walk_config(FG_LOSS_DAPO, FG_LEVEL_TOKEN);
    const char *tag = "[walk dapo token, f32, filter_eps 0.3]";
    if (tu_problem_fill_logp(&prob, cfg.temperature, 0.2, 0.3) != 0) {
        CHECK(0, "%s oracle failed", tag);
        tu_problem_free(&prob);
        return;
    }
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    const linear_request req = {.kind = KIND_LOSS, .cfg = &cfg, .batch = batch};
    const fg_linear_options filt = {FG_IMPL_FUSED, 0, 0.3};
    outs ov[WALKS + 1], u;
    for (int w = 0; w <= WALKS; w++)
        outs_make(&ov[w], FG_DTYPE_F32, 1);
    outs_make(&u, FG_DTYPE_F32, 1);
    fg_linear_plan_info info, uinfo;
    call_report rep[WALKS], urep;
    if (walks(ctx, tag, &filt, &req, &in, ov, 0, &info, rep)) {
        for (int w = 0; w < WALKS; w++)
            CHECK(rep[w].entries > 0 && rep[w].kept < rep[w].entries &&
                      rep[w].kept == rep[0].kept && rep[w].entries == rep[0].entries,
                  "%s %s walk: %lld of %lld dlogits entries kept, the host walk %lld of %lld",
                  tag, walk_name[w], (long long)rep[w].kept, (long long)rep[w].entries,
                  (long long)rep[0].kept, (long long)rep[0].entries);
        printf("%s %lld of %lld dlogits entries kept\n", tag, (long long)rep[0].kept,
               (long long)rep[0].entries);
        const size_t b =
            budget_for(ctx, WALK_HOST, NULL, &req, &in, &u.out, &info, &uinfo);
        CHECK(b > 0, "%s: no budget plans the unfiltered call in the same chunks", tag);
        outs_fill(&u, 0x5a);
        const fg_status st =
            b ? on_cpu(ctx, WALK_HOST, DROP_NONE, b, NULL, &req, &in, &u.out, NULL, &urep)
              : FG_ERR_BUDGET_TOO_SMALL;
        CHECK(st == FG_OK && urep.kept == urep.entries, "%s unfiltered: %s (%s)", tag,
              fg_status_name(st), urep.msg);
        CHECK(memcmp(&u.out.loss, &ov[0].out.loss, sizeof u.out.loss) == 0 &&
                  memcmp(&u.out.metrics, &ov[0].out.metrics, sizeof u.out.metrics) == 0 &&
                  memcmp(u.logp, ov[0].logp, DN * sizeof(float)) == 0 &&
                  memcmp(u.entropy, ov[0].entropy, DN * sizeof(float)) == 0 &&
                  memcmp(u.gb, ov[0].gb, DV * sizeof(float)) == 0,
              "%s: the forward or grad_bias differs from the unfiltered call's", tag);
    }
    outs_free(&u);
    for (int w = 0; w <= WALKS; w++)
        outs_free(&ov[w]);
    tu_problem_free(&prob);
}

/* No token unmasked, on every walk: the loss, its metrics and every output
 * bitwise alike; the per-token outputs and gradients zero. */
static void empty_case(fg_context *ctx)
{
    tu_problem prob;
    tu_problem_make(&prob, DB, DT, DH, DV, FG_DTYPE_F32, 1, 4242u);
    fg_loss_config cfg = walk_config(FG_LOSS_DAPO, FG_LEVEL_TOKEN);
    const char *tag = "[walk dapo token, f32, every token masked]";
    if (tu_problem_fill_logp(&prob, cfg.temperature, 0.2, 0.3) != 0)
        CHECK(0, "%s oracle failed", tag);
    memset(prob.tb.mask, 0, DN);
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    const linear_request req = {.kind = KIND_LOSS, .cfg = &cfg, .batch = batch};
    outs ov[WALKS];
    for (int w = 0; w < WALKS; w++) {
        outs_make(&ov[w], FG_DTYPE_F32, 1);
        outs_fill(&ov[w], 0x5a);
        call_report rep;
        const fg_status st = on_cpu(ctx, (enum walk)w, DROP_NONE, (size_t)1 << 22, NULL, &req,
                                    &in, &ov[w].out, NULL, &rep);
        CHECK(st == FG_OK, "%s %s walk: %s (%s)", tag, walk_name[w], fg_status_name(st),
              rep.msg);
        if (w > 0)
            CHECK(outs_same(&ov[0], &ov[w]), "%s: the %s walk differs from the host walk", tag,
                  walk_name[w]);
    }
    int zero = 1;
    for (int64_t i = 0; i < DN; i++)
        zero &= ov[0].logp[i] == 0.0f && ov[0].entropy[i] == 0.0f;
    for (int64_t i = 0; i < (int64_t)DN * DH; i++)
        zero &= ((float *)ov[0].gh)[i] == 0.0f;
    for (int64_t i = 0; i < (int64_t)DV * DH; i++)
        zero &= ((float *)ov[0].gw)[i] == 0.0f;
    for (int64_t i = 0; i < DV; i++)
        zero &= ((float *)ov[0].gb)[i] == 0.0f;
    CHECK(zero, "%s: an output not zero", tag);
    for (int w = 0; w < WALKS; w++)
        outs_free(&ov[w]);
    tu_problem_free(&prob);
}

/* A call needing an optional op the ops table lacks: FG_ERR_UNSUPPORTED
 * naming it, from the plan query (info not written) and from the call
 * (every output unchanged), on the host and the staged walk. */
static void refusals(fg_context *ctx)
{
    tu_problem prob;
    tu_problem_make(&prob, DB, DT, DH, DV, FG_DTYPE_F32, 1, 31337u);
    fg_loss_config cfg = walk_config(FG_LOSS_DAPO, FG_LEVEL_TOKEN);
    if (tu_problem_fill_logp(&prob, cfg.temperature, 0.2, 0.3) != 0)
        CHECK(0, "%s", "refusals: the oracle failed");
    const fg_batch *pb = tu_batch_view(&prob.tb);
    const fg_tokens tokens = {DB, DT, pb->token_ids, pb->mask};
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    outs o;
    outs_make(&o, FG_DTYPE_F32, 1);
    const fg_linear_options filt = {FG_IMPL_FUSED, 0, 1e-3};
    for (int d = DROP_FILTER; d <= DROP_SHARD_STATS; d++) {
        fg_loss_config hcfg;
        fg_batch hb;
        linear_request req = {.kind = KIND_LOSS, .cfg = &cfg, .batch = pb};
        const fg_linear_options *opts = &filt;
        const char *op = "filter";
        fg_linear_outputs view, *out = &o.out;
        if (d == DROP_SHARD_STATS) {
            fg_linear_head_request(&req, KIND_SHARD_STATS, &hcfg, &hb, 0.7, &tokens, NULL, NULL);
            req.stats_out = o.stats;
            opts = NULL;
            op = "shard_stats";
            out = outs_for(&o, KIND_SHARD_STATS, &view);
        }
        for (int w = WALK_HOST; w <= WALK_STAGED; w++) {
            fg_linear_plan_info info, none;
            memset(&info, 0x5a, sizeof info);
            memset(&none, 0x5a, sizeof none);
            call_report rep;
            fg_status st = on_cpu(ctx, (enum walk)w, (enum drop)d, (size_t)1 << 24, opts, &req,
                                  &in, out, &info, &rep);
            CHECK(st == FG_ERR_UNSUPPORTED && strstr(rep.msg, op) &&
                      memcmp(&info, &none, sizeof info) == 0,
                  "no %s, %s walk, plan query: %s (%s)", op, walk_name[w], fg_status_name(st),
                  rep.msg);
            outs_fill(&o, 0x5a);
            st = on_cpu(ctx, (enum walk)w, (enum drop)d, (size_t)1 << 24, opts, &req, &in, out,
                        NULL, &rep);
            CHECK(st == FG_ERR_UNSUPPORTED && strstr(rep.msg, op) &&
                      strstr(fg_last_error(ctx), op) && outs_are(&o, 0x5a),
                  "no %s, %s walk: %s (%s), outputs %s", op, walk_name[w], fg_status_name(st),
                  fg_last_error(ctx), outs_are(&o, 0x5a) ? "unchanged" : "written");
            if (w == WALK_HOST && d == DROP_FILTER)
                printf("[refusal] %s\n", rep.msg);
        }
    }
    outs_free(&o);
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
    loss_case(ctx, FG_LOSS_DAPO, FG_LEVEL_TOKEN, FG_DTYPE_F32, FG_DTYPE_F32);
    loss_case(ctx, FG_LOSS_GRPO, FG_LEVEL_SEQUENCE, FG_DTYPE_F32, FG_DTYPE_F32);
    loss_case(ctx, FG_LOSS_DAPO, FG_LEVEL_TOKEN, FG_DTYPE_BF16, FG_DTYPE_F32);
    loss_case(ctx, FG_LOSS_DAPO, FG_LEVEL_TOKEN, FG_DTYPE_BF16, FG_DTYPE_BF16);
    loss_case(ctx, FG_LOSS_GRPO, FG_LEVEL_SEQUENCE, FG_DTYPE_BF16, FG_DTYPE_BF16);
    head_case(ctx, FG_DTYPE_F32);
    head_case(ctx, FG_DTYPE_BF16);
    filter_case(ctx);
    empty_case(ctx);
    refusals(ctx);
    fg_context_destroy(ctx);
    return tu_finish();
}
