/*
 * test_deferred: a call with no host wait between its chunks (linear_grpo.c
 * runs_deferred: each chunk's g and e from the backend's derivs op, on the
 * loss math of loss_token.h; every token read and checked once, after the
 * chunks) over the seam's reference backend, against the same backend's
 * chunked walk (its derivs op taken away: each chunk's statistics to the
 * host, the loss math there, g and e back):
 *
 *  1. Losses no token can fail (token level, no KL: certified), every such
 *     loss type, f32 and bf16 inputs, odd sizes (B = 3, T = 11, H = 20,
 *     V = 53, a ragged mask, padded strides, a bias in half the cases),
 *     several chunks: loss, metrics, logp, entropy and the three gradients
 *     bitwise equal to the chunked walk's (one source of the loss math: the
 *     same bits on the host and in derivs).
 *  2. Host synchronisations (waits and copies, counted by the reference
 *     backend): the deferred walk's are the same for one chunk and for
 *     several; the chunked walk's grow with the chunks.
 *  3. Losses that read every token's log-prob first (sequence level, vespo,
 *     the entropy quantile, the off-policy mask; the finite check on or
 *     off): deferred too (every token is checked between the two sweeps),
 *     bitwise the chunked walk's; the KL deferred in several chunks (one
 *     chunk: the chunked walk). A call that stays chunked, with the chunked
 *     walk's results and synchronisations: the finite check off for a
 *     token-level loss. The KL overflowing at a token of the first chunk
 *     and of the last: FG_ERR_OVERFLOW, the same message from both walks,
 *     logp, entropy and the loss untouched, grad_weight written as the
 *     contract says.
 *  4. fg_linear_logprobs (nothing written before the end: deferred, derivs
 *     or not; bitwise equal to one chunk's) and fg_linear_logprobs_backward
 *     (the caller's derivatives read by derivs in the backend's memory;
 *     bitwise equal to the chunked walk's).
 *  5. Gradient filtering deferred: the kept count and the gradients equal
 *     to the chunked walk's.
 *  6. Backend faults: a stats op flagging a target outside [0, V) in the
 *     second chunk, and also a NaN log-prob in the first (the finite check
 *     off, a sequence-level loss: deferred): the same status and message
 *     from both walks, the first chunk's first.
 *  7. An accumulating loss call with the KL over several chunks (it reads
 *     every token first: deferred), a loss without gradients, a batch
 *     with every token masked: bitwise the chunked walk's.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "call.h"
#include "linear_request.h"
#include "test_util.h"

enum { B = 3, T = 11, H = 20, V = 53, N = B * T };

/* How a walk went. */
typedef struct walk {
    fg_status st;
    int64_t chunks, entries, kept;
    long syncs;
    char msg[sizeof ((fg_error *)0)->msg];
} walk;

/* The reference backend's stats op, flagging row 2 of every chunk after
 * the first, and with nan_first a NaN log-prob at row 1 of the first
 * (part 6). */
static const fg_backend_ops *ref_ops;
static int nan_first;
static fg_status flagging_stats(void *be, const fg_backend_call *c, int64_t r0, int64_t m,
                                char *msg, size_t n)
{
    const fg_status st = ref_ops->stats(be, c, r0, m, msg, n);
    if (st == FG_OK && r0 > 0 && m > 2 && *c->row_check > 2)
        *c->row_check = 2;
    if (st == FG_OK && r0 == 0 && m > 1 && nan_first)
        c->logp[1] = NAN;
    return st;
}

enum variant { DEFERRED, CHUNKED, FAULTY_DEFERRED, FAULTY_CHUNKED };

/* One request on the reference backend (variant: with derivs or not, its
 * stats op faulty or not) in a fresh call at `budget`. */
static walk run(fg_context *ctx, enum variant v, size_t budget, const fg_linear_options *o,
                const linear_request *req, const fg_linear_inputs *in, fg_linear_outputs *out)
{
    walk w;
    memset(&w, 0, sizeof w);
    char msg[256];
    fg_device ref;
    if (fg_backend_reference_create(NULL, &ref, msg, sizeof msg) != FG_OK) {
        w.st = FG_ERR_BACKEND;
        return w;
    }
    ref_ops = ref.ops;
    fg_backend_ops ops = *ref.ops;
    if (v == CHUNKED || v == FAULTY_CHUNKED)
        ops.derivs = NULL;
    if (v == FAULTY_DEFERRED || v == FAULTY_CHUNKED)
        ops.stats = flagging_stats;
    const fg_device be = {&ops, ref.state};
    fg_exec ex;
    fg_exec_init(&ex);
    ex.memory_budget = budget;
    fg_call call;
    if ((w.st = fg_call_begin(ctx, &ex, &call)) != FG_OK)
        return w;
    const long before = fg_backend_reference_syncs();
    w.st = fg_linear_run(&call, &be, o, req, in, out);
    w.syncs = fg_backend_reference_syncs() - before;
    w.chunks = call.chunks;
    w.entries = call.dlogits_entries;
    w.kept = call.dlogits_kept;
    snprintf(w.msg, sizeof w.msg, "%s", w.st == FG_OK ? "" : call.err->msg);
    (void)fg_call_end(&call, w.st);
    return w;
}

/* The least budget (in 256-byte steps) at which the request plans `want`
 * chunks or fewer on the reference backend (want 1: one chunk), else the
 * largest that plans more than one. */
static size_t budget_for(fg_context *ctx, int64_t want, const fg_linear_options *o,
                         const linear_request *req, const fg_linear_inputs *in,
                         const fg_linear_outputs *out)
{
    char msg[256];
    fg_device ref;
    if (fg_backend_reference_create(NULL, &ref, msg, sizeof msg) != FG_OK)
        return 0;
    size_t several = 0;
    for (size_t budget = 4096; budget < ((size_t)1 << 26); budget += 256) {
        fg_exec ex;
        fg_exec_init(&ex);
        ex.memory_budget = budget;
        fg_call call;
        if (fg_call_begin(ctx, &ex, &call) != FG_OK)
            return 0;
        fg_linear_plan_info info;
        const fg_status st = fg_linear_plan_request(&call, &ref, o, req, in, out, &info);
        (void)fg_call_end(&call, st);
        if (st != FG_OK)
            continue;
        if (info.chunks <= want)
            return budget;
        if (want > 1 && info.chunks > 1)
            several = budget;
    }
    return several;
}

/* The loss request of a problem. */
static linear_request loss_request(const fg_loss_config *cfg, const fg_batch *batch)
{
    linear_request r;
    memset(&r, 0, sizeof r);
    r.kind = KIND_LOSS;
    r.cfg = cfg;
    r.batch = batch;
    return r;
}

/* A problem of the test's shape (opts NULL: tu_problem_make's) with old
 * and reference log-probs near the oracle's own at the configs'
 * temperature; 0, after a failed CHECK, when the oracle refuses it. */
static int make_problem(tu_problem *prob, fg_dtype dt, int with_bias, uint64_t seed,
                        const tu_problem_opts *opts, const char *tag)
{
    if (opts)
        tu_problem_make_opts(prob, B, T, H, V, dt, with_bias, seed, opts);
    else
        tu_problem_make(prob, B, T, H, V, dt, with_bias, seed);
    if (tu_problem_fill_logp(prob, 0.8, 0.2, 0.3) == 0)
        return 1;
    CHECK(0, "%s: the oracle refused the batch", tag);
    tu_problem_free(prob);
    return 0;
}

/* Parts 1-3 and 5: one configuration, deferred and chunked, at one chunk
 * and at several. `deferred`: whether the several-chunk walk should run
 * without host waits between its chunks (2: and the one-chunk walk with
 * them). */
static void loss_case(fg_context *ctx, const char *tag, const fg_loss_config *cfg, fg_dtype dt,
                      int with_bias, int check_finite, double filter_eps, int deferred,
                      uint64_t seed)
{
    const tu_problem_opts po = {0, 0, 0, 3, 5, (int)(seed % 4)};
    tu_problem prob;
    if (!make_problem(&prob, dt, with_bias, seed, &po, tag))
        return;
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    const fg_linear_options o = {FG_IMPL_FUSED, 0, filter_eps};
    const linear_request req = loss_request(cfg, batch);
    tu_linear_outs a, b, one;
    tu_linear_outs_make(&a, N, H, V, with_bias);
    tu_linear_outs_make(&b, N, H, V, with_bias);
    tu_linear_outs_make(&one, N, H, V, with_bias);
    if (!with_bias)
        a.out.grad_bias.data = b.out.grad_bias.data = one.out.grad_bias.data = NULL;
    fg_context_set_check_finite(ctx, check_finite);
    const size_t several = budget_for(ctx, 4, &o, &req, &in, &a.out);
    const size_t whole = budget_for(ctx, 1, &o, &req, &in, &a.out);
    tu_linear_outs_fill(&a, 0xA5);
    tu_linear_outs_fill(&b, 0x5A);
    const walk d = run(ctx, DEFERRED, several, &o, &req, &in, &a.out);
    const walk c = run(ctx, CHUNKED, several, &o, &req, &in, &b.out);
    const walk d1 = run(ctx, DEFERRED, whole, &o, &req, &in, &one.out);
    const walk c1 = run(ctx, CHUNKED, whole, &o, &req, &in, &one.out);
    fg_context_set_check_finite(ctx, 1);
    CHECK(d.st == FG_OK && c.st == FG_OK && d1.st == FG_OK && c1.st == FG_OK,
          "%s: %s / %s / %s / %s: %s%s", tag, fg_status_name(d.st), fg_status_name(c.st),
          fg_status_name(d1.st), fg_status_name(c1.st), d.msg, c.msg);
    CHECK(d.chunks >= 2 && d.chunks == c.chunks && d1.chunks == 1,
          "%s: %lld / %lld chunks at %zu bytes, %lld at %zu", tag, (long long)d.chunks,
          (long long)c.chunks, several, (long long)d1.chunks, whole);
    CHECK(tu_linear_outs_same(&a, &b), "%s: the deferred walk's results differ from the chunked "
                                       "walk's (loss %.9g / %.9g)",
          tag, a.out.loss, b.out.loss);
    CHECK(d.kept == c.kept && d.entries == c.entries, "%s: kept %lld of %lld / %lld of %lld",
          tag, (long long)d.kept, (long long)d.entries, (long long)c.kept, (long long)c.entries);
    if (filter_eps > 0)
        CHECK(d.kept < d.entries, "%s: the filter kept every entry (%lld)", tag,
              (long long)d.kept);
    /* The chunked walk waits (or copies) at least once more a chunk. */
    CHECK(c.syncs - c1.syncs >= c.chunks - 1, "%s: chunked %ld syncs in %lld chunks, %ld in one",
          tag, c.syncs, (long long)c.chunks, c1.syncs);
    if (deferred == 2) /* the KL: deferred in several chunks, the chunked walk in one */
        CHECK(d.syncs <= d1.syncs && d.syncs < c.syncs && d1.syncs == c1.syncs,
              "%s: deferred %ld syncs in %lld chunks, %ld in one (chunked %ld, %ld)", tag,
              d.syncs, (long long)d.chunks, d1.syncs, c.syncs, c1.syncs);
    else if (deferred)
        CHECK(d.syncs == d1.syncs && d.syncs < c.syncs,
              "%s: deferred %ld syncs in %lld chunks, %ld in one (chunked %ld)", tag, d.syncs,
              (long long)d.chunks, d1.syncs, c.syncs);
    else
        CHECK(d.syncs == c.syncs, "%s: not deferred, yet %ld syncs against the chunked %ld",
              tag, d.syncs, c.syncs);
    printf("%-40s %lld chunks: %ld host syncs (%ld in one chunk); chunked %ld (%ld)\n", tag,
           (long long)d.chunks, d.syncs, d1.syncs, c.syncs, c1.syncs);
    tu_linear_outs_free(&a);
    tu_linear_outs_free(&b);
    tu_linear_outs_free(&one);
    tu_problem_free(&prob);
}

static fg_loss_config config(fg_loss_type lt, fg_is_level lvl, double beta)
{
    fg_loss_config cfg;
    fg_loss_config_init(&cfg);
    cfg.loss_type = lt;
    cfg.importance_sampling_level = lvl;
    cfg.temperature = 0.8;
    cfg.beta = beta;
    cfg.entropy_coef = lt == FG_LOSS_DAPO ? 0.05 : 0.0;
    return cfg;
}

/* Part 4: the head's log-probs, forward and backward. */
static void head_case(fg_context *ctx, fg_dtype dt)
{
    tu_problem prob;
    tu_problem_make(&prob, B, T, H, V, dt, 1, 77u + (uint64_t)dt);
    const fg_batch *pb = tu_batch_view(&prob.tb);
    const fg_tokens tokens = {B, T, pb->token_ids, pb->mask};
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    float dlogp[N], dent[N];
    for (int64_t n = 0; n < N; n++) {
        dlogp[n] = (float)(0.3 * tu_normal(&prob.rng));
        dent[n] = (float)(0.1 * tu_normal(&prob.rng));
    }
    fg_loss_config cfg;
    fg_batch batch;
    const char *dn = dt == FG_DTYPE_BF16 ? "bf16" : "f32";
    for (int k = 0; k < 2; k++) {
        linear_request req; /* as fg_linear_logprobs(_backward) builds it */
        fg_linear_head_request(&req, k == 0 ? KIND_LOGPROBS : KIND_LOGPROBS_BACKWARD, &cfg,
                               &batch, 0.9, &tokens, k ? dlogp : NULL, k ? dent : NULL);
        tu_linear_outs a, b, one;
        tu_linear_outs_make(&a, N, H, V, 0);
        tu_linear_outs_make(&b, N, H, V, 0);
        tu_linear_outs_make(&one, N, H, V, 0);
        for (tu_linear_outs *x = &a; x; x = x == &a ? &b : x == &b ? &one : NULL) {
            x->out.grad_bias.data = NULL;
            if (k == 0)
                x->out.grad_hidden.data = x->out.grad_weight.data = NULL;
        }
        const size_t several = budget_for(ctx, 4, NULL, &req, &in, &a.out);
        const size_t whole = budget_for(ctx, 1, NULL, &req, &in, &a.out);
        tu_linear_outs_fill(&a, 0xA5);
        tu_linear_outs_fill(&b, 0xA5);
        tu_linear_outs_fill(&one, 0xA5);
        const walk d = run(ctx, DEFERRED, several, NULL, &req, &in, &a.out);
        const walk c = run(ctx, CHUNKED, several, NULL, &req, &in, &b.out);
        const walk d1 = run(ctx, DEFERRED, whole, NULL, &req, &in, &one.out);
        const char *what = k == 0 ? "logprobs" : "logprobs_backward";
        CHECK(d.st == FG_OK && c.st == FG_OK && d1.st == FG_OK, "%s %s: %s / %s: %s%s", what,
              dn, fg_status_name(d.st), fg_status_name(c.st), d.msg, c.msg);
        CHECK(d.chunks >= 2 && d1.chunks == 1, "%s %s: %lld and %lld chunks", what, dn,
              (long long)d.chunks, (long long)d1.chunks);
        /* The forward writes nothing before the end: it never waits between
         * chunks, derivs or not; the reference's rows have the same bits in
         * any chunk. The backward: bitwise the chunked walk's. */
        CHECK(tu_linear_outs_same(&a, k == 0 ? &one : &b),
              "%s %s: the deferred results differ from the %s", what, dn,
              k == 0 ? "one chunk's" : "chunked walk's");
        CHECK(d.syncs == d1.syncs && (k == 0 ? c.syncs == d.syncs : d.syncs < c.syncs),
              "%s %s: deferred %ld syncs in %lld chunks, %ld in one (chunked %ld)", what, dn,
              d.syncs, (long long)d.chunks, d1.syncs, c.syncs);
        printf("%-40s %lld chunks: %ld host syncs (%ld in one chunk); chunked %ld\n", what,
               (long long)d.chunks, d.syncs, d1.syncs, c.syncs);
        tu_linear_outs_free(&a);
        tu_linear_outs_free(&b);
        tu_linear_outs_free(&one);
    }
    tu_problem_free(&prob);
}

/* Part 6: a backend fault in the second chunk, both walks; then with a
 * NaN log-prob in the first chunk too, the finite check off and a loss
 * that reads every token first (deferred all the same): the first chunk's
 * refusal, as the chunked walk finds it. */
static void fault_case(fg_context *ctx)
{
    tu_problem prob;
    if (!make_problem(&prob, FG_DTYPE_F32, 0, 5150u, NULL, "fault"))
        return;
    const fg_batch *batch = tu_batch_view(&prob.tb);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    for (int k = 0; k < 2; k++) {
        const fg_loss_config cfg =
            config(FG_LOSS_DAPO, k ? FG_LEVEL_SEQUENCE : FG_LEVEL_TOKEN, 0.0);
        const linear_request req = loss_request(&cfg, batch);
        tu_linear_outs a, b;
        tu_linear_outs_make(&a, N, H, V, 0);
        tu_linear_outs_make(&b, N, H, V, 0);
        a.out.grad_bias.data = b.out.grad_bias.data = NULL;
        nan_first = k;
        fg_context_set_check_finite(ctx, !k);
        const size_t several = budget_for(ctx, 4, NULL, &req, &in, &a.out);
        const walk d = run(ctx, FAULTY_DEFERRED, several, NULL, &req, &in, &a.out);
        const walk c = run(ctx, FAULTY_CHUNKED, several, NULL, &req, &in, &b.out);
        fg_context_set_check_finite(ctx, 1);
        nan_first = 0;
        const fg_status want = k ? FG_ERR_NONFINITE_INPUT : FG_ERR_TOKEN_OUT_OF_RANGE;
        CHECK(d.chunks >= 2 && d.st == want && c.st == d.st && strcmp(d.msg, c.msg) == 0 &&
                  strstr(d.msg, k ? "NaN or Inf" : "reference backend"),
              "fault %d (%lld chunks): %s \"%s\" / %s \"%s\"", k, (long long)d.chunks,
              fg_status_name(d.st), d.msg, fg_status_name(c.st), c.msg);
        tu_linear_outs_free(&a);
        tu_linear_outs_free(&b);
    }
    tu_problem_free(&prob);
}

/* The KL overflowing at one token (its reference log-prob far above its
 * log-prob), of the first chunk and of the last: FG_ERR_OVERFLOW with the
 * same message from both walks, logp, entropy and the loss left as they
 * were; the chunked walk wrote the gradients of the chunks before the
 * token's (none for the first), the deferred walk every chunk's
 * (fusedgrpo.h "Conventions"). */
static int bytes_are(const void *p, size_t n, unsigned char v)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != v)
            return 0;
    return 1;
}

static void kl_overflow_case(fg_context *ctx)
{
    for (int where = 0; where < 2; where++) {
        const char *tag = where ? "kl overflow, last chunk" : "kl overflow, first chunk";
        tu_problem prob;
        if (!make_problem(&prob, FG_DTYPE_F32, 0, 7170u, NULL, tag))
            return;
        fg_batch *batch = (fg_batch *)tu_batch_view(&prob.tb);
        int64_t at = -1;
        for (int64_t n = 0; n < N; n++)
            if (batch->mask[n] && (where || at < 0))
                at = n;
        ((float *)batch->ref_logp)[at] = 200.0f; /* exp(200 - logp): d loss/d logp overflows */
        const fg_linear_inputs in = tu_problem_inputs(&prob);
        const fg_loss_config kl = config(FG_LOSS_GRPO, FG_LEVEL_TOKEN, 0.04);
        const linear_request req = loss_request(&kl, batch);
        tu_linear_outs a, b;
        tu_linear_outs_make(&a, N, H, V, 0);
        tu_linear_outs_make(&b, N, H, V, 0);
        a.out.grad_bias.data = b.out.grad_bias.data = NULL;
        tu_linear_outs_fill(&a, 0x5A);
        tu_linear_outs_fill(&b, 0x5A);
        const size_t several = budget_for(ctx, 4, NULL, &req, &in, &a.out);
        const walk d = run(ctx, DEFERRED, several, NULL, &req, &in, &a.out);
        const walk c = run(ctx, CHUNKED, several, NULL, &req, &in, &b.out);
        CHECK(d.chunks >= 2 && d.st == FG_ERR_OVERFLOW && c.st == d.st &&
                  strcmp(d.msg, c.msg) == 0,
              "%s (%lld chunks): %s \"%s\" / %s \"%s\"", tag, (long long)d.chunks,
              fg_status_name(d.st), d.msg, fg_status_name(c.st), c.msg);
        const size_t nt = (size_t)N * sizeof(float), nw = (size_t)V * H * sizeof(float);
        for (const tu_linear_outs *o = &a; o; o = o == &a ? &b : NULL)
            CHECK(bytes_are(o->logp, nt, 0x5A) && bytes_are(o->entropy, nt, 0x5A) &&
                      bytes_are(&o->out.loss, sizeof o->out.loss, 0x5A),
                  "%s: the %s walk wrote logp, entropy or the loss", tag,
                  o == &a ? "deferred" : "chunked");
        CHECK(!bytes_are(a.grad_weight, nw, 0x5A) &&
                  bytes_are(b.grad_weight, nw, 0x5A) == !where,
              "%s: grad_weight written by the deferred walk %d, by the chunked walk %d", tag,
              !bytes_are(a.grad_weight, nw, 0x5A), !bytes_are(b.grad_weight, nw, 0x5A));
        CHECK(d.syncs < c.syncs || !where, "%s: deferred %ld syncs, chunked %ld", tag, d.syncs,
              c.syncs);
        tu_linear_outs_free(&a);
        tu_linear_outs_free(&b);
        tu_problem_free(&prob);
    }
}

/* A loss call that accumulates into an f32 grad_weight over several chunks
 * with the KL (not certified: it computes every token's log-prob first, and
 * so runs deferred), and one without gradients; and a batch with no
 * unmasked token. */
static void other_case(fg_context *ctx)
{
    tu_problem prob;
    if (!make_problem(&prob, FG_DTYPE_BF16, 1, 6160u, NULL, "other"))
        return;
    fg_batch *batch = (fg_batch *)tu_batch_view(&prob.tb);
    const fg_linear_inputs in = tu_problem_inputs(&prob);
    const fg_loss_config kl = config(FG_LOSS_GRPO, FG_LEVEL_TOKEN, 0.04);
    const linear_request req = loss_request(&kl, batch);
    for (int k = 0; k < 3; k++) {
        const char *what = k == 0 ? "accumulating with the KL" : k == 1 ? "no gradients"
                                                                        : "every token masked";
        uint8_t saved[N];
        memcpy(saved, batch->mask, N);
        if (k == 2)
            memset((uint8_t *)batch->mask, 0, N);
        tu_linear_outs a, b, one;
        tu_linear_outs_make(&a, N, H, V, 1);
        tu_linear_outs_make(&b, N, H, V, 1);
        tu_linear_outs_make(&one, N, H, V, 1);
        for (tu_linear_outs *x = &a; x; x = x == &a ? &b : x == &b ? &one : NULL) {
            x->out.accumulate = k == 0;
            if (k == 1)
                x->out.grad_hidden.data = x->out.grad_weight.data = x->out.grad_bias.data = NULL;
            tu_linear_outs_fill(x, 0x3C); /* finite values to accumulate onto */
        }
        const size_t several = budget_for(ctx, 4, NULL, &req, &in, &a.out);
        const size_t whole = budget_for(ctx, 1, NULL, &req, &in, &a.out);
        const walk d = run(ctx, DEFERRED, several, NULL, &req, &in, &a.out);
        const walk c = run(ctx, CHUNKED, several, NULL, &req, &in, &b.out);
        const walk d1 = run(ctx, DEFERRED, whole, NULL, &req, &in, &one.out);
        CHECK(d.st == FG_OK && c.st == FG_OK && d1.st == FG_OK, "%s: %s / %s / %s: %s%s", what,
              fg_status_name(d.st), fg_status_name(c.st), fg_status_name(d1.st), d.msg, c.msg);
        CHECK(k == 2 || d.chunks >= 2, "%s: %lld chunks", what, (long long)d.chunks);
        CHECK(tu_linear_outs_same(&a, &b), "%s: deferred and chunked results differ", what);
        if (k == 1) /* the forward only: every row has its bits in any chunk */
            CHECK(tu_linear_outs_same(&a, &one), "%s: several chunks and one differ", what);
        /* k == 0 in one chunk has no forward sweep: the KL's chunked walk. */
        CHECK((k == 0 || d.syncs == d1.syncs) && (k == 0 ? d.syncs < c.syncs : d.syncs == c.syncs),
              "%s: deferred %ld syncs in %lld chunks, %ld in one (chunked %ld)", what, d.syncs,
              (long long)d.chunks, d1.syncs, c.syncs);
        printf("%-40s %lld chunks: %ld host syncs (%ld in one chunk); chunked %ld\n", what,
               (long long)d.chunks, d.syncs, d1.syncs, c.syncs);
        memcpy((uint8_t *)batch->mask, saved, N);
        tu_linear_outs_free(&a);
        tu_linear_outs_free(&b);
        tu_linear_outs_free(&one);
    }
    tu_problem_free(&prob);
}

int main(void)
{
    fg_context *ctx = NULL;
    if (tu_host_context_create(&ctx) != FG_OK) {
        CHECK(0, "%s", "context create");
        return tu_finish();
    }
    const fg_loss_type certified[] = {FG_LOSS_GRPO, FG_LOSS_BNPO,  FG_LOSS_DR_GRPO,
                                      FG_LOSS_DAPO, FG_LOSS_LUSPO, FG_LOSS_CISPO,
                                      FG_LOSS_SAPO};
    for (size_t i = 0; i < sizeof certified / sizeof certified[0]; i++)
        for (int dt = 0; dt < 2; dt++) {
            const fg_loss_config cfg = config(certified[i], FG_LEVEL_TOKEN, 0.0);
            char tag[96];
            snprintf(tag, sizeof tag, "[%s token %s]", tu_loss_name((int)certified[i]),
                     dt ? "bf16" : "f32");
            loss_case(ctx, tag, &cfg, dt ? FG_DTYPE_BF16 : FG_DTYPE_F32, (int)(i + dt) % 2, 1,
                      0.0, 1, 900u + 10u * i + (uint64_t)dt);
        }
    const fg_loss_config kl = config(FG_LOSS_GRPO, FG_LEVEL_TOKEN, 0.04);
    loss_case(ctx, "[grpo token, the KL]", &kl, FG_DTYPE_F32, 1, 1, 0.0, 2, 31u);
    /* Losses that read every token first: checked between the sweeps. */
    const fg_loss_config seq = config(FG_LOSS_GRPO, FG_LEVEL_SEQUENCE, 0.0);
    loss_case(ctx, "[grpo sequence]", &seq, FG_DTYPE_BF16, 0, 1, 0.0, 1, 32u);
    loss_case(ctx, "[grpo sequence, finite check off]", &seq, FG_DTYPE_F32, 1, 0, 0.0, 1, 35u);
    const fg_loss_config vespo = config(FG_LOSS_VESPO, FG_LEVEL_TOKEN, 0.0);
    loss_case(ctx, "[vespo token]", &vespo, FG_DTYPE_F32, 0, 1, 0.0, 1, 36u);
    fg_loss_config quantile = config(FG_LOSS_GRPO, FG_LEVEL_TOKEN, 0.0);
    quantile.top_entropy_quantile = 0.5;
    loss_case(ctx, "[grpo, entropy quantile 0.5]", &quantile, FG_DTYPE_BF16, 1, 1, 0.0, 1, 37u);
    fg_loss_config off = config(FG_LOSS_DAPO, FG_LEVEL_TOKEN, 0.0);
    off.off_policy_mask_threshold = 0.05;
    loss_case(ctx, "[dapo, off-policy mask]", &off, FG_DTYPE_F32, 0, 1, 0.0, 1, 38u);
    const fg_loss_config dapo = config(FG_LOSS_DAPO, FG_LEVEL_TOKEN, 0.0);
    loss_case(ctx, "[dapo, finite check off: chunked]", &dapo, FG_DTYPE_F32, 0, 0, 0.0, 0, 33u);
    loss_case(ctx, "[dapo bf16, filtered]", &dapo, FG_DTYPE_BF16, 1, 1, 0.4, 1, 34u);
    head_case(ctx, FG_DTYPE_F32);
    head_case(ctx, FG_DTYPE_BF16);
    other_case(ctx);
    fault_case(ctx);
    kl_overflow_case(ctx);
    fg_context_destroy(ctx);
    return tu_finish();
}
