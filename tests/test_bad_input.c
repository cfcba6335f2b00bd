/*
 * test_bad_input: every bad input of LOSS_SPEC.md "Bad input" (and the
 * header's argument rules) is refused with its own status, before any output
 * is written. For each case all outputs (loss, metrics, logp, entropy, every
 * gradient buffer, with slack beyond their ends) are filled with a sentinel
 * byte pattern, the call must return the expected status, fg_last_error must
 * be non-empty and every output byte must be untouched. Linear cases run on
 * both FG_IMPL_FUSED and FG_IMPL_MATERIALIZED.
 *
 * Masked positions are never read: an out-of-range masked token id, or a NaN
 * at a masked position of old_logp / ref_logp / is_ratio, must succeed.
 * Bad execution options (fg_exec: a misaligned or empty caller workspace,
 * workspace_bytes without a workspace) are refused the same way.
 * Precedence: with several faults, the status is that of the first check in
 * the library's order (advantages, then one pass over the tokens checking
 * token id, old_logp, ref_logp, is_ratio in that order per token).
 * Finally a valid call succeeds and fg_last_error is "".
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

enum { B = 3, T = 5, H = 13, V = 101, N = B * T, SLACK = 64 };
#define ANY_ERROR ((fg_status)-1)
#define SENT 0xA5

typedef struct S {
    tu_batch tb;
    float hidden[N * H], weight[V * H], bias[V], logits[N * V];
    uint16_t weight_bf16[V * H];
    float logp[N + SLACK], ent[N + SLACK];
    float gh[(N + 1) * H + SLACK], gw[(V + 1) * H + SLACK], gb[V + SLACK];
    float gl[(N + 1) * V + SLACK];
    fg_loss_config cfg;
    fg_batch batch;
    fg_linear_inputs in;
    fg_linear_outputs out;  /* linear outputs */
    fg_matrix lmat;         /* logits input  */
    fg_logits_outputs lout; /* logits outputs */
    fg_exec exec;           /* passed unless null_exec */
    unsigned char workspace[4096 + 128];
    int null_ctx, null_cfg, null_in, null_batch, null_out, null_logits, null_exec;
} S;

static S s_;
static fg_context *ctx;

static void reset(S *s) {
    tu_batch_free(&s->tb);
    memset(s, 0, sizeof(*s));
    /* sequence 1 all masked, masked ids out of range (tu_batch_make pattern 1) */
    const tu_problem_opts po = {1.0, 0.5, 0.1, 0, 0, 1};
    tu_problem p;
    tu_problem_make_opts(&p, B, T, H, V, FG_DTYPE_F32, 1, 4242, &po);
    memcpy(s->hidden, p.hidden_s, sizeof s->hidden);
    memcpy(s->weight, p.weight_s, sizeof s->weight);
    memcpy(s->bias, p.bias_s, sizeof s->bias);
    for (int i = 0; i < V * H; i++) s->weight_bf16[i] = fg_f32_to_bf16(s->weight[i]);
    tu_rng *rng = &p.rng;
    s->tb = p.tb; /* the batch stays; the rest of the problem goes */
    memset(&p.tb, 0, sizeof p.tb);
    s->tb.have_old = s->tb.have_ref = 1;
    s->tb.is_mode = 1;
    double lp[N];
    for (int n = 0; n < N; n++) lp[n] = -4.0 - tu_uniform(rng);
    tu_batch_fill_logp(&s->tb, lp, 0.2, 0.2, rng);
    for (int n = 0; n < N; n++) /* finite padding here: NaN cases are set one by one */
        if (!s->tb.mask[n]) s->tb.old_logp[n] = s->tb.ref_logp[n] = s->tb.is_ratio[n] = 0.5f;
    s->batch = *tu_batch_view(&s->tb);
    for (int i = 0; i < N * V; i++) s->logits[i] = (float)(2.0 * tu_normal(rng));
    tu_problem_free(&p);

    fg_loss_config_init(&s->cfg);
    s->cfg.beta = 0.04;
    s->cfg.entropy_coef = 0.1;
    s->cfg.temperature = 0.9;

    s->in.hidden = fg_matrix_make(s->hidden, FG_DTYPE_F32, N, H);
    s->in.weight = fg_matrix_make(s->weight, FG_DTYPE_F32, V, H);
    s->in.bias = fg_vector_make(s->bias, FG_DTYPE_F32, V);
    s->in.vocab_start = 0;
    s->in.vocab_total = 0;

    s->out.logp = s->logp;
    s->out.entropy = s->ent;
    s->out.grad_hidden = fg_matrix_make(s->gh, FG_DTYPE_F32, N, H);
    s->out.grad_weight = fg_matrix_make(s->gw, FG_DTYPE_F32, V, H);
    s->out.grad_bias = fg_vector_make(s->gb, FG_DTYPE_F32, V);

    s->lmat = fg_matrix_make(s->logits, FG_DTYPE_F32, N, V);
    s->lout.logp = s->logp;
    s->lout.entropy = s->ent;
    s->lout.grad_logits = fg_matrix_make(s->gl, FG_DTYPE_F32, N, V);
    fg_exec_init(&s->exec);
    s->null_exec = 1; /* the context's settings, unless a case sets exec */
}

/* A 64-byte aligned address inside s->workspace, plus `offset` bytes. */
static void *workspace_at(S *s, size_t offset) {
    const uintptr_t a = ((uintptr_t)s->workspace + 63) & ~(uintptr_t)63;
    return (void *)(a + offset);
}

static void fill_sentinels(S *s) {
    tu_fill_bytes(s->logp, sizeof s->logp, SENT);
    tu_fill_bytes(s->ent, sizeof s->ent, SENT);
    tu_fill_bytes(s->gh, sizeof s->gh, SENT);
    tu_fill_bytes(s->gw, sizeof s->gw, SENT);
    tu_fill_bytes(s->gb, sizeof s->gb, SENT);
    tu_fill_bytes(s->gl, sizeof s->gl, SENT);
    tu_fill_bytes(&s->out.loss, sizeof s->out.loss, SENT);
    tu_fill_bytes(&s->out.metrics, sizeof s->out.metrics, SENT);
    tu_fill_bytes(&s->lout.loss, sizeof s->lout.loss, SENT);
    tu_fill_bytes(&s->lout.metrics, sizeof s->lout.metrics, SENT);
}

/* loss / metrics: the ones of the outputs struct the call was given. */
static int untouched(const S *s, const double *loss, const fg_metrics *metrics) {
    return tu_bytes_are(s->logp, sizeof s->logp, SENT) && tu_bytes_are(s->ent, sizeof s->ent, SENT) &&
           tu_bytes_are(s->gh, sizeof s->gh, SENT) && tu_bytes_are(s->gw, sizeof s->gw, SENT) &&
           tu_bytes_are(s->gb, sizeof s->gb, SENT) && tu_bytes_are(s->gl, sizeof s->gl, SENT) &&
           tu_bytes_are(loss, sizeof *loss, SENT) && tu_bytes_are(metrics, sizeof *metrics, SENT);
}

static void judge(const char *path, const char *name, fg_status want, fg_status got, S *s,
                  const double *loss, const fg_metrics *metrics) {
    if (want == FG_OK) {
        CHECK(got == FG_OK, "%s '%s': got %s, want FG_OK (%s)", path, name, fg_status_name(got),
              fg_last_error(ctx));
        if (got == FG_OK) {
            CHECK(strcmp(fg_last_error(ctx), "") == 0, "%s '%s': last_error '%s' after success",
                  path, name, fg_last_error(ctx));
            CHECK(isfinite(*loss), "%s '%s': loss %g", path, name, *loss);
        }
        return;
    }
    if (want == ANY_ERROR)
        CHECK(got != FG_OK, "%s '%s': accepted (want an error)", path, name);
    else
        CHECK(got == want, "%s '%s': got %s, want %s", path, name, fg_status_name(got),
              fg_status_name(want));
    if (!s->null_ctx) {
        const char *e = fg_last_error(ctx);
        CHECK(e != NULL && e[0] != '\0', "%s '%s': empty last_error", path, name);
    }
    CHECK(untouched(s, loss, metrics), "%s '%s': an output was written on failure", path, name);
}

/* Runs the linear entry point on both implementations. */
static void expect_lin(const char *name, fg_status want, S *s) {
    const fg_impl impls[2] = {FG_IMPL_FUSED, FG_IMPL_MATERIALIZED};
    for (int k = 0; k < 2; k++) {
        fg_linear_options lo = {impls[k], 0, 0.0};
        fill_sentinels(s);
        fg_status st = fg_linear_grpo(s->null_ctx ? NULL : ctx, &lo, s->null_cfg ? NULL : &s->cfg,
                                      s->null_in ? NULL : &s->in,
                                      s->null_batch ? NULL : &s->batch,
                                      s->null_out ? NULL : &s->out,
                                      s->null_exec ? NULL : &s->exec);
        judge(k == 0 ? "fused" : "materialized", name, want, st, s, &s->out.loss,
              &s->out.metrics);
    }
}

static void expect_log(const char *name, fg_status want, S *s) {
    fill_sentinels(s);
    fg_status st = fg_logits_grpo(s->null_ctx ? NULL : ctx, s->null_cfg ? NULL : &s->cfg,
                                  s->null_logits ? NULL : &s->lmat,
                                  s->null_batch ? NULL : &s->batch,
                                  s->null_out ? NULL : &s->lout,
                                  s->null_exec ? NULL : &s->exec);
    judge("logits", name, want, st, s, &s->lout.loss, &s->lout.metrics);
}

/* Both entry points (cases that concern only the batch or the config). */
static void expect_both(const char *name, fg_status want, S *s) {
    expect_lin(name, want, s);
    expect_log(name, want, s);
}

static int first_unmasked(const S *s, int b) {
    for (int t = 0; t < T; t++)
        if (s->tb.mask[b * T + t]) return b * T + t;
    return -1;
}
static int first_masked(const S *s) {
    for (int n = 0; n < N; n++)
        if (!s->tb.mask[n]) return n;
    return -1;
}

int main(void) {
    fg_status cs = fg_context_create(NULL, &ctx);
    if (cs != FG_OK) {
        CHECK(0, "context create: %s", fg_status_name(cs));
        return tu_finish();
    }
    S *s = &s_;
    const float nonfin[2] = {NAN, INFINITY};
    const char *nf_name[2] = {"NaN", "Inf"};

    /* the valid baseline succeeds */
    reset(s);
    expect_both("valid", FG_OK, s);
    CHECK(first_unmasked(s, 0) >= 0 && first_masked(s) >= 0, "%s", "batch needs both kinds");

    /* ---- token ids */
    const int64_t bad_ids[] = {-1, V, V + 1000, INT64_MIN};
    for (size_t i = 0; i < sizeof bad_ids / sizeof bad_ids[0]; i++) {
        reset(s);
        s->tb.token_ids[first_unmasked(s, 2)] = bad_ids[i];
        char nm[64];
        snprintf(nm, sizeof nm, "unmasked token id %lld", (long long)bad_ids[i]);
        expect_both(nm, FG_ERR_TOKEN_OUT_OF_RANGE, s);
    }
    reset(s);
    s->tb.token_ids[first_masked(s)] = -3;
    expect_both("masked token id -3", FG_OK, s);
    reset(s);
    s->tb.token_ids[first_masked(s)] = V + 7;
    expect_both("masked token id V+7", FG_OK, s);

    /* ---- shapes */
    reset(s); s->in.hidden.cols = H - 1;
    expect_lin("hidden cols != weight cols", FG_ERR_SHAPE_MISMATCH, s);
    reset(s); s->in.weight.cols = H - 1;
    expect_lin("weight cols != hidden cols", FG_ERR_SHAPE_MISMATCH, s);
    reset(s); s->in.hidden.rows = N - 1;
    expect_lin("hidden rows != B*T", FG_ERR_SHAPE_MISMATCH, s);
    reset(s); s->lmat.rows = N - 1;
    expect_log("logits rows != B*T", FG_ERR_SHAPE_MISMATCH, s);
    reset(s); s->in.bias.len = V - 1;
    expect_lin("bias len != V", FG_ERR_SHAPE_MISMATCH, s);
    reset(s); s->in.bias.len = V + 1;
    expect_lin("bias len V+1", FG_ERR_SHAPE_MISMATCH, s);
    reset(s); s->out.grad_hidden.rows = N + 1;
    expect_lin("grad_hidden rows", FG_ERR_SHAPE_MISMATCH, s);
    reset(s); s->out.grad_hidden.cols = H - 1;
    expect_lin("grad_hidden cols", FG_ERR_SHAPE_MISMATCH, s);
    reset(s); s->out.grad_weight.rows = V + 1;
    expect_lin("grad_weight rows", FG_ERR_SHAPE_MISMATCH, s);
    reset(s); s->out.grad_weight.cols = H - 1;
    expect_lin("grad_weight cols", FG_ERR_SHAPE_MISMATCH, s);
    reset(s); s->out.grad_bias.len = V + 1;
    expect_lin("grad_bias len", FG_ERR_SHAPE_MISMATCH, s);
    reset(s); s->lout.grad_logits.rows = N + 1;
    expect_log("grad_logits rows", FG_ERR_SHAPE_MISMATCH, s);
    reset(s); s->lout.grad_logits.cols = V - 1;
    expect_log("grad_logits cols", FG_ERR_SHAPE_MISMATCH, s);

    /* ---- non-positive sizes (everything else made consistent with them) */
    reset(s);
    s->batch.batch = 0; s->in.hidden.rows = 0; s->out.grad_hidden.rows = 0; s->lmat.rows = 0;
    s->lout.grad_logits.rows = 0;
    expect_both("B = 0", FG_ERR_INVALID_SIZE, s);
    reset(s);
    s->batch.seq_len = 0; s->in.hidden.rows = 0; s->out.grad_hidden.rows = 0; s->lmat.rows = 0;
    s->lout.grad_logits.rows = 0;
    expect_both("T = 0", FG_ERR_INVALID_SIZE, s);
    reset(s);
    s->batch.batch = -3;
    expect_both("B = -3", FG_ERR_INVALID_SIZE, s);
    reset(s);
    s->in.weight.rows = 0; s->in.bias.len = 0; s->out.grad_weight.rows = 0; s->out.grad_bias.len = 0;
    expect_lin("V = 0", FG_ERR_INVALID_SIZE, s);
    reset(s);
    s->lmat.cols = 0; s->lout.grad_logits.cols = 0;
    expect_log("V = 0", FG_ERR_INVALID_SIZE, s);
    reset(s);
    s->in.hidden.cols = 0; s->in.weight.cols = 0; s->out.grad_hidden.cols = 0;
    s->out.grad_weight.cols = 0;
    expect_lin("H = 0", FG_ERR_INVALID_SIZE, s);

    /* ---- ld < cols */
    reset(s); s->in.hidden.ld = H - 1;
    expect_lin("hidden ld < cols", FG_ERR_INVALID_SIZE, s);
    reset(s); s->in.weight.ld = H - 1;
    expect_lin("weight ld < cols", FG_ERR_INVALID_SIZE, s);
    reset(s); s->out.grad_hidden.ld = H - 1;
    expect_lin("grad_hidden ld < cols", FG_ERR_INVALID_SIZE, s);
    reset(s); s->out.grad_weight.ld = H - 1;
    expect_lin("grad_weight ld < cols", FG_ERR_INVALID_SIZE, s);
    reset(s); s->lmat.ld = V - 1;
    expect_log("logits ld < cols", FG_ERR_INVALID_SIZE, s);
    reset(s); s->lout.grad_logits.ld = V - 1;
    expect_log("grad_logits ld < cols", FG_ERR_INVALID_SIZE, s);

    /* ---- config */
    reset(s); s->batch.ref_logp = NULL;
    expect_both("beta != 0 without ref_logp", FG_ERR_MISSING_REF_LOGP, s);
    const double temps[] = {0.0, -1.0, NAN, INFINITY, -0.0};
    for (size_t i = 0; i < sizeof temps / sizeof temps[0]; i++) {
        reset(s);
        s->cfg.temperature = temps[i];
        char nm[64];
        snprintf(nm, sizeof nm, "temperature %g", temps[i]);
        expect_both(nm, FG_ERR_BAD_TEMPERATURE, s);
    }
    reset(s); s->cfg.loss_type = (fg_loss_type)99;
    expect_both("loss_type 99", FG_ERR_UNKNOWN_LOSS_TYPE, s);
    reset(s); s->cfg.loss_type = FG_LOSS_TYPE_COUNT;
    expect_both("loss_type COUNT", FG_ERR_UNKNOWN_LOSS_TYPE, s);
    reset(s); s->cfg.importance_sampling_level = (fg_is_level)99;
    expect_both("level 99", FG_ERR_UNKNOWN_LEVEL, s);
    {
        fg_loss_type lt = FG_LOSS_GRPO;
        fg_is_level lv = FG_LEVEL_TOKEN;
        CHECK(fg_loss_type_parse("foo", &lt) == FG_ERR_UNKNOWN_LOSS_TYPE, "%s", "parse 'foo'");
        CHECK(fg_is_level_parse("foo", &lv) == FG_ERR_UNKNOWN_LEVEL, "%s", "parse level 'foo'");
    }
    reset(s); s->cfg.epsilon_low = NAN;
    expect_both("epsilon_low NaN", FG_ERR_BAD_HYPERPARAMETER, s);
    reset(s); s->cfg.beta = NAN;
    expect_both("beta NaN", FG_ERR_BAD_HYPERPARAMETER, s);
    reset(s); s->cfg.entropy_coef = INFINITY;
    expect_both("entropy_coef Inf", FG_ERR_BAD_HYPERPARAMETER, s);
    reset(s); s->cfg.loss_type = FG_LOSS_SAPO; s->cfg.sapo_temperature_pos = 0.0;
    expect_both("sapo_temperature_pos 0", FG_ERR_BAD_HYPERPARAMETER, s);
    reset(s); s->cfg.loss_type = FG_LOSS_VESPO; s->cfg.vespo_lambda_neg = NAN;
    expect_both("vespo_lambda_neg NaN", FG_ERR_BAD_HYPERPARAMETER, s);
    reset(s); s->cfg.top_entropy_quantile = 1.5;
    expect_both("top_entropy_quantile 1.5", FG_ERR_BAD_HYPERPARAMETER, s);
    reset(s); s->cfg.top_entropy_quantile = -0.1;
    expect_both("top_entropy_quantile -0.1", FG_ERR_BAD_HYPERPARAMETER, s);
    reset(s); s->cfg.off_policy_mask_threshold = NAN;
    expect_both("off_policy_mask_threshold NaN", FG_ERR_BAD_HYPERPARAMETER, s);
    reset(s); s->cfg.off_policy_mask_threshold = -INFINITY;
    expect_both("off_policy_mask_threshold -Inf", FG_ERR_BAD_HYPERPARAMETER, s);
    /* the sampler's log-probs: NaN is an unscored token (allowed), Inf an error */
    reset(s); s->cfg.off_policy_mask_threshold = 0.1;
    s->batch.sampling_logp = s->tb.sampling_logp;
    s->tb.sampling_logp[first_unmasked(s, 0)] = INFINITY;
    expect_both("sampling_logp Inf", FG_ERR_NONFINITE_INPUT, s);
    reset(s); s->cfg.off_policy_mask_threshold = 0.1;
    s->batch.sampling_logp = s->tb.sampling_logp;
    s->tb.sampling_logp[first_unmasked(s, 0)] = NAN;
    expect_both("sampling_logp NaN", FG_OK, s);

    /* ---- non-finite inputs */
    for (int k = 0; k < 2; k++) {
        char nm[96];
        const float x = nonfin[k];
        const int nu = first_unmasked(s, 2);
        reset(s); s->hidden[nu * H + 3] = x;
        snprintf(nm, sizeof nm, "%s in hidden", nf_name[k]);
        expect_lin(nm, FG_ERR_NONFINITE_INPUT, s);
        reset(s); s->weight[17 * H + 5] = x;
        snprintf(nm, sizeof nm, "%s in weight", nf_name[k]);
        expect_lin(nm, FG_ERR_NONFINITE_INPUT, s);
        reset(s); s->bias[V - 1] = x;
        snprintf(nm, sizeof nm, "%s in bias", nf_name[k]);
        expect_lin(nm, FG_ERR_NONFINITE_INPUT, s);
        reset(s); s->logits[nu * V + 50] = x;
        snprintf(nm, sizeof nm, "%s in logits", nf_name[k]);
        expect_log(nm, FG_ERR_NONFINITE_INPUT, s);
        reset(s); s->tb.advantages[2] = x;
        snprintf(nm, sizeof nm, "%s in advantages", nf_name[k]);
        expect_both(nm, FG_ERR_NONFINITE_INPUT, s);
        reset(s); s->tb.old_logp[nu] = x;
        snprintf(nm, sizeof nm, "%s in old_logp", nf_name[k]);
        expect_both(nm, FG_ERR_NONFINITE_INPUT, s);
        reset(s); s->tb.ref_logp[nu] = x;
        snprintf(nm, sizeof nm, "%s in ref_logp", nf_name[k]);
        expect_both(nm, FG_ERR_NONFINITE_INPUT, s);
        reset(s); s->tb.is_ratio[nu] = x;
        snprintf(nm, sizeof nm, "%s in is_ratio [B,T]", nf_name[k]);
        expect_both(nm, FG_ERR_NONFINITE_INPUT, s);
        reset(s); s->batch.is_ratio_per_sequence = 1; s->tb.is_ratio[2] = x;
        snprintf(nm, sizeof nm, "%s in is_ratio [B]", nf_name[k]);
        expect_both(nm, FG_ERR_NONFINITE_INPUT, s);
    }
    /* masked positions are not read */
    reset(s); s->tb.old_logp[first_masked(s)] = NAN;
    expect_both("NaN in old_logp at a masked position", FG_OK, s);
    reset(s); s->tb.ref_logp[first_masked(s)] = NAN;
    expect_both("NaN in ref_logp at a masked position", FG_OK, s);
    reset(s); s->tb.is_ratio[first_masked(s)] = INFINITY;
    expect_both("Inf in is_ratio at a masked position", FG_OK, s);

    /* ---- NULL pointers */
    reset(s); s->null_ctx = 1;
    expect_both("ctx NULL", FG_ERR_NULL_ARGUMENT, s);
    reset(s); s->null_cfg = 1;
    expect_both("cfg NULL", FG_ERR_NULL_ARGUMENT, s);
    reset(s); s->null_in = 1;
    expect_lin("inputs NULL", FG_ERR_NULL_ARGUMENT, s);
    reset(s); s->null_batch = 1;
    expect_both("batch NULL", FG_ERR_NULL_ARGUMENT, s);
    reset(s); s->null_out = 1;
    expect_both("outputs NULL", FG_ERR_NULL_ARGUMENT, s);
    reset(s); s->null_logits = 1;
    expect_log("logits NULL", FG_ERR_NULL_ARGUMENT, s);
    reset(s); s->lmat.data = NULL;
    expect_log("logits data NULL", FG_ERR_NULL_ARGUMENT, s);
    reset(s); s->in.hidden.data = NULL;
    expect_lin("hidden data NULL", FG_ERR_NULL_ARGUMENT, s);
    reset(s); s->in.weight.data = NULL;
    expect_lin("weight data NULL", FG_ERR_NULL_ARGUMENT, s);
    reset(s); s->batch.token_ids = NULL;
    expect_both("token_ids NULL", FG_ERR_NULL_ARGUMENT, s);
    reset(s); s->batch.mask = NULL;
    expect_both("mask NULL", FG_ERR_NULL_ARGUMENT, s);
    reset(s); s->batch.advantages = NULL;
    expect_both("advantages NULL", FG_ERR_NULL_ARGUMENT, s);

    /* ---- execution options (fg_exec) */
    reset(s); s->null_exec = 0;
    expect_both("exec all zero (the context's settings)", FG_OK, s);
    reset(s); s->null_exec = 0; s->exec.threads = 1; s->exec.memory_budget = (size_t)1 << 20;
    expect_both("exec 1 thread, 1 MiB", FG_OK, s);
    const size_t misalign[] = {1, 8, 32, 63};
    for (size_t i = 0; i < sizeof misalign / sizeof misalign[0]; i++) {
        reset(s);
        s->null_exec = 0;
        s->exec.workspace = workspace_at(s, misalign[i]);
        s->exec.workspace_bytes = 4096;
        char nm[64];
        snprintf(nm, sizeof nm, "workspace 64-byte aligned + %zu", misalign[i]);
        expect_both(nm, FG_ERR_INVALID_SIZE, s);
    }
    reset(s); s->null_exec = 0; s->exec.workspace = workspace_at(s, 0); s->exec.workspace_bytes = 0;
    expect_both("workspace of 0 bytes", FG_ERR_INVALID_SIZE, s);
    reset(s); s->null_exec = 0; s->exec.workspace_bytes = 4096;
    expect_both("workspace_bytes without a workspace", FG_ERR_NULL_ARGUMENT, s);
    /* a misaligned workspace is refused before any argument is looked at */
    reset(s); s->null_exec = 0; s->exec.workspace = workspace_at(s, 4);
    s->exec.workspace_bytes = 4096; s->null_batch = 1;
    expect_both("misaligned workspace and batch NULL", FG_ERR_INVALID_SIZE, s);
    /* an aligned workspace smaller than the call needs: refused, nothing written
     * (the logits path's per-token arrays need more than 64 bytes here too) */
    reset(s); s->null_exec = 0; s->exec.workspace = workspace_at(s, 0);
    s->exec.workspace_bytes = 64;
    expect_both("workspace of 64 bytes", FG_ERR_BUDGET_TOO_SMALL, s);

    /* ---- precedence: the first failing check in the library's order */
    {
        const int n0 = first_unmasked(s, 0), n2 = first_unmasked(s, 2);
        reset(s); /* advantages before any per-token input */
        s->tb.advantages[2] = NAN; s->tb.token_ids[n0] = -1; s->tb.old_logp[n0] = NAN;
        expect_both("NaN advantage + bad id + NaN old_logp", FG_ERR_NONFINITE_INPUT, s);
        CHECK(strstr(fg_last_error(ctx), "advantages") != NULL, "precedence: '%s' does not "
              "name the advantages", fg_last_error(ctx));
        reset(s); /* an earlier token's NaN before a later token's bad id */
        s->tb.old_logp[n0] = NAN; s->tb.token_ids[n2] = V;
        expect_both("NaN old_logp at token n0, bad id at a later token", FG_ERR_NONFINITE_INPUT, s);
        reset(s); /* an earlier token's bad id before a later token's NaN */
        s->tb.token_ids[n0] = V; s->tb.ref_logp[n2] = NAN;
        expect_both("bad id at token n0, NaN ref_logp at a later token",
                    FG_ERR_TOKEN_OUT_OF_RANGE, s);
        reset(s); /* one token: id, then old_logp, ref_logp, is_ratio */
        s->tb.token_ids[n2] = -5; s->tb.old_logp[n2] = NAN;
        expect_both("bad id and NaN old_logp at one token", FG_ERR_TOKEN_OUT_OF_RANGE, s);
        reset(s);
        s->tb.is_ratio[n2] = NAN; s->tb.ref_logp[n2] = INFINITY; s->tb.old_logp[n2] = NAN;
        expect_both("NaN old_logp, ref_logp, is_ratio at one token", FG_ERR_NONFINITE_INPUT, s);
        CHECK(strstr(fg_last_error(ctx), "old_logp") != NULL, "precedence: '%s' does not name "
              "old_logp", fg_last_error(ctx));
        reset(s);
        s->tb.is_ratio[n2] = NAN; s->tb.ref_logp[n2] = INFINITY;
        expect_both("Inf ref_logp and NaN is_ratio at one token", FG_ERR_NONFINITE_INPUT, s);
        CHECK(strstr(fg_last_error(ctx), "ref_logp") != NULL, "precedence: '%s' does not name "
              "ref_logp", fg_last_error(ctx));
    }

    /* ---- misuse the header forbids (the exact status is not pinned) */
    reset(s); s->in.weight = fg_matrix_make(s->weight_bf16, FG_DTYPE_BF16, V, H);
    expect_lin("weight bf16 with hidden f32", ANY_ERROR, s);
    reset(s); s->in.vocab_start = 5;
    expect_lin("vocab_start != 0 unsharded", ANY_ERROR, s);
    reset(s); s->out.grad_hidden.dtype = FG_DTYPE_BF16;
    expect_lin("grad_hidden in bf16", ANY_ERROR, s);

    /* ---- byte counts that overflow (last: a validator that reads first would crash) */
    reset(s);
    s->in.weight.rows = INT64_MAX / 2; s->in.bias.data = NULL; s->in.bias.len = 0;
    s->out.grad_weight.data = NULL; s->out.grad_bias.data = NULL;
    expect_lin("weight rows INT64_MAX/2", FG_ERR_SIZE_OVERFLOW, s);
    reset(s); s->in.hidden.ld = INT64_MAX / 2;
    expect_lin("hidden ld INT64_MAX/2", FG_ERR_SIZE_OVERFLOW, s);
    reset(s); s->lmat.cols = INT64_MAX / 2; s->lmat.ld = INT64_MAX / 2; s->lout.grad_logits.data = NULL;
    expect_log("logits cols INT64_MAX/2", FG_ERR_SIZE_OVERFLOW, s);
    reset(s);
    s->batch.batch = INT64_MAX / 2; s->batch.seq_len = 4;
    expect_both("B*T overflows int64", FG_ERR_SIZE_OVERFLOW, s);

    /* ---- and a valid call after all that */
    reset(s);
    expect_both("valid (final)", FG_OK, s);
    CHECK(strcmp(fg_last_error(ctx), "") == 0, "last_error '%s' after the final valid call",
          fg_last_error(ctx));

    tu_batch_free(&s->tb);
    fg_context_destroy(ctx);
    return tu_finish();
}
