/*
 * The chunk planner (linear_plan.h), one for every backend.
 *
 * Everything the call holds must fit the budget: the fixed part (targets,
 * grad_bias's and a bf16 grad_weight's float32 sums; on a host backend the
 * [B, T] arrays too; on another every unmasked token's statistics and the
 * loss's per-sequence constants), one chunk's buffers, and the backend's
 * scratch for it. The chunk size is the largest that fits, then shaped by the
 * backend's facts: equal chunks, unless that turns grad_hidden's product
 * slow (chunk_slow); in whole logits blocks where the backend pads a
 * chunk's last block (logits_block_rows).
 */
#include <string.h>

#include "grad_filter.h"
#include "linear_plan.h"
#include "report.h"
#include "shard_stats.h"

fg_status fg_linear_backend_failed(fg_call *call, const fg_device *be, fg_status st,
                                   const char *msg)
{
    if (st == FG_OK)
        return FG_OK;
    /* The CPU backend's messages are the call's own (it writes the error
     * sink); another backend is named. */
    if (strcmp(be->ops->name, "cpu") == 0)
        return fg_fail(call->err, st, "%s", msg);
    return fg_fail(call->err, st, "%s backend: %s", be->ops->name, msg);
}

/* Whether GEMM 3 sums into float32 sums: the plan's flag and, for the
 * backend's shapes while planning, a placeholder the call replaces. */
static void set_gw_sum(linear_plan *p, int on)
{
    static float planned;
    p->gw_sum = on;
    p->bc.gw_sum = on ? &planned : NULL;
}

/* The chunk size is planned with room for this many product workers'
 * scratch (or one, when the budget holds no more), never with the thread
 * count: the chunks, and so the order of grad_weight's sums, are the same
 * for any thread count. The call then runs its products on as many of its
 * threads as the budget holds scratch for. */
#define PLAN_GEMM_WORKERS 8

size_t fg_linear_chunk_bytes(const linear_plan *p, int64_t m)
{
    const fg_backend_call *c = &p->bc;
    size_t b = fg_linear_piece(p, (size_t)m * (size_t)p->V * fg_dtype_size(p->logit_t));
    if (p->any_grad && !p->dl_alias)
        b += fg_linear_piece(p, (size_t)m * (size_t)p->V * fg_dtype_size(p->dlogit_t));
    b += fg_linear_piece(p, (size_t)m * (size_t)p->H * fg_dtype_size(p->cmp_t));
    /* The rows' statistics, g, e; on a device backend g, e alone (the
     * statistics are slices of per-token arrays: fixed_bytes). */
    b += fg_linear_piece(p, (p->host ? 6 : 2) * (size_t)m * sizeof(float));
    if (p->want_gh) /* and the failure flag of its reduction */
        b += fg_linear_piece(p, ((size_t)m * (size_t)p->H + (size_t)p->hook) * sizeof(float));
    if (p->hook)
        b += fg_linear_piece(p, (size_t)fg_shard_floats(m) * sizeof(float));
    if (c->filter_eps > 0 && !(p->be.ops->caps & FG_BACKEND_FILTER_IN_PLACE))
        /* kept ids, their count and each row's token */
        b += fg_linear_piece(p, (size_t)m * (size_t)c->kept_cap * sizeof(int32_t)) +
             fg_linear_piece(p, (size_t)m * sizeof(int32_t)) +
             fg_linear_piece(p, (size_t)m * sizeof(int64_t));
    return b;
}

/* A host backend's arena is mapped in whole pages. */
static size_t whole(const linear_plan *p, size_t bytes)
{
    return p->host ? fg_ws_page_round(bytes) : bytes;
}

/* The backend's scratch for chunks of m rows (the last one `last` rows) on
 * `workers` threads; prepares their work, so that a backend failure
 * surfaces before any output is written. */
static fg_status scratch_bytes(fg_call *call, const linear_plan *p, int64_t m, int64_t last,
                               int workers, size_t *bytes)
{
    fg_backend_call c = p->bc;
    c.workers = workers;
    char msg[sizeof call->err->msg];
    msg[0] = '\0';
    *bytes = 0;
    const fg_status st = p->be.ops->chunk_scratch(p->be.state, &c, m, last, bytes, msg, sizeof msg);
    return fg_linear_backend_failed(call, &p->be, st, msg);
}

/* What a call with chunks of m rows (the last one `last` rows) and `workers`
 * product threads holds: the fixed part, one chunk's buffers and the
 * scratch. */
static fg_status need_bytes(fg_call *call, const linear_plan *p, int64_t m, int64_t last,
                            int workers, size_t *need)
{
    size_t scratch;
    const fg_status st = scratch_bytes(call, p, m, last, workers, &scratch);
    *need = whole(p, p->fixed_bytes + fg_linear_chunk_bytes(p, m) + scratch);
    return st;
}

/* Whether grad_hidden's product for a chunk of m rows runs markedly slower
 * than for longer ones (the backend's fact; none without chunk_slow). */
static int dhidden_slow(const linear_plan *p, int64_t m)
{
    return p->be.ops->chunk_slow && p->be.ops->chunk_slow(p->be.state, &p->bc, m);
}

/* Rows a chunk for n rows at most nc a chunk: equal chunks, so that the last
 * is not a sliver, unless equal chunks are too short for grad_hidden's
 * blocks to run at full speed while nc-row ones are not (dhidden_slow:
 * measured 1.39x the materialized step's time at T = 2048, H = 1024, bf16,
 * AVX2, with six equal 342-row chunks where five of 371 and one of 193 stay
 * fast but the last, before the tile path's stride); then nc-row chunks and
 * a shorter last one. */
static int64_t chunk_rows(const linear_plan *p, int64_t n, int64_t nc)
{
    const int64_t chunks = (n + nc - 1) / nc, equal = (n + chunks - 1) / chunks;
    return dhidden_slow(p, equal) && !dhidden_slow(p, nc) ? nc : equal;
}

/* The same number of chunks (or fewer) in whole logits blocks: the equal
 * size rounded up to FG_BLOCK_LOGITS_M, the last chunk shorter. No chunk but
 * the last runs a zero-padded block (gemm_onednn.h): against equal chunks,
 * each with its own, the logits product pads once rather than once a chunk
 * (up to 143 rows each). 0 where that would turn a chunk's grad_hidden slow
 * (dhidden_slow) that was not, or leave no shorter last chunk. */
static int64_t group_rows(const linear_plan *p, int64_t n, int64_t nc)
{
    const int64_t g = p->be.ops->logits_block_rows, chunks = (n + nc - 1) / nc;
    const int64_t rows = ((n + chunks - 1) / chunks + g - 1) / g * g;
    const int64_t k = (n + rows - 1) / rows, last = n - (k - 1) * rows;
    const int64_t was_last = n - (chunks - 1) * nc;
    if (rows == nc || k < 2 || (dhidden_slow(p, rows) && !dhidden_slow(p, nc)) ||
        (dhidden_slow(p, last) && !dhidden_slow(p, was_last)))
        return 0;
    return rows;
}

/* The same number of chunks with every chunk but the first in whole logits
 * blocks: g = the equal size rounded down to FG_BLOCK_LOGITS_M, and the
 * first holds the n - (chunks - 1)·g left, so only it runs a padded block,
 * where group_rows' chunks do not fit. Returns g (the first chunk n -
 * (chunks - 1)·g rows), or 0 where no chunk would be spared a padded block,
 * or where a chunk's grad_hidden would turn slow (dhidden_slow) that was
 * not. */
static int64_t lead_rows(const linear_plan *p, int64_t n, int64_t nc)
{
    const int64_t gr = p->be.ops->logits_block_rows, chunks = (n + nc - 1) / nc;
    const int64_t g = n / chunks / gr * gr, first = n - (chunks - 1) * g;
    const int64_t last = n - (chunks - 1) * nc;
    const int64_t partial = (chunks - 1) * (nc % gr != 0) + (last % gr != 0);
    if (chunks < 2 || g < gr || partial <= (first % gr != 0) ||
        (dhidden_slow(p, g) && !dhidden_slow(p, nc)))
        return 0;
    return g;
}

/* Rows the logits product pads for chunks of m rows over n (the last
 * shorter): each chunk's last block is whole (gemm_onednn.h). */
static int64_t padded_logits_rows(const linear_plan *p, int64_t n, int64_t m)
{
    const int64_t g = p->be.ops->logits_block_rows, full = n / m, last = n - full * m;
    return full * ((m + g - 1) / g * g - m) + (last ? (last + g - 1) / g * g - last : 0);
}

/* More chunks, in whole logits blocks: every chunk but the first holds g =
 * the most whole blocks nc holds, the first the rest (at most nc), so that
 * only it pads a block. Taken where equal chunks of nc pad more rows than
 * this by FG_BLOCK_LOGITS_M for each chunk it adds (an added chunk reads the
 * weight three more times; taken as costing no more than a block of logits
 * rows, not measured): at T = 2048, H = 1024 and 2048, bf16 (AVX2), equal
 * chunks of 342 rows pad 544 rows, 320 + 6 x 288 pad 112. Returns the first
 * chunk's rows (*lead: how many more than g it holds), or 0 where no plan is
 * better, or where grad_hidden would turn slow (dhidden_slow) that was not. */
static int64_t block_rows(const linear_plan *p, int64_t n, int64_t nc,
                          int64_t *lead)
{
    const int64_t gr = p->be.ops->logits_block_rows, g = nc / gr * gr, chunks = (n + nc - 1) / nc;
    if (g < gr || n <= nc || (dhidden_slow(p, g) && !dhidden_slow(p, nc)))
        return 0;
    const int64_t more = (n - nc + g - 1) / g + 1, first = n - (more - 1) * g;
    const int64_t saved = padded_logits_rows(p, n, nc) - padded_logits_rows(p, n, g);
    if (saved <= (more - chunks) * gr)
        return 0;
    *lead = first > g ? first - g : 0;
    return first > g ? first : g;
}

/* The largest chunk size (chunk_rows) whose need with `workers` GEMM
 * scratchpads fits the budget, or 0. */
/* What chunks of chunk_rows(raw) rows need with `workers` scratch. */
static fg_status need_of(fg_call *call, const linear_plan *p, int workers, int64_t raw,
                         size_t *need)
{
    const int64_t n = p->n_active, nc = chunk_rows(p, n, raw), chunks = (n + nc - 1) / nc;
    return need_bytes(call, p, nc, n - (chunks - 1) * nc, workers, need);
}

static fg_status fit_chunks(fg_call *call, const linear_plan *p, int workers, int64_t *out)
{
    const int64_t n = p->n_active;
    const size_t row = fg_linear_chunk_bytes(p, 1); /* chunks are fitted unpadded */
    const size_t budget = call->budget;
    const size_t avail = budget > p->fixed_bytes ? budget - p->fixed_bytes : 0;
    int64_t nc = (int64_t)(avail / row) < n ? (int64_t)(avail / row) : n, over = 0;
    *out = 0;
    while (nc >= 1) {
        size_t need;
        const fg_status st = need_of(call, p, workers, nc, &need);
        if (st != FG_OK)
            return st;
        if (need <= budget)
            break;
        /* Over by need - budget: drop that many rows' worth (at least one),
         * trying one row before giving up (the scratch is not linear in m). */
        const int64_t m = chunk_rows(p, n, nc);
        const int64_t cut = (int64_t)((need - budget + row - 1) / row);
        over = nc;
        nc = m == 1 ? 0 : (m - cut > 1 ? m - cut : 1);
    }
    if (nc < 1)
        return FG_OK;
    /* The cut may overshoot (the need grows in whole pages, the scratch in
     * steps): the largest size between the one that fits and the one that
     * did not. */
    int64_t lo = nc, hi = over > 0 ? over - 1 : nc;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        size_t need;
        const fg_status st = need_of(call, p, workers, mid, &need);
        if (st != FG_OK)
            return st;
        if (need <= budget)
            lo = mid;
        else
            hi = mid - 1;
    }
    *out = chunk_rows(p, n, lo);
    return FG_OK;
}

/* The largest chunk size that fits, with room for PLAN_GEMM_WORKERS GEMM
 * scratchpads or else one (*workers, NULL: not wanted); 0 when not even one
 * row fits. */
static fg_status fit_any(fg_call *call, const linear_plan *p, int64_t *nc, int *workers)
{
    fg_status st = fit_chunks(call, p, PLAN_GEMM_WORKERS, nc);
    int w = PLAN_GEMM_WORKERS;
    if (st == FG_OK && *nc < 1) {
        st = fit_chunks(call, p, 1, nc);
        w = 1;
    }
    if (workers)
        *workers = w;
    return st;
}

/* Chooses Nc: all active rows (materialized), or the largest equal-chunk size
 * that fits the budget (fused, see PLAN_GEMM_WORKERS), then the GEMM worker
 * count. `forced` > 0: that Nc (the smallest of a collective call's shards,
 * so that every shard walks the same chunks). */
static fg_status plan_chunks(fg_call *call, linear_plan *p, int64_t forced)
{
    const int64_t n = p->n_active;
    const int threads = call->threads;
    int64_t nc = forced > 0 ? forced : n;
    fg_status st;
    int fit_workers = PLAN_GEMM_WORKERS;
    if (p->fused && forced <= 0) {
        if ((st = fit_any(call, p, &nc, &fit_workers)) != FG_OK)
            return st;
        if (nc < 1) {
            size_t need1, scratch1;
            if ((st = need_bytes(call, p, 1, 1, 1, &need1)) != FG_OK ||
                (st = scratch_bytes(call, p, 1, 1, 1, &scratch1)) != FG_OK)
                return st;
            return fg_fail(call->err, FG_ERR_BUDGET_TOO_SMALL,
                           "a memory budget of %zu bytes is too small: one token row a chunk "
                           "needs %zu bytes (per-call arrays %zu%s + one row's logits, dlogits, "
                           "hidden rows and row arrays %zu + GEMM scratch %zu for one thread%s; "
                           "V = %lld, H = %lld)",
                           call->budget, need1, p->fixed_bytes,
                           p->gw_sum ? ", with the bf16 grad_weight's float32 sums" : "",
                           fg_linear_chunk_bytes(p, 1), scratch1,
                           p->host ? ", in whole pages" : "", (long long)p->V, (long long)p->H);
        }
    }
    if (forced <= 0) /* forced: exactly that, the same chunks on every shard whatever its
                        own vocabulary slice makes of dhidden_slow */
        nc = chunk_rows(p, n, nc);
    size_t need;
    int64_t chunks = (n + nc - 1) / nc, other = n - (chunks - 1) * nc; /* the other size */
    p->lead = 0;
    if (p->fused && forced <= 0 && !p->hook && p->be.ops->logits_block_rows > 0) {
        /* Chunks in whole logits blocks where they fit with the scratchpads they were
         * fitted with (never the thread count, like the chunks): rounded up (group_rows),
         * else rounded down with the rest in the first chunk (lead_rows), else more of
         * them where that pads fewer rows enough (block_rows). Not where shards
         * merge per chunk: they agree on the smallest Nc, and a shard replanned with it
         * walks chunks of exactly that many rows. */
        const int64_t rows = group_rows(p, n, nc);
        if (rows > 0 && (st = need_bytes(call, p, rows, n - (n - 1) / rows * rows, fit_workers,
                                         &need)) != FG_OK)
            return st;
        if (rows > 0 && need <= call->budget) {
            nc = rows;
            chunks = (n + nc - 1) / nc;
            other = n - (chunks - 1) * nc;
        } else {
            const int64_t g = lead_rows(p, n, nc);
            if (g > 0 && (st = need_bytes(call, p, n - (chunks - 1) * g, g, fit_workers,
                                          &need)) != FG_OK)
                return st;
            if (g > 0 && need <= call->budget) {
                nc = n - (chunks - 1) * g;
                p->lead = nc - g;
                other = g;
            } else {
                int64_t lead = 0;
                const int64_t first = block_rows(p, n, nc, &lead), later = first - lead;
                const int64_t k = first > 0 ? 1 + (n - first + later - 1) / later : 0;
                const int64_t rest = lead ? later : n - (k - 1) * first; /* the other size */
                if (first > 0 &&
                    (st = need_bytes(call, p, first, rest, fit_workers, &need)) != FG_OK)
                    return st;
                if (first > 0 && need <= call->budget) {
                    nc = first;
                    p->lead = lead;
                    chunks = k;
                    other = rest;
                }
            }
        }
    }
    /* As many product threads as the budget holds scratch for. */
    int workers = 1;
    size_t scratch, more;
    if ((st = scratch_bytes(call, p, nc, other, 1, &scratch)) != FG_OK)
        return st;
    while (workers < threads) {
        if ((st = scratch_bytes(call, p, nc, other, workers + 1, &more)) != FG_OK)
            return st;
        if (p->fused && whole(p, p->fixed_bytes + fg_linear_chunk_bytes(p, nc) + more) >
                            call->budget)
            break;
        workers++;
        scratch = more;
    }
    p->Nc = nc;
    p->chunks = chunks;
    p->bc.workers = workers;
    p->bc.chunk_rows = nc;
    p->scratch_bytes = scratch;
    return FG_OK;
}


fg_status fg_linear_plan_rows(fg_call *call, linear_plan *p, int64_t rows)
{
    return plan_chunks(call, p, rows);
}

/* Gradient filtering's threshold, when a backward product runs. The CPU's
 * sparse grad_weight product writes float32: there a bf16 grad_weight
 * written in bf16 (one chunk, or summed in bf16 per chunk:
 * plan_grad_weight_sums) runs dense. A backend that filters in place
 * chooses its products itself (CUDA: dense for a bf16 grad_weight not
 * summed in float32). */
static void plan_filter(const fg_linear_options *o, linear_plan *p)
{
    const double eps =
        o->filter_eps == FG_FILTER_EPS_AUTO ? fg_filter_eps_auto(p->in_t) : o->filter_eps;
    const int in_place = (p->be.ops->caps & FG_BACKEND_FILTER_IN_PLACE) != 0;
    const int gw_writable = in_place || !p->want_gw || p->gw_sum || p->gw_t == FG_DTYPE_F32;
    const int on = p->fused && eps > 0 && (p->want_gh || p->want_gw) && gw_writable;
    const size_t count = fg_linear_piece(p, sizeof(int64_t)); /* kept_count */
    if ((p->bc.filter_eps > 0) != on)
        p->fixed_bytes = on ? p->fixed_bytes + count : p->fixed_bytes - count;
    p->bc.filter_eps = on ? eps : 0;
    p->bc.kept_cap = on ? fg_kept_cap(p->V) : 0;
}

/* The rows of each of the equal chunks of at most `rows` rows over n. */
static int64_t equal_rows(int64_t n, int64_t rows)
{
    const int64_t chunks = (n + rows - 1) / rows;
    return (n + chunks - 1) / chunks;
}

/* How a bf16 grad_weight is summed over the chunks. In float32, in a [V, H]
 * buffer of the workspace, rounded once at the end (with the caller's values
 * when accumulating): always where the backend's products cannot write bf16
 * (a compute dtype of float32: oneDNN 2.6 has no f32 x f32 -> bf16 product),
 * else when the call walks more than one chunk and the budget holds the
 * buffer beside chunks (and, with filtering, the kept entries) that stay
 * fast: not below the backend's fast_chunk_rows when chunks without the
 * sums are not, and to under half of those (on an H200 at V = 151936, H =
 * 4096, the sums (2.3 GiB) at a 3 GiB budget left chunks of 741 rows
 * instead of 2470: 1.27x the bare products instead of 1.08x). Otherwise
 * GEMM 3 sums into the bf16 grad_weight: one rounding per chunk. */
static fg_status plan_grad_weight_sums(fg_call *call, const fg_linear_options *o, linear_plan *p)
{
    if (!p->want_gw || p->gw_t != FG_DTYPE_BF16)
        return FG_OK;
    const size_t bytes = fg_linear_piece(p, (size_t)p->V * (size_t)p->H * sizeof(float));
    if (p->cmp_t == FG_DTYPE_BF16) {
        if (!p->fused)
            return FG_OK; /* one product, one rounding */
        int64_t nc, nc_sum;
        fg_status st = fit_any(call, p, &nc, NULL);
        if (st != FG_OK || nc < 1 || nc >= p->n_active)
            return st; /* too small (plan_chunks says so), or one chunk */
        linear_plan q = *p;
        set_gw_sum(&q, 1);
        q.fixed_bytes += bytes;
        plan_filter(o, &q); /* the sums turn filtering on: its buffers too */
        if ((st = fit_any(call, &q, &nc_sum, NULL)) != FG_OK)
            return st;
        const int64_t fast = p->be.ops->fast_chunk_rows, m = equal_rows(p->n_active, nc);
        const int64_t m_sums = nc_sum < 1 ? 0 : equal_rows(p->n_active, nc_sum);
        if (nc_sum < 1 || (fast > 0 && m >= fast && m_sums < fast && 2 * m_sums < m))
            return FG_OK;
    }
    set_gw_sum(p, 1);
    p->gw_sum_bytes = bytes;
    p->fixed_bytes += bytes;
    return FG_OK;
}

/* FG_ERR_UNSUPPORTED where the call needs an optional op the backend lacks
 * (backend.h): refused by name, never run some other way. */
static fg_status needs_op(fg_call *call, const linear_plan *p, int has, const char *op,
                          const char *what)
{
    if (has)
        return FG_OK;
    return fg_fail(call->err, FG_ERR_UNSUPPORTED,
                   "%s needs the backend op %s, which the %s backend does not have", what, op,
                   p->be.ops->name);
}

static fg_status check_ops(fg_call *call, const linear_request *req, const linear_plan *p)
{
    const fg_backend_ops *ops = p->be.ops;
    fg_status st;
    if (p->hook && (st = needs_op(call, p, ops->shard_stats != NULL, "shard_stats",
                                  "a vocab-sharded weight with a communicator")) != FG_OK)
        return st;
    if (p->hook && p->want_gh &&
        (st = needs_op(call, p, ops->dhidden && ops->put_grad_hidden, "dhidden/put_grad_hidden",
                       "grad_hidden of a vocab-sharded weight with a communicator")) != FG_OK)
        return st;
    if (req->kind == KIND_SHARD_STATS &&
        (st = needs_op(call, p, ops->shard_stats != NULL, "shard_stats",
                       "fg_linear_shard_stats")) != FG_OK)
        return st;
    return needs_op(call, p, p->bc.filter_eps <= 0 || ops->filter, "filter",
                    "gradient filtering (filter_eps)");
}

fg_status fg_linear_plan_call(fg_call *call, const fg_device *be, const fg_linear_options *o,
                              const linear_request *req, const uint8_t *mask,
                              const fg_linear_inputs *in, const fg_linear_outputs *out,
                              int64_t n_active, linear_plan *p)
{
    const input_bounds bounds = p->bounds;
    memset(p, 0, sizeof *p);
    p->bounds = bounds;
    p->be = *be;
    p->host = (be->ops->caps & FG_BACKEND_HOST_MEMORY) != 0;
    p->fused = o->impl == FG_IMPL_FUSED;
    p->in_t = in->hidden.dtype;
    p->cmp_t = be->ops->compute_dtype(be->state, p->in_t);
    p->logit_t = (!p->fused && o->round_logits_to_input_dtype) ? p->in_t : FG_DTYPE_F32;
    p->dlogit_t = p->cmp_t; /* the gradient products take dlogits in the compute dtype */
    p->dl_alias = p->fused && p->dlogit_t == p->logit_t;
    p->H = in->hidden.cols;
    p->V = in->weight.rows;
    p->sharded = fg_linear_is_sharded(in);
    p->hook = p->sharded && fg_uses_hook(req->kind);
    p->vocab_start = in->vocab_start;
    p->want_gh = out->grad_hidden.data != NULL;
    p->want_gw = out->grad_weight.data != NULL;
    p->want_gb = out->grad_bias.data != NULL;
    p->any_grad = p->want_gh || p->want_gw || p->want_gb;
    p->gh_t = p->want_gh ? out->grad_hidden.dtype : FG_DTYPE_F32;
    p->gw_t = p->want_gw ? out->grad_weight.dtype : FG_DTYPE_F32;
    p->gb_t = p->want_gb ? out->grad_bias.dtype : FG_DTYPE_F32;
    p->accumulate = out->accumulate != 0;
    p->n_active = n_active;
    const fg_batch *batch = req->batch;
    const int64_t N = batch->batch * batch->seq_len;
    /* A host backend's arena also holds the per-call [B, T] arrays and the
     * unmasked rows; a device backend gets its own copy of the rows. */
    p->fixed_bytes = p->host ? fg_common_workspace_bytes(batch->batch, N)
                             : fg_linear_piece(p, (size_t)n_active * sizeof(int64_t));
    if (p->want_gb) /* grad_bias's f32 sums, committed at the end */
        p->fixed_bytes += fg_linear_piece(p, (size_t)p->V * sizeof(float));
    /* The unmasked tokens' targets (local ids) and the stats op's row check:
     * one int on a host backend. A device backend keeps every token's
     * statistics and a row check a chunk ([n_active] slots), read once after
     * the chunks, and the loss plan's per-sequence constants for derivs. */
    p->fixed_bytes += fg_linear_piece(p, (size_t)n_active * sizeof(int64_t));
    if (p->host)
        p->fixed_bytes += fg_linear_piece(p, sizeof(int));
    else
        p->fixed_bytes += fg_linear_piece(p, 4 * (size_t)n_active * sizeof(float)) +
                          fg_linear_piece(p, (size_t)n_active * sizeof(int)) +
                          fg_linear_piece(p, (size_t)fg_loss_plan_scratch_doubles(batch->batch) *
                                                 sizeof(double));
    if (call->device_report) /* report_tokens' sums of the loss */
        p->fixed_bytes += fg_linear_piece(p, fg_report_sums_bytes(batch->batch, batch->seq_len));
    p->bc = (fg_backend_call){.N = N, .H = p->H, .V = p->V, .n_active = n_active,
                              .in_t = p->in_t, .logit_t = p->logit_t, .dlogit_t = p->dlogit_t,
                              .inv_temp = (float)(1.0 / req->cfg->temperature),
                              .accumulate = p->accumulate, .workers = 1, .hook = p->hook,
                              .hidden = in->hidden, .weight = in->weight, .bias = in->bias,
                              .mask = mask, .grad_hidden = out->grad_hidden,
                              .grad_weight = out->grad_weight, .grad_bias = out->grad_bias};
    static float planned_bias_sums;
    p->bc.gb_sum = p->want_gb ? &planned_bias_sums : NULL; /* placed by the call */
    fg_status st;
    if (p->n_active > 0) {
        if ((st = plan_grad_weight_sums(call, o, p)) != FG_OK)
            return st;
        plan_filter(o, p);
    }
    if ((st = check_ops(call, req, p)) != FG_OK)
        return st;
    if (p->n_active == 0)
        return FG_OK;
    if ((st = plan_chunks(call, p, 0)) != FG_OK)
        return st;
    char msg[sizeof call->err->msg];
    msg[0] = '\0';
    return fg_linear_backend_failed(call, be, be->ops->supports(be->state, &p->bc, msg, sizeof msg),
                                    msg);
}

size_t fg_linear_plan_total(const linear_plan *p)
{
    if (p->n_active == 0)
        return whole(p, p->fixed_bytes);
    return whole(p, p->fixed_bytes + fg_linear_chunk_bytes(p, p->Nc) + p->scratch_bytes);
}

fg_status fg_linear_min_budget(fg_call *call, const linear_plan *p, size_t *bytes)
{
    *bytes = 0;
    if (!p->fused)
        return FG_OK;
    if (p->n_active == 0) {
        *bytes = whole(p, p->fixed_bytes);
        return FG_OK;
    }
    /* Where the products write bf16, a bf16 grad_weight runs without its
     * float32 sums (plan_grad_weight_sums): the smallest budget leaves them
     * out. */
    linear_plan q = *p;
    if (q.gw_sum && q.cmp_t == FG_DTYPE_BF16) {
        set_gw_sum(&q, 0);
        q.fixed_bytes -= q.gw_sum_bytes;
        /* Filtering decided again without the sums (plan_filter). */
        const fg_linear_options same = {FG_IMPL_FUSED, 0, q.bc.filter_eps};
        plan_filter(&same, &q);
    }
    return need_bytes(call, &q, 1, 1, 1, bytes);
}
