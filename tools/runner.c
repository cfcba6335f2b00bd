/* One impl on one problem: see runner.h. */
#include "runner.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

void ft_loss_config_from(const ft_config *cfg, fg_loss_config *out)
{
    fg_loss_config_init(out);
    out->loss_type = (fg_loss_type)cfg->loss_type; /* the config holds the library's values */
    out->importance_sampling_level = (fg_is_level)cfg->importance_sampling_level;
    out->temperature = cfg->temperature;
    out->epsilon_low = cfg->epsilon_low;
    /* The config's "auto"/"off" (NaN, -1) as the library's sentinels; its
     * ranges are the library's, which checks them again. */
    out->epsilon_high = isnan(cfg->epsilon_high) ? FG_EPSILON_HIGH_SAME_AS_LOW : cfg->epsilon_high;
    out->delta = isnan(cfg->delta) ? FG_DELTA_OFF : cfg->delta;
    out->beta = cfg->beta;
    out->max_completion_length =
        cfg->max_completion_length < 0 ? FG_MAX_COMPLETION_LENGTH_T : cfg->max_completion_length;
    out->num_items_in_batch =
        isnan(cfg->num_items_in_batch) ? FG_NUM_ITEMS_UNMASKED : cfg->num_items_in_batch;
    out->sapo_temperature_pos = cfg->sapo_temperature_pos;
    out->sapo_temperature_neg = cfg->sapo_temperature_neg;
    out->use_bias_correction_kl = cfg->use_bias_correction_kl;
    out->entropy_coef = cfg->entropy_coef;
    out->vespo_k_pos = cfg->vespo_k_pos;
    out->vespo_lambda_pos = cfg->vespo_lambda_pos;
    out->vespo_k_neg = cfg->vespo_k_neg;
    out->vespo_lambda_neg = cfg->vespo_lambda_neg;
    out->off_policy_mask_threshold =
        isnan(cfg->off_policy_mask_threshold) ? INFINITY : cfg->off_policy_mask_threshold;
    out->top_entropy_quantile = cfg->top_entropy_quantile;
}

void ft_batch_from(const ft_problem *p, fg_batch *out)
{
    *out = (fg_batch){p->s.batch, p->s.seq_len, p->token_ids, p->mask, p->advantages, p->old_logp,
                      p->ref_logp, p->is_ratio, p->s.is_ratio == FT_ISR_SEQUENCE, NULL};
}

/* "what: FG_ERR_X: message" for a failed library call. */
static int lib_error(ft_runner *r, const char *what, fg_status st)
{
    const char *name = fg_status_name(st), *msg = r->ctx ? fg_last_error(r->ctx) : "";
    const int named = strncmp(msg, name, strlen(name)) == 0; /* messages start with the name */
    return ft_error(r->err, sizeof r->err, "%s: %s%s%s", what, named ? "" : name,
                    named || !*msg ? "" : ": ", msg);
}

static fg_linear_outputs linear_outputs(const ft_runner *r)
{
    const ft_config *s = &r->p->s;
    return (fg_linear_outputs){0, {0}, r->logp, r->entropy,
                               fg_matrix_make(r->grad_hidden, FG_DTYPE_F32, s->batch * s->seq_len, s->hidden),
                               fg_matrix_make(r->grad_weight, FG_DTYPE_F32, s->vocab, s->hidden),
                               fg_vector_make(r->grad_bias, FG_DTYPE_F32, r->grad_bias ? s->vocab : 0), 0};
}

/* The planner's view of a call with opts: for memory_budget min, first
 * the smallest budget it runs with, then the plan at that budget. */
static int plan(ft_runner *r, const fg_linear_options *opts, fg_exec *exec, fg_linear_plan_info *info)
{
    fg_linear_outputs o = linear_outputs(r);
    fg_status st = fg_linear_grpo_plan(r->ctx, opts, &r->loss, &r->lin, &r->batch, &o, exec, info);
    if (st == FG_OK && r->min_budget && info->min_budget_bytes > 0) {
        exec->memory_budget = info->min_budget_bytes;
        st = fg_linear_grpo_plan(r->ctx, opts, &r->loss, &r->lin, &r->batch, &o, exec, info);
    }
    return st == FG_OK ? 0 : lib_error(r, "fg_linear_grpo_plan", st);
}

int ft_runner_init(ft_runner *r, const ft_config *cfg, const ft_problem *p, int impl, int full_step)
{
    memset(r, 0, sizeof *r);
    r->impl = impl;
    r->full_step = full_step;
    r->min_budget = cfg->memory_budget == FT_BUDGET_MIN;
    r->p = p;
    const ft_config *s = &p->s;
    const int64_t N = s->batch * s->seq_len, H = s->hidden, V = s->vocab;
    ft_loss_config_from(cfg, &r->loss);
    ft_batch_from(p, &r->batch);
    fg_context_options o;
    fg_context_options_init(&o);
    o.threads = (int)cfg->threads;
    o.memory_budget = r->min_budget ? 0 : (size_t)cfg->memory_budget;
    o.check_finite = cfg->check_finite;
    fg_status st = fg_context_create(&o, &r->ctx);
    if (st != FG_OK)
        return ft_error(r->err, sizeof r->err, "fg_context_create: %s", fg_status_name(st));
    if (cfg->threads > 0) /* the tool's own loops take the same thread count */
        omp_set_num_threads((int)cfg->threads);
    r->lin = (fg_linear_inputs){fg_matrix_make(p->hidden, s->dtype, N, H),
                                fg_matrix_make(p->weight, s->dtype, V, H),
                                fg_vector_make(p->bias, s->dtype, p->bias ? V : 0), 0, 0};
    r->lopts.impl = impl == FT_IMPL_BASELINE ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED;
    r->lopts.round_logits_to_input_dtype = impl == FT_IMPL_BASELINE && cfg->round_logits;
    r->lopts.filter_eps = impl != FT_IMPL_FUSED  ? 0.0
                          : isnan(cfg->filter_eps) ? FG_FILTER_EPS_AUTO
                                                   : cfg->filter_eps;

    /* One pre-faulted mapping: logp, entropy, the gradients (when wanted),
     * then the logits impl's logits, which are tool memory, not outputs. */
    const int grads = impl != FT_IMPL_LOGITS || full_step;
    const size_t n = (size_t)N, h = (size_t)H, v = (size_t)V, page = 4096;
    const size_t zb = impl == FT_IMPL_LOGITS ? n * v * ft_dtype_size(s->dtype) : 0, gb = p->bias ? v * 4 : 0;
    const size_t sizes[6] = {n * 4, n * 4, grads ? n * h * 4 : 0, grads ? v * h * 4 : 0, grads ? gb : 0, zb};
    size_t off[6];
    for (int k = 0; k < 6; k++) {
        off[k] = r->buf_bytes;
        r->buf_bytes += (sizes[k] + page - 1) / page * page;
    }
    r->output_bytes = sizes[0] + sizes[1] + sizes[2] + sizes[3] + sizes[4];
    r->logits_bytes = sizes[5];
    if ((r->buf = ft_big_alloc(r->buf_bytes)) == NULL)
        return ft_error(r->err, sizeof r->err, "out of memory for %zu bytes of outputs", r->buf_bytes);
    float **outs[5] = {&r->logp, &r->entropy, &r->grad_hidden, &r->grad_weight, &r->grad_bias};
    for (int k = 0; k < 5; k++)
        *outs[k] = sizes[k] ? (float *)(r->buf + off[k]) : NULL;
    r->logits = sizes[5] ? r->buf + off[5] : NULL;
    /* Block-high chunks: the same oneDNN blocks as one whole product. */
    if (impl == FT_IMPL_LOGITS &&
        ft_gemm_init(&r->gemm, (int)cfg->threads, FG_BLOCK_LOGITS_M, r->err, sizeof r->err) != 0)
        return -1;
    fg_linear_plan_info info;
    return impl != FT_IMPL_LOGITS && r->min_budget ? plan(r, &r->lopts, &r->exec, &info) : 0;
}

int ft_runner_materialize_logits(ft_runner *r)
{
    const ft_problem *p = r->p;
    if (ft_gemm_logits(&r->gemm, p->s.dtype, p->hidden, ft_problem_tokens(p), p->s.dtype, p->weight,
                       p->bias, p->s.vocab, p->s.hidden, p->s.dtype, r->logits) == 0)
        return 0;
    return ft_error(r->err, sizeof r->err, "tool logits GEMM: %s", r->gemm.err.msg);
}

int ft_runner_logits_kernel(ft_runner *r)
{
    const ft_config *s = &r->p->s;
    fg_matrix logits = fg_matrix_make(r->logits, s->dtype, s->batch * s->seq_len, s->vocab);
    /* In place: grad_logits is the logits buffer, same dtype and ld. */
    fg_logits_outputs o = {0, {0}, r->logp, r->entropy, logits};
    double t0 = omp_get_wtime();
    fg_status st = fg_logits_grpo(r->ctx, &r->loss, &logits, &r->batch, &o, &r->exec);
    r->kernel_s = omp_get_wtime() - t0;
    if (st != FG_OK)
        return lib_error(r, "fg_logits_grpo", st);
    r->loss_value = o.loss;
    r->metrics = o.metrics;
    return 0;
}

/* grad_bias[v] = sum over tokens of dlogits[n, v], in blocks of columns. */
static void column_sums(const void *d, int dtype, int64_t N, int64_t V, float *out)
{
#pragma omp parallel for schedule(static)
    for (int64_t v0 = 0; v0 < V; v0 += 256) {
        const int64_t v1 = V - v0 < 256 ? V : v0 + 256;
        for (int64_t v = v0; v < v1; v++)
            out[v] = 0.0f;
        for (int64_t n = 0; n < N; n++)
            for (int64_t v = v0; v < v1; v++)
                out[v] += ft_load(d, dtype, n * V + v);
    }
}

int ft_runner_step(ft_runner *r)
{
    const ft_problem *p = r->p;
    if (r->impl != FT_IMPL_LOGITS) {
        fg_linear_outputs o = linear_outputs(r);
        fg_status st = fg_linear_grpo(r->ctx, &r->lopts, &r->loss, &r->lin, &r->batch, &o, &r->exec);
        if (st != FG_OK)
            return lib_error(r, "fg_linear_grpo", st);
        r->loss_value = o.loss;
        r->metrics = o.metrics;
        return 0;
    }
    if (ft_runner_materialize_logits(r) != 0 || ft_runner_logits_kernel(r) != 0)
        return -1;
    if (!r->full_step)
        return 0;
    if (ft_gemm_backward(&r->gemm, p->s.dtype, r->logits, p->hidden, ft_problem_tokens(p), p->s.dtype,
                         p->weight, p->s.vocab, p->s.hidden, r->grad_hidden, r->grad_weight, 0) != 0)
        return ft_error(r->err, sizeof r->err, "tool backward GEMMs: %s", r->gemm.err.msg);
    if (r->grad_bias)
        column_sums(r->logits, p->s.dtype, ft_problem_tokens(p), p->s.vocab, r->grad_bias);
    return 0;
}

size_t ft_runner_tool_bytes(const ft_runner *r) { return r->logits_bytes + ft_gemm_bytes(&r->gemm); }

int64_t ft_runner_fused_chunk_rows(ft_runner *r, int64_t *later)
{
    const fg_linear_options fused = {FG_IMPL_FUSED, 0, 0.0};
    fg_exec exec = {0};
    fg_linear_plan_info info;
    const int ok = plan(r, &fused, &exec, &info) == 0;
    *later = ok ? info.later_chunk_rows : 0;
    return ok ? info.chunk_rows : 0;
}

void ft_runner_free(ft_runner *r)
{
    ft_big_free(r->buf, r->buf_bytes);
    if (r->gemm.cache)
        ft_gemm_free(&r->gemm);
    fg_context_destroy(r->ctx);
    memset(r, 0, sizeof *r);
}
