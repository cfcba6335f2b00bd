/* The CUDA pieces' one way to refuse: a status, and its message written into
 * the caller's buffer (the CPU library's fg_fail writes into its context,
 * which these pieces do not see). */
#ifndef FG_CUDA_FAIL_H
#define FG_CUDA_FAIL_H

#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

#include "fusedgrpo.h"

static inline fg_status fail(fg_status st, char *msg, size_t msg_size, const char *fmt, ...)
{
    if (msg && msg_size) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, msg_size, fmt, ap);
        va_end(ap);
    }
    return st;
}

/* The last kernel launch's status: FG_ERR_BACKEND naming `what` when it failed. */
static inline fg_status launched(const char *what, char *msg, size_t msg_size)
{
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return fail(FG_ERR_BACKEND, msg, msg_size, "CUDA: launching %s: %s (%s)", what,
                    cudaGetErrorName(err), cudaGetErrorString(err));
    return FG_OK;
}

#endif
