/*
 * The phase API of a vocab-sharded call (fusedgrpo.h, "phases of a
 * vocab-sharded call"), its reductions done here as a framework would do
 * them, one shard after another in one process:
 *   (a) fg_linear_shard_stats on every shard; MAX over the shards;
 *   (b) fg_shard_stats_rescale; SUM over the shards; fg_shard_stats_finish;
 *   (c) fg_grpo_loss_from_logp;
 *   (d) fg_linear_shard_backward; grad_hidden summed over the shards.
 * Checked:
 *   - against the float64 oracle (loss, logp, entropy, the three gradients);
 *   - against one process's fg_linear_grpo: loss and logp within 1e-5
 *     relative, gradients within 1e-4 (the sharded paths' bounds);
 *   - every shard gets the same bits, and the SUM in two orders (shards
 *     forward and backward) gives the same bits: the merge is exact;
 *   - a shard given a bad token id or NaN hidden states makes every shard's
 *     next phase return that status; a batch with every token masked.
 * Odd sizes, uneven shards (one of them without the target of any token is
 * likely), 1 to 4 shards, f32 and bf16, token and sequence level, beta != 0.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "test_util.h"

#define MAX_SHARDS 4

/* Against the oracle: each the smallest round number >= 4x the worst
 * measured (AVX2, this test; measured worst in the comment). */
/* The loss from logp, phase (c): a CPU entry point, on a CPU context
 * whatever backend the GEMM phases run on (FG_TEST_BACKEND). */
static fg_context *ctx_host;

static const double TOL_LOSS = 3e-6;    /* |a-b| / max(|b|, scale); 6.8e-7 */
static const double TOL_LOGP = 2e-6;    /* max |a-b| / max(|b|, 1) over tokens; 3.8e-7 */
static const double TOL_ENTROPY = 5e-6; /* the same; 1.2e-6 */
static const double TOL_GRAD = 5e-6;    /* relative L2; 1.2e-6 (f32 GEMMs, bf16 inputs too) */
/* bf16 inputs on a CPU with bf16 GEMM kernels (dlogits rounded to bf16 before
 * GEMMs 2 and 3): not measured here (AVX2); the bound of test_bf16_grads'
 * one-chunk products. */
static const double TOL_GRAD_BF16_GEMM = 2e-2;

typedef struct shard {
    int64_t v0, v1;
    float *stats;
    float *logp, *entropy, *dlogp, *dentropy;
    float *gh, *gw, *gb;
} shard;

static float *falloc(int64_t n) { return tu_xmalloc((size_t)n * sizeof(float)); }

/* Shard s's view of the problem's weight and bias. */
static fg_linear_inputs shard_inputs(const tu_problem *p, const shard *s)
{
    return tu_problem_shard_inputs(p, s->v0, s->v1);
}

/* MAX, then SUM, as a framework's allreduce would: in place on every shard.
 * The SUM is made twice, shards in order and in reverse, and both must give
 * the same bits (the limbs are exact integers). */
static void reduce_max(shard *sh, int P, int64_t N)
{
    for (int64_t i = 0; i < FG_SHARD_STATS_MAX_COUNT(N); i++) {
        float m = sh[0].stats[i];
        for (int s = 1; s < P; s++)
            m = sh[s].stats[i] > m ? sh[s].stats[i] : m;
        for (int s = 0; s < P; s++)
            sh[s].stats[i] = m;
    }
}

static int reduce_sum(shard *sh, int P, int64_t N)
{
    int same = 1;
    const int64_t o = FG_SHARD_STATS_SUM_OFFSET(N);
    for (int64_t i = o; i < o + FG_SHARD_STATS_SUM_COUNT(N); i++) {
        float fwd = 0, bwd = 0;
        for (int s = 0; s < P; s++)
            fwd += sh[s].stats[i];
        for (int s = P - 1; s >= 0; s--)
            bwd += sh[s].stats[i];
        same &= memcmp(&fwd, &bwd, sizeof fwd) == 0;
        for (int s = 0; s < P; s++)
            sh[s].stats[i] = fwd;
    }
    return same;
}

typedef struct tcase {
    const char *name;
    fg_dtype dtype;
    int shards;
    fg_loss_type loss;
    fg_is_level level;
    double beta, entropy_coef, temperature;
    int bias;
} tcase;

static void run_case(fg_context *ctx, const tcase *tc, uint64_t seed)
{
    const int64_t B = 3, T = 37, H = 45, V = 301, N = B * T;
    const int P = tc->shards;
    tu_problem prob;
    tu_problem_make(&prob, B, T, H, V, tc->dtype, tc->bias, seed);
    tu_problem_fill_logp(&prob, tc->temperature, 0.2, 0.2);
    prob.tb.is_mode = 0;
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_tokens tokens = {B, T, batch->token_ids, batch->mask};
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = tc->loss;
    cfg.importance_sampling_level = tc->level;
    cfg.beta = tc->beta;
    cfg.entropy_coef = tc->entropy_coef;
    cfg.temperature = tc->temperature;

    shard sh[MAX_SHARDS];
    for (int s = 0; s < P; s++) { /* uneven: the first shards are short */
        sh[s].v0 = s == 0 ? 0 : sh[s - 1].v1;
        sh[s].v1 = s == P - 1 ? V : V * (s + 1) / P - 11 * (P - 1 - s);
        const int64_t Vs = sh[s].v1 - sh[s].v0;
        sh[s].stats = falloc(FG_SHARD_STATS_FLOATS(N));
        sh[s].logp = falloc(N);
        sh[s].entropy = falloc(N);
        sh[s].dlogp = falloc(N);
        sh[s].dentropy = falloc(N);
        sh[s].gh = falloc(N * H);
        sh[s].gw = falloc(Vs * H);
        sh[s].gb = falloc(Vs);
    }
    fg_status st;
    /* (a), MAX, (b), SUM, finish */
    for (int s = 0; s < P; s++) {
        const fg_linear_inputs in = shard_inputs(&prob, &sh[s]);
        st = fg_linear_shard_stats(ctx, NULL, tc->temperature, &in, &tokens, sh[s].stats, NULL);
        CHECK(st == FG_OK, "%s shard %d stats: %s", tc->name, s, fg_last_error(ctx));
    }
    reduce_max(sh, P, N);
    for (int s = 0; s < P; s++)
        CHECK(fg_shard_stats_rescale(ctx, &tokens, sh[s].stats) == FG_OK, "%s rescale: %s",
              tc->name, fg_last_error(ctx));
    CHECK(reduce_sum(sh, P, N), "%s: the SUM's bits depend on the order of the shards", tc->name);
    for (int s = 0; s < P; s++) {
        st = fg_shard_stats_finish(ctx, &tokens, sh[s].stats, sh[s].logp, sh[s].entropy);
        CHECK(st == FG_OK, "%s shard %d finish: %s", tc->name, s, fg_last_error(ctx));
        CHECK(memcmp(sh[s].logp, sh[0].logp, (size_t)N * 4) == 0 &&
                  memcmp(sh[s].entropy, sh[0].entropy, (size_t)N * 4) == 0,
              "%s: shard %d's logp/entropy differ from shard 0's", tc->name, s);
    }
    /* (c) on every shard (the same inputs: the same bits) */
    fg_logp_outputs lo[MAX_SHARDS];
    for (int s = 0; s < P; s++) {
        memset(&lo[s], 0, sizeof lo[s]);
        lo[s].grad_logp = sh[s].dlogp;
        lo[s].grad_entropy = sh[s].dentropy;
        st = fg_grpo_loss_from_logp(ctx_host, &cfg, batch, sh[s].logp, sh[s].entropy, &lo[s],
                                    NULL);
        CHECK(st == FG_OK, "%s loss: %s", tc->name, fg_last_error(ctx_host));
    }
    /* (d), then grad_hidden summed over the shards */
    for (int s = 0; s < P; s++) {
        const fg_linear_inputs in = shard_inputs(&prob, &sh[s]);
        const int64_t Vs = sh[s].v1 - sh[s].v0;
        fg_linear_grads g = {fg_matrix_make(sh[s].gh, FG_DTYPE_F32, N, H),
                             fg_matrix_make(sh[s].gw, FG_DTYPE_F32, Vs, H),
                             fg_vector_make(tc->bias ? sh[s].gb : NULL, FG_DTYPE_F32, Vs), 0};
        st = fg_linear_shard_backward(ctx, NULL, tc->temperature, &in, &tokens, sh[s].stats,
                                      sh[s].dlogp, sh[s].dentropy, &g, NULL);
        CHECK(st == FG_OK, "%s shard %d backward: %s", tc->name, s, fg_last_error(ctx));
    }
    float *gh = falloc(N * H), *gw = falloc(V * H), *gb = falloc(V);
    for (int64_t i = 0; i < N * H; i++) {
        float acc = 0;
        for (int s = 0; s < P; s++)
            acc += sh[s].gh[i];
        gh[i] = acc;
    }
    for (int s = 0; s < P; s++) {
        memcpy(gw + sh[s].v0 * H, sh[s].gw, (size_t)(sh[s].v1 - sh[s].v0) * H * 4);
        memcpy(gb + sh[s].v0, sh[s].gb, (size_t)(sh[s].v1 - sh[s].v0) * 4);
    }

    /* One process, the same problem: fg_linear_grpo. */
    tu_linear_outs one;
    tu_linear_outs_make(&one, N, H, V, tc->bias);
    const fg_linear_inputs in1 = tu_problem_inputs(&prob);
    st = fg_linear_grpo(ctx, NULL, &cfg, &in1, batch, &one.out, NULL);
    CHECK(st == FG_OK, "%s one process: %s", tc->name, fg_last_error(ctx));
    double e_loss1 = tu_rel_err(lo[0].loss, one.out.loss, 1e-3);
    double e_lp1 = 0;
    for (int64_t n = 0; n < N; n++)
        if (batch->mask[n]) {
            const double e = fabs((double)sh[0].logp[n] - one.logp[n]) /
                             fmax(fabs((double)one.logp[n]), 1.0);
            e_lp1 = e > e_lp1 ? e : e_lp1;
        }
    CHECK(e_loss1 <= 1e-5, "%s: loss %.9g vs one process %.9g", tc->name, lo[0].loss, one.out.loss);
    CHECK(e_lp1 <= 1e-5, "%s: logp vs one process %.2e", tc->name, e_lp1);
    fg_linear_plan_info pi; /* bf16 GEMM kernels: dlogits rounded to bf16 (test_mpi.c) */
    memset(&pi, 0, sizeof pi);
    fg_linear_grpo_plan(ctx, NULL, &cfg, &in1, batch, &one.out, NULL, &pi);
    const double tol_one = pi.gemm_dtype == FG_DTYPE_BF16 ? 2e-2 : 1e-4;
    CHECK(tu_rel_l2f(gh, one.grad_hidden, N * H) <= tol_one &&
              tu_rel_l2f(gw, one.grad_weight, V * H) <= tol_one &&
              (!tc->bias || tu_rel_l2f(gb, one.grad_bias, V) <= tol_one),
          "%s: gradients vs one process: hidden %.2e weight %.2e", tc->name,
          tu_rel_l2f(gh, one.grad_hidden, N * H), tu_rel_l2f(gw, one.grad_weight, V * H));

    /* The oracle. */
    fg_oracle_result ora;
    if (fg_oracle_linear(&cfg, batch, prob.hidden, prob.weight, prob.bias, H, V, &ora) != 0) {
        CHECK(0, "%s: oracle failed", tc->name);
    } else {
        const double scale = fg_oracle_loss_scale(&cfg, batch, ora.logp, ora.entropy);
        TOL_CHECK("phases loss", fabs(lo[0].loss - ora.loss) / fmax(fabs(ora.loss), scale),
                  TOL_LOSS, "%s", tc->name);
        double e_lp = 0, e_ent = 0;
        for (int64_t n = 0; n < N; n++)
            if (batch->mask[n]) {
                e_lp = fmax(e_lp, fabs(sh[0].logp[n] - ora.logp[n]) / fmax(fabs(ora.logp[n]), 1));
                e_ent = fmax(e_ent, fabs(sh[0].entropy[n] - ora.entropy[n]) / fmax(ora.entropy[n], 1));
            }
        TOL_CHECK("phases logp", e_lp, TOL_LOGP, "%s", tc->name);
        TOL_CHECK("phases entropy", e_ent, TOL_ENTROPY, "%s", tc->name);
        const double errs[3] = {tu_rel_l2(gh, FG_DTYPE_F32, N, H, H, ora.grad_hidden),
                                tu_rel_l2(gw, FG_DTYPE_F32, V, H, H, ora.grad_weight),
                                tc->bias ? tu_rel_l2(gb, FG_DTYPE_F32, 1, V, V, ora.grad_bias) : 0};
        const double e = fmax(errs[0], fmax(errs[1], errs[2]));
        if (pi.gemm_dtype == FG_DTYPE_BF16)
            TOL_CHECK("phases grads (bf16 GEMMs)", e, TOL_GRAD_BF16_GEMM, "%s", tc->name);
        else
            TOL_CHECK("phases grads", e, TOL_GRAD, "%s", tc->name);
        fg_oracle_result_free(&ora);
    }
    printf("%-26s shards=%d: loss %.9f (one process %.9f), logp vs one %.1e\n", tc->name, P,
           lo[0].loss, one.out.loss, e_lp1);
    tu_linear_outs_free(&one);
    free(gh);
    free(gw);
    free(gb);
    for (int s = 0; s < P; s++) {
        free(sh[s].stats);
        free(sh[s].logp);
        free(sh[s].entropy);
        free(sh[s].dlogp);
        free(sh[s].dentropy);
        free(sh[s].gh);
        free(sh[s].gw);
        free(sh[s].gb);
    }
    tu_problem_free(&prob);
}

/* Shard `bad` gets a broken input (a token id past the vocabulary, or NaN in
 * a hidden row it reads); its (a) fails and writes nothing, it raises its
 * status slot, and after the MAX every shard's next phase returns that status. */
static void check_failure(fg_context *ctx, int P, int bad, int nan_input)
{
    const int64_t B = 2, T = 9, H = 13, V = 97, N = B * T;
    tu_problem prob;
    tu_problem_make(&prob, B, T, H, V, FG_DTYPE_F32, 0, 77 + (uint64_t)bad);
    const fg_batch *batch = tu_batch_view(&prob.tb);
    int64_t *bad_ids = tu_xmalloc((size_t)N * sizeof(int64_t));
    memcpy(bad_ids, batch->token_ids, (size_t)N * sizeof(int64_t));
    int64_t first = 0;
    while (!batch->mask[first])
        first++;
    bad_ids[first] = V + 3;
    float *bad_hidden = tu_xmalloc((size_t)N * H * sizeof(float));
    memcpy(bad_hidden, prob.hidden_s, (size_t)N * H * sizeof(float));
    bad_hidden[first * H + 5] = NAN;
    shard sh[MAX_SHARDS];
    const fg_status want = nan_input ? FG_ERR_NONFINITE_INPUT : FG_ERR_TOKEN_OUT_OF_RANGE;
    for (int s = 0; s < P; s++) {
        sh[s].v0 = V * s / P;
        sh[s].v1 = V * (s + 1) / P;
        sh[s].stats = falloc(FG_SHARD_STATS_FLOATS(N));
        tu_fill_nan(sh[s].stats, (size_t)FG_SHARD_STATS_FLOATS(N));
        fg_linear_inputs in = shard_inputs(&prob, &sh[s]);
        fg_tokens tokens = {B, T, batch->token_ids, batch->mask};
        if (s == bad && nan_input)
            in.hidden.data = bad_hidden;
        if (s == bad && !nan_input)
            tokens.token_ids = bad_ids;
        const fg_status st = fg_linear_shard_stats(ctx, NULL, 1.0, &in, &tokens, sh[s].stats, NULL);
        CHECK(st == (s == bad ? want : FG_OK), "failure P=%d bad=%d: shard %d stats gave %s", P,
              bad, s, fg_status_name(st));
        if (st != FG_OK) {
            CHECK(isnan(sh[s].stats[0]), "%s", "a failed phase wrote its stats");
            sh[s].stats[FG_SHARD_STATS_STATUS(N)] = (float)st; /* the caller's part */
        }
    }
    /* The failed shard's buffer is NaN where it wrote nothing; a framework's
     * MAX of NaN is its own business, but the status slot is a number on
     * every shard. */
    for (int s = 0; s < P; s++) {
        float slot = 0;
        for (int r = 0; r < P; r++)
            slot = sh[r].stats[FG_SHARD_STATS_STATUS(N)] > slot ? sh[r].stats[FG_SHARD_STATS_STATUS(N)]
                                                                 : slot;
        sh[s].stats[FG_SHARD_STATS_STATUS(N)] = slot;
    }
    const fg_tokens tokens = {B, T, batch->token_ids, batch->mask};
    for (int s = 0; s < P; s++) {
        const fg_status st = fg_shard_stats_rescale(ctx, &tokens, sh[s].stats);
        CHECK(st == want, "failure P=%d bad=%d: shard %d rescale gave %s (%s)", P, bad, s,
              fg_status_name(st), fg_last_error(ctx));
        float lp[18];
        CHECK(fg_shard_stats_finish(ctx, &tokens, sh[s].stats, lp, NULL) == want,
              "failure P=%d: shard %d finish", P, s);
        const fg_linear_inputs in = shard_inputs(&prob, &sh[s]);
        float gh[18 * 13];
        fg_linear_grads g = {fg_matrix_make(gh, FG_DTYPE_F32, N, H), {0}, {0}, 0};
        CHECK(fg_linear_shard_backward(ctx, NULL, 1.0, &in, &tokens, sh[s].stats, lp, NULL, &g,
                                       NULL) == want,
              "failure P=%d: shard %d backward", P, s);
        free(sh[s].stats);
    }
    free(bad_ids);
    free(bad_hidden);
    tu_problem_free(&prob);
}

/* Every token masked: no statistics, zero log-probs, loss and gradients. */
static void check_all_masked(fg_context *ctx)
{
    const int64_t B = 2, T = 5, H = 7, V = 31, N = B * T;
    tu_problem prob;
    tu_problem_make(&prob, B, T, H, V, FG_DTYPE_F32, 1, 5);
    memset(prob.tb.mask, 0, (size_t)N);
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_tokens tokens = {B, T, batch->token_ids, batch->mask};
    shard s = {0, V, falloc(FG_SHARD_STATS_FLOATS(N)), falloc(N), falloc(N), falloc(N), falloc(N),
               falloc(N * H), falloc(V * H), falloc(V)};
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    fg_logp_outputs lo;
    memset(&lo, 0, sizeof lo);
    lo.loss = 1;
    lo.grad_logp = s.dlogp;
    lo.grad_entropy = s.dentropy;
    fg_linear_grads g = {fg_matrix_make(s.gh, FG_DTYPE_F32, N, H),
                         fg_matrix_make(s.gw, FG_DTYPE_F32, V, H),
                         fg_vector_make(s.gb, FG_DTYPE_F32, V), 0};
    tu_fill_nan(s.gh, (size_t)(N * H));
    tu_fill_nan(s.gw, (size_t)(V * H));
    const int ok = fg_linear_shard_stats(ctx, NULL, 1.0, &in, &tokens, s.stats, NULL) == FG_OK &&
                   fg_shard_stats_rescale(ctx, &tokens, s.stats) == FG_OK &&
                   fg_shard_stats_finish(ctx, &tokens, s.stats, s.logp, s.entropy) == FG_OK &&
                   fg_grpo_loss_from_logp(ctx_host, &cfg, batch, s.logp, s.entropy, &lo, NULL) ==
                       FG_OK &&
                   fg_linear_shard_backward(ctx, NULL, 1.0, &in, &tokens, s.stats, s.dlogp,
                                            s.dentropy, &g, NULL) == FG_OK;
    CHECK(ok, "all masked: %s", fg_last_error(ctx));
    int zeros = lo.loss == 0;
    for (int64_t i = 0; i < N; i++)
        zeros &= s.logp[i] == 0 && s.entropy[i] == 0 && s.dlogp[i] == 0;
    for (int64_t i = 0; i < N * H; i++)
        zeros &= s.gh[i] == 0;
    for (int64_t i = 0; i < V * H; i++)
        zeros &= s.gw[i] == 0;
    CHECK(zeros, "%s", "all masked: nonzero loss, logp or gradients");
    free(s.stats);
    free(s.logp);
    free(s.entropy);
    free(s.dlogp);
    free(s.dentropy);
    free(s.gh);
    free(s.gw);
    free(s.gb);
    tu_problem_free(&prob);
}

int main(void)
{
    fg_context *ctx;
    if (fg_context_create(NULL, &ctx) != FG_OK || tu_host_context_create(&ctx_host) != FG_OK)
        return 1;
    /* What a shard sends per call, counted: 10 floats a token and a status. */
    CHECK(FG_SHARD_STATS_MAX_COUNT(1000) + FG_SHARD_STATS_SUM_COUNT(1000) == 10001, "%s",
          "the reductions are not 10 floats a token");
    const tcase cases[] = {
        {"dapo token f32 bias", FG_DTYPE_F32, 2, FG_LOSS_DAPO, FG_LEVEL_TOKEN, 0, 0, 0.9, 1},
        {"grpo sequence beta f32", FG_DTYPE_F32, 3, FG_LOSS_GRPO, FG_LEVEL_SEQUENCE, 0.05, 0.01,
         1.0, 0},
        {"cispo token beta bf16", FG_DTYPE_BF16, 4, FG_LOSS_CISPO, FG_LEVEL_TOKEN, 0.04, 0, 0.7,
         1},
        {"sapo token entropy f32", FG_DTYPE_F32, 4, FG_LOSS_SAPO, FG_LEVEL_TOKEN, 0, 0.02, 1.1, 1},
        {"dr_grpo token one shard", FG_DTYPE_F32, 1, FG_LOSS_DR_GRPO, FG_LEVEL_TOKEN, 0.02, 0, 1.0,
         1},
    };
    uint64_t seed = 1301;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(ctx, &cases[i], seed++);
    check_failure(ctx, 2, 1, 0);
    check_failure(ctx, 3, 0, 1);
    check_failure(ctx, 4, 2, 0);
    check_all_masked(ctx);
    fg_context_destroy(ctx);
    fg_context_destroy(ctx_host);
    return tu_finish();
}
