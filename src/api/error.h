/*
 * Error reporting shared by every layer: a status and a readable message.
 * A layer that can fail takes an fg_error* sink and returns
 * fg_fail(err, status, ...); the context owns the sink of its calls
 * (fg_last_error), the tool passes its own.
 */
#ifndef FG_ERROR_H
#define FG_ERROR_H

#include "fusedgrpo.h"

typedef struct fg_error {
    char msg[512];
} fg_error;

/* Records "<STATUS_NAME>: <message>" in err and returns status. */
fg_status fg_fail(fg_error *err, fg_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static inline void fg_error_clear(fg_error *err) { err->msg[0] = '\0'; }

#endif
