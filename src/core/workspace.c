#define _GNU_SOURCE /* MAP_POPULATE, MAP_ANONYMOUS */
/* The arena (see workspace.h), checked size arithmetic and the fault points. */
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "internal.h"
#include "workspace.h"

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

static _Atomic long exec_target = -1, exec_count;

void fg_fault_exec_arm(long k)
{
    atomic_store(&exec_target, k);
    atomic_store(&exec_count, 0);
}

long fg_fault_exec_points(void) { return atomic_load(&exec_count); }

int fg_fault_exec_hit(void) { return atomic_fetch_add(&exec_count, 1) == atomic_load(&exec_target); }
#endif

size_t fg_ws_round(size_t bytes) { return (bytes + FG_ALIGN - 1) & ~(size_t)(FG_ALIGN - 1); }

size_t fg_ws_page_round(size_t bytes) { return (bytes + 4095) & ~(size_t)4095; }

/* A page mapped past the arena's end, never handed out or counted. oneDNN's
 * JIT kernels read a row's tail with masked vector loads (vmaskmovps) whose
 * masked-off lanes may lie past the last buffer; the CPU never faults on them,
 * but qemu's emulation (7.2, the CI's AVX2-only CPU) does when they cross into
 * an unmapped page. */
#define ARENA_TAIL_SLACK ((size_t)4096)

void fg_arena_release(fg_arena *a, size_t *held)
{
    if (a->base && !a->borrowed) {
        munmap(a->base, a->capacity + ARENA_TAIL_SLACK);
        *held -= a->capacity;
    }
    memset(a, 0, sizeof *a);
}

fg_status fg_arena_reserve(fg_arena *a, size_t bytes, size_t keep_limit, size_t *held)
{
    a->used = 0;
    /* Keep the arena when it fits without hoarding. keep_limit is the call's
     * budget: a call within its budget never holds more (a fused call after a
     * larger-budget or materialized one must not sit on that arena). A call
     * that needs more than the budget (the materialized path, which has none)
     * keeps up to twice its need. */
    if (bytes > keep_limit)
        keep_limit = bytes > SIZE_MAX / 2 ? SIZE_MAX : 2 * bytes;
    if (bytes <= a->capacity && a->capacity <= keep_limit)
        return FG_OK;
    if (bytes > SIZE_MAX - 4095 - ARENA_TAIL_SLACK)
        return FG_ERR_OUT_OF_MEMORY;
    const size_t cap = fg_ws_page_round(bytes);
    /* Free first so the peak is the larger arena, not old + new. */
    fg_arena_release(a, held);
    /* MAP_POPULATE: first-touch faults cost ~3 s/GiB here, pre-faulting 20x less. */
    void *p = fg_fault_hit() ? MAP_FAILED
                             : mmap(NULL, cap + ARENA_TAIL_SLACK, PROT_READ | PROT_WRITE,
                                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED)
        return FG_ERR_OUT_OF_MEMORY;
    a->base = p;
    a->capacity = cap;
    *held += cap;
    return FG_OK;
}

void fg_arena_borrow(fg_arena *a, void *mem, size_t bytes)
{
    a->base = mem;
    a->capacity = bytes;
    a->used = 0;
    a->borrowed = 1;
}

void *fg_arena_take(fg_arena *a, size_t bytes)
{
    const size_t need = fg_ws_round(bytes);
    if (need > a->capacity - a->used)
        return NULL;
    void *p = a->base + a->used;
    a->used += need;
    return p;
}
