#define _GNU_SOURCE /* MAP_POPULATE, MAP_ANONYMOUS */
/* The tracked allocator and the reusable arena (see internal.h). */
#include <stdlib.h>
#include <sys/mman.h>

#include "internal.h"

int fg_mul_size(size_t a, size_t b, size_t *out)
{
    if (a && b > SIZE_MAX / a)
        return 0;
    *out = a * b;
    return 1;
}

int fg_add_size(size_t a, size_t b, size_t *out)
{
    if (b > SIZE_MAX - a)
        return 0;
    *out = a + b;
    return 1;
}

#ifdef FG_FAULT_INJECTION
#include <stdatomic.h>
/* One process-wide count of fault points (atomic: contexts may run on
 * several threads, e.g. one per vocab shard). */
static _Atomic long fault_target = -1, fault_count;

void fg_fault_arm(long k)
{
    atomic_store(&fault_target, k);
    atomic_store(&fault_count, 0);
}

long fg_fault_points(void) { return atomic_load(&fault_count); }

int fg_fault_hit(void) { return atomic_fetch_add(&fault_count, 1) == atomic_load(&fault_target); }
#endif

static void count_alloc(fg_context *ctx, size_t bytes)
{
    ctx->bytes_current += bytes;
    if (ctx->bytes_current > ctx->bytes_peak)
        ctx->bytes_peak = ctx->bytes_current;
}

size_t fg_ws_round(size_t bytes) { return (bytes + FG_ALIGN - 1) & ~(size_t)(FG_ALIGN - 1); }

size_t fg_ws_page_round(size_t bytes) { return (bytes + 4095) & ~(size_t)4095; }

void fg_ws_release(fg_context *ctx)
{
    if (ctx->ws.base) {
        munmap(ctx->ws.base, ctx->ws.capacity);
        ctx->bytes_current -= ctx->ws.capacity;
    }
    ctx->ws.base = NULL;
    ctx->ws.capacity = 0;
    ctx->ws.used = 0;
}

fg_status fg_ws_reserve(fg_context *ctx, size_t bytes)
{
    ctx->ws.used = 0;
    /* Keep the arena when it fits without hoarding: a fused call after a
     * materialized one must not sit on the baseline's N x V arena. */
    size_t keep_limit = bytes > SIZE_MAX / 2 ? SIZE_MAX : 2 * bytes;
    if (keep_limit < ctx->budget)
        keep_limit = ctx->budget;
    if (bytes <= ctx->ws.capacity && ctx->ws.capacity <= keep_limit)
        return FG_OK;
    if (bytes > SIZE_MAX - 4095)
        return FG_ERR_OUT_OF_MEMORY;
    size_t cap = fg_ws_page_round(bytes);
    /* Free first so the peak is the larger arena, not old + new. */
    fg_ws_release(ctx);
    /* MAP_POPULATE: first-touch faults cost ~3 s/GiB here, pre-faulting 20x less. */
    void *p = fg_fault_hit() ? MAP_FAILED
                             : mmap(NULL, cap, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED)
        return FG_ERR_OUT_OF_MEMORY;
    ctx->ws.base = p;
    ctx->ws.capacity = cap;
    count_alloc(ctx, cap);
    return FG_OK;
}

void *fg_ws_take(fg_context *ctx, size_t bytes)
{
    size_t need = fg_ws_round(bytes);
    if (need > ctx->ws.capacity - ctx->ws.used)
        return NULL;
    void *p = ctx->ws.base + ctx->ws.used;
    ctx->ws.used += need;
    return p;
}
