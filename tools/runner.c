/* One impl on one problem: see runner.h. */
#include "runner.h"

#include "bigbuf.h"
#include "stats.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

int ft_loss_config_from(const ft_config *cfg, fg_loss_config *out, char *err, size_t errlen)
{
    fg_loss_config_init(out);
    /* Go through the names so the tool never depends on enum order. */
    const char *level = cfg->importance_sampling_level ? "sequence" : "token";
    if (fg_loss_type_parse(ft_loss_type_name(cfg->loss_type), &out->loss_type) != FG_OK ||
        fg_is_level_parse(level, &out->importance_sampling_level) != FG_OK) {
        snprintf(err, errlen, "the library does not know loss_type '%s' / level '%s'",
                 ft_loss_type_name(cfg->loss_type), level);
        return -1;
    }
    out->temperature = cfg->temperature;
    out->epsilon_low = cfg->epsilon_low;
    out->epsilon_high = isnan(cfg->epsilon_high) ? -1.0 : cfg->epsilon_high;
    out->delta = isnan(cfg->delta) ? -1.0 : cfg->delta;
    out->beta = cfg->beta;
    out->max_completion_length = cfg->max_completion_length; /* -1: T */
    out->num_items_in_batch = isnan(cfg->num_items_in_batch) ? -1.0 : cfg->num_items_in_batch;
    out->sapo_temperature_pos = cfg->sapo_temperature_pos;
    out->sapo_temperature_neg = cfg->sapo_temperature_neg;
    out->use_bias_correction_kl = cfg->use_bias_correction_kl;
    out->entropy_coef = cfg->entropy_coef;
    return 0;
}

int ft_context_from(const ft_config *cfg, fg_context **out, char *err, size_t errlen)
{
    fg_context_options o;
    fg_context_options_init(&o);
    o.threads = (int)cfg->threads;
    o.memory_budget = (size_t)cfg->memory_budget;
    o.check_finite = cfg->check_finite;
    fg_status st = fg_context_create(&o, out);
    if (st != FG_OK) {
        snprintf(err, errlen, "fg_context_create: %s", fg_status_name(st));
        return -1;
    }
    /* The tool's own GEMMs and loops use the same thread count. */
    if (cfg->threads > 0)
        omp_set_num_threads((int)cfg->threads);
    return 0;
}

void ft_batch_from(const ft_problem *p, fg_batch *out)
{
    memset(out, 0, sizeof *out);
    out->batch = p->s.batch;
    out->seq_len = p->s.seq_len;
    out->token_ids = p->token_ids;
    out->mask = p->mask;
    out->advantages = p->advantages;
    out->old_logp = p->old_logp;
    out->ref_logp = p->ref_logp;
    out->is_ratio = p->is_ratio;
    out->is_ratio_per_sequence = p->s.is_ratio == FT_ISR_SEQUENCE;
}

static fg_outputs outputs(const ft_runner *r);
static int lib_error(ft_runner *r, const char *what, fg_status st);

/* memory_budget: min. The planner's smallest budget for this very call. */
static int use_min_budget(ft_runner *r)
{
    fg_outputs o = outputs(r);
    fg_linear_plan_info plan;
    fg_status st = fg_linear_grpo_plan(r->ctx, &r->lopts, &r->loss, &r->lin, &r->batch, &o, &plan);
    if (st != FG_OK)
        return lib_error(r, "fg_linear_grpo_plan", st);
    if (plan.min_budget_bytes > 0 &&
        (st = fg_context_set_memory_budget(r->ctx, plan.min_budget_bytes)) != FG_OK)
        return lib_error(r, "fg_context_set_memory_budget", st);
    return 0;
}

static fg_dtype lib_dtype(int dtype) { return dtype == FT_DTYPE_BF16 ? FG_DTYPE_BF16 : FG_DTYPE_F32; }

int ft_runner_init(ft_runner *r, const ft_config *cfg, const ft_problem *p, int impl, int full_step)
{
    memset(r, 0, sizeof *r);
    r->impl = impl;
    r->full_step = full_step;
    r->p = p;
    const ft_problem_shape *s = &p->s;
    const int64_t N = s->batch * s->seq_len, H = s->hidden, V = s->vocab;
    if (ft_loss_config_from(cfg, &r->loss, r->err, sizeof r->err) != 0 ||
        ft_context_from(cfg, &r->ctx, r->err, sizeof r->err) != 0)
        return -1;

    ft_batch_from(p, &r->batch);

    fg_dtype dt = lib_dtype(s->dtype);
    r->lin.hidden = fg_matrix_make(p->hidden, dt, N, H);
    r->lin.weight = fg_matrix_make(p->weight, dt, V, H);
    r->lin.bias = fg_vector_make(p->bias, dt, p->bias ? V : 0);
    r->lin.vocab_start = 0;
    r->lin.vocab_total = 0;
    r->lopts.impl = impl == FT_IMPL_BASELINE ? FG_IMPL_MATERIALIZED : FG_IMPL_FUSED;
    r->lopts.round_logits_to_input_dtype = impl == FT_IMPL_BASELINE && cfg->round_logits;

    int grads = impl != FT_IMPL_LOGITS || full_step;
    r->logp = ft_big_alloc((size_t)N * sizeof(float));
    r->entropy = ft_big_alloc((size_t)N * sizeof(float));
    r->output_bytes = 2 * (size_t)N * sizeof(float);
    if (grads) {
        r->grad_hidden = ft_big_alloc((size_t)(N * H) * sizeof(float));
        r->grad_weight = ft_big_alloc((size_t)(V * H) * sizeof(float));
        r->output_bytes += (size_t)(N * H + V * H) * sizeof(float);
        if (p->bias) {
            r->grad_bias = ft_big_alloc((size_t)V * sizeof(float));
            r->output_bytes += (size_t)V * sizeof(float);
        }
    }
    int failed = !r->logp || !r->entropy || (grads && (!r->grad_hidden || !r->grad_weight)) ||
                 (grads && p->bias && !r->grad_bias);
    if (impl == FT_IMPL_LOGITS && !failed) {
        r->logits_bytes = (size_t)(N * V) * ft_dtype_size(s->dtype);
        r->logits = ft_big_alloc(r->logits_bytes);
        failed = r->logits == NULL ||
                 ft_gemm_ws_reserve(&r->ws, ft_gemm_ws_need(s->dtype, s->dtype, N, V, H)) != 0;
    }
    if (failed) {
        snprintf(r->err, sizeof r->err, "out of memory allocating the output buffers");
        return -1;
    }
    if (cfg->memory_budget == FT_BUDGET_MIN && impl != FT_IMPL_LOGITS)
        return use_min_budget(r);
    return 0;
}

static fg_outputs outputs(const ft_runner *r)
{
    fg_outputs o;
    memset(&o, 0, sizeof o);
    const ft_problem_shape *s = &r->p->s;
    const int64_t N = s->batch * s->seq_len;
    o.logp = r->logp;
    o.entropy = r->entropy;
    if (r->impl == FT_IMPL_LOGITS) {
        /* In place: the same buffer, dtype and ld as the logits. */
        o.grad_logits = fg_matrix_make(r->logits, lib_dtype(s->dtype), N, s->vocab);
    } else {
        o.grad_hidden = fg_matrix_make(r->grad_hidden, FG_DTYPE_F32, N, s->hidden);
        o.grad_weight = fg_matrix_make(r->grad_weight, FG_DTYPE_F32, s->vocab, s->hidden);
        o.grad_bias = fg_vector_make(r->grad_bias, FG_DTYPE_F32, r->grad_bias ? s->vocab : 0);
    }
    return o;
}

void ft_describe_status(const fg_context *ctx, fg_status st, char *buf, size_t n)
{
    const char *name = fg_status_name(st);
    const char *msg = ctx ? fg_last_error(ctx) : "";
    if (msg == NULL || *msg == '\0')
        snprintf(buf, n, "%s", name);
    else if (strncmp(msg, name, strlen(name)) == 0)
        snprintf(buf, n, "%s", msg);
    else
        snprintf(buf, n, "%s: %s", name, msg);
}

static int lib_error(ft_runner *r, const char *what, fg_status st)
{
    char msg[900];
    ft_describe_status(r->ctx, st, msg, sizeof msg);
    snprintf(r->err, sizeof r->err, "%s: %s", what, msg);
    return -1;
}

int ft_runner_materialize_logits(ft_runner *r)
{
    const ft_problem_shape *s = &r->p->s;
    return ft_gemm_logits(&r->ws, s->dtype, r->p->hidden, s->batch * s->seq_len, r->p->weight,
                          r->p->bias, s->vocab, s->hidden, r->logits, s->dtype, r->err,
                          sizeof r->err);
}

int ft_runner_logits_kernel(ft_runner *r)
{
    const ft_problem_shape *s = &r->p->s;
    fg_matrix logits = fg_matrix_make(r->logits, lib_dtype(s->dtype), s->batch * s->seq_len, s->vocab);
    fg_outputs o = outputs(r);
    double t0 = ft_now();
    fg_status st = fg_logits_grpo(r->ctx, &r->loss, &logits, &r->batch, &o);
    r->kernel_s = ft_now() - t0;
    if (st != FG_OK)
        return lib_error(r, "fg_logits_grpo", st);
    r->loss_value = o.loss;
    r->metrics = o.metrics;
    return 0;
}

int ft_runner_step(ft_runner *r)
{
    const ft_problem_shape *s = &r->p->s;
    if (r->impl != FT_IMPL_LOGITS) {
        fg_outputs o = outputs(r);
        fg_status st = fg_linear_grpo(r->ctx, &r->lopts, &r->loss, &r->lin, &r->batch, &o);
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
    const int64_t N = s->batch * s->seq_len;
    if (ft_gemm_grad_hidden(&r->ws, s->dtype, r->logits, r->p->weight, N, s->vocab, s->hidden,
                            r->grad_hidden, r->err, sizeof r->err) != 0 ||
        ft_gemm_grad_weight(&r->ws, s->dtype, r->logits, r->p->hidden, N, s->vocab, s->hidden,
                            r->grad_weight, r->err, sizeof r->err) != 0)
        return -1;
    if (r->grad_bias)
        ft_colsum(s->dtype, r->logits, N, s->vocab, r->grad_bias);
    return 0;
}

size_t ft_runner_tool_bytes(const ft_runner *r) { return r->logits_bytes + ft_gemm_ws_bytes(&r->ws); }

void ft_runner_release_buffers(ft_runner *r)
{
    if (r->p == NULL)
        return;
    const ft_problem_shape *s = &r->p->s;
    const size_t N = (size_t)(s->batch * s->seq_len), H = (size_t)s->hidden, V = (size_t)s->vocab;
    ft_big_free(r->logp, N * sizeof(float));
    ft_big_free(r->entropy, N * sizeof(float));
    ft_big_free(r->grad_hidden, N * H * sizeof(float));
    ft_big_free(r->grad_weight, V * H * sizeof(float));
    ft_big_free(r->grad_bias, V * sizeof(float));
    ft_big_free(r->logits, r->logits_bytes);
    r->logp = r->entropy = r->grad_hidden = r->grad_weight = r->grad_bias = NULL;
    r->logits = NULL;
    r->logits_bytes = 0;
    ft_gemm_ws_free(&r->ws);
    if (r->ctx)
        fg_release_workspace(r->ctx);
}

void ft_runner_free(ft_runner *r)
{
    ft_runner_release_buffers(r);
    fg_context_destroy(r->ctx);
    memset(r, 0, sizeof *r);
}
