/* Argument checks (see validate.h). */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "cpu_dispatch.h"
#include "validate.h"

static int finite_d(double x) { return isfinite(x); }

fg_status fg_validate_config(fg_error *err, const fg_loss_config *cfg)
{
    if (!cfg)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "cfg is NULL");
    if ((int)cfg->loss_type < 0 || cfg->loss_type >= FG_LOSS_TYPE_COUNT)
        return fg_fail(err, FG_ERR_UNKNOWN_LOSS_TYPE,
                       "loss_type %d is not one of grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo, vespo",
                       (int)cfg->loss_type);
    if ((int)cfg->importance_sampling_level < 0 ||
        cfg->importance_sampling_level >= FG_LEVEL_COUNT)
        return fg_fail(err, FG_ERR_UNKNOWN_LEVEL,
                       "importance_sampling_level %d is not token or sequence",
                       (int)cfg->importance_sampling_level);
    /* The kernels scale by (float)(1 / temperature): it must be finite too
     * (a temperature below ~2.9e-39 would turn every logit into Inf/NaN). */
    if (!(cfg->temperature > 0) || !finite_d(cfg->temperature) ||
        !isfinite((float)(1.0 / cfg->temperature)))
        return fg_fail(err, FG_ERR_BAD_TEMPERATURE,
                       "temperature must be finite and > 0 with a finite float reciprocal, got %g",
                       cfg->temperature);
    /* docs/LOSS_SPEC.md "Option ranges and overflow": every option in its
     * range, a sentinel only as the exact value fg_loss_config_init sets. */
    const double eps_high = cfg->epsilon_high;
    const struct {
        const char *name;
        double v;
        int ok;
        const char *range;
    } ranges[] = {
        {"epsilon_low", cfg->epsilon_low, finite_d(cfg->epsilon_low) && cfg->epsilon_low >= 0,
         ">= 0"},
        {"epsilon_high", eps_high,
         eps_high == FG_EPSILON_HIGH_SAME_AS_LOW || (finite_d(eps_high) && eps_high >= 0),
         ">= 0 (or -1: same as epsilon_low)"},
        {"delta", cfg->delta,
         cfg->delta == FG_DELTA_OFF || (finite_d(cfg->delta) && cfg->delta > 0),
         "> 0 (or 0: off)"},
        {"beta", cfg->beta, finite_d(cfg->beta) && cfg->beta >= 0, ">= 0"},
        {"num_items_in_batch", cfg->num_items_in_batch,
         cfg->num_items_in_batch == FG_NUM_ITEMS_UNMASKED ||
             (finite_d(cfg->num_items_in_batch) && cfg->num_items_in_batch > 0),
         "> 0 (or -1: the unmasked token count)"},
        /* sapo divides by its temperatures (4 / tau) */
        {"sapo_temperature_pos", cfg->sapo_temperature_pos,
         cfg->sapo_temperature_pos > 0 && finite_d(cfg->sapo_temperature_pos) &&
             finite_d(4.0 / cfg->sapo_temperature_pos),
         "> 0 with a finite 4 / value"},
        {"sapo_temperature_neg", cfg->sapo_temperature_neg,
         cfg->sapo_temperature_neg > 0 && finite_d(cfg->sapo_temperature_neg) &&
             finite_d(4.0 / cfg->sapo_temperature_neg),
         "> 0 with a finite 4 / value"},
        {"entropy_coef", cfg->entropy_coef, finite_d(cfg->entropy_coef), "finite"},
        {"vespo_k_pos", cfg->vespo_k_pos, finite_d(cfg->vespo_k_pos) && cfg->vespo_k_pos > 0,
         "> 0"},
        {"vespo_lambda_pos", cfg->vespo_lambda_pos,
         finite_d(cfg->vespo_lambda_pos) && cfg->vespo_lambda_pos > 0, "> 0"},
        {"vespo_k_neg", cfg->vespo_k_neg, finite_d(cfg->vespo_k_neg) && cfg->vespo_k_neg > 0,
         "> 0"},
        {"vespo_lambda_neg", cfg->vespo_lambda_neg,
         finite_d(cfg->vespo_lambda_neg) && cfg->vespo_lambda_neg > 0, "> 0"},
        /* +INFINITY is "off"; NaN and -INFINITY mean nothing */
        {"off_policy_mask_threshold", cfg->off_policy_mask_threshold,
         !isnan(cfg->off_policy_mask_threshold) && cfg->off_policy_mask_threshold != -INFINITY,
         "a number (or +INFINITY: off)"},
        {"top_entropy_quantile", cfg->top_entropy_quantile,
         cfg->top_entropy_quantile >= 0.0 && cfg->top_entropy_quantile <= 1.0,
         "in [0, 1] (1: off)"},
    };
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++)
        if (!ranges[i].ok)
            return fg_fail(err, FG_ERR_BAD_HYPERPARAMETER, "%s must be %s, got %g",
                           ranges[i].name, ranges[i].range, ranges[i].v);
    if (cfg->max_completion_length < 0)
        return fg_fail(err, FG_ERR_BAD_HYPERPARAMETER,
                       "max_completion_length must be >= 1 (or 0: T), got %lld",
                       (long long)cfg->max_completion_length);
    return FG_OK;
}

/* "name[b, t] is x" for a non-finite per-token input. */
static fg_status nonfinite_token(fg_error *err, const char *name, const float *x, int64_t i,
                                 int64_t T)
{
    return fg_fail(err, FG_ERR_NONFINITE_INPUT, "%s[%lld, %lld] is %g", name, (long long)(i / T),
                   (long long)(i % T), (double)x[i]);
}

/* B, T and the token and mask pointers of a batch. */
static fg_status check_token_shape(fg_error *err, int64_t B, int64_t T, const int64_t *ids,
                                   const uint8_t *mask, const char *what)
{
    if (B <= 0 || T <= 0)
        return fg_fail(err, FG_ERR_INVALID_SIZE, "batch (B=%lld) and seq_len (T=%lld) must be >= 1",
                       (long long)B, (long long)T);
    size_t n, bytes;
    if (!fg_mul_size((size_t)B, (size_t)T, &n) || n > (size_t)INT64_MAX ||
        !fg_mul_size(n, sizeof(int64_t), &bytes))
        return fg_fail(err, FG_ERR_SIZE_OVERFLOW, "B*T = %lld*%lld overflows", (long long)B,
                       (long long)T);
    if (!ids)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "%s->token_ids is NULL", what);
    if (!mask)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "%s->mask is NULL", what);
    return FG_OK;
}

/* The one pass over the mask before outputs are written: the unmasked token
 * ids, the per-token inputs that are read there (NULL entries skipped), and
 * the count of unmasked tokens. */
static fg_status scan_unmasked(fg_error *err, int64_t B, int64_t T, const int64_t *ids,
                               const uint8_t *mask, int64_t vocab, const fg_token_input *reads,
                               int n_reads, int64_t *n_active)
{
    int64_t active = 0;
    for (int64_t i = 0; i < B * T; i++) {
        if (!mask[i])
            continue;
        active++;
        if (ids[i] < 0 || ids[i] >= vocab)
            return fg_fail(err, FG_ERR_TOKEN_OUT_OF_RANGE,
                           "token_ids[%lld, %lld] = %lld is outside [0, %lld)", (long long)(i / T),
                           (long long)(i % T), (long long)ids[i], (long long)vocab);
        for (int k = 0; k < n_reads; k++)
            if (reads[k].x && !isfinite(reads[k].x[i]))
                return nonfinite_token(err, reads[k].name, reads[k].x, i, T);
    }
    *n_active = active;
    return FG_OK;
}

fg_status fg_validate_batch_shape(fg_error *err, const fg_loss_config *cfg, const fg_batch *b)
{
    if (!b)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "batch is NULL");
    fg_status st = check_token_shape(err, b->batch, b->seq_len, b->token_ids, b->mask, "batch");
    if (st != FG_OK)
        return st;
    if (!b->advantages)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "batch->advantages is NULL");
    if (cfg->beta != 0 && !b->ref_logp)
        return fg_fail(err, FG_ERR_MISSING_REF_LOGP,
                       "beta = %g needs ref_logp (the reference policy's log-probs)", cfg->beta);
    return FG_OK;
}

fg_status fg_validate_batch(fg_error *err, const fg_loss_config *cfg, const fg_batch *b,
                            int64_t vocab, int64_t *n_active)
{
    fg_status st = fg_validate_batch_shape(err, cfg, b);
    if (st != FG_OK)
        return st;
    for (int64_t i = 0; i < b->batch; i++)
        if (!isfinite(b->advantages[i]))
            return fg_fail(err, FG_ERR_NONFINITE_INPUT, "advantages[%lld] is %g", (long long)i,
                           (double)b->advantages[i]);
    if (b->is_ratio && b->is_ratio_per_sequence)
        for (int64_t i = 0; i < b->batch; i++)
            if (!isfinite(b->is_ratio[i]))
                return fg_fail(err, FG_ERR_NONFINITE_INPUT, "is_ratio[%lld] is %g",
                               (long long)i, (double)b->is_ratio[i]);
    const fg_token_input reads[3] = {
        {"old_logp", b->old_logp},
        {"ref_logp", cfg->beta != 0 ? b->ref_logp : NULL},
        {"is_ratio", b->is_ratio && !b->is_ratio_per_sequence ? b->is_ratio : NULL}};
    st = scan_unmasked(err, b->batch, b->seq_len, b->token_ids, b->mask, vocab, reads, 3, n_active);
    if (st != FG_OK || !b->sampling_logp || isinf(cfg->off_policy_mask_threshold))
        return st;
    /* The sampler's log-probs: NaN marks a token it could not score (it
     * counts 0, as in TRL); an infinity is an error. */
    const int64_t T = b->seq_len;
    for (int64_t i = 0; i < b->batch * T; i++)
        if (b->mask[i] && isinf(b->sampling_logp[i]))
            return nonfinite_token(err, "sampling_logp", b->sampling_logp, i, T);
    return FG_OK;
}

fg_status fg_validate_tokens_shape(fg_error *err, const fg_tokens *tok)
{
    if (!tok)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "tokens is NULL");
    return check_token_shape(err, tok->batch, tok->seq_len, tok->token_ids, tok->mask, "tokens");
}

fg_status fg_validate_tokens(fg_error *err, const fg_tokens *tok, int64_t vocab,
                             const fg_token_input *reads, int n_reads, int64_t *n_active)
{
    fg_status st = fg_validate_tokens_shape(err, tok);
    if (st != FG_OK)
        return st;
    return scan_unmasked(err, tok->batch, tok->seq_len, tok->token_ids, tok->mask, vocab, reads,
                         n_reads, n_active);
}

fg_status fg_validate_matrix(fg_error *err, const char *name, const fg_matrix *m, int64_t rows,
                             int64_t cols)
{
    if (!m || !m->data)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "%s: data is NULL", name);
    if (m->dtype != FG_DTYPE_F32 && m->dtype != FG_DTYPE_BF16)
        return fg_fail(err, FG_ERR_UNSUPPORTED, "%s: unknown dtype %d", name, (int)m->dtype);
    if (m->rows <= 0 || m->cols <= 0)
        return fg_fail(err, FG_ERR_INVALID_SIZE, "%s: sizes must be >= 1, got [%lld, %lld]", name,
                       (long long)m->rows, (long long)m->cols);
    if (m->ld < m->cols)
        return fg_fail(err, FG_ERR_INVALID_SIZE, "%s: row stride ld = %lld < cols = %lld", name,
                       (long long)m->ld, (long long)m->cols);
    size_t elems, bytes;
    if (!fg_mul_size((size_t)(m->rows - 1), (size_t)m->ld, &elems) ||
        !fg_add_size(elems, (size_t)m->cols, &elems) || elems > (size_t)INT64_MAX / 4 ||
        !fg_mul_size(elems, fg_dtype_size(m->dtype), &bytes))
        return fg_fail(err, FG_ERR_SIZE_OVERFLOW, "%s: [%lld, %lld] with ld %lld overflows", name,
                       (long long)m->rows, (long long)m->cols, (long long)m->ld);
    if ((rows >= 0 && m->rows != rows) || (cols >= 0 && m->cols != cols))
        return fg_fail(err, FG_ERR_SHAPE_MISMATCH, "%s: shape [%lld, %lld], expected [%lld, %lld]",
                       name, (long long)m->rows, (long long)m->cols,
                       (long long)(rows >= 0 ? rows : m->rows),
                       (long long)(cols >= 0 ? cols : m->cols));
    return FG_OK;
}

fg_status fg_validate_vector(fg_error *err, const char *name, const fg_vector *v, int64_t len)
{
    if (!v || !v->data)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "%s: data is NULL", name);
    if (v->dtype != FG_DTYPE_F32 && v->dtype != FG_DTYPE_BF16)
        return fg_fail(err, FG_ERR_UNSUPPORTED, "%s: unknown dtype %d", name, (int)v->dtype);
    if (v->len <= 0)
        return fg_fail(err, FG_ERR_INVALID_SIZE, "%s: length must be >= 1, got %lld", name,
                       (long long)v->len);
    if ((uint64_t)v->len > (uint64_t)INT64_MAX / 4)
        return fg_fail(err, FG_ERR_SIZE_OVERFLOW, "%s: length %lld overflows", name,
                       (long long)v->len);
    if (len >= 0 && v->len != len)
        return fg_fail(err, FG_ERR_SHAPE_MISMATCH, "%s: length %lld, expected %lld", name,
                       (long long)v->len, (long long)len);
    return FG_OK;
}

fg_span fg_span_bytes(const char *name, const void *p, size_t bytes)
{
    fg_span s = {name, (uintptr_t)p, (uintptr_t)p};
    if (p) /* saturated: a range that would wrap ends at the top of the address space */
        s.hi = bytes > UINTPTR_MAX - s.lo ? UINTPTR_MAX : s.lo + bytes;
    return s;
}

fg_span fg_span_matrix(const char *name, const fg_matrix *m)
{
    if (!m->data)
        return fg_span_bytes(name, NULL, 0);
    const size_t elems = (size_t)(m->rows - 1) * (size_t)m->ld + (size_t)m->cols;
    return fg_span_bytes(name, m->data, elems * fg_dtype_size(m->dtype));
}

fg_span fg_span_vector(const char *name, const fg_vector *v)
{
    return fg_span_bytes(name, v->data, (size_t)v->len * fg_dtype_size(v->dtype));
}

void fg_batch_spans(const fg_batch *b, fg_span spans[FG_BATCH_SPANS])
{
    const size_t N = (size_t)(b->batch * b->seq_len), f = sizeof(float);
    const size_t is_ratio = b->is_ratio_per_sequence ? (size_t)b->batch : N;
    spans[0] = fg_span_bytes("token_ids", b->token_ids, N * sizeof(int64_t));
    spans[1] = fg_span_bytes("mask", b->mask, N);
    spans[2] = fg_span_bytes("advantages", b->advantages, (size_t)b->batch * f);
    spans[3] = fg_span_bytes("old_logp", b->old_logp, N * f);
    spans[4] = fg_span_bytes("ref_logp", b->ref_logp, N * f);
    spans[5] = fg_span_bytes("is_ratio", b->is_ratio, is_ratio * f);
    spans[6] = fg_span_bytes("sampling_logp", b->sampling_logp, N * f);
}

static int spans_meet(const fg_span *a, const fg_span *b)
{
    return a->lo < a->hi && b->lo < b->hi && a->lo < b->hi && b->lo < a->hi;
}

static fg_status aliased(fg_error *err, const fg_span *out, const fg_span *other, const char *what)
{
    return fg_fail(err, FG_ERR_ALIASED_OUTPUT,
                   "%s shares memory with %s %s (bytes [%p, %p) and [%p, %p)): an output may "
                   "not overlap an input or another output",
                   out->name, what, other->name, (void *)out->lo, (void *)out->hi,
                   (void *)other->lo, (void *)other->hi);
}

fg_status fg_check_aliasing(fg_error *err, const fg_span *outs, int n_outs, const fg_span *ins,
                            int n_ins, const void *workspace, size_t workspace_bytes)
{
    /* The caller's workspace is written by the call: an output like the others. */
    const fg_span ws = fg_span_bytes("exec->workspace", workspace, workspace_bytes);
    for (int k = 0; k < n_ins; k++)
        if (spans_meet(&ws, &ins[k]))
            return aliased(err, &ws, &ins[k], "the input");
    for (int k = 0; k < n_outs; k++)
        if (spans_meet(&ws, &outs[k]))
            return aliased(err, &ws, &outs[k], "the output");
    for (int i = 0; i < n_outs; i++) {
        for (int k = 0; k < n_ins; k++)
            if (spans_meet(&outs[i], &ins[k]))
                return aliased(err, &outs[i], &ins[k], "the input");
        for (int k = i + 1; k < n_outs; k++)
            if (spans_meet(&outs[i], &outs[k]))
                return aliased(err, &outs[i], &outs[k], "the output");
    }
    return FG_OK;
}

/* The largest |x| of n elements as its raw magnitude bits (sign cleared):
 * for floats the bits order as the magnitudes do, and bits at or above the
 * all-ones exponent are NaN or Inf. An integer max: vectorizes, one pass. */
FG_CPU_CLONES
static uint32_t max_magnitude_bits(const void *p, fg_dtype dt, int64_t n)
{
    if (dt == FG_DTYPE_BF16) {
        const uint16_t *x = p;
        uint16_t top = 0;
        for (int64_t i = 0; i < n; i++) {
            const uint16_t b = x[i] & 0x7fffu;
            top = b > top ? b : top;
        }
        return (uint32_t)top << 16; /* as float bits */
    }
    uint32_t top = 0;
    const uint32_t *x = p;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t b = x[i] & 0x7fffffffu;
        top = b > top ? b : top;
    }
    return top;
}

static int64_t first_nonfinite(const void *p, fg_dtype dt, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        const uint32_t b = dt == FG_DTYPE_BF16 ? (uint32_t)((const uint16_t *)p)[i] << 16
                                               : ((const uint32_t *)p)[i];
        if ((b & 0x7f800000u) == 0x7f800000u)
            return i;
    }
    return -1;
}

static double magnitude_of(uint32_t bits)
{
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

fg_status fg_scan_matrix(fg_error *err, int threads, const char *name, const fg_matrix *m,
                         const uint8_t *row_mask, fg_magnitude *out)
{
    const size_t es = fg_dtype_size(m->dtype);
    int64_t top_row = -1;
    uint32_t top = 0;
#pragma omp parallel num_threads(threads)
    {
        int64_t my_row = -1;
        uint32_t my_top = 0;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m->rows; r++) {
            if (row_mask && !row_mask[r])
                continue;
            const uint32_t b = max_magnitude_bits(
                (const unsigned char *)m->data + (size_t)r * (size_t)m->ld * es, m->dtype, m->cols);
            if (my_row < 0 || b > my_top || (b == my_top && r < my_row)) {
                my_top = b;
                my_row = r;
            }
        }
#pragma omp critical(fg_scan_matrix)
        if (my_row >= 0 && (top_row < 0 || my_top > top || (my_top == top && my_row < top_row))) {
            top = my_top;
            top_row = my_row;
        }
    }
    if (top >= 0x7f800000u) { /* NaN or Inf: the first such row (ties: the lowest row) */
        int64_t bad_row = -1;
        for (int64_t r = 0; r < m->rows && bad_row < 0; r++)
            if ((!row_mask || row_mask[r]) &&
                max_magnitude_bits((const unsigned char *)m->data + (size_t)r * (size_t)m->ld * es,
                                   m->dtype, m->cols) >= 0x7f800000u)
                bad_row = r;
        const int64_t c = first_nonfinite(
            (const unsigned char *)m->data + (size_t)bad_row * (size_t)m->ld * es, m->dtype, m->cols);
        return fg_fail(err, FG_ERR_NONFINITE_INPUT, "%s[%lld, %lld] is NaN or Inf", name,
                       (long long)bad_row, (long long)c);
    }
    out->value = magnitude_of(top);
    out->index = top_row < 0 ? 0 : top_row;
    return FG_OK;
}

fg_status fg_scan_vector(fg_error *err, const char *name, const fg_vector *v, fg_magnitude *out)
{
    const uint32_t top = max_magnitude_bits(v->data, v->dtype, v->len);
    if (top >= 0x7f800000u)
        return fg_fail(err, FG_ERR_NONFINITE_INPUT, "%s[%lld] is NaN or Inf", name,
                       (long long)first_nonfinite(v->data, v->dtype, v->len));
    out->value = magnitude_of(top);
    out->index = 0;
    return FG_OK;
}

fg_status fg_grad_bound_add(fg_error *err, fg_grad_bound *gb, double dlogp, double dentropy,
                            int64_t n, int64_t T)
{
    /* The L1 norm of token n's d loss/d logits row (docs/LOSS_SPEC.md "Option
     * ranges and overflow"): 2|g| + 2|e|(log V + 1), over the temperature. */
    const double s = 2.0 * (fabs(dlogp) + fabs(dentropy) * (gb->log_vocab + 1.0)) * gb->inv_temp;
    gb->sum += s;
    if (s * gb->row_scale > FG_OVERFLOW_LIMIT)
        return fg_fail(err, FG_ERR_OVERFLOW,
                       "token [%lld, %lld]: d loss/d logp = %g and d loss/d entropy = %g give a "
                       "%s row up to %g, beyond float range",
                       (long long)(n / T), (long long)(n % T), dlogp, dentropy, gb->row_name,
                       s * gb->row_scale);
    if (gb->sum * gb->sum_scale > FG_OVERFLOW_LIMIT)
        return fg_fail(err, FG_ERR_OVERFLOW,
                       "up to token [%lld, %lld]: the tokens' d loss/d logp and d loss/d entropy "
                       "give %s entries up to %g, beyond float range",
                       (long long)(n / T), (long long)(n % T), gb->sum_name,
                       gb->sum * gb->sum_scale);
    return FG_OK;
}

fg_status fg_validate_shard_stats(fg_error *err, const float *stats, int64_t n)
{
    if (!stats)
        return fg_fail(err, FG_ERR_NULL_ARGUMENT, "stats is NULL");
    const float slot = stats[FG_SHARD_STATS_STATUS(n)];
    if (slot == 0.0f)
        return FG_OK;
    if (slot >= 1.0f && slot < (float)FG_STATUS_COUNT && slot == (float)(int)slot)
        return fg_fail(err, (fg_status)(int)slot,
                       "a vocab shard failed fg_linear_shard_stats with %s (its status slot, "
                       "reduced by MAX, reached this shard); every shard returns it",
                       fg_status_name((fg_status)(int)slot));
    return fg_fail(err, FG_ERR_COMMUNICATOR,
                   "the stats' status slot holds %g, not a status: the buffer was not filled "
                   "by fg_linear_shard_stats and reduced by MAX",
                   (double)slot);
}
