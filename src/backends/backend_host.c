/* Host memory for the seam's host backends (backend_host.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_host.h"

void fg_host_destroy(void *be) { (void)be; }

fg_status fg_host_alloc(void *be, size_t bytes, void **ptr, char *msg, size_t msg_size)
{
    (void)be;
    *ptr = aligned_alloc(256, bytes ? (bytes + 255) / 256 * 256 : 256);
    if (*ptr)
        return FG_OK;
    snprintf(msg, msg_size, "cannot allocate %zu bytes", bytes);
    return FG_ERR_OUT_OF_MEMORY;
}

void fg_host_release(void *be, void *ptr)
{
    (void)be;
    free(ptr);
}

fg_status fg_host_copy(void *be, void *dst, const void *src, size_t bytes, char *msg,
                       size_t msg_size)
{
    (void)be, (void)msg, (void)msg_size;
    if (bytes)
        memmove(dst, src, bytes);
    return FG_OK;
}

fg_status fg_host_fill_zero(void *be, void *dst, size_t bytes, char *msg, size_t msg_size)
{
    (void)be, (void)msg, (void)msg_size;
    if (bytes)
        memset(dst, 0, bytes);
    return FG_OK;
}

fg_status fg_host_wait(void *be, char *msg, size_t msg_size)
{
    (void)be, (void)msg, (void)msg_size;
    return FG_OK;
}
