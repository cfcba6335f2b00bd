/*
 * fg_linear_grpo: the loss from hidden states and the LM-head weight.
 *
 * Fused (FG_IMPL_FUSED): the unmasked tokens are processed in chunks of Nc
 * rows, Nc chosen so that everything the call holds fits the budget:
 *
 *   for each chunk of rows R:                       shapes
 *     hbuf   = hidden[R]                            [Nc, H]   gather
 *     logits = hbuf · Wᵀ + bias                     [Nc, V]   GEMM 1 (in whole
 *                                                   144-row blocks: gemm_onednn.h)
 *     per row: lse, logp, entropy, then d loss/d logits (in place, or bf16)
 *     grad_bias   += Σ_rows dlogits                 [V]
 *     grad_hidden[R] = dlogits · W                  [Nc, H]   GEMM 2
 *     grad_weight += dlogitsᵀ · hbuf                [V, H]    GEMM 3
 *
 * Token-level ratios need nothing beyond a token's own row, so the gradient
 * comes out of the same sweep: three GEMM-sized products in all, as many as
 * the baseline. Sequence-level ratios (GSPO), vespo's weight, the off-policy
 * mask and the entropy quantile need every token's log-prob or entropy first
 * (fg_loss_needs_all_tokens): one forward sweep (GEMM 1 only), then the sweep
 * above recomputing the logits, unless everything fits in one chunk.
 *
 * Gradient filtering (filter_eps > 0, grad_filter.h): GEMMs 2 and 3 become
 * sparse products over each row's kept entries of dlogits, when every row of
 * the chunk keeps few enough of them.
 *
 * Materialized (FG_IMPL_MATERIALIZED): the plain baseline, one chunk of all
 * rows with a separate [N, V] dlogits buffer, as a framework holds them.
 */
#include <math.h>
#include <string.h>

#include "backend_cpu.h"
#include "bf16.h"
#include "call.h"
#include "collective.h"
#include "finish.h"
#include "grad_filter.h"
#include "shard_stats.h"
#include "linear_device.h"
#include "linear_request.h"
#include "validate.h"

typedef struct linear_plan {
    int fused;
    fg_dtype in_t;    /* storage of hidden, weight, bias                          */
    fg_dtype cmp_t;   /* the gathered hidden rows and dlogits: bf16 only where the
                         CPU multiplies bf16 natively, else f32 (gemm_onednn.h)   */
    fg_dtype logit_t, dlogit_t;
    int dl_alias; /* dlogits overwrite the f32 logits in place */
    int64_t H, V, Nc, chunks;
    int64_t lead; /* chunk 0 holds Nc rows, every later one Nc - lead (the last
                     maybe fewer): the rows past whole logits blocks, in one chunk
                     (plan_chunks, lead_rows); 0: every chunk Nc rows */
    int want_gh, want_gw, want_gb, any_grad;
    fg_dtype gh_t, gw_t, gb_t; /* the gradient outputs' dtypes (bf16 for bf16 inputs) */
    int accumulate; /* grad_weight and grad_bias += this call's gradient */
    int gw_sum;     /* a bf16 grad_weight summed over the chunks in a float32 [V, H]
                       buffer of the workspace (in fixed_bytes), rounded once      */
    size_t gw_sum_bytes;
    int sharded; /* weight holds vocab rows [vocab_start, vocab_start + V) */
    int hook;    /* sharded, merged through the context's communicator per chunk */
    int64_t vocab_start;
    int64_t n_active;     /* unmasked tokens: the rows the chunks cover            */
    size_t fixed_bytes;   /* per-call [B, T] arrays (fg_common_workspace_bytes)    */
    fg_gemm_scratch gemm; /* GEMM scratch of the chosen chunk sizes               */
    int gemm_workers;     /* threads the GEMMs run on: the scratchpads held        */
    size_t scratch_bytes; /* fg_gemm_scratch_bytes(gemm, gemm_workers)             */
    double filter_eps;    /* gradient filtering's threshold; 0: off                */
    int64_t kept_cap;     /* kept entries a row may have (fg_kept_cap), filtering  */
    input_bounds bounds;  /* what the up-front scan found (fg_linear_validate)     */
    fg_backend_call bc;   /* the call as the CPU backend sees it: shapes, dtypes,
                             views; its workspace pointers placed by the call
                             (planning reads bc.gw_sum as a flag: set_gw_sum)    */
    fg_cpu_backend cpu;   /* the backend's facts the planner asks               */
} linear_plan;

/* Whether GEMM 3 sums into float32 sums: the plan's flag and, for the
 * backend's shapes while planning, a placeholder the call replaces. */
static void set_gw_sum(linear_plan *p, int on)
{
    static float planned;
    p->gw_sum = on;
    p->bc.gw_sum = on ? &planned : NULL;
}

/* The chunk size is planned with room for this many GEMM scratchpads (or one,
 * when the budget holds no more), never with the thread count: the chunks,
 * and so the order of grad_weight's sums, are the same for any thread count.
 * The call then runs its GEMMs on as many of its threads as the budget holds
 * scratchpads for. */
#define PLAN_GEMM_WORKERS 8

static size_t chunk_bytes(const linear_plan *p, int64_t m)
{
    size_t b = fg_ws_round((size_t)m * (size_t)p->V * fg_dtype_size(p->logit_t));
    if (p->any_grad && !p->dl_alias)
        b += fg_ws_round((size_t)m * (size_t)p->V * fg_dtype_size(p->dlogit_t));
    b += fg_ws_round((size_t)m * (size_t)p->H * fg_dtype_size(p->cmp_t));
    b += fg_ws_round(6 * (size_t)m * sizeof(float)); /* the rows' statistics, g and e */
    if (p->want_gh) /* and the failure flag of its reduction */
        b += fg_ws_round(((size_t)m * (size_t)p->H + (size_t)p->hook) * sizeof(float));
    if (p->hook)
        b += fg_ws_round((size_t)fg_shard_floats(m) * sizeof(float));
    if (p->filter_eps > 0) /* kept ids, their count and each row's token */
        b += fg_ws_round((size_t)m * (size_t)p->kept_cap * sizeof(int32_t)) +
             fg_ws_round((size_t)m * sizeof(int32_t)) + fg_ws_round((size_t)m * sizeof(int64_t));
    return b;
}

/* What a call with chunks of m rows (the last one `last` rows) and `workers`
 * GEMM threads holds: the fixed arrays, one chunk's buffers and the GEMM
 * scratch, in whole pages since the arena is mapped in pages. Prepares the
 * GEMMs of both sizes, so backend failures surface before any output is
 * written. */
static fg_status need_bytes(fg_call *call, const linear_plan *p, int64_t m, int64_t last,
                            int workers, size_t *need, fg_gemm_scratch *gs)
{
    (void)call;
    memset(gs, 0, sizeof *gs);
    fg_status st = fg_cpu_prepare_chunk(&p->cpu, &p->bc, m, gs);
    if (st == FG_OK && last != m)
        st = fg_cpu_prepare_chunk(&p->cpu, &p->bc, last, gs);
    *need = fg_ws_page_round(p->fixed_bytes + chunk_bytes(p, m) +
                             fg_gemm_scratch_bytes(gs, workers));
    return st;
}

/* Whether grad_hidden's blocks for a chunk of m rows may run at half speed
 * (the CPU backend's fact: fg_cpu_dhidden_slow). */
static int dhidden_slow(fg_call *call, const linear_plan *p, int64_t m)
{
    (void)call;
    return fg_cpu_dhidden_slow(&p->cpu, &p->bc, m);
}

/* Rows a chunk for n rows at most nc a chunk: equal chunks, so that the last
 * is not a sliver, unless equal chunks are too short for grad_hidden's
 * blocks to run at full speed while nc-row ones are not (dhidden_slow:
 * measured 1.39x the materialized step's time at T = 2048, H = 1024, bf16,
 * AVX2, with six equal 342-row chunks where five of 371 and one of 193 stay
 * fast but the last, before the tile path's stride); then nc-row chunks and
 * a shorter last one. */
static int64_t chunk_rows(fg_call *call, const linear_plan *p, int64_t n, int64_t nc)
{
    const int64_t chunks = (n + nc - 1) / nc, equal = (n + chunks - 1) / chunks;
    return dhidden_slow(call, p, equal) && !dhidden_slow(call, p, nc) ? nc : equal;
}

/* The same number of chunks (or fewer) in whole logits blocks: the equal
 * size rounded up to FG_BLOCK_LOGITS_M, the last chunk shorter. No chunk but
 * the last runs a zero-padded block (gemm_onednn.h): against equal chunks,
 * each with its own, the logits product pads once rather than once a chunk
 * (up to 143 rows each). 0 where that would turn a chunk's grad_hidden slow
 * (dhidden_slow) that was not, or leave no shorter last chunk. */
static int64_t group_rows(fg_call *call, const linear_plan *p, int64_t n, int64_t nc)
{
    const int64_t g = fg_cpu_logits_block_rows(), chunks = (n + nc - 1) / nc;
    const int64_t rows = ((n + chunks - 1) / chunks + g - 1) / g * g;
    const int64_t k = (n + rows - 1) / rows, last = n - (k - 1) * rows;
    const int64_t was_last = n - (chunks - 1) * nc;
    if (rows == nc || k < 2 || (dhidden_slow(call, p, rows) && !dhidden_slow(call, p, nc)) ||
        (dhidden_slow(call, p, last) && !dhidden_slow(call, p, was_last)))
        return 0;
    return rows;
}

/* Chunk k's first row and rows (run_chunk walks them). */
static int64_t chunk_start(const linear_plan *p, int64_t k)
{
    return k == 0 ? 0 : p->lead + k * (p->Nc - p->lead);
}

static int64_t chunk_len(const linear_plan *p, int64_t k)
{
    const int64_t r0 = chunk_start(p, k), m = k == 0 ? p->Nc : p->Nc - p->lead;
    return p->n_active - r0 < m ? p->n_active - r0 : m;
}

/* The same number of chunks with every chunk but the first in whole logits
 * blocks: g = the equal size rounded down to FG_BLOCK_LOGITS_M, and the
 * first holds the n - (chunks - 1)·g left, so only it runs a padded block,
 * where group_rows' chunks do not fit. Returns g (the first chunk n -
 * (chunks - 1)·g rows), or 0 where no chunk would be spared a padded block,
 * or where a chunk's grad_hidden would turn slow (dhidden_slow) that was
 * not. */
static int64_t lead_rows(fg_call *call, const linear_plan *p, int64_t n, int64_t nc)
{
    const int64_t gr = fg_cpu_logits_block_rows(), chunks = (n + nc - 1) / nc;
    const int64_t g = n / chunks / gr * gr, first = n - (chunks - 1) * g;
    const int64_t last = n - (chunks - 1) * nc;
    const int64_t partial = (chunks - 1) * (nc % gr != 0) + (last % gr != 0);
    if (chunks < 2 || g < gr || partial <= (first % gr != 0) ||
        (dhidden_slow(call, p, g) && !dhidden_slow(call, p, nc)))
        return 0;
    return g;
}

/* Rows the logits product pads for chunks of m rows over n (the last
 * shorter): each chunk's last block is whole (gemm_onednn.h). */
static int64_t padded_logits_rows(int64_t n, int64_t m)
{
    const int64_t g = fg_cpu_logits_block_rows(), full = n / m, last = n - full * m;
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
static int64_t block_rows(fg_call *call, const linear_plan *p, int64_t n, int64_t nc,
                          int64_t *lead)
{
    const int64_t gr = fg_cpu_logits_block_rows(), g = nc / gr * gr, chunks = (n + nc - 1) / nc;
    if (g < gr || n <= nc || (dhidden_slow(call, p, g) && !dhidden_slow(call, p, nc)))
        return 0;
    const int64_t more = (n - nc + g - 1) / g + 1, first = n - (more - 1) * g;
    const int64_t saved = padded_logits_rows(n, nc) - padded_logits_rows(n, g);
    if (saved <= (more - chunks) * gr)
        return 0;
    *lead = first > g ? first - g : 0;
    return first > g ? first : g;
}

/* The largest chunk size (chunk_rows) whose need with `workers` GEMM
 * scratchpads fits the budget, or 0. */
static fg_status fit_chunks(fg_call *call, const linear_plan *p, int workers, int64_t *out)
{
    const int64_t n = p->n_active;
    const size_t row = chunk_bytes(p, 1); /* chunks are fitted unpadded */
    const size_t budget = call->budget;
    const size_t avail = budget > p->fixed_bytes ? budget - p->fixed_bytes : 0;
    int64_t nc = (int64_t)(avail / row) < n ? (int64_t)(avail / row) : n;
    *out = 0;
    while (nc >= 1) {
        nc = chunk_rows(call, p, n, nc);
        const int64_t chunks = (n + nc - 1) / nc;
        size_t need;
        fg_gemm_scratch gs;
        fg_status st = need_bytes(call, p, nc, n - (chunks - 1) * nc, workers, &need, &gs);
        if (st != FG_OK)
            return st;
        if (need <= budget) {
            *out = nc;
            return FG_OK;
        }
        /* Over by need - budget: drop that many rows' worth (at least one),
         * trying one row before giving up (GEMM scratch is not linear in m). */
        const int64_t cut = (int64_t)((need - budget + row - 1) / row);
        nc = nc == 1 ? 0 : (nc - cut > 1 ? nc - cut : 1);
    }
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
            size_t need1;
            fg_gemm_scratch gs1;
            if ((st = need_bytes(call, p, 1, 1, 1, &need1, &gs1)) != FG_OK)
                return st;
            return fg_fail(call->err, FG_ERR_BUDGET_TOO_SMALL,
                           "a memory budget of %zu bytes is too small: one token row a chunk "
                           "needs %zu bytes (per-call arrays %zu%s + one row's logits, dlogits, "
                           "hidden rows and statistics %zu + GEMM scratch %zu for one thread, "
                           "in whole pages; V = %lld, H = %lld)",
                           call->budget, need1, p->fixed_bytes,
                           p->gw_sum ? ", with the bf16 grad_weight's float32 sums" : "",
                           chunk_bytes(p, 1), fg_gemm_scratch_bytes(&gs1, 1), (long long)p->V,
                           (long long)p->H);
        }
    }
    if (forced <= 0) /* forced: exactly that, the same chunks on every shard whatever its
                        own vocabulary slice makes of dhidden_slow */
        nc = chunk_rows(call, p, n, nc);
    size_t need;
    int64_t chunks = (n + nc - 1) / nc, other = n - (chunks - 1) * nc; /* the other size */
    p->lead = 0;
    if (p->fused && forced <= 0 && !p->hook) {
        /* Chunks in whole logits blocks where they fit with the scratchpads they were
         * fitted with (never the thread count, like the chunks): rounded up (group_rows),
         * else rounded down with the rest in the first chunk (lead_rows), else more of
         * them where that pads fewer rows enough (block_rows). Not where shards
         * merge per chunk: they agree on the smallest Nc, and a shard replanned with it
         * walks chunks of exactly that many rows. */
        const int64_t rows = group_rows(call, p, n, nc);
        fg_gemm_scratch gs;
        if (rows > 0 && (st = need_bytes(call, p, rows, n - (n - 1) / rows * rows, fit_workers,
                                         &need, &gs)) != FG_OK)
            return st;
        if (rows > 0 && need <= call->budget) {
            nc = rows;
            chunks = (n + nc - 1) / nc;
            other = n - (chunks - 1) * nc;
        } else {
            const int64_t g = lead_rows(call, p, n, nc);
            if (g > 0 && (st = need_bytes(call, p, n - (chunks - 1) * g, g, fit_workers, &need,
                                          &gs)) != FG_OK)
                return st;
            if (g > 0 && need <= call->budget) {
                nc = n - (chunks - 1) * g;
                p->lead = nc - g;
                other = g;
            } else {
                int64_t lead = 0;
                const int64_t first = block_rows(call, p, n, nc, &lead), later = first - lead;
                const int64_t k = first > 0 ? 1 + (n - first + later - 1) / later : 0;
                const int64_t rest = lead ? later : n - (k - 1) * first; /* the other size */
                if (first > 0 &&
                    (st = need_bytes(call, p, first, rest, fit_workers, &need, &gs)) != FG_OK)
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
    if ((st = need_bytes(call, p, nc, other, 1, &need, &p->gemm)) != FG_OK)
        return st;
    /* As many GEMM threads as the budget holds scratchpads for. */
    int workers = 1;
    while (workers < threads &&
           (!p->fused || fg_ws_page_round(p->fixed_bytes + chunk_bytes(p, nc) +
                                          fg_gemm_scratch_bytes(&p->gemm, workers + 1)) <=
                             call->budget))
        workers++;
    p->Nc = nc;
    p->chunks = chunks;
    p->gemm_workers = workers;
    p->scratch_bytes = fg_gemm_scratch_bytes(&p->gemm, workers);
    return FG_OK;
}

int fg_linear_is_sharded(const fg_linear_inputs *in)
{
    return in->vocab_start != 0 || (in->vocab_total > 0 && in->vocab_total != in->weight.rows);
}

fg_grad_bound fg_linear_grad_bound(const input_bounds *ib, const fg_linear_outputs *out,
                                   double temperature, int64_t vocab)
{
    const int gh = ib->scanned && out->grad_hidden.data, gw = ib->scanned && out->grad_weight.data;
    const int gb = ib->scanned && out->grad_bias.data;
    const double sum_scale = gw && ib->hidden_max > 1.0 ? ib->hidden_max : (gw || gb ? 1.0 : 0.0);
    fg_grad_bound b = {1.0 / temperature, log((double)vocab), gh ? ib->weight_max : 0.0,
                       sum_scale, "grad_hidden", gw ? "grad_weight" : "grad_bias", 0.0};
    return b;
}

/* The caller's grad_logp and grad_entropy (backward kinds) bound the whole
 * gradient before anything runs: refused when it could overflow. */
static fg_status bound_external(fg_call *call, const linear_request *req,
                                const fg_linear_outputs *out, int64_t vocab,
                                const input_bounds *ib)
{
    const fg_batch *batch = req->batch;
    fg_grad_bound gb = fg_linear_grad_bound(ib, out, req->cfg->temperature, vocab);
    for (int64_t n = 0; n < batch->batch * batch->seq_len; n++) {
        if (!batch->mask[n])
            continue;
        const fg_status st = fg_grad_bound_add(call->err, &gb, req->dlogp[n],
                                               req->dentropy ? req->dentropy[n] : 0.0, n,
                                               batch->seq_len);
        if (st != FG_OK)
            return st;
    }
    return FG_OK;
}

/* Every logit is bounded by |z| <= (H·max|h|·max|w| + max|b|) / temperature
 * (so is every partial sum of the product); beyond FG_OVERFLOW_LIMIT the row
 * statistics could overflow: FG_ERR_OVERFLOW. */
fg_status fg_linear_check_bounds(fg_call *call, const linear_request *req,
                                 const fg_linear_inputs *in, const fg_linear_outputs *out,
                                 fg_magnitude h, fg_magnitude w, fg_magnitude b, input_bounds *ib)
{
    const double H = (double)in->hidden.cols, temperature = req->cfg->temperature;
    const double bound = H * h.value * w.value + b.value;
    if (bound > FG_OVERFLOW_LIMIT || bound / temperature > FG_OVERFLOW_LIMIT) {
        const int64_t T = req->batch->seq_len;
        return fg_fail(call->err, FG_ERR_OVERFLOW,
                       "hidden row %lld (token [%lld, %lld]) holds |h| = %g: with H = %lld, "
                       "|weight| up to %g (row %lld) and |bias| up to %g, the logits could "
                       "reach %g / temperature %g, beyond float range",
                       (long long)h.index, (long long)(h.index / T), (long long)(h.index % T),
                       h.value, (long long)in->hidden.cols, w.value, (long long)w.index, b.value,
                       bound, temperature);
    }
    ib->scanned = 1;
    ib->hidden_max = h.value;
    ib->weight_max = w.value;
    ib->logit_max = bound / temperature;
    if (req->kind == KIND_LOGPROBS_BACKWARD || req->kind == KIND_SHARD_BACKWARD)
        return bound_external(call, req, out,
                              fg_linear_is_sharded(in) ? in->vocab_total : in->weight.rows, ib);
    return FG_OK;
}

/* The NaN/Inf scan of hidden (its unmasked rows), weight and bias in host
 * memory, then the bounds their largest magnitudes give. */
static fg_status scan_inputs(fg_call *call, const linear_request *req, const fg_linear_inputs *in,
                             const fg_linear_outputs *out, input_bounds *ib)
{
    fg_error *err = call->err;
    fg_magnitude h, w, b = {0.0, 0};
    fg_status st;
    if ((st = fg_scan_matrix(err, call->threads, "hidden", &in->hidden, req->batch->mask, &h)) !=
            FG_OK ||
        (st = fg_scan_matrix(err, call->threads, "weight", &in->weight, NULL, &w)) != FG_OK)
        return st;
    if (in->bias.data && (st = fg_scan_vector(err, "bias", &in->bias, &b)) != FG_OK)
        return st;
    return fg_linear_check_bounds(call, req, in, out, h, w, b, ib);
}

fg_status fg_linear_validate(fg_call *call, const fg_linear_options *o, const linear_request *req,
                             const fg_linear_inputs *in, const fg_linear_outputs *out,
                             int64_t *n_active, input_bounds *ib)
{
    fg_error *err = call->err;
    const fg_loss_config *cfg = req->cfg;
    const fg_batch *batch = req->batch;
    fg_status st;
    if (!in)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "in is NULL");
    if (!out)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "out is NULL");
    if (o->impl != FG_IMPL_FUSED && o->impl != FG_IMPL_MATERIALIZED)
        return fg_fail(err, FG_ERR_UNSUPPORTED, "unknown impl %d", (int)o->impl);
    if ((st = fg_validate_config(err, cfg)) != FG_OK)
        return st;
    if ((st = fg_validate_matrix(err, "hidden", &in->hidden, -1, -1)) != FG_OK ||
        (st = fg_validate_matrix(err, "weight", &in->weight, -1, in->hidden.cols)) != FG_OK)
        return st;
    if (in->weight.dtype != in->hidden.dtype)
        return fg_fail(err, FG_ERR_SHAPE_MISMATCH, "weight dtype differs from hidden dtype");
    const int64_t V = in->weight.rows, H = in->hidden.cols;
    if (in->bias.data) {
        if ((st = fg_validate_vector(err, "bias", &in->bias, V)) != FG_OK)
            return st;
        if (in->bias.dtype != in->weight.dtype)
            return fg_fail(err, FG_ERR_SHAPE_MISMATCH, "bias dtype differs from weight dtype");
    }
    const int sharded = fg_linear_is_sharded(in);
    if (sharded) {
        if (in->vocab_start < 0 || in->vocab_total <= 0 || in->vocab_start > in->vocab_total - V)
            return fg_fail(err, FG_ERR_SHAPE_MISMATCH,
                           "vocab shard of %lld rows at vocab_start = %lld does not lie in "
                           "[0, vocab_total = %lld)",
                           (long long)V, (long long)in->vocab_start, (long long)in->vocab_total);
        if (fg_uses_hook(req->kind) && !call->comm.allreduce)
            return fg_fail(err, FG_ERR_NULL_ARGUMENT,
                           "a vocab-sharded weight needs a communicator (fg_context_options.comm), "
                           "or the phase API (fg_linear_shard_stats)");
    }
    const int64_t vocab = sharded ? in->vocab_total : V;
    if (req->kind == KIND_LOSS) {
        st = fg_validate_batch(err, cfg, batch, vocab, n_active);
    } else {
        const int backward = req->kind == KIND_LOGPROBS_BACKWARD || req->kind == KIND_SHARD_BACKWARD;
        if (backward && !req->dlogp)
            return fg_fail(err, FG_ERR_NULL_ARGUMENT, "grad_logp is NULL");
        if (req->kind == KIND_SHARD_STATS && !req->stats_out)
            return fg_fail(err, FG_ERR_NULL_ARGUMENT, "stats is NULL");
        if (req->kind == KIND_SHARD_BACKWARD &&
            (st = fg_validate_shard_stats(err, req->stats_in, batch->batch * batch->seq_len)) != FG_OK)
            return st;
        const fg_token_input reads[2] = {{"grad_logp", req->dlogp},
                                         {"grad_entropy", req->dentropy}};
        st = fg_validate_tokens(err, req->tokens, vocab, reads, 2, n_active);
    }
    if (st != FG_OK)
        return st;
    const int64_t N = batch->batch * batch->seq_len;
    if (in->hidden.rows != N)
        return fg_fail(err, FG_ERR_SHAPE_MISMATCH, "hidden has %lld rows, B*T = %lld",
                       (long long)in->hidden.rows, (long long)N);
    if (out->grad_hidden.data &&
        (st = fg_validate_matrix(err, "grad_hidden", &out->grad_hidden, N, H)) != FG_OK)
        return st;
    if (out->grad_weight.data &&
        (st = fg_validate_matrix(err, "grad_weight", &out->grad_weight, V, H)) != FG_OK)
        return st;
    if (out->grad_bias.data && (st = fg_validate_vector(err, "grad_bias", &out->grad_bias, V)) != FG_OK)
        return st;
    if (in->hidden.dtype != FG_DTYPE_BF16 &&
        ((out->grad_hidden.data && out->grad_hidden.dtype != FG_DTYPE_F32) ||
         (out->grad_weight.data && out->grad_weight.dtype != FG_DTYPE_F32) ||
         (out->grad_bias.data && out->grad_bias.dtype != FG_DTYPE_F32)))
        return fg_fail(err, FG_ERR_UNSUPPORTED,
                       "bfloat16 gradients need bfloat16 inputs; float32 inputs get float32 "
                       "gradients");
    if (req->kind == KIND_LOGPROBS && !out->logp && !out->entropy)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "logp and entropy are both NULL: nothing to compute");
    if ((req->kind == KIND_LOGPROBS_BACKWARD || req->kind == KIND_SHARD_BACKWARD) &&
        !out->grad_hidden.data && !out->grad_weight.data && !out->grad_bias.data)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT,
                       "grad_hidden, grad_weight and grad_bias are all NULL: nothing to compute");
    if (o->round_logits_to_input_dtype && o->impl == FG_IMPL_FUSED)
        return fg_fail(err, FG_ERR_UNSUPPORTED,
                       "round_logits_to_input_dtype is a materialized-baseline option");
    if (!(o->filter_eps == FG_FILTER_EPS_AUTO || (o->filter_eps >= 0 && o->filter_eps <= 1)))
        return fg_fail(err, FG_ERR_BAD_HYPERPARAMETER,
                       "filter_eps = %g: 0 (off), a threshold in (0, 1], or FG_FILTER_EPS_AUTO",
                       o->filter_eps);
    if (o->filter_eps != 0 && o->impl != FG_IMPL_FUSED)
        return fg_fail(err, FG_ERR_UNSUPPORTED,
                       "filter_eps is a fused-path option (the materialized baseline is exact)");
    memset(ib, 0, sizeof *ib);
    return FG_OK;
}

fg_status fg_linear_check_aliasing(const fg_call *call, const linear_request *req,
                                   const fg_linear_inputs *in, const fg_linear_outputs *out)
{
    const fg_batch *b = req->batch; /* the head kinds' view holds their tokens */
    const size_t N = (size_t)(b->batch * b->seq_len), f = sizeof(float);
    const size_t stats = (size_t)FG_SHARD_STATS_FLOATS(N) * f;
    fg_span ins[FG_BATCH_SPANS + 6];
    fg_batch_spans(b, ins);
    ins[FG_BATCH_SPANS + 0] = fg_span_matrix("hidden", &in->hidden);
    ins[FG_BATCH_SPANS + 1] = fg_span_matrix("weight", &in->weight);
    ins[FG_BATCH_SPANS + 2] = fg_span_vector("bias", &in->bias);
    ins[FG_BATCH_SPANS + 3] = fg_span_bytes("grad_logp", req->dlogp, N * f);
    ins[FG_BATCH_SPANS + 4] = fg_span_bytes("grad_entropy", req->dentropy, N * f);
    ins[FG_BATCH_SPANS + 5] = fg_span_bytes("stats", req->stats_in, stats);
    const fg_span outs[] = {fg_span_bytes("logp", out->logp, N * f),
                            fg_span_bytes("entropy", out->entropy, N * f),
                            fg_span_matrix("grad_hidden", &out->grad_hidden),
                            fg_span_matrix("grad_weight", &out->grad_weight),
                            fg_span_vector("grad_bias", &out->grad_bias),
                            fg_span_bytes("stats", req->stats_out, stats)};
    return fg_check_aliasing(call->err, outs, (int)(sizeof outs / sizeof outs[0]), ins,
                             (int)(sizeof ins / sizeof ins[0]), call->caller_workspace,
                             call->caller_workspace_bytes);
}

/* Everything one call carries from chunk to chunk. The chunk buffers are
 * the CPU backend's: p.bc's workspace pointers. */
typedef struct linear_call {
    linear_plan p;
    fg_device be; /* the CPU backend (backend_cpu.h) over p.cpu */
    fg_common c;
    const fg_linear_inputs *in;
    fg_linear_outputs *out;
    float *stats; /* the hook: a chunk's statistics and their reductions (shard_stats.h) */
    enum call_kind kind;
    float *shard_out; /* KIND_SHARD_STATS: the caller's [B*T] statistics        */
    fg_status failed; /* the hook: this shard failed; it skips its work up to the
                         next reduction, whose flag stops every shard            */
    fg_grad_bound gb;  /* the gradient bound of the tokens checked so far     */
    int64_t checked;   /* tokens whose derivatives are checked (check_tokens) */
    double loss;       /* KIND_LOSS: the loss and metrics, evaluated once every
                          token is checked, committed at the end               */
    fg_metrics metrics;
    int evaluated;
    int certified; /* KIND_LOSS: no token can be refused (cannot_overflow) */
    char msg[8];   /* CPU_OP */
} linear_call;

enum sweep_mode { SWEEP_FORWARD, SWEEP_BACKWARD, SWEEP_BOTH };

/* A CPU backend op on the call: its message is in the call's error sink
 * already (backend_cpu.c), the op's own copy goes to L->msg unread. */
#define CPU_OP(L, op, ...)                                                                        \
    ((L)->be.ops->op((L)->be.state, &(L)->p.bc, __VA_ARGS__, (L)->msg, sizeof (L)->msg))

/* Returned by a step of the hook when a reduction carried some shard's
 * failure flag: every shard stops there, and fg_collective_outcome agrees on
 * the status. Never leaves this file. */
#define STOPPED FG_STATUS_COUNT

/* A local failure: alone, the call ends here; with the hook, the shard skips
 * its work up to its next reduction, which stops every shard. */
static fg_status fail(const linear_plan *p, linear_call *L, fg_status st)
{
    if (!p->hook || st == FG_OK)
        return st;
    if (!L->failed)
        L->failed = st;
    return FG_OK;
}

/* One reduction of the hook's sequence (buf holds count + 1 floats). */
static fg_status exchange(fg_call *call, linear_call *L, float *buf, int64_t count, fg_reduce_op op)
{
    const int r = fg_collective_reduce(call, buf, count, op, L->failed != FG_OK);
    if (r < 0) {
        L->failed = fg_fail(call->err, FG_ERR_COMMUNICATOR, "the communicator's allreduce failed");
        return STOPPED;
    }
    return r ? STOPPED : FG_OK;
}

/* The hook's merge of a chunk's statistics: this shard's own, MAX, the sums
 * rescaled to exact limbs, SUM, then every row's lse/logp/entropy. */
static fg_status merge_chunk(fg_call *call, linear_call *L, int64_t r0, int64_t m)
{
    const fg_rows rows = {.count = m, .V = L->p.V, .token = L->c.active + r0};
    float *buf = L->stats;
    if (!L->failed)
        (void)fail(&L->p, L, CPU_OP(L, shard_stats, r0, m, buf, m, 0));
    fg_status st = exchange(call, L, buf, fg_shard_max_count(m) - 1, FG_REDUCE_MAX);
    if (st != FG_OK)
        return st;
    /* No shard failed: nothing can fail between here and the SUM. */
    for (int64_t i = 0; i < m; i++)
        fg_shard_encode(buf, m, i);
    if (call->comm.allreduce(call->comm.user, buf + fg_shard_sum_offset(m), fg_shard_sum_count(m),
                             FG_REDUCE_SUM) != 0) {
        L->failed = fg_fail(call->err, FG_ERR_COMMUNICATOR, "the communicator's allreduce failed");
        return STOPPED;
    }
    if (fg_sweep_shard_merged(&rows, buf, &L->c.ta) != 0) {
        L->failed = fg_fail(call->err, FG_ERR_COMMUNICATOR,
                            "the summed statistics are not sums of shards' limbs (the "
                            "communicator's SUM is not a sum, or more than %d shards)",
                            FG_SHARD_MAX_SHARDS);
        return STOPPED;
    }
    return FG_OK;
}

/* Tokens tok[0..m) once their statistics are known, before anything they
 * feed is written: the statistics, and with `grads` (the loss's derivatives
 * are due) each token's loss term and derivatives and the gradient bound
 * (fg_common_check_tokens). Once every token's derivatives are checked, the
 * loss and metrics (KIND_LOSS). The head-only kinds check statistics alone:
 * the caller's derivatives were bounded with the arguments. */
static fg_status check_tokens(fg_call *call, linear_call *L, const int64_t *tok, int64_t m,
                              int grads)
{
    const int loss = L->kind == KIND_LOSS;
    fg_status st = fg_common_check_tokens(&L->c, call->err, tok, m, L->p.bounds.scanned,
                                          grads && loss ? &L->gb : NULL);
    if (st != FG_OK || !grads || !loss)
        return st;
    L->checked += m;
    if (L->checked == L->c.n_active) {
        st = fg_common_evaluate(&L->c, call->err, &L->loss, &L->metrics);
        L->evaluated = 1;
    }
    return st;
}

/* The chunk's row statistics (the backend's per-row arrays) into c.ta at
 * its tokens, where the loss math and the checks read them. */
static void stats_to_tokens(linear_call *L, const int64_t *tok, int64_t m)
{
    const fg_backend_call *bc = &L->p.bc;
    const fg_token_arrays *ta = &L->c.ta;
    for (int64_t i = 0; i < m; i++) {
        const int64_t n = tok[i];
        ta->zmax[n] = bc->zmax[i];
        ta->lsum[n] = bc->lsum[i];
        ta->entropy[n] = bc->entropy[i];
        ta->logp[n] = bc->logp[i];
    }
}

/* The loss math's derivatives of a token for the backend (stats_backward). */
static void token_derivs(const void *user, int64_t k, float logp, float entropy, float *g,
                         float *e)
{
    const fg_common *c = user;
    const int64_t n = c->active[k];
    *g = fg_loss_dlogp(&c->plan, n, logp, entropy);
    *e = fg_loss_dentropy(&c->plan, n, entropy);
}

/* The backward's inputs of the chunk from c.ta: its rows' statistics (as
 * stats computed them, or as shards merged them) and the loss math's g, e. */
static void tokens_to_backward(linear_call *L, int64_t r0, int64_t m)
{
    const fg_backend_call *bc = &L->p.bc;
    const fg_token_arrays *ta = &L->c.ta;
    for (int64_t i = 0; i < m; i++) {
        const int64_t n = L->c.active[r0 + i];
        bc->zmax[i] = ta->zmax[n];
        bc->lsum[i] = ta->lsum[n];
        bc->entropy[i] = ta->entropy[n];
        token_derivs(&L->c, r0 + i, ta->logp[n], ta->entropy[n], &bc->g[i], &bc->e[i]);
    }
}

/* One chunk k: GEMM 1 (unless the logits are still there), the row sweep of
 * `mode`, then the bias column sums and GEMMs 2 and 3 when gradients are
 * due; every step on the CPU backend (backend_cpu.h). */
static fg_status run_chunk(fg_call *call, linear_call *L, int64_t k, enum sweep_mode mode,
                           int logits_ready, int first_backward_chunk)
{
    const linear_plan *p = &L->p;
    const fg_backend_call *bc = &p->bc;
    const int64_t r0 = chunk_start(p, k), m = chunk_len(p, k);
    const int64_t *tok = L->c.active + r0;
    fg_status st;
    if (!logits_ready && !L->failed && (st = fail(p, L, CPU_OP(L, logits, r0, m))) != FG_OK)
        return st;
    if (L->kind == KIND_SHARD_STATS) /* the phase API's (a): this shard's own */
        return CPU_OP(L, shard_stats, r0, m, L->shard_out, L->c.plan.B * L->c.plan.T, 1);
    if (p->hook && mode != SWEEP_BACKWARD) {
        /* Statistics need every shard: merge, check (every shard has the same
         * merged statistics; a gradient bound one shard's own weight rows
         * break stops every shard at the next reduction), then (token level)
         * the backward. */
        if ((st = merge_chunk(call, L, r0, m)) != FG_OK)
            return st;
        if (!L->failed &&
            (st = fail(p, L, check_tokens(call, L, tok, m, mode == SWEEP_BOTH))) != FG_OK)
            return st;
        if (mode == SWEEP_FORWARD)
            return FG_OK;
        mode = SWEEP_BACKWARD;
    }
    if (!L->failed) {
        switch (mode) {
        case SWEEP_FORWARD:
            if ((st = CPU_OP(L, stats, r0, m)) != FG_OK) /* never with the hook */
                return st;
            stats_to_tokens(L, tok, m);
            return check_tokens(call, L, tok, m, 0);
        case SWEEP_BACKWARD:
            tokens_to_backward(L, r0, m);
            if ((st = fail(p, L, CPU_OP(L, backward, r0, m))) != FG_OK)
                return st;
            break;
        case SWEEP_BOTH: { /* dlogits are the workspace's: checked before the outputs */
            const fg_backend_derivs d = {token_derivs, &L->c};
            if ((st = CPU_OP(L, stats_backward, r0, m, &d)) != FG_OK) /* never with the hook */
                return st;
            stats_to_tokens(L, tok, m);
            if ((st = check_tokens(call, L, tok, m, 1)) != FG_OK)
                return st;
            break;
        }
        }
    }
    /* Gradient filtering (the backend's threshold; counts the entries either
     * way): the products below then run sparse where every row keeps few. */
    if ((p->want_gh || p->want_gw) && !L->failed &&
        (st = fail(p, L, CPU_OP(L, filter, r0, m))) != FG_OK)
        return st;
    /* GEMM 3 overwrites in the first backward chunk, unless it sums straight
     * into the grad_weight of an accumulating call; a bf16 one's float32
     * sums start afresh (finish adds the caller's values). */
    const int sum_in = !first_backward_chunk || (p->accumulate && !p->gw_sum);
    if (!p->hook) /* the seam's grads: GEMM 2 into grad_hidden, GEMM 3 */
        return L->failed ? FG_OK : CPU_OP(L, grads, r0, m, !sum_in);
    /* The hook: each shard holds its vocab rows' share of grad_hidden, summed
     * between the product and the rows it writes; then GEMM 3 alone. */
    if (p->want_gh) {
        if (!L->failed && (st = fail(p, L, CPU_OP(L, dhidden, r0, m))) != FG_OK)
            return st;
        if ((st = exchange(call, L, bc->ghbuf, m * p->H, FG_REDUCE_SUM)) != FG_OK)
            return st;
        if (!L->failed && (st = fail(p, L, CPU_OP(L, put_grad_hidden, r0, m))) != FG_OK)
            return st;
    }
    if (p->want_gw && !L->failed) {
        fg_backend_call gw_only = *bc;
        gw_only.grad_hidden.data = NULL;
        st = L->be.ops->grads(L->be.state, &gw_only, r0, m, !sum_in, L->msg, sizeof L->msg);
        if ((st = fail(p, L, st)) != FG_OK)
            return st;
    }
    return FG_OK;
}

/* grad_bias's float32 sums start from the caller's values when accumulating
 * (gb_seeded), else from 0: they live in the workspace and reach the caller
 * in finish, so a refused call leaves grad_bias as it was. The sums are the
 * same float additions, in the same order, as summing in place: float32
 * micro-batches give one call's bits (a bf16 grad_bias is rounded at the end
 * of each call). */
static void start_bias_sums(linear_call *L)
{
    const linear_plan *p = &L->p;
    fg_backend_call *bc = &L->p.bc;
    if (!p->want_gb)
        return;
    const void *gb = L->out->grad_bias.data;
    for (int64_t v = 0; v < p->V; v++)
        bc->gb_sum[v] = !p->accumulate             ? 0.0f
                        : p->gb_t == FG_DTYPE_BF16 ? fg_bf16_load(((const uint16_t *)gb)[v])
                                                   : ((const float *)gb)[v];
    bc->gb_seeded = p->accumulate;
}

/* Whether no token of a loss call can be refused once the chunks run: the
 * loss math's bound from the inputs alone (fg_loss_cannot_overflow, given
 * the scanned logits' bound), and the gradients it bounds within the call's
 * fg_grad_bound. Never with the hook: each shard bounds its own weight rows,
 * and the shards must walk the same sweeps. */
static int cannot_overflow(const linear_call *L)
{
    const linear_plan *p = &L->p;
    const fg_grad_bound *gb = &L->gb;
    double gmax, gsum;
    if (L->kind != KIND_LOSS || !p->bounds.scanned || p->hook ||
        !fg_loss_cannot_overflow(&L->c.plan, p->bounds.logit_max, gb->log_vocab, &gmax, &gsum))
        return 0;
    const double e = fabs(L->c.plan.entropy_weight) * (gb->log_vocab + 1.0);
    const double smax = 2.0 * (gmax + e) * gb->inv_temp;
    const double ssum = 2.0 * (gsum + (double)L->c.n_active * e) * gb->inv_temp;
    return smax * gb->row_scale <= FG_OVERFLOW_LIMIT && ssum * gb->sum_scale <= FG_OVERFLOW_LIMIT;
}

/* Whether the loss call computes every token's log-prob before any gradient:
 * the loss needs them (fg_loss_needs_all_tokens), or an accumulating call of
 * several chunks sums GEMM 3 straight into the caller's grad_weight, which a
 * token refused in a later chunk (FG_ERR_OVERFLOW) would leave changed,
 * unless no token can be refused (cannot_overflow: token-level losses
 * without the KL, for inputs some 30 orders of magnitude inside the float
 * range). The alternative, float32 sums of grad_weight in the workspace
 * committed at the end, needs V x H floats the budget rarely holds (620 MB
 * at V = 151936, H = 1024); the forward sweep costs one more logits product
 * per token. */
static int forward_first(const linear_call *L)
{
    const linear_plan *p = &L->p;
    return fg_loss_needs_all_tokens(&L->c.plan) ||
           (L->kind == KIND_LOSS && p->accumulate && p->want_gw && !p->gw_sum && p->chunks > 1 &&
            !L->certified);
}

static fg_status run_sweeps(fg_call *call, linear_call *L)
{
    const linear_plan *p = &L->p;
    fg_status st = FG_OK;
    if (!p->any_grad) {
        for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
            st = run_chunk(call, L, k, SWEEP_FORWARD, 0, 0);
        return st;
    }
    if (L->kind == KIND_SHARD_BACKWARD) { /* the merged statistics are given */
        for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
            st = run_chunk(call, L, k, SWEEP_BACKWARD, 0, k == 0);
        return st;
    }
    if (!forward_first(L)) {
        for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
            st = run_chunk(call, L, k, SWEEP_BOTH, 0, k == 0);
        return st;
    }
    /* Every log-prob and entropy first (sequence-level ratios, vespo, the
     * off-policy mask, the entropy quantile; every token checked), then the
     * gradient sweep. With one chunk the logits are still in the buffer and
     * need no recomputation. */
    for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
        st = run_chunk(call, L, k, SWEEP_FORWARD, 0, 0);
    if (st != FG_OK || L->failed)
        return st;
    fg_common_prepare(&L->c);
    /* With the hook a shard whose own gradient bound fails joins the
     * backward's reductions, whose flag stops every shard (fail). */
    if ((st = fail(p, L, check_tokens(call, L, L->c.active, L->c.n_active, 1))) != FG_OK)
        return st;
    for (int64_t k = 0; k < p->chunks && st == FG_OK; k++)
        st = run_chunk(call, L, k, SWEEP_BACKWARD, p->chunks == 1, k == 0);
    return st;
}

/* How a bf16 grad_weight is summed over the chunks. In float32, in a [V, H]
 * buffer of the workspace, rounded once at the end (with the caller's values
 * when accumulating): always where the CPU has no bf16 GEMM kernels (oneDNN
 * 2.6 has no f32 x f32 -> bf16 product there), else when the call walks more
 * than one chunk and the budget holds the buffer (the chunks shrink to make
 * room, as they would for a float32 grad_weight's passes). Otherwise GEMM 3
 * sums into the bf16 grad_weight (oneDNN's sum post-op): one rounding per
 * chunk. */
static fg_status plan_grad_weight_sums(fg_call *call, linear_plan *p)
{
    if (!p->want_gw || p->gw_t != FG_DTYPE_BF16)
        return FG_OK;
    const size_t bytes = fg_ws_round((size_t)p->V * (size_t)p->H * sizeof(float));
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
        if ((st = fit_any(call, &q, &nc_sum, NULL)) != FG_OK)
            return st;
        if (nc_sum < 1)
            return FG_OK;
    }
    set_gw_sum(p, 1);
    p->gw_sum_bytes = bytes;
    p->fixed_bytes += bytes;
    return FG_OK;
}

/* Gradient filtering's threshold, when a backward product runs. The sparse
 * grad_weight product writes float32: a bf16 grad_weight summed in bf16 per
 * chunk (plan_grad_weight_sums) runs dense. */
static void plan_filter(const fg_linear_options *o, linear_plan *p)
{
    const double eps = o->filter_eps == FG_FILTER_EPS_AUTO ? fg_filter_eps_auto(p->in_t) : o->filter_eps;
    const int gw_f32 = !p->want_gw || p->gw_sum || p->gw_t == FG_DTYPE_F32;
    if (p->fused && eps > 0 && (p->want_gh || p->want_gw) && gw_f32) {
        p->filter_eps = eps;
        p->kept_cap = fg_kept_cap(p->V);
    }
}

/* The plan of a validated call: dtypes, which products run, and the chunks
 * (a collective call then re-plans them at the shards' agreed size). */
static fg_status plan_call(fg_call *call, const fg_linear_options *o, const linear_request *req,
                           const fg_linear_inputs *in, const fg_linear_outputs *out,
                           int64_t n_active, linear_plan *p)
{
    memset(p, 0, sizeof *p);
    p->fused = o->impl == FG_IMPL_FUSED;
    p->in_t = in->hidden.dtype;
    p->cmp_t = fg_cpu_gemm_dtype(call, p->in_t);
    p->logit_t = (!p->fused && o->round_logits_to_input_dtype) ? p->in_t : FG_DTYPE_F32;
    p->dlogit_t = p->cmp_t; /* the gradient GEMMs take dlogits in the compute dtype */
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
    p->fixed_bytes = fg_common_workspace_bytes(batch->batch, batch->batch * batch->seq_len);
    if (p->want_gb) /* grad_bias's f32 sums, committed at the end */
        p->fixed_bytes += fg_ws_round((size_t)p->V * sizeof(float));
    /* The unmasked tokens' targets (local ids) and the stats op's row check. */
    p->fixed_bytes += fg_ws_round((size_t)n_active * sizeof(int64_t)) + fg_ws_round(2 * sizeof(int));
    p->cpu = (fg_cpu_backend){.call = call, .gemm_workers = 1,
                              .tiles = !(p->hook && p->in_t == FG_DTYPE_F32)};
    p->bc = (fg_backend_call){.N = batch->batch * batch->seq_len, .H = p->H, .V = p->V,
                              .n_active = n_active, .in_t = p->in_t, .logit_t = p->logit_t,
                              .dlogit_t = p->dlogit_t,
                              .inv_temp = (float)(1.0 / req->cfg->temperature),
                              .accumulate = p->accumulate, .hidden = in->hidden,
                              .weight = in->weight, .bias = in->bias, .mask = batch->mask,
                              .grad_hidden = out->grad_hidden, .grad_weight = out->grad_weight,
                              .grad_bias = out->grad_bias};
    if (p->n_active == 0)
        return FG_OK;
    fg_status st = plan_grad_weight_sums(call, p);
    if (st != FG_OK)
        return st;
    plan_filter(o, p);
    return plan_chunks(call, p, 0);
}

/* The arena a planned call reserves. */
static size_t plan_total(const linear_plan *p)
{
    if (p->n_active == 0)
        return fg_ws_page_round(p->fixed_bytes);
    return fg_ws_page_round(p->fixed_bytes + chunk_bytes(p, p->Nc) + p->scratch_bytes);
}

/* Every argument check, then the plan (opts NULL: fused). `is_call`: for
 * the call itself, which also scans the inputs for NaN/Inf; the plan query
 * (0) reads shapes and the mask only. */
static fg_status check_and_plan(fg_call *call, const fg_linear_options *opts,
                                const linear_request *req, const fg_linear_inputs *in,
                                const fg_linear_outputs *out, int is_call, linear_plan *p)
{
    memset(p, 0, sizeof *p);
    const fg_linear_options fused = {FG_IMPL_FUSED, 0, 0.0};
    const fg_linear_options *o = opts ? opts : &fused;
    int64_t n_active = 0;
    input_bounds ib;
    fg_status st = fg_linear_validate(call, o, req, in, out, &n_active, &ib);
    /* The call writes its outputs: they must not overlap what it reads (the
     * cheap check first, then the pass over the inputs' values). */
    if (st == FG_OK && is_call)
        st = fg_linear_check_aliasing(call, req, in, out);
    if (st == FG_OK && is_call && call->check_finite)
        st = scan_inputs(call, req, in, out, &ib);
    if (st != FG_OK)
        return st;
    st = plan_call(call, o, req, in, out, n_active, p);
    p->bounds = ib;
    return st;
}

/* What the shards of a collective call must agree on: everything that sets
 * the sequence of reductions or the result, except each shard's own rows. */
static fg_call_hash call_hash(const fg_linear_options *opts, const linear_request *req,
                              const fg_linear_inputs *in, const fg_linear_outputs *out,
                              const linear_plan *p)
{
    fg_call_hash k;
    fg_hash_init(&k);
    const fg_batch *b = req->batch;
    const fg_loss_config *c = req->cfg;
    const int64_t ints[] = {req->kind, opts ? opts->impl : FG_IMPL_FUSED,
                            opts ? opts->round_logits_to_input_dtype : 0, b->batch, b->seq_len,
                            in->hidden.cols, in->vocab_total, in->hidden.dtype, p->sharded,
                            in->bias.data != NULL, p->want_gh, p->want_gw, p->want_gb,
                            out->accumulate, p->gh_t, p->gw_t, p->gb_t, p->n_active, c->loss_type,
                            c->importance_sampling_level, c->max_completion_length,
                            c->use_bias_correction_kl, req->dlogp != NULL, req->dentropy != NULL};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        fg_hash_i64(&k, ints[i]);
    const double reals[] = {opts ? opts->filter_eps : 0.0, c->temperature, c->epsilon_low,
                            c->epsilon_high, c->delta, c->beta, c->num_items_in_batch,
                            c->sapo_temperature_pos, c->sapo_temperature_neg, c->entropy_coef,
                            c->vespo_k_pos, c->vespo_lambda_pos, c->vespo_k_neg,
                            c->vespo_lambda_neg, c->off_policy_mask_threshold,
                            c->top_entropy_quantile};
    for (size_t i = 0; i < sizeof reals / sizeof reals[0]; i++)
        fg_hash_f64(&k, reals[i]);
    const int64_t N = b->batch * b->seq_len;
    for (int64_t n = 0; n < N; n++) /* the mask, and the tokens where it is set */
        fg_hash_i64(&k, b->mask[n] ? b->token_ids[n] : -1);
    return k;
}

/* A collective call's entry (fg_communicator): the shards agree on the call
 * and its chunk size, plan and reserve for it, and agree that all of them
 * can run it. Every shard makes both reductions whatever its own status. */
static fg_status enter_collective(fg_call *call, const fg_linear_options *opts,
                                  const linear_request *req, const fg_linear_inputs *in,
                                  const fg_linear_outputs *out, linear_plan *p)
{
    fg_status st = check_and_plan(call, opts, req, in, out, 1, p);
    fg_call_hash hash = {0};
    if (st == FG_OK)
        hash = call_hash(opts, req, in, out, p);
    int64_t nc = p->Nc;
    st = fg_collective_agree(call, st, hash, &nc);
    if (st == FG_OK && p->n_active > 0 && nc != p->Nc)
        st = plan_chunks(call, p, nc);
    if (st == FG_OK)
        st = fg_call_reserve(call, plan_total(p));
    return fg_collective_ready(call, st);
}

/* The phase API's (a) and (d) helpers the seam driver shares
 * (linear_request.h). */
void fg_shard_stats_close(float *stats, const fg_batch *batch)
{
    const int64_t N = batch->batch * batch->seq_len;
    for (int64_t n = 0; n < N; n++)
        if (!batch->mask[n])
            fg_shard_put_empty(stats, N, n);
    stats[FG_SHARD_STATS_STATUS(N)] = 0.0f;
}

void fg_shard_stats_load(const float *stats, const fg_batch *batch, const fg_common *c)
{
    const int64_t N = batch->batch * batch->seq_len;
    for (int64_t k = 0; k < c->n_active; k++) {
        const int64_t n = c->active[k];
        fg_shard_merged_at(stats, N, n, &c->ta.zmax[n], &c->ta.lsum[n], &c->ta.entropy[n]);
    }
}

fg_status fg_linear_grpo_plan(fg_context *ctx, const fg_linear_options *opts,
                              const fg_loss_config *cfg, const fg_linear_inputs *in,
                              const fg_batch *batch, const fg_linear_outputs *out,
                              const fg_exec *exec, fg_linear_plan_info *info)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_call call;
    fg_status st = fg_call_begin(ctx, exec, &call);
    if (st != FG_OK)
        return st;
    if (!info)
        return fg_call_end(&call, fg_fail(call.err, FG_ERR_NULL_ARGUMENT, "info is NULL"));
    linear_plan p;
    const linear_request req = {KIND_LOSS, cfg, batch, NULL, NULL, NULL, NULL, NULL};
    if (call.device)
        return fg_call_end(&call, fg_linear_device_plan(&call, opts, &req, in, out, info));
    const fg_status plan_st = check_and_plan(&call, opts, &req, in, out, 0, &p);
    if (plan_st != FG_OK && !(plan_st == FG_ERR_BUDGET_TOO_SMALL && p.n_active > 0))
        return fg_call_end(&call, plan_st); /* an argument error: info is not written */
    fg_linear_plan_info r;
    memset(&r, 0, sizeof r);
    if (p.fused && p.n_active > 0) {
        /* With bf16 GEMM kernels a bf16 grad_weight runs without its float32
         * sums (plan_grad_weight_sums): the smallest budget leaves them out. */
        linear_plan q = p;
        if (q.gw_sum && q.cmp_t == FG_DTYPE_BF16) {
            set_gw_sum(&q, 0);
            q.fixed_bytes -= q.gw_sum_bytes;
        }
        fg_gemm_scratch gs1;
        if ((st = need_bytes(&call, &q, 1, 1, 1, &r.min_budget_bytes, &gs1)) != FG_OK)
            return fg_call_end(&call, st);
    }
    r.fixed_bytes = p.fixed_bytes;
    r.gemm_dtype = p.cmp_t;
    r.grad_weight_sum_bytes = p.gw_sum_bytes;
    if (plan_st == FG_OK) {
        r.chunk_rows = p.Nc;
        r.later_chunk_rows = p.Nc - p.lead;
        r.chunks = p.chunks;
        r.chunk_bytes = p.n_active > 0 ? chunk_bytes(&p, p.Nc) : 0;
        r.gemm_scratch_bytes = p.scratch_bytes;
        r.working_bytes = plan_total(&p);
    }
    if (p.fused && p.n_active == 0)
        r.min_budget_bytes = fg_ws_page_round(p.fixed_bytes);
    *info = r;
    /* FG_ERR_BUDGET_TOO_SMALL keeps its message; info is written. */
    return fg_call_end(&call, plan_st);
}

/* Runs a request: checks, plan, the arena, then the sweeps; outputs are
 * written only once every check has passed and the arena is in hand. */
static fg_status linear_execute(fg_context *ctx, const fg_linear_options *opts,
                                const linear_request *req, const fg_linear_inputs *in,
                                fg_linear_outputs *out, const fg_exec *exec)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    fg_call call;
    fg_status st = fg_call_begin(ctx, exec, &call);
    if (st != FG_OK)
        return st;
    if (call.device) /* a backend behind the seam: linear_device.c */
        return fg_call_end(&call, fg_linear_device_execute(&call, opts, req, in, out));
    linear_call L;
    memset(&L, 0, sizeof L);
    linear_plan *p = &L.p;
    /* With a communicator the one-call kinds are collective, sharded or not:
     * a shard that fails its checks still joins the entry agreement. */
    const int collective = call.comm.allreduce != NULL && fg_uses_hook(req->kind);
    if (collective)
        st = enter_collective(&call, opts, req, in, out, p);
    else if ((st = check_and_plan(&call, opts, req, in, out, 1, p)) == FG_OK)
        st = fg_call_reserve(&call, plan_total(p));
    if (st != FG_OK)
        return fg_call_end(&call, st);
    /* All checks passed and all resources are in hand: the sweeps run from
     * here on; they write grad_hidden and grad_weight chunk by chunk (each
     * chunk's tokens checked first), everything else at the end. */
    const fg_batch *batch = req->batch;
    call.chunk_rows = p->Nc;
    call.chunks = p->chunks;
    if (req->kind == KIND_LOSS)
        fg_common_init(call.arena, &L.c, req->cfg, batch);
    else
        fg_common_init_external(call.arena, &L.c, batch, req->dlogp, req->dentropy);
    L.in = in;
    L.out = out;
    L.kind = req->kind;
    L.shard_out = req->stats_out;
    L.gb = fg_linear_grad_bound(&p->bounds, out, req->cfg->temperature,
                      p->sharded ? in->vocab_total : p->V);
    L.certified = cannot_overflow(&L);
    /* The CPU backend's workspace (backend.h, fg_backend_call), carved from
     * the arena as the plan counted it. */
    fg_backend_cpu_init(&p->cpu, &call, p->cpu.tiles, &L.be);
    p->cpu.gemm_workers = p->gemm_workers;
    p->cpu.filter_eps = p->filter_eps;
    p->cpu.kept_cap = p->kept_cap;
    fg_backend_call *bc = &p->bc;
    bc->rows = L.c.active;
    int64_t *targets = fg_call_take(&call, (size_t)p->n_active * sizeof(int64_t));
    for (int64_t i = 0; i < p->n_active; i++) /* local ids: this shard's rows */
        targets[i] = batch->token_ids[L.c.active[i]] - p->vocab_start;
    bc->targets = targets;
    bc->row_check = fg_call_take(&call, 2 * sizeof(int));
    bc->row_check[0] = bc->row_check[1] = FG_BACKEND_ROW_NONE;
    bc->gb_sum = p->want_gb ? fg_call_take(&call, (size_t)p->V * sizeof(float)) : NULL;
    bc->gw_sum = p->gw_sum ? fg_call_take(&call, (size_t)p->V * (size_t)p->H * sizeof(float))
                           : NULL;
    if (p->n_active > 0) {
        const size_t Nc = (size_t)p->Nc;
        bc->chunk_rows = p->Nc;
        bc->logits = fg_call_take(&call, Nc * (size_t)p->V * fg_dtype_size(p->logit_t));
        bc->dlogits = p->any_grad && !p->dl_alias
                          ? fg_call_take(&call, Nc * (size_t)p->V * fg_dtype_size(p->dlogit_t))
                          : bc->logits;
        bc->hbuf = fg_call_take(&call, Nc * (size_t)p->H * fg_dtype_size(p->cmp_t));
        float *row_arrays = fg_call_take(&call, 6 * Nc * sizeof(float));
        bc->zmax = row_arrays;
        bc->lsum = row_arrays + Nc;
        bc->entropy = row_arrays + 2 * Nc;
        bc->logp = row_arrays + 3 * Nc;
        bc->g = row_arrays + 4 * Nc;
        bc->e = row_arrays + 5 * Nc;
        if (p->want_gh) /* and the hook's flag slot */
            bc->ghbuf = fg_call_take(&call, (Nc * (size_t)p->H + (size_t)p->hook) * sizeof(float));
        bc->scratch = p->scratch_bytes ? fg_call_take(&call, p->scratch_bytes) : NULL;
        if (p->hook)
            L.stats = fg_call_take(&call, (size_t)fg_shard_floats(p->Nc) * sizeof(float));
        if (p->filter_eps > 0) {
            p->cpu.kept_idx = fg_call_take(&call, Nc * (size_t)p->kept_cap * sizeof(int32_t));
            p->cpu.kept_nnz = fg_call_take(&call, Nc * sizeof(int32_t));
            p->cpu.kept_tgt = fg_call_take(&call, Nc * sizeof(int64_t));
        }
    }
    start_bias_sums(&L);
    if (req->kind == KIND_SHARD_BACKWARD)
        fg_shard_stats_load(req->stats_in, batch, &L.c);
    if (p->n_active > 0)
        st = run_sweeps(&call, &L);
    if (collective) {
        /* Every shard leaves with the same status: its own failure, or one a
         * reduction's flag stopped it for. */
        fg_status local = L.failed ? L.failed : (st == STOPPED ? FG_OK : st);
        if ((st = fg_collective_outcome(&call, local)) != FG_OK)
            return fg_call_end(&call, st);
    }
    const int loss = req->kind == KIND_LOSS;
    if (st == FG_OK && loss && !L.evaluated) { /* no gradient sweep checked the tokens
        (a loss without gradients, or no unmasked token): their loss terms, then the loss */
        fg_common_prepare(&L.c);
        st = check_tokens(&call, &L, L.c.active, L.c.n_active, 1);
    }
    if (st != FG_OK) /* nothing committed: see "Conventions" in fusedgrpo.h */
        return fg_call_end(&call, st);
    if (req->kind == KIND_SHARD_STATS)
        fg_shard_stats_close(L.shard_out, batch);
    if (p->any_grad && (st = L.be.ops->finish(L.be.state, bc, L.msg, sizeof L.msg)) != FG_OK)
        return fg_call_end(&call, st);
    if (loss) {
        out->loss = L.loss;
        out->metrics = L.metrics;
    }
    fg_common_commit(&L.c, batch, out->logp, out->entropy);
    return fg_call_end(&call, FG_OK);
}

fg_status fg_linear_grpo(fg_context *ctx, const fg_linear_options *opts,
                         const fg_loss_config *cfg, const fg_linear_inputs *in,
                         const fg_batch *batch, fg_linear_outputs *out, const fg_exec *exec)
{
    const linear_request req = {KIND_LOSS, cfg, batch, NULL, NULL, NULL, NULL, NULL};
    return linear_execute(ctx, opts, &req, in, out, exec);
}

/* A head-only request: a default config with the temperature, a batch view
 * of the tokens (an empty one when tokens is NULL: validation reports it). */
static void head_request(linear_request *req, enum call_kind kind, fg_loss_config *cfg,
                         fg_batch *batch, double temperature, const fg_tokens *tokens,
                         const float *dlogp, const float *dentropy)
{
    memset(req, 0, sizeof *req);
    fg_loss_config_init(cfg);
    cfg->temperature = temperature;
    memset(batch, 0, sizeof *batch);
    if (tokens) {
        batch->batch = tokens->batch;
        batch->seq_len = tokens->seq_len;
        batch->token_ids = tokens->token_ids;
        batch->mask = tokens->mask;
    }
    req->kind = kind;
    req->cfg = cfg;
    req->batch = batch;
    req->tokens = tokens;
    req->dlogp = dlogp;
    req->dentropy = dentropy;
}

fg_status fg_linear_logprobs(fg_context *ctx, const fg_linear_options *opts, double temperature,
                             const fg_linear_inputs *in, const fg_tokens *tokens, float *logp,
                             float *entropy, const fg_exec *exec)
{
    fg_loss_config cfg;
    fg_batch batch;
    linear_request req;
    head_request(&req, KIND_LOGPROBS, &cfg, &batch, temperature, tokens, NULL, NULL);
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    out.logp = logp;
    out.entropy = entropy;
    return linear_execute(ctx, opts, &req, in, &out, exec);
}

/* A backward request's gradient views as the outputs the driver writes;
 * grads NULL: NULL, which validation reports as "out is NULL". */
static fg_linear_outputs *grads_as_outputs(const fg_linear_grads *grads, fg_linear_outputs *out)
{
    memset(out, 0, sizeof *out);
    if (!grads)
        return NULL;
    out->grad_hidden = grads->grad_hidden;
    out->grad_weight = grads->grad_weight;
    out->grad_bias = grads->grad_bias;
    out->accumulate = grads->accumulate;
    return out;
}

fg_status fg_linear_logprobs_backward(fg_context *ctx, const fg_linear_options *opts,
                                      double temperature, const fg_linear_inputs *in,
                                      const fg_tokens *tokens, const float *grad_logp,
                                      const float *grad_entropy, fg_linear_grads *grads,
                                      const fg_exec *exec)
{
    fg_loss_config cfg;
    fg_batch batch;
    linear_request req;
    head_request(&req, KIND_LOGPROBS_BACKWARD, &cfg, &batch, temperature, tokens, grad_logp,
                 grad_entropy);
    fg_linear_outputs out;
    return linear_execute(ctx, opts, &req, in, grads_as_outputs(grads, &out), exec);
}

fg_status fg_linear_shard_stats(fg_context *ctx, const fg_linear_options *opts,
                                double temperature, const fg_linear_inputs *in,
                                const fg_tokens *tokens, float *stats, const fg_exec *exec)
{
    fg_loss_config cfg;
    fg_batch batch;
    linear_request req;
    head_request(&req, KIND_SHARD_STATS, &cfg, &batch, temperature, tokens, NULL, NULL);
    req.stats_out = stats;
    fg_linear_outputs out;
    memset(&out, 0, sizeof out);
    return linear_execute(ctx, opts, &req, in, &out, exec);
}

fg_status fg_linear_shard_backward(fg_context *ctx, const fg_linear_options *opts,
                                   double temperature, const fg_linear_inputs *in,
                                   const fg_tokens *tokens, const float *stats,
                                   const float *grad_logp, const float *grad_entropy,
                                   fg_linear_grads *grads, const fg_exec *exec)
{
    fg_loss_config cfg;
    fg_batch batch;
    linear_request req;
    head_request(&req, KIND_SHARD_BACKWARD, &cfg, &batch, temperature, tokens, grad_logp,
                 grad_entropy);
    req.stats_in = stats;
    fg_linear_outputs out;
    return linear_execute(ctx, opts, &req, in, grads_as_outputs(grads, &out), exec);
}
