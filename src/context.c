/* The opaque context: options, error message, thread control, statistics. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gemm_onednn.h"
#include "internal.h"

void fg_context_options_init(fg_context_options *opts)
{
    if (!opts)
        return;
    memset(opts, 0, sizeof *opts);
    opts->backend = FG_BACKEND_CPU;
    opts->threads = 0;
    opts->memory_budget = FG_DEFAULT_MEMORY_BUDGET;
    opts->check_finite = 1;
}

fg_status fg_context_create(const fg_context_options *opts, fg_context **out)
{
    if (!out)
        return FG_ERR_NULL_ARGUMENT;
    *out = NULL;
    fg_context_options o;
    if (opts)
        o = *opts;
    else
        fg_context_options_init(&o);
    if (o.backend != FG_BACKEND_CPU)
        return FG_ERR_UNSUPPORTED; /* the CUDA backend is not part of this build */
    fg_context *ctx = fg_fault_hit() ? NULL : calloc(1, sizeof *ctx);
    if (!ctx)
        return FG_ERR_OUT_OF_MEMORY;
    ctx->opts = o;
    ctx->budget = o.memory_budget ? o.memory_budget : FG_DEFAULT_MEMORY_BUDGET;
    fg_status st = fg_gemm_cache_create(ctx);
    if (st != FG_OK) {
        free(ctx);
        return st;
    }
    *out = ctx;
    return FG_OK;
}

void fg_context_destroy(fg_context *ctx)
{
    if (!ctx)
        return;
    fg_gemm_cache_destroy(ctx);
    fg_ws_release(ctx);
    free(ctx);
}

const char *fg_last_error(const fg_context *ctx) { return ctx ? ctx->error : "NULL context"; }

fg_status fg_fail(fg_context *ctx, fg_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(ctx->error, sizeof ctx->error, "%s: ", fg_status_name(status));
    if (n > 0 && (size_t)n < sizeof ctx->error)
        vsnprintf(ctx->error + n, sizeof ctx->error - (size_t)n, fmt, ap);
    va_end(ap);
    return status;
}

void fg_clear_error(fg_context *ctx) { ctx->error[0] = '\0'; }

fg_status fg_context_set_threads(fg_context *ctx, int threads)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    ctx->opts.threads = threads;
    return FG_OK;
}

fg_status fg_context_set_memory_budget(fg_context *ctx, size_t bytes)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    ctx->budget = bytes ? bytes : FG_DEFAULT_MEMORY_BUDGET;
    return FG_OK;
}

fg_status fg_context_set_check_finite(fg_context *ctx, int on)
{
    if (!ctx)
        return FG_ERR_NULL_ARGUMENT;
    ctx->opts.check_finite = on != 0;
    return FG_OK;
}

fg_status fg_get_memory_stats(const fg_context *ctx, fg_memory_stats *out)
{
    if (!ctx || !out)
        return FG_ERR_NULL_ARGUMENT;
    out->current_bytes = ctx->bytes_current;
    out->peak_bytes = ctx->bytes_peak;
    out->budget_bytes = ctx->budget;
    out->chunk_rows = ctx->last_chunk_rows;
    out->chunks = ctx->last_chunks;
    out->gemm_flops = ctx->last_gemm_flops;
    out->gemm_seconds = ctx->last_gemm_seconds;
    out->call_seconds = ctx->last_call_seconds;
    return FG_OK;
}

void fg_reset_peak_memory(fg_context *ctx)
{
    if (ctx)
        ctx->bytes_peak = ctx->bytes_current;
}

void fg_release_workspace(fg_context *ctx)
{
    if (ctx)
        fg_ws_release(ctx);
}

double fg_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int fg_threads(const fg_context *ctx)
{
    return ctx->opts.threads > 0 ? ctx->opts.threads : omp_get_max_threads();
}

int fg_threads_enter(const fg_context *ctx)
{
    int saved = omp_get_max_threads();
    omp_set_num_threads(fg_threads(ctx));
    return saved;
}

void fg_threads_leave(int saved) { omp_set_num_threads(saved); }
