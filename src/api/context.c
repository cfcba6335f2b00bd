/*
 * The opaque context: default options, the error message, the kept arena,
 * the GEMM cache and the statistics of the last call. The only file that
 * knows struct fg_context; every call reaches the layers below through an
 * fg_call (call.h).
 */
#define _GNU_SOURCE /* dladdr: where this library was loaded from */
#include <dlfcn.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "call.h"
#include "internal.h"

struct fg_context {
    fg_context_options opts;
    fg_error error;
    fg_arena arena;
    fg_gemm_cache *gemm;
    /* A backend behind the seam (FG_BACKEND_CUDA, FG_BACKEND_REFERENCE): its
     * ops and state, the library it came from, and its kept working memory. */
    fg_device device;
    void *device_library;
    void *device_mem;
    size_t device_bytes;
    size_t bytes_current; /* held now: the arena (on a backend behind the seam:
                             its memory)                                      */
    size_t host_held;     /* a backend behind the seam: the host arena of the
                             calls' O(tokens) arrays, not the backend's memory */
    size_t bytes_peak;    /* high-water mark, a borrowed workspace included   */
    size_t last_budget;
    int64_t last_chunk_rows, last_chunks, last_gemm_flops, last_dl_entries, last_dl_kept;
    double last_gemm_seconds, last_call_seconds;
};

void fg_context_options_init(fg_context_options *opts)
{
    if (!opts)
        return;
    memset(opts, 0, sizeof *opts);
    opts->backend = FG_BACKEND_CPU;
    opts->threads = 0;
    opts->memory_budget = 0; /* the backend's default, set by fg_context_create */
    opts->check_finite = 1;
}

void fg_exec_init(fg_exec *exec)
{
    if (exec)
        memset(exec, 0, sizeof *exec);
}

/* The CUDA backend's library: FUSEDGRPO_CUDA_LIBRARY, else beside this
 * library, else the loader's search path. The core never links CUDA. */
static void *open_cuda_library(fg_error *err)
{
    const char *name = "libfusedgrpo_cuda.so";
    const char *env = getenv("FUSEDGRPO_CUDA_LIBRARY");
    if (env && *env) {
        void *h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (!h)
            fg_fail(err, FG_ERR_UNSUPPORTED, "FUSEDGRPO_CUDA_LIBRARY=%s: %s", env, dlerror());
        return h;
    }
    static const char anchor = 0; /* an object of this library, for dladdr */
    Dl_info info;
    if (dladdr(&anchor, &info) && info.dli_fname) {
        char path[4096];
        const char *slash = strrchr(info.dli_fname, '/');
        const int dir = slash ? (int)(slash - info.dli_fname) : 0;
        if (slash && snprintf(path, sizeof path, "%.*s/%s", dir, info.dli_fname, name) <
                         (int)sizeof path) {
            void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
            if (h)
                return h;
        }
    }
    void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!h)
        fg_fail(err, FG_ERR_UNSUPPORTED,
                "the CUDA backend (%s) is not found beside libfusedgrpo or on the loader's "
                "path, and FUSEDGRPO_CUDA_LIBRARY is not set: %s",
                name, dlerror());
    return h;
}

static fg_status create_device(fg_context *ctx, const fg_context_options *o)
{
    char msg[sizeof ctx->error.msg];
    msg[0] = '\0';
    fg_status st;
    if (o->backend == FG_BACKEND_REFERENCE) {
        st = fg_backend_reference_create(o->stream, &ctx->device, msg, sizeof msg);
    } else {
        ctx->device_library = open_cuda_library(&ctx->error);
        if (!ctx->device_library)
            return FG_ERR_UNSUPPORTED;
        fg_backend_create_fn create;
        *(void **)&create = dlsym(ctx->device_library, FG_BACKEND_ENTRY);
        if (!create)
            return fg_fail(&ctx->error, FG_ERR_UNSUPPORTED, "the CUDA backend library has no %s",
                           FG_BACKEND_ENTRY);
        st = create(o->stream, &ctx->device, msg, sizeof msg);
    }
    if (st == FG_OK && (!ctx->device.ops || ctx->device.ops->abi != FG_BACKEND_ABI)) {
        if (ctx->device.ops)
            ctx->device.ops->destroy(ctx->device.state);
        memset(&ctx->device, 0, sizeof ctx->device);
        return fg_fail(&ctx->error, FG_ERR_UNSUPPORTED,
                       "the backend library was built for another backend interface");
    }
    if (st != FG_OK)
        memset(&ctx->device, 0, sizeof ctx->device);
    return st == FG_OK ? FG_OK : fg_fail(&ctx->error, st, "%s", msg);
}

/* The calling thread's last failed create's message (fg_context_create_error). */
static _Thread_local fg_error create_error;

const char *fg_context_create_error(void) { return create_error.msg; }

fg_status fg_context_create(const fg_context_options *opts, fg_context **out)
{
    fg_error_clear(&create_error);
    if (!out)
        return fg_fail(&create_error, FG_ERR_NULL_ARGUMENT, "out is NULL");
    *out = NULL;
    fg_context_options o;
    if (opts)
        o = *opts;
    else
        fg_context_options_init(&o);
    if (o.backend != FG_BACKEND_CPU && o.backend != FG_BACKEND_CUDA &&
        o.backend != FG_BACKEND_REFERENCE)
        return fg_fail(&create_error, FG_ERR_UNSUPPORTED, "backend %d is none of FG_BACKEND_CPU, "
                       "FG_BACKEND_CUDA, FG_BACKEND_REFERENCE", (int)o.backend);
    if (o.threads > FG_MAX_THREADS)
        return fg_fail(&create_error, FG_ERR_BAD_HYPERPARAMETER,
                       "threads = %d is above FG_MAX_THREADS (%d)", o.threads, FG_MAX_THREADS);
    /* The CPU's bf16 products (gemm_onednn.c, bf16_products_chosen): a
     * misspelt value would silently leave the choice to the measurement. */
    const char *bf16_products = getenv("FUSEDGRPO_BF16_PRODUCTS");
    if (bf16_products && *bf16_products && strcmp(bf16_products, "native") != 0 &&
        strcmp(bf16_products, "f32") != 0)
        return fg_fail(&create_error, FG_ERR_BAD_HYPERPARAMETER,
                       "FUSEDGRPO_BF16_PRODUCTS must be native or f32 (unset: measured), got '%s'",
                       bf16_products);
    if (!o.memory_budget)
        o.memory_budget = o.backend == FG_BACKEND_CUDA ? FG_DEFAULT_CUDA_MEMORY_BUDGET
                                                       : FG_DEFAULT_MEMORY_BUDGET;
    fg_context *ctx = fg_fault_hit() ? NULL : calloc(1, sizeof *ctx);
    if (!ctx)
        return fg_fail(&create_error, FG_ERR_OUT_OF_MEMORY, "the context (%zu bytes)",
                       sizeof *ctx);
    ctx->opts = o;
    ctx->last_budget = o.memory_budget;
    fg_status st = fg_gemm_cache_create(&ctx->gemm);
    if (st == FG_OK && o.backend != FG_BACKEND_CPU)
        st = create_device(ctx, &o);
    if (st != FG_OK) {
        if (ctx->error.msg[0])
            create_error = ctx->error;
        else
            fg_fail(&create_error, st, "the context's setup failed");
        fg_context_destroy(ctx);
        return st;
    }
    *out = ctx;
    return FG_OK;
}

static void release_device_memory(fg_context *ctx)
{
    if (ctx->device_mem) {
        ctx->device.ops->release(ctx->device.state, ctx->device_mem);
        ctx->bytes_current -= ctx->device_bytes;
    }
    ctx->device_mem = NULL;
    ctx->device_bytes = 0;
}

void fg_context_destroy(fg_context *ctx)
{
    if (!ctx)
        return;
    if (ctx->device.ops) {
        release_device_memory(ctx);
        ctx->device.ops->destroy(ctx->device.state);
    }
    if (ctx->device_library)
        dlclose(ctx->device_library);
    fg_gemm_cache_destroy(ctx->gemm);
    fg_arena_release(&ctx->arena, ctx->device.ops ? &ctx->host_held : &ctx->bytes_current);
    free(ctx);
}

const char *fg_last_error(const fg_context *ctx) { return ctx ? ctx->error.msg : "NULL context"; }

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
    out->budget_bytes = ctx->last_budget;
    out->chunk_rows = ctx->last_chunk_rows;
    out->chunks = ctx->last_chunks;
    out->gemm_flops = ctx->last_gemm_flops;
    out->gemm_seconds = ctx->last_gemm_seconds;
    out->call_seconds = ctx->last_call_seconds;
    out->dlogits_entries = ctx->last_dl_entries;
    out->dlogits_kept = ctx->last_dl_kept;
    return FG_OK;
}

void fg_reset_peak_memory(fg_context *ctx)
{
    if (ctx)
        ctx->bytes_peak = ctx->bytes_current;
}

void fg_release_workspace(fg_context *ctx)
{
    if (!ctx)
        return;
    fg_arena_release(&ctx->arena, ctx->device.ops ? &ctx->host_held : &ctx->bytes_current);
    if (ctx->device.ops)
        release_device_memory(ctx);
}

/* ------------------------------------------------------------------ calls */

fg_status fg_call_begin(fg_context *ctx, const fg_exec *exec, fg_call *call)
{
    memset(call, 0, sizeof *call);
    fg_error_clear(&ctx->error);
    fg_exec e;
    if (exec)
        e = *exec;
    else
        fg_exec_init(&e);
    if (e.workspace && ((uintptr_t)e.workspace % FG_ALIGN != 0 || e.workspace_bytes == 0))
        return fg_fail(&ctx->error, FG_ERR_INVALID_SIZE,
                       "exec->workspace must be %d-byte aligned and workspace_bytes > 0", FG_ALIGN);
    if (!e.workspace && e.workspace_bytes)
        return fg_fail(&ctx->error, FG_ERR_NULL_ARGUMENT,
                       "exec->workspace_bytes is set but exec->workspace is NULL");
    if (e.threads > FG_MAX_THREADS)
        return fg_fail(&ctx->error, FG_ERR_BAD_HYPERPARAMETER,
                       "exec->threads = %d is above FG_MAX_THREADS = %d", e.threads,
                       FG_MAX_THREADS);
    call->ctx = ctx;
    call->err = &ctx->error;
    call->threads = e.threads > 0 ? e.threads
                    : ctx->opts.threads > 0 ? ctx->opts.threads : omp_get_max_threads();
    call->budget = e.memory_budget ? e.memory_budget : ctx->opts.memory_budget;
    call->device_report = e.device_report;
    if (ctx->device.ops) {
        call->device = &ctx->device; /* the workspace is the backend's memory */
        call->device_workspace = e.workspace;
        call->device_workspace_bytes = e.workspace_bytes;
        call->arena = &ctx->arena;
    } else if (e.workspace) {
        fg_arena_borrow(&call->borrowed, e.workspace, e.workspace_bytes);
        call->arena = &call->borrowed; /* chunks are planned from the budget alone */
    } else {
        call->arena = &ctx->arena;
    }
    call->caller_workspace = e.workspace;
    call->caller_workspace_bytes = e.workspace_bytes;
    call->check_finite = ctx->opts.check_finite;
    call->comm = ctx->opts.comm;
    call->gemm = ctx->gemm;
    call->saved_threads = omp_get_max_threads();
    omp_set_num_threads(call->threads);
    call->t0 = omp_get_wtime();
    return FG_OK;
}

fg_status fg_call_reserve(fg_call *call, size_t bytes)
{
    fg_context *ctx = call->ctx;
    if (call->arena->borrowed) {
        call->arena->used = 0;
        if (bytes > call->arena->capacity)
            return fg_fail(call->err, FG_ERR_BUDGET_TOO_SMALL,
                           "the caller's workspace holds %zu bytes, the call needs %zu",
                           call->arena->capacity, bytes);
        if (ctx->bytes_current + bytes > ctx->bytes_peak)
            ctx->bytes_peak = ctx->bytes_current + bytes;
        call->ran = 1;
        return FG_OK;
    }
    /* On a backend behind the seam the arena holds the host's copies, outside
     * the budget and the counted bytes (the backend's memory). */
    if (fg_arena_reserve(call->arena, bytes, call->device ? SIZE_MAX : call->budget,
                         call->device ? &ctx->host_held : &ctx->bytes_current) != FG_OK)
        return fg_fail(call->err, FG_ERR_OUT_OF_MEMORY, "cannot allocate %zu bytes of workspace",
                       bytes);
    if (ctx->bytes_current > ctx->bytes_peak)
        ctx->bytes_peak = ctx->bytes_current;
    call->ran = 1;
    return FG_OK;
}

void *fg_call_take(fg_call *call, size_t bytes) { return fg_arena_take(call->arena, bytes); }

fg_status fg_call_host_only(const fg_call *call, const char *entry)
{
    if (call->device_report)
        return fg_fail(call->err, FG_ERR_UNSUPPORTED,
                       "exec->device_report: %s checks on the host (device-reported calls: "
                       "fg_linear_grpo, fg_linear_logprobs, fg_linear_logprobs_backward)",
                       entry);
    if (!call->device)
        return FG_OK;
    return fg_fail(call->err, FG_ERR_UNSUPPORTED,
                   "%s runs on the CPU backend only; this context's backend is %s", entry,
                   call->device->ops->name);
}

fg_status fg_call_reserve_device(fg_call *call, size_t bytes, void **ptr)
{
    fg_context *ctx = call->ctx;
    *ptr = NULL;
    if (call->device_workspace) {
        if (bytes > call->device_workspace_bytes)
            return fg_fail(call->err, FG_ERR_BUDGET_TOO_SMALL,
                           "the caller's workspace holds %zu bytes, the call needs %zu",
                           call->device_workspace_bytes, bytes);
        if (ctx->bytes_current + bytes > ctx->bytes_peak)
            ctx->bytes_peak = ctx->bytes_current + bytes;
        *ptr = call->device_workspace;
        call->ran = 1;
        return FG_OK;
    }
    if (bytes > ctx->device_bytes) {
        release_device_memory(ctx);
        char msg[sizeof ctx->error.msg];
        void *mem = NULL;
        const fg_status st = fg_fault_hit() ? FG_ERR_OUT_OF_MEMORY
                                            : ctx->device.ops->alloc(ctx->device.state, bytes,
                                                                     &mem, msg, sizeof msg);
        if (st != FG_OK)
            return fg_fail(call->err, st, "cannot allocate %zu bytes of %s memory", bytes,
                           ctx->device.ops->name);
        ctx->device_mem = mem;
        ctx->device_bytes = bytes;
        ctx->bytes_current += bytes;
    }
    if (ctx->bytes_current > ctx->bytes_peak)
        ctx->bytes_peak = ctx->bytes_current;
    *ptr = ctx->device_mem;
    call->ran = 1;
    return FG_OK;
}

fg_status fg_call_end(fg_call *call, fg_status st)
{
    fg_context *ctx = call->ctx;
    omp_set_num_threads(call->saved_threads);
    if (!call->ran)
        return st; /* checks or planning only: the last call's statistics stand */
    ctx->last_budget = call->budget;
    ctx->last_chunk_rows = call->chunk_rows;
    ctx->last_chunks = call->chunks;
    ctx->last_gemm_flops = call->gemm_stats.flops;
    ctx->last_gemm_seconds = call->gemm_stats.seconds;
    ctx->last_call_seconds = omp_get_wtime() - call->t0;
    ctx->last_dl_entries = call->dlogits_entries;
    ctx->last_dl_kept = call->dlogits_kept;
    return st;
}
