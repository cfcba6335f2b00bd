/*
 * Internal state shared by the library's files: the context, error reporting,
 * the tracked workspace and thread control. Nothing here is public.
 */
#ifndef FG_INTERNAL_H
#define FG_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "fusedgrpo.h"

#define FG_ALIGN 64
#define FG_GEMM_CACHE_SLOTS 128

struct fg_gemm_cache; /* gemm_onednn.c */

/* The tracked workspace: one arena kept across calls (page faults are slow,
 * so memory is mapped once with MAP_POPULATE and reused), carved per call by
 * a bump pointer. Every byte the library holds goes through fg_ws_* so that
 * the counted peak is the real working memory. */
typedef struct fg_workspace {
    unsigned char *base;
    size_t capacity;
    size_t used; /* bump pointer of the current call */
} fg_workspace;

struct fg_context {
    fg_context_options opts;
    size_t budget;
    char error[512];
    fg_workspace ws;
    size_t bytes_current;
    size_t bytes_peak;
    int64_t last_chunk_rows;
    int64_t last_chunks;
    int64_t last_gemm_flops;
    double last_gemm_seconds;
    double last_call_seconds;
    struct fg_gemm_cache *gemm;
};

/* Records a failure message on ctx and returns status (for `return fg_fail(...)`). */
fg_status fg_fail(fg_context *ctx, fg_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
void fg_clear_error(fg_context *ctx);

/* Arena: make sure it holds `bytes` (reallocating if smaller), then reset the
 * bump pointer. Fails with FG_ERR_OUT_OF_MEMORY (a smaller old arena is
 * released first, so none is held then). */
fg_status fg_ws_reserve(fg_context *ctx, size_t bytes);
/* Carve an aligned block from the reserved arena (never fails if the caller
 * reserved fg_ws_bytes() of its plan). */
void *fg_ws_take(fg_context *ctx, size_t bytes);
/* Bytes a block of `bytes` occupies in the arena once aligned. */
size_t fg_ws_round(size_t bytes);
/* The arena's real size for `bytes`: whole pages. */
size_t fg_ws_page_round(size_t bytes);
void fg_ws_release(fg_context *ctx);

/* Thread control: a library call runs with ctx's thread count and restores
 * the caller's OpenMP setting afterwards. */
int fg_threads_enter(const fg_context *ctx);
void fg_threads_leave(int saved);
int fg_threads(const fg_context *ctx);

/* Monotonic wall clock in seconds. */
double fg_now(void);

/* Test-only fault injection, compiled in with -DFG_FAULT_INJECTION (never in
 * a release build). Every allocation the library makes itself (context, GEMM
 * cache, arena, tracked blocks) and every oneDNN object it creates passes a
 * fault point first: fg_fault_hit() returns 1 at the armed one and the
 * allocation then fails as if memory were exhausted. The test drivers
 * (tests/test_alloc_failure.c) declare fg_fault_arm / fg_fault_points
 * themselves: they are not part of the public API.
 *   fg_fault_arm(k): the k-th fault point from now (0-based) fails, the others
 *                    succeed; k < 0 disarms. Resets the counter.
 *   fg_fault_points(): fault points passed since the last fg_fault_arm. */
#ifdef FG_FAULT_INJECTION
int fg_fault_hit(void);
void fg_fault_arm(long k);
long fg_fault_points(void);
#else
static inline int fg_fault_hit(void) { return 0; }
#endif

/* Checked size arithmetic: returns 0 on overflow. */
int fg_mul_size(size_t a, size_t b, size_t *out);
int fg_add_size(size_t a, size_t b, size_t *out);

static inline size_t fg_dtype_size(fg_dtype t) { return t == FG_DTYPE_BF16 ? 2 : 4; }

#endif
