/*
 * What one call of an entry point runs with: the context's settings merged
 * with the caller's fg_exec (threads, budget, workspace), the error sink, the
 * arena and the GEMM cache. The context hands it down (fg_call_begin) and
 * takes back the call's statistics (fg_call_end); the drivers below read
 * only this, never the context itself.
 */
#ifndef FG_CALL_H
#define FG_CALL_H

#include "backend.h"
#include "error.h"
#include "gemm_onednn.h"
#include "workspace.h"

typedef struct fg_call {
    fg_error *err;
    int threads;         /* this call's thread count (>= 1)                     */
    size_t budget;       /* the fused path's cap                                  */
    int check_finite;
    fg_communicator comm;
    fg_gemm_cache *gemm;
    fg_arena *arena;     /* the context's, or `borrowed` (host memory)            */
    /* A context on a backend behind the seam (backend.h): its backend, and the
     * caller's workspace in that backend's memory (NULL: the context's). */
    const fg_device *device;
    void *device_workspace;
    size_t device_workspace_bytes;
    /* The caller's workspace (fg_exec.workspace, host or device memory; NULL:
     * none): the call writes it, so it may meet no argument (fg_check_aliasing). */
    const void *caller_workspace;
    size_t caller_workspace_bytes;
    /* fg_exec.device_report (backend memory; NULL: checks on the host). */
    fg_device_report *device_report;
    /* Statistics the driver fills for fg_memory_stats. */
    fg_gemm_stats gemm_stats;
    int64_t chunk_rows, chunks;
    int64_t dlogits_entries, dlogits_kept; /* what the backward products used */
    /* Private to context.c. */
    struct fg_context *ctx;
    fg_arena borrowed; /* the caller's workspace, if any */
    int saved_threads;
    int ran; /* reserved its memory: outputs are being written */
    double t0;
} fg_call;

/* Resolves exec against ctx's settings and checks it (a misaligned or empty
 * caller workspace is refused). Clears ctx's error. Sets the OpenMP thread
 * count for the call. On failure nothing needs ending. */
fg_status fg_call_begin(struct fg_context *ctx, const fg_exec *exec, fg_call *call);

/* The call's working memory: `bytes` from the caller's workspace (which
 * must hold them) or from the context's arena (mapped once, kept for reuse).
 * FG_ERR_BUDGET_TOO_SMALL / FG_ERR_OUT_OF_MEMORY with a message. */
fg_status fg_call_reserve(fg_call *call, size_t bytes);
void *fg_call_take(fg_call *call, size_t bytes);

/* The entry points that run on host memory only: FG_ERR_UNSUPPORTED, naming
 * `entry`, on a context whose backend is not the CPU, or with a device
 * report (ends nothing). */
fg_status fg_call_host_only(const fg_call *call, const char *entry);

/* A device call's working memory in the backend's memory: the caller's
 * workspace (which must hold `bytes`), or the context's, kept for reuse and
 * grown when a call needs more. Counted in fg_memory_stats. */
fg_status fg_call_reserve_device(fg_call *call, size_t bytes, void **ptr);

/* Restores the caller's OpenMP thread count and, if the call got as far as
 * its memory, records its statistics on the context. Returns st. */
fg_status fg_call_end(fg_call *call, fg_status st);

#endif
