/*
 * The seam's memory ops (backend.h) for a backend whose memory is the
 * host's: the CPU backend and the reference share them. Every op has
 * finished when it returns, so wait has nothing to wait for.
 */
#ifndef FG_BACKEND_HOST_H
#define FG_BACKEND_HOST_H

#include "backend.h"

void fg_host_destroy(void *be);
/* Whole 256-byte units, as the interface promises its alignment. */
fg_status fg_host_alloc(void *be, size_t bytes, void **ptr, char *msg, size_t msg_size);
void fg_host_release(void *be, void *ptr);
/* to_host and to_device alike. */
fg_status fg_host_copy(void *be, void *dst, const void *src, size_t bytes, char *msg,
                       size_t msg_size);
fg_status fg_host_fill_zero(void *be, void *dst, size_t bytes, char *msg, size_t msg_size);
fg_status fg_host_wait(void *be, char *msg, size_t msg_size);

#endif
