/*
 * test_logprobs: the LM head's log-probs alone (fg_linear_logprobs) and the
 * backward of a caller's own loss through them (fg_linear_logprobs_backward),
 * against the float64 oracle (fg_oracle_linear_head).
 *
 * Odd shapes (B = 3, T = 7, H = 45, V = 1013, ragged mask, padded rows),
 * f32 and bf16, fused (a budget of a few rows a chunk, so several chunks) and
 * materialized, temperatures 1 and 0.7, with and without a bias. The caller's
 * loss is random: grad_logp and grad_entropy drawn per token. Also:
 *   - the forward pass holds no more than its budget (counted peak) and fits
 *     more rows a chunk than the loss call at the same budget (no dlogits, no
 *     gradient rows);
 *   - the backward with the loss's own d loss/d logp and d loss/d entropy
 *     gives fg_linear_grpo's gradients (the same sweep, 4 GEMMs instead of 3);
 *   - accumulate adds to grad_weight / grad_bias;
 *   - bad arguments return their status and write nothing.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "test_util.h"

enum { B = 3, T = 7, H = 45, V = 1013, N = B * T };

static fg_tokens tokens_of(const fg_batch *b)
{
    fg_tokens t = {b->batch, b->seq_len, b->token_ids, b->mask};
    return t;
}

/* Largest |a - b| / max(|b|, 1) over unmasked tokens; masked entries of a must be 0. */
static double token_err(const float *a, const double *b, const uint8_t *mask, int *masked_nonzero)
{
    double worst = 0;
    for (int n = 0; n < N; n++) {
        if (!mask[n]) {
            *masked_nonzero |= a[n] != 0.0f;
            continue;
        }
        const double e = fabs((double)a[n] - b[n]) / fmax(fabs(b[n]), 1.0);
        worst = e > worst || isnan(e) ? e : worst;
    }
    return worst;
}

/* The smallest budget (to 1 KiB) a call runs with (one_chunk: in one chunk):
 * budgets below fail with FG_ERR_BUDGET_TOO_SMALL (or walk several chunks).
 * backward: fg_linear_logprobs_backward with g, else the forward. Measured,
 * not assumed: what a CPU's GEMMs need differs (AVX-512's scratch is larger). */
static size_t smallest_budget(fg_context *ctx, const fg_linear_inputs *in, const fg_tokens *tok,
                              const float *dlogp, fg_linear_grads *g, float *logp, int one_chunk)
{
    size_t lo = 1024, hi = (size_t)64 << 20; /* lo fails, hi runs */
    while (hi - lo > 1024) {
        const size_t mid = lo + (hi - lo) / 2;
        fg_exec e;
        fg_exec_init(&e);
        e.memory_budget = mid;
        fg_status st = g ? fg_linear_logprobs_backward(ctx, NULL, 1.0, in, tok, dlogp, NULL, g, &e)
                         : fg_linear_logprobs(ctx, NULL, 1.0, in, tok, logp, NULL, &e);
        fg_memory_stats ms;
        fg_get_memory_stats(ctx, &ms);
        if (st == FG_OK && (!one_chunk || ms.chunks == 1))
            hi = mid;
        else
            lo = mid;
    }
    return hi;
}

/* Forward and backward of one case against the oracle. */
static void check_case(fg_context *ctx, fg_dtype dt, int materialized, double temperature,
                       int with_bias, uint64_t seed)
{
    tu_problem_opts po = {0};
    po.hidden_pad = 3;
    po.weight_pad = 1;
    tu_problem p;
    tu_problem_make_opts(&p, B, T, H, V, dt, with_bias, seed, &po);
    const fg_batch *batch = tu_batch_view(&p.tb);
    const fg_tokens tok = tokens_of(batch);
    const fg_linear_inputs in = tu_problem_inputs(&p);
    const fg_linear_options opts = {materialized ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED, 0, 0.0};
    const char *dname = dt == FG_DTYPE_BF16 ? "bf16" : "f32";
    const char *iname = materialized ? "materialized" : "fused";
    /* Fused: a third of the way from the smallest budget to the smallest that
     * runs in one chunk: a few rows a chunk, several chunks, on any CPU. */
    fg_exec exec;
    fg_exec_init(&exec);

    /* the caller's loss: random per-token derivatives */
    float dlogp[N], dent[N];
    double dlogp_d[N], dent_d[N];
    for (int n = 0; n < N; n++) {
        dlogp[n] = (float)(tu_normal(&p.rng) / N);
        dent[n] = (float)(0.1 * tu_normal(&p.rng) / N);
        dlogp_d[n] = dlogp[n];
        dent_d[n] = dent[n];
    }
    tu_linear_outs o;
    tu_linear_outs_make(&o, N, H, V, with_bias);
    fg_linear_grads g = {o.out.grad_hidden, o.out.grad_weight, o.out.grad_bias, 0};
    float logp[N], ent[N];
    size_t fwd_budget = 0, bwd_budget = 0;
    if (!materialized) {
        const size_t f0 = smallest_budget(ctx, &in, &tok, NULL, NULL, logp, 0);
        const size_t f1 = smallest_budget(ctx, &in, &tok, NULL, NULL, logp, 1);
        const size_t b0 = smallest_budget(ctx, &in, &tok, dlogp, &g, NULL, 0);
        const size_t b1 = smallest_budget(ctx, &in, &tok, dlogp, &g, NULL, 1);
        fwd_budget = f0 + (f1 - f0) / 3;
        bwd_budget = b0 + (b1 - b0) / 3;
    }
    fg_oracle_result ref;
    CHECK(fg_oracle_linear_head(batch, p.hidden, p.weight, p.bias, H, V, temperature, dlogp_d,
                                dent_d, &ref) == 0,
          "%s", "oracle");

    /* forward */
    exec.memory_budget = fwd_budget;
    tu_fill_nan(logp, N);
    tu_fill_nan(ent, N);
    fg_release_workspace(ctx); /* the peak then counts this call's arena alone */
    fg_reset_peak_memory(ctx);
    fg_status st = fg_linear_logprobs(ctx, &opts, temperature, &in, &tok, logp, ent, &exec);
    CHECK(st == FG_OK, "%s %s logprobs: %s", dname, iname, fg_last_error(ctx));
    fg_memory_stats ms;
    fg_get_memory_stats(ctx, &ms);
    if (!materialized) {
        CHECK(ms.peak_bytes <= exec.memory_budget, "%s fused logprobs peak %zu > budget %zu",
              dname, ms.peak_bytes, exec.memory_budget);
        CHECK(ms.chunks > 1, "%s fused logprobs: %lld chunks, several wanted", dname,
              (long long)ms.chunks);
    }
    int masked_nonzero = 0;
    /* worst measured: logp 1.4e-7, entropy 6.9e-7 (Zen 5), 1.5e-6 (AVX2) (bf16 inputs are
     * rounded alike for the oracle) */
    TOL_CHECK("logprobs/logp", token_err(logp, ref.logp, p.tb.mask, &masked_nonzero), 1e-6,
              "%s %s T=%g bias=%d", dname, iname, temperature, with_bias);
    TOL_CHECK("logprobs/entropy", token_err(ent, ref.entropy, p.tb.mask, &masked_nonzero), 5e-6,
              "%s %s T=%g bias=%d", dname, iname, temperature, with_bias);
    CHECK(!masked_nonzero, "%s %s: masked log-probs or entropies not 0", dname, iname);

    /* backward */
    exec.memory_budget = bwd_budget;
    tu_linear_outs_fill(&o, 0x7f);
    fg_release_workspace(ctx);
    fg_reset_peak_memory(ctx);
    st = fg_linear_logprobs_backward(ctx, &opts, temperature, &in, &tok, dlogp, dent, &g, &exec);
    CHECK(st == FG_OK, "%s %s backward: %s", dname, iname, fg_last_error(ctx));
    fg_get_memory_stats(ctx, &ms);
    if (!materialized) {
        CHECK(ms.peak_bytes <= exec.memory_budget, "%s fused backward peak %zu > budget %zu",
              dname, ms.peak_bytes, exec.memory_budget);
        CHECK(ms.chunks > 1, "%s fused backward: %lld chunks, several wanted", dname,
              (long long)ms.chunks);
    }
    /* worst measured (rel. L2, Zen 5): 3.8e-7; bf16 with native bf16 GEMMs
     * (dlogits rounded to bf16) 2.9e-3 */
    const int native = dt == FG_DTYPE_BF16 && tu_bf16_gemms_native();
    const char *gh = native ? "logprobs/grad bf16 native" : "logprobs/grad";
    const double gtol = native ? 8e-3 : 2e-6;
    TOL_CHECK(gh, tu_rel_l2(o.grad_hidden, FG_DTYPE_F32, N, H, H, ref.grad_hidden), gtol,
              "grad_hidden %s %s T=%g bias=%d", dname, iname, temperature, with_bias);
    TOL_CHECK(gh, tu_rel_l2(o.grad_weight, FG_DTYPE_F32, V, H, H, ref.grad_weight), gtol,
              "grad_weight %s %s T=%g bias=%d", dname, iname, temperature, with_bias);
    if (with_bias)
        TOL_CHECK(gh, tu_rel_l2(o.grad_bias, FG_DTYPE_F32, 1, V, V, ref.grad_bias), gtol,
                  "grad_bias %s %s T=%g", dname, iname, temperature);

    /* accumulate: a second call adds the same gradient */
    if (!materialized && dt == FG_DTYPE_F32) {
        float *gw1 = tu_xmalloc(sizeof(float) * V * H);
        memcpy(gw1, o.grad_weight, sizeof(float) * V * H);
        g.accumulate = 1;
        st = fg_linear_logprobs_backward(ctx, &opts, temperature, &in, &tok, dlogp, dent, &g,
                                         &exec);
        CHECK(st == FG_OK, "accumulate: %s", fg_last_error(ctx));
        double worst = 0;
        for (int i = 0; i < V * H; i++)
            worst = fmax(worst, fabs((double)o.grad_weight[i] - 2.0 * gw1[i]) /
                                    fmax(fabs(2.0 * gw1[i]), 1e-3));
        /* worst measured 1.2e-7 */
        TOL_CHECK("logprobs/accumulate", worst, 1e-6, "T=%g bias=%d", temperature, with_bias);
        free(gw1);
    }
    tu_linear_outs_free(&o);
    fg_oracle_result_free(&ref);
    tu_problem_free(&p);
}

/* The backward fed with the loss's own per-token derivatives gives the loss
 * call's gradients; the forward gives its log-probs. */
static void check_matches_loss(fg_context *ctx)
{
    tu_problem p;
    tu_problem_make(&p, B, T, H, V, FG_DTYPE_F32, 1, 99);
    CHECK(tu_problem_fill_logp(&p, 0.9, 0.3, 0.3) == 0, "%s", "oracle log-probs");
    const fg_batch *batch = tu_batch_view(&p.tb);
    const fg_tokens tok = tokens_of(batch);
    const fg_linear_inputs in = tu_problem_inputs(&p);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = FG_LOSS_GRPO;
    cfg.temperature = 0.9;
    cfg.beta = 0.04;
    cfg.entropy_coef = 0.01;
    fg_oracle_result ref; /* the oracle's d loss/d logp and d loss/d entropy */
    CHECK(fg_oracle_linear(&cfg, batch, p.hidden, p.weight, p.bias, H, V, &ref) == 0, "%s",
          "oracle");
    tu_linear_outs a, b;
    tu_linear_outs_make(&a, N, H, V, 1);
    tu_linear_outs_make(&b, N, H, V, 1);
    CHECK(fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &a.out, NULL) == FG_OK, "loss: %s",
          fg_last_error(ctx));
    float dlogp[N], dent[N];
    for (int n = 0; n < N; n++) {
        dlogp[n] = (float)ref.dlogp[n];
        dent[n] = (float)ref.dentropy[n];
    }
    fg_linear_grads g = {b.out.grad_hidden, b.out.grad_weight, b.out.grad_bias, 0};
    CHECK(fg_linear_logprobs_backward(ctx, NULL, cfg.temperature, &in, &tok, dlogp, dent, &g,
                                      NULL) == FG_OK,
          "backward: %s", fg_last_error(ctx));
    CHECK(fg_linear_logprobs(ctx, NULL, cfg.temperature, &in, &tok, b.logp, b.entropy, NULL) ==
              FG_OK,
          "logprobs: %s", fg_last_error(ctx));
    CHECK(memcmp(a.logp, b.logp, sizeof(float) * N) == 0 &&
              memcmp(a.entropy, b.entropy, sizeof(float) * N) == 0,
          "%s", "logprobs differ from the loss call's (same sweep: bitwise expected)");
    /* worst measured 1.1e-6 (the oracle's d loss/d logp are central
     * differences; the library's own sweep is closer to itself) */
    TOL_CHECK("logprobs/as loss", tu_rel_l2(b.grad_weight, FG_DTYPE_F32, V, H, H, ref.grad_weight),
              2e-6, "%s", "grad_weight via the loss's dlogp vs the oracle");
    double num = 0, den = 0;
    for (int i = 0; i < V * H; i++) {
        num += ((double)a.grad_weight[i] - b.grad_weight[i]) * ((double)a.grad_weight[i] - b.grad_weight[i]);
        den += (double)a.grad_weight[i] * a.grad_weight[i];
    }
    TOL_CHECK("logprobs/as loss", sqrt(num / den), 2e-6, "%s",
              "grad_weight via the loss's dlogp vs fg_linear_grpo");
    tu_linear_outs_free(&a);
    tu_linear_outs_free(&b);
    fg_oracle_result_free(&ref);
    tu_problem_free(&p);
}

/* The forward fits at least as many rows a chunk as the loss call at the same
 * budget (the loss call's smallest budget plus 4 of its rows), in no more
 * memory (no gradient rows, no scratch of the gradient GEMMs). */
static void check_chunking(fg_context *ctx)
{
    tu_problem p;
    tu_problem_make(&p, B, T, H, V, FG_DTYPE_F32, 0, 5);
    const fg_batch *batch = tu_batch_view(&p.tb);
    const fg_tokens tok = tokens_of(batch);
    const fg_linear_inputs in = tu_problem_inputs(&p);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    tu_linear_outs o;
    tu_linear_outs_make(&o, N, H, V, 0);
    fg_linear_plan_info plan;
    CHECK(fg_linear_grpo_plan(ctx, NULL, &cfg, &in, batch, &o.out, NULL, &plan) == FG_OK, "%s",
          fg_last_error(ctx));
    fg_exec exec;
    fg_exec_init(&exec);
    exec.memory_budget = plan.min_budget_bytes + 4 * plan.chunk_bytes / plan.chunk_rows;
    float logp[N];
    fg_memory_stats fwd, loss;
    fg_release_workspace(ctx);
    fg_reset_peak_memory(ctx);
    CHECK(fg_linear_logprobs(ctx, NULL, 1.0, &in, &tok, logp, NULL, &exec) == FG_OK, "%s",
          fg_last_error(ctx));
    fg_get_memory_stats(ctx, &fwd);
    fg_release_workspace(ctx);
    fg_reset_peak_memory(ctx);
    CHECK(fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &o.out, &exec) == FG_OK, "%s",
          fg_last_error(ctx));
    fg_get_memory_stats(ctx, &loss);
    CHECK(fwd.chunk_rows >= loss.chunk_rows && fwd.peak_bytes <= loss.peak_bytes,
          "forward-only chunk %lld rows, loss chunk %lld: at least as many expected, in no more memory", (long long)fwd.chunk_rows,
          (long long)loss.chunk_rows);
    tu_linear_outs_free(&o);
    tu_problem_free(&p);
}

/* Bad arguments: their status, and nothing written. */
static void check_bad_args(fg_context *ctx)
{
    tu_problem p;
    tu_problem_make(&p, B, T, H, V, FG_DTYPE_F32, 1, 7);
    const fg_batch *batch = tu_batch_view(&p.tb);
    fg_tokens tok = tokens_of(batch);
    const fg_linear_inputs in = tu_problem_inputs(&p);
    float logp[N], dlogp[N];
    for (int n = 0; n < N; n++) dlogp[n] = 0.01f;
    tu_linear_outs o;
    tu_linear_outs_make(&o, N, H, V, 1);
    fg_linear_grads g = {o.out.grad_hidden, o.out.grad_weight, o.out.grad_bias, 0};
    tu_fill_bytes(logp, sizeof logp, 0x5a);
    tu_linear_outs_fill(&o, 0x5a);

    CHECK(fg_linear_logprobs(ctx, NULL, 1.0, &in, &tok, NULL, NULL, NULL) == FG_ERR_NULL_ARGUMENT,
          "%s", "no output");
    CHECK(fg_linear_logprobs(ctx, NULL, 0.0, &in, &tok, logp, NULL, NULL) == FG_ERR_BAD_TEMPERATURE,
          "%s", "temperature 0");
    CHECK(fg_linear_logprobs(ctx, NULL, 1.0, &in, NULL, logp, NULL, NULL) == FG_ERR_NULL_ARGUMENT,
          "%s", "tokens NULL");
    CHECK(fg_linear_logprobs_backward(ctx, NULL, 1.0, &in, &tok, NULL, NULL, &g, NULL) ==
              FG_ERR_NULL_ARGUMENT,
          "%s", "grad_logp NULL");
    CHECK(fg_linear_logprobs_backward(ctx, NULL, 1.0, &in, &tok, dlogp, NULL, NULL, NULL) ==
              FG_ERR_NULL_ARGUMENT,
          "%s", "out NULL");
    fg_linear_grads none = {0};
    CHECK(fg_linear_logprobs_backward(ctx, NULL, 1.0, &in, &tok, dlogp, NULL, &none, NULL) ==
              FG_ERR_NULL_ARGUMENT,
          "%s", "no gradient wanted");
    int64_t first = -1;
    for (int n = 0; n < N && first < 0; n++)
        if (p.tb.mask[n]) first = n;
    dlogp[first] = NAN;
    CHECK(fg_linear_logprobs_backward(ctx, NULL, 1.0, &in, &tok, dlogp, NULL, &g, NULL) ==
              FG_ERR_NONFINITE_INPUT,
          "%s", "NaN grad_logp");
    CHECK(strstr(fg_last_error(ctx), "grad_logp") != NULL, "message: %s", fg_last_error(ctx));
    dlogp[first] = 0.01f;
    const int64_t keep = p.tb.token_ids[first];
    p.tb.token_ids[first] = V;
    CHECK(fg_linear_logprobs(ctx, NULL, 1.0, &in, &tok, logp, NULL, NULL) ==
              FG_ERR_TOKEN_OUT_OF_RANGE,
          "%s", "token out of range");
    p.tb.token_ids[first] = keep;
    CHECK(tu_bytes_are(logp, sizeof logp, 0x5a) && tu_linear_outs_are(&o, 0x5a), "%s",
          "a failed call wrote an output");
    tu_linear_outs_free(&o);
    tu_problem_free(&p);
}

int main(void)
{
    fg_context *ctx = NULL;
    if (fg_context_create(NULL, &ctx) != FG_OK) {
        CHECK(0, "%s", "context create");
        return tu_finish();
    }
    uint64_t seed = 1;
    for (int dt = 0; dt < 2; dt++)
        for (int materialized = 0; materialized < 2; materialized++)
            for (int ti = 0; ti < 2; ti++, seed++)
                check_case(ctx, dt ? FG_DTYPE_BF16 : FG_DTYPE_F32, materialized, ti ? 0.7 : 1.0,
                           (int)(seed & 1), seed);
    check_matches_loss(ctx);
    check_chunking(ctx);
    check_bad_args(ctx);
    fg_context_destroy(ctx);
    return tu_finish();
}
