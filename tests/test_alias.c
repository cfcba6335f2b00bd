/*
 * test_alias: no output may share memory with an input or another output
 * (fusedgrpo.h "Conventions"). Every array of a call lives in one pool, at
 * adjacent offsets (touching, never overlapping: every call runs, and gives
 * the bits of the same call on separate buffers); each case then moves one
 * array onto another and expects FG_ERR_ALIASED_OUTPUT naming both, with the
 * whole pool (every input and output) unchanged. Covered: every entry point
 * with outputs (fg_linear_grpo, fg_linear_logprobs,
 * fg_linear_logprobs_backward, fg_logits_grpo, fg_grpo_loss_from_logp, the
 * phases' fg_linear_shard_stats, fg_shard_stats_rescale,
 * fg_shard_stats_finish, fg_linear_shard_backward), on the CPU and (one call)
 * behind the seam on the reference backend; the same array, a shifted view,
 * one row of overlap, interleaved rows, output over output, output over a
 * per-token input, the caller's workspace over an input or an output. Allowed: fg_logits_grpo's grad_logits exactly over the
 * logits (the same bits as out of place), and the plan query with one
 * placeholder for every output. Odd sizes; several chunks where the call
 * chunks (a budget of a few rows).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fg_oracle.h"
#include "test_util.h"

enum { B = 3, T = 5, H = 13, V = 1031, N = B * T };

static fg_context *ctx, *ref_ctx;
static tu_problem prob;
static double *logits_true; /* [N, V], the problem's logits */

static int has(const char *msg, const char *part) { return strstr(msg, part) != NULL; }

/* ---------------------------------------------------------------- layout */

/* Where each array of a call lives: in the pool, adjacent, unless a case
 * moved it. hidden and grad_hidden hold [N, 2H] so that rows can be
 * interleaved (ld = 2H). */
typedef struct layout {
    float *hidden, *weight, *gw, *bias, *gh, *gb;
    int64_t ldh, ldgh;
    float *logp, *entropy, *dlogp, *dent, *old, *ref, *adv, *stats;
    int64_t *ids;
    uint8_t *mask;
    float *logits, *glog;
    fg_dtype glog_dt;
    int64_t ldglog;
} layout;

enum { STATS = 13 * N + 1 };
static const size_t sizes[] = {2 * N * H, V * H, V * H, V,         2 * N * H, V, N, N,
                               N,         N,     N,     N,         B + 1, STATS, 2 * N, N,
                               N * V,     N * V};
enum { N_REGIONS = sizeof sizes / sizeof sizes[0] };
static float *pool, *pool_copy;
static size_t pool_len;

/* The adjacent layout: each region right after the previous one. */
static layout base_layout(void)
{
    float *at[N_REGIONS];
    size_t off = 0;
    for (int i = 0; i < N_REGIONS; i++) {
        at[i] = pool + off;
        off += sizes[i] + (sizes[i] & 1); /* even: the int64 ids stay aligned */
    }
    layout L = {at[0], at[1], at[2], at[3], at[4], at[5], H, H, at[6], at[7], at[8], at[9],
                at[10], at[11], at[12], at[13], (int64_t *)(void *)at[14], (uint8_t *)at[15],
                at[16], at[17], FG_DTYPE_F32, V};
    return L;
}

static size_t pool_floats(void)
{
    size_t n = 0;
    for (int i = 0; i < N_REGIONS; i++)
        n += sizes[i] + (sizes[i] & 1);
    return n;
}

static void put_tokens(const layout *L)
{
    memcpy(L->ids, prob.tb.token_ids, N * sizeof(int64_t));
    memcpy(L->mask, prob.tb.mask, N);
}

/* The pool's contents for a case: the problem's inputs where the layout
 * puts them (those a case moved included, and the tokens at their base
 * places too, for prepare), distinct values elsewhere. */
static void fill(const layout *L)
{
    for (size_t i = 0; i < pool_len; i++)
        pool[i] = 0.001f * (float)(i % 977) - 0.25f;
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < H; h++)
            L->hidden[n * L->ldh + h] = (float)prob.hidden[n * H + h];
    for (int64_t i = 0; i < V * H; i++)
        L->weight[i] = (float)prob.weight[i];
    for (int64_t v = 0; v < V; v++)
        L->bias[v] = (float)prob.bias[v];
    for (int64_t i = 0; i < N * V; i++)
        L->logits[i] = (float)logits_true[i];
    for (int64_t n = 0; n < N; n++) {
        const int masked = !prob.tb.mask[n];
        L->old[n] = masked ? 0.0f : prob.tb.old_logp[n];
        L->ref[n] = masked ? 0.0f : prob.tb.ref_logp[n];
        L->dlogp[n] = 0.5f - 0.07f * (float)(n % 11);
        L->dent[n] = 0.03f * (float)(n % 5) - 0.05f;
    }
    for (int64_t b = 0; b < B; b++)
        L->adv[b] = prob.tb.advantages[b];
    /* the tokens last: a case may lay them over another input */
    const layout base = base_layout();
    put_tokens(&base);
    put_tokens(L);
}

/* -------------------------------------------------------------- the calls */

enum call_kind {
    LOSS,
    LOGPROBS,
    BACKWARD,
    SHARD_STATS,
    RESCALE,
    FINISH,
    SHARD_BACKWARD,
    FROM_LOGP,
    LOGITS,
    KINDS
};
static const char *const kind_names[KINDS] = {
    "fg_linear_grpo",        "fg_linear_logprobs",    "fg_linear_logprobs_backward",
    "fg_linear_shard_stats", "fg_shard_stats_rescale", "fg_shard_stats_finish",
    "fg_linear_shard_backward", "fg_grpo_loss_from_logp", "fg_logits_grpo"};

static fg_linear_inputs inputs_of(const layout *L)
{
    fg_linear_inputs in;
    memset(&in, 0, sizeof in);
    in.hidden = (fg_matrix){L->hidden, FG_DTYPE_F32, N, H, L->ldh};
    in.weight = fg_matrix_make(L->weight, FG_DTYPE_F32, V, H);
    in.bias = fg_vector_make(L->bias, FG_DTYPE_F32, V);
    return in;
}

static fg_batch batch_of(const layout *L)
{
    fg_batch b;
    memset(&b, 0, sizeof b);
    b.batch = B;
    b.seq_len = T;
    b.token_ids = L->ids;
    b.mask = L->mask;
    b.advantages = L->adv;
    b.old_logp = L->old;
    b.ref_logp = L->ref;
    return b;
}

static fg_linear_grads grads_of(const layout *L, int accumulate)
{
    fg_linear_grads g;
    memset(&g, 0, sizeof g);
    g.grad_hidden = (fg_matrix){L->gh, FG_DTYPE_F32, N, H, L->ldgh};
    g.grad_weight = fg_matrix_make(L->gw, FG_DTYPE_F32, V, H);
    g.grad_bias = fg_vector_make(L->gb, FG_DTYPE_F32, V);
    g.accumulate = accumulate;
    return g;
}

/* A budget of a few token rows a chunk (set in main from the planner): the
 * calls that chunk walk several. */
static size_t budget;

static fg_exec small_budget(void)
{
    fg_exec e;
    fg_exec_init(&e);
    e.memory_budget = budget;
    return e;
}

/* One call of `kind` over the layout's arrays (the phases' stats must hold
 * a finished (a)-(b) for SHARD_BACKWARD, an (a) for RESCALE and FINISH). */
static fg_status call(fg_context *c, enum call_kind kind, const layout *L)
{
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.beta = 0.04;
    const fg_linear_inputs in = inputs_of(L);
    const fg_batch b = batch_of(L);
    const fg_tokens tok = {B, T, L->ids, L->mask};
    fg_linear_grads g = grads_of(L, 1);
    const fg_exec ex = small_budget();
    switch (kind) {
    case LOSS: {
        fg_linear_outputs out;
        memset(&out, 0, sizeof out);
        out.logp = L->logp;
        out.entropy = L->entropy;
        out.grad_hidden = g.grad_hidden;
        out.grad_weight = g.grad_weight;
        out.grad_bias = g.grad_bias;
        out.accumulate = 1;
        return fg_linear_grpo(c, NULL, &cfg, &in, &b, &out, &ex);
    }
    case LOGPROBS:
        return fg_linear_logprobs(c, NULL, 1.0, &in, &tok, L->logp, L->entropy, &ex);
    case BACKWARD:
        return fg_linear_logprobs_backward(c, NULL, 1.0, &in, &tok, L->dlogp, L->dent, &g, &ex);
    case SHARD_STATS:
        return fg_linear_shard_stats(c, NULL, 1.0, &in, &tok, L->stats, &ex);
    case RESCALE:
        return fg_shard_stats_rescale(c, &tok, L->stats);
    case FINISH:
        return fg_shard_stats_finish(c, &tok, L->stats, L->logp, L->entropy);
    case SHARD_BACKWARD:
        g.accumulate = 0;
        return fg_linear_shard_backward(c, NULL, 1.0, &in, &tok, L->stats, L->dlogp, L->dent, &g,
                                        &ex);
    case FROM_LOGP: {
        fg_logp_outputs out;
        memset(&out, 0, sizeof out);
        out.grad_logp = L->dlogp;
        out.grad_entropy = L->dent;
        return fg_grpo_loss_from_logp(c, &cfg, &b, L->logp, L->entropy, &out, NULL);
    }
    case LOGITS: {
        fg_logits_outputs out;
        memset(&out, 0, sizeof out);
        out.logp = L->logp;
        out.entropy = L->entropy;
        out.grad_logits = (fg_matrix){L->glog, L->glog_dt, N, V, L->ldglog};
        const fg_matrix lg = fg_matrix_make(L->logits, FG_DTYPE_F32, N, V);
        return fg_logits_grpo(c, &cfg, &lg, &b, &out, NULL);
    }
    default:
        return FG_ERR_UNSUPPORTED;
    }
}

/* What a call reads before it may run: (a)'s statistics for the phases after
 * it, the merged ones (and finite logp, entropy) for (d) and the loss from
 * logp. Returns 0 when a step failed. */
static int prepare(enum call_kind kind, const layout *L)
{
    if (kind == RESCALE || kind == FINISH || kind == SHARD_BACKWARD || kind == FROM_LOGP) {
        /* the phases' own arrays, at their base places */
        const layout P = base_layout();
        fg_status st = call(ctx, SHARD_STATS, &P);
        if (st == FG_OK && kind != RESCALE)
            st = call(ctx, RESCALE, &P);
        if (st == FG_OK && kind != RESCALE && kind != FINISH)
            st = call(ctx, FINISH, &P);
        if (P.stats != L->stats && st == FG_OK)
            memmove(L->stats, P.stats, STATS * sizeof(float));
        if (kind == FROM_LOGP && st == FG_OK) {
            memmove(L->logp, P.logp, N * sizeof(float));
            memmove(L->entropy, P.entropy, N * sizeof(float));
        }
        put_tokens(L); /* where the steps above wrote over them */
        CHECK(st == FG_OK, "%s: preparing its inputs: %s", kind_names[kind], fg_last_error(ctx));
        return st == FG_OK;
    }
    return 1;
}

/* ----------------------------------------------------------------- checks */

/* The case must be refused naming `out` and `other`, the pool unchanged. */
static void expect_refused(fg_context *c, const char *what, enum call_kind kind, const layout *L,
                           const char *out, const char *role, const char *other)
{
    fill(L);
    if (!prepare(kind, L))
        return;
    memcpy(pool_copy, pool, pool_len * sizeof(float));
    const fg_status st = call(c, kind, L);
    char want[160];
    snprintf(want, sizeof want, "%s shares memory with the %s %s", out, role, other);
    const char *msg = fg_last_error(c);
    CHECK(st == FG_ERR_ALIASED_OUTPUT && has(msg, want),
          "%s (%s): status %s, message '%s', wanted '%s'", what, kind_names[kind],
          fg_status_name(st), msg, want);
    CHECK(memcmp(pool, pool_copy, pool_len * sizeof(float)) == 0,
          "%s (%s): a refused call changed memory", what, kind_names[kind]);
}

/* The adjacent layout runs every call, and gives the bits of the same call
 * on separate buffers (the pool's regions touch: nothing is refused there). */
static void check_adjacent_runs(void)
{
    const layout L = base_layout();
    for (int k = 0; k < KINDS; k++) {
        fill(&L);
        if (!prepare((enum call_kind)k, &L))
            continue;
        float *before = tu_xmalloc(pool_len * sizeof(float));
        memcpy(before, pool, pool_len * sizeof(float));
        const fg_status st = call(ctx, (enum call_kind)k, &L);
        CHECK(st == FG_OK, "%s, adjacent arrays: %s", kind_names[k], fg_last_error(ctx));
        /* the same call on a copy of the pool made elsewhere */
        float *after = tu_xmalloc(pool_len * sizeof(float));
        memcpy(after, pool, pool_len * sizeof(float));
        memcpy(pool_copy, before, pool_len * sizeof(float));
        layout C = L;
        const ptrdiff_t shift = pool_copy - pool;
        float **f[] = {&C.hidden, &C.weight, &C.gw, &C.bias, &C.gh, &C.gb, &C.logp,
                       &C.entropy, &C.dlogp, &C.dent, &C.old, &C.ref, &C.adv, &C.stats,
                       &C.logits, &C.glog};
        for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
            *f[i] += shift;
        C.ids = (int64_t *)(void *)((float *)(void *)C.ids + shift);
        C.mask = (uint8_t *)((float *)(void *)C.mask + shift);
        const fg_status st2 = call(ctx, (enum call_kind)k, &C);
        CHECK(st2 == FG_OK && memcmp(after, pool_copy, pool_len * sizeof(float)) == 0,
              "%s: adjacent arrays give other bits than separate ones (%s)", kind_names[k],
              fg_status_name(st2));
        free(before);
        free(after);
    }
}

/* An accumulating backward of several chunks into the weight it reads: the
 * gradient would be summed into rows still to be read. Refused, and the
 * same call into a buffer of its own gives the oracle-checked numbers the
 * other tests hold it to (here: finite, nonzero, and what it adds). */
static void check_backward(void)
{
    layout L = base_layout();
    L.gw = L.weight;
    expect_refused(ctx, "grad_weight = weight", BACKWARD, &L, "grad_weight", "input", "weight");
    expect_refused(ref_ctx, "grad_weight = weight, reference backend", BACKWARD, &L,
                   "grad_weight", "input", "weight");
    L = base_layout();
    L.gw = L.weight + (V - 1) * H; /* one row in common */
    expect_refused(ctx, "grad_weight over weight's last row", BACKWARD, &L, "grad_weight",
                   "input", "weight");
    L = base_layout();
    L.gh = L.hidden + 1; /* a shifted view */
    expect_refused(ctx, "grad_hidden one element into hidden", BACKWARD, &L, "grad_hidden",
                   "input", "hidden");
    L = base_layout();
    L.gb = L.bias;
    expect_refused(ctx, "grad_bias = bias", BACKWARD, &L, "grad_bias", "input", "bias");
    L = base_layout();
    L.gh = L.dlogp - 3;
    expect_refused(ctx, "grad_hidden over grad_logp", BACKWARD, &L, "grad_hidden", "input",
                   "grad_logp");
    L = base_layout();
    L.gb = L.gw + V * H - 2; /* output over output */
    expect_refused(ctx, "grad_bias over grad_weight", BACKWARD, &L, "grad_weight", "output",
                   "grad_bias");

    /* The numbers: the probe's call, into a buffer of its own, adds the
     * gradient to what it held; into the weight it would not. */
    L = base_layout();
    fill(&L);
    for (int64_t i = 0; i < V * H; i++)
        L.gw[i] = L.weight[i];
    const fg_status st = call(ctx, BACKWARD, &L);
    CHECK(st == FG_OK, "backward into a copy of the weight: %s", fg_last_error(ctx));
    float *sum = tu_xmalloc(V * H * sizeof(float));
    memcpy(sum, L.gw, V * H * sizeof(float));
    fg_linear_grads g = grads_of(&L, 0);
    const fg_linear_inputs in = inputs_of(&L);
    const fg_tokens tok = {B, T, L.ids, L.mask};
    const fg_exec ex = small_budget();
    CHECK(fg_linear_logprobs_backward(ctx, NULL, 1.0, &in, &tok, L.dlogp, L.dent, &g, &ex) ==
              FG_OK,
          "backward, overwriting: %s", fg_last_error(ctx));
    double worst = 0;
    for (int64_t i = 0; i < V * H; i++)
        worst = fmax(worst, fabs((double)sum[i] - ((double)L.gw[i] + (double)L.weight[i])));
    TOL_CHECK("alias_accumulate_sum", worst, 1e-6, "weight + gradient, V = %d, H = %d", V, H);
    /* the gradient itself, against the float64 oracle */
    double dlogp[N], dent[N];
    for (int64_t n = 0; n < N; n++) {
        dlogp[n] = L.dlogp[n];
        dent[n] = L.dent[n];
    }
    fg_batch tb;
    memset(&tb, 0, sizeof tb);
    tb.batch = B;
    tb.seq_len = T;
    tb.token_ids = L.ids;
    tb.mask = L.mask;
    fg_oracle_result ref;
    CHECK(fg_oracle_linear_head(&tb, prob.hidden, prob.weight, prob.bias, H, V, 1.0, dlogp, dent,
                                &ref) == 0,
          "%s", "oracle");
    TOL_CHECK("alias_grad_weight", tu_rel_l2(L.gw, FG_DTYPE_F32, V, H, H, ref.grad_weight), 1e-6,
              "backward beside its inputs, V = %d, H = %d", V, H);
    TOL_CHECK("alias_grad_hidden", tu_rel_l2(L.gh, FG_DTYPE_F32, N, H, H, ref.grad_hidden), 2e-6,
              "backward beside its inputs, V = %d, H = %d", V, H);
    fg_oracle_result_free(&ref);
    fg_memory_stats ms;
    fg_get_memory_stats(ctx, &ms);
    CHECK(ms.chunks > 1, "the budget walks several chunks (%lld)", (long long)ms.chunks);
    free(sum);
}

static void check_loss_and_logprobs(void)
{
    layout L = base_layout();
    L.logp = L.old;
    expect_refused(ctx, "logp = old_logp", LOSS, &L, "logp", "input", "old_logp");
    L = base_layout();
    L.entropy = L.logp + 1;
    expect_refused(ctx, "entropy one element into logp", LOSS, &L, "logp", "output", "entropy");
    L = base_layout();
    L.gb = L.bias;
    expect_refused(ctx, "grad_bias = bias", LOSS, &L, "grad_bias", "input", "bias");
    L = base_layout();
    L.adv = L.gw + 7;
    expect_refused(ctx, "advantages inside grad_weight", LOSS, &L, "grad_weight", "input",
                   "advantages");
    /* Interleaved rows share no element, but each array's range holds the
     * other's rows: refused (one range per array). */
    L = base_layout();
    L.ldh = L.ldgh = 2 * H;
    L.gh = L.hidden + H;
    expect_refused(ctx, "grad_hidden rows between hidden's", LOSS, &L, "grad_hidden", "input",
                   "hidden");
    L = base_layout();
    L.gw = L.weight;
    expect_refused(ctx, "grad_weight = weight", LOSS, &L, "grad_weight", "input", "weight");

    L = base_layout();
    L.logp = (float *)(void *)L.ids;
    expect_refused(ctx, "logp over token_ids", LOGPROBS, &L, "logp", "input", "token_ids");
    L = base_layout();
    L.mask = (uint8_t *)(L.entropy + 2);
    expect_refused(ctx, "mask inside entropy", LOGPROBS, &L, "entropy", "input", "mask");
    L = base_layout();
    L.entropy = L.logp;
    expect_refused(ctx, "entropy = logp", LOGPROBS, &L, "logp", "output", "entropy");
}

static void check_phases(void)
{
    layout L = base_layout();
    L.stats = L.hidden + 5;
    expect_refused(ctx, "stats inside hidden", SHARD_STATS, &L, "stats", "input", "hidden");
    L = base_layout();
    L.mask = (uint8_t *)L.stats - 2; /* the mask's last bytes under the stats' first */
    expect_refused(ctx, "mask over the stats' start", RESCALE, &L, "stats", "input", "mask");
    L = base_layout();
    L.logp = L.stats + 2 * N;
    expect_refused(ctx, "logp inside stats", FINISH, &L, "stats", "output", "logp");
    L = base_layout();
    L.entropy = (float *)(void *)L.ids;
    expect_refused(ctx, "entropy over token_ids", FINISH, &L, "entropy", "input", "token_ids");
    L = base_layout();
    L.gh = L.stats + 1; /* N x H floats: within the stats */
    expect_refused(ctx, "grad_hidden inside stats", SHARD_BACKWARD, &L, "grad_hidden", "input",
                   "stats");
    L = base_layout();
    L.gh = L.dent;
    expect_refused(ctx, "grad_hidden over grad_entropy", SHARD_BACKWARD, &L, "grad_hidden",
                   "input", "grad_entropy");
    L = base_layout();
    L.dlogp = L.logp;
    expect_refused(ctx, "grad_logp = logp", FROM_LOGP, &L, "grad_logp", "input", "logp");
    L = base_layout();
    L.dent = L.dlogp + N - 1;
    expect_refused(ctx, "grad_entropy over grad_logp's end", FROM_LOGP, &L, "grad_logp",
                   "output", "grad_entropy");
    L = base_layout();
    L.dlogp = L.ref + 1;
    expect_refused(ctx, "grad_logp over ref_logp", FROM_LOGP, &L, "grad_logp", "input",
                   "ref_logp");
}

/* fg_logits_grpo: grad_logits exactly over the logits runs (the bits of the
 * out-of-place call); any other overlap is refused. */
static void check_logits(void)
{
    layout L = base_layout();
    fill(&L);
    CHECK(call(ctx, LOGITS, &L) == FG_OK, "logits, out of place: %s", fg_last_error(ctx));
    float *want = tu_xmalloc(N * V * sizeof(float));
    memcpy(want, L.glog, N * V * sizeof(float));
    float logp[N];
    memcpy(logp, L.logp, sizeof logp);
    layout P = base_layout();
    P.glog = P.logits;
    fill(&P);
    CHECK(call(ctx, LOGITS, &P) == FG_OK, "logits, in place: %s", fg_last_error(ctx));
    CHECK(memcmp(P.logits, want, N * V * sizeof(float)) == 0 &&
              memcmp(P.logp, logp, sizeof logp) == 0,
          "%s", "in place gives other bits than out of place");
    free(want);

    L = base_layout();
    L.glog = L.logits + V; /* one row down: it would overwrite rows still to be read */
    expect_refused(ctx, "grad_logits one row into logits", LOGITS, &L, "grad_logits", "input",
                   "logits");
    L = base_layout();
    L.glog = L.logits;
    L.glog_dt = FG_DTYPE_BF16; /* the same data, another dtype: not in place */
    expect_refused(ctx, "bf16 grad_logits over f32 logits", LOGITS, &L, "grad_logits", "input",
                   "logits");
    L = base_layout();
    L.glog = L.logits;
    L.ldglog = V + 1; /* ld differs: rows drift apart */
    expect_refused(ctx, "grad_logits over logits with another ld", LOGITS, &L, "grad_logits",
                   "input", "logits");
    L = base_layout();
    L.logp = L.logits + 3 * V;
    expect_refused(ctx, "logp inside logits", LOGITS, &L, "logp", "input", "logits");
    L = base_layout();
    L.glog = L.logits;
    L.entropy = L.logits + 2;
    expect_refused(ctx, "entropy inside in-place grad_logits", LOGITS, &L, "entropy", "output",
                   "grad_logits");
    L = base_layout();
    L.adv = L.glog + N * V - B;
    expect_refused(ctx, "advantages under grad_logits' end", LOGITS, &L, "grad_logits", "input",
                   "advantages");
}

/* The plan query writes nothing: one placeholder may stand for every output.
 * Returns the plan's smallest budget and one chunk row's bytes (the budget
 * it ran with permitting). */
static size_t plan_placeholder(size_t *row_bytes)
{
    static float placeholder[1];
    layout L = base_layout();
    fill(&L);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    const fg_linear_inputs in = inputs_of(&L);
    const fg_batch b = batch_of(&L);
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    out.grad_hidden = fg_matrix_make(placeholder, FG_DTYPE_F32, N, H);
    out.grad_weight = fg_matrix_make(placeholder, FG_DTYPE_F32, V, H);
    out.grad_bias = fg_vector_make(placeholder, FG_DTYPE_F32, V);
    fg_linear_plan_info info;
    const fg_exec ex = small_budget();
    CHECK(fg_linear_grpo_plan(ctx, NULL, &cfg, &in, &b, &out, &ex, &info) == FG_OK,
          "plan with one placeholder: %s", fg_last_error(ctx));
    *row_bytes = info.chunk_rows > 0 ? info.chunk_bytes / (size_t)info.chunk_rows : 0;
    return info.min_budget_bytes;
}

/* The small budget: the loss's smallest (one row a chunk) and two rows more;
 * the plan with the placeholder then walks several chunks. */
static void set_small_budget(void)
{
    size_t row_bytes;
    budget = (size_t)1 << 30;
    budget = plan_placeholder(&row_bytes) + 2 * row_bytes;
    fg_memory_stats ms;
    (void)plan_placeholder(&row_bytes);
    layout L = base_layout();
    fill(&L);
    CHECK(call(ctx, LOSS, &L) == FG_OK && fg_get_memory_stats(ctx, &ms) == FG_OK &&
              ms.chunks > 1,
          "the small budget (%zu bytes) walks several chunks: %s, %lld", budget,
          fg_last_error(ctx), (long long)ms.chunks);
}

/* The caller's workspace (fg_exec.workspace) is written by the call: over
 * an input (here hidden, placed at its start) or an output it is refused,
 * with hidden unchanged; beside them the same call runs. */
static void check_caller_workspace(void)
{
    const fg_linear_inputs in0 = tu_problem_inputs(&prob);
    const fg_batch *batch = tu_batch_view(&prob.tb);
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    tu_linear_outs o;
    tu_linear_outs_make(&o, N, H, V, 1);
    fg_exec e;
    fg_exec_init(&e);
    fg_linear_plan_info plan;
    CHECK(fg_linear_grpo_plan(ctx, NULL, &cfg, &in0, batch, &o.out, &e, &plan) == FG_OK,
          "workspace plan: %s", fg_last_error(ctx));
    const size_t hidden_bytes = (size_t)N * H * sizeof(float);
    const size_t ws_bytes = plan.working_bytes + hidden_bytes;
    float *ws = tu_xmalloc_aligned(ws_bytes);
    memcpy(ws, prob.hidden_s, hidden_bytes); /* f32 problem, contiguous rows */
    fg_linear_inputs in = in0;
    in.hidden = fg_matrix_make(ws, FG_DTYPE_F32, N, H);
    e.workspace = ws;
    e.workspace_bytes = ws_bytes;
    fg_status st = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &o.out, &e);
    CHECK(st == FG_ERR_ALIASED_OUTPUT &&
              has(fg_last_error(ctx), "exec->workspace shares memory with the input hidden"),
          "workspace over hidden: %s: %s", fg_status_name(st), fg_last_error(ctx));
    CHECK(memcmp(ws, prob.hidden_s, hidden_bytes) == 0, "%s", "workspace over hidden: hidden changed");
    /* over an output: grad_hidden at the workspace's start */
    in.hidden = in0.hidden;
    fg_linear_outputs out = o.out;
    out.grad_hidden = fg_matrix_make(ws, FG_DTYPE_F32, N, H);
    st = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &out, &e);
    CHECK(st == FG_ERR_ALIASED_OUTPUT &&
              has(fg_last_error(ctx), "exec->workspace shares memory with the output grad_hidden"),
          "workspace over grad_hidden: %s: %s", fg_status_name(st), fg_last_error(ctx));
    /* apart from every argument: runs */
    st = fg_linear_grpo(ctx, NULL, &cfg, &in, batch, &o.out, &e);
    CHECK(st == FG_OK, "workspace apart: %s", fg_last_error(ctx));
    free(ws);
    tu_linear_outs_free(&o);
}

int main(void)
{
    CHECK(strcmp(fg_status_name(FG_ERR_ALIASED_OUTPUT), "FG_ERR_ALIASED_OUTPUT") == 0 &&
              FG_ERR_ALIASED_OUTPUT == FG_ERR_OVERFLOW + 1,
          "%s", "FG_ERR_ALIASED_OUTPUT's name and place (after the older statuses)");
    fg_context_options o;
    fg_context_options_init(&o);
    CHECK(fg_context_create(&o, &ctx) == FG_OK, "%s", "context");
    o.backend = FG_BACKEND_REFERENCE;
    CHECK(fg_context_create(&o, &ref_ctx) == FG_OK, "%s", "reference context");
    tu_problem_make(&prob, B, T, H, V, FG_DTYPE_F32, 1, 4242);
    CHECK(tu_problem_fill_logp(&prob, 1.0, 0.2, 0.2) == 0, "%s", "oracle log-probs");
    logits_true = tu_problem_logits(&prob);
    pool_len = pool_floats();
    pool = tu_xmalloc_aligned(pool_len * sizeof(float));
    pool_copy = tu_xmalloc_aligned(pool_len * sizeof(float));

    set_small_budget();
    check_adjacent_runs();
    check_backward();
    check_loss_and_logprobs();
    check_phases();
    check_logits();
    check_caller_workspace();

    free(pool);
    free(pool_copy);
    free(logits_true);
    tu_problem_free(&prob);
    fg_context_destroy(ref_ctx);
    fg_context_destroy(ctx);
    return tu_finish();
}
